"""The drafter: DSpark speculative decoding's side of a step (spec 1.6, 2.10), around the target's verify forward.

A step with drafts runs, for a request that drafted k tokens, its pending rows then the k drafts as one chunk (mixed
with prefill chunks and plain decodes in the batched forward). Around it, in this order, with the host reading the
device once (after the proposal):

* ``before``: each verifying request's cache saves the window ring rows its chunk will overwrite
  (``SequenceKV.save_rows``);
* (the forward, then the rejection sampler's verdict, left on the device: ``RejectionSampler.decide``);
* ``ingest``: every chunk's rows past what its request's DSpark rings hold go in (``DSpark.ingest_spans``, from the
  forward's taps: every request's rows in one pass), a verify chunk's drafted rows included, since which of them
  are committed is still on the device. The proposal cannot see the uncommitted ones: its window holds positions up
  to its committed one only;
* ``propose``: each request that sampled (and has no grammar) drafts its next block from its rings
  (``ProposeGraphs``: every request's block in one pass in a batch bucket's fixed shapes, replayed from a CUDA
  graph on a GPU), at its committed position p and with the target's token y after it, both taken on the device
  from the verdict (``inputs``: p = the chunk's last row before its drafts + the drafts accepted). With a
  confidence threshold (adaptive K) a block keeps its drafts only while the confidence head's estimate that every
  draft so far is accepted (the product of sigmoid(kappa_i), spec 2.10) stays at or above it;
* (the host reads the verdict and the proposal together);
* ``settle``: each verify chunk's rejected rows leave the rings (``DSparkCache.drop_after``) and its cache is rolled
  back to its accepted rows (``SequenceKV.rollback``), down to a multiple of the compressors' ratio (2 on V4.1): a
  kept row past it would need the compressor's carried half-group rebuilt, so it is run again with the next step's
  rows instead (one more row, never a wrong state). Returns the rows each chunk gave back
  (``StepOutput.rolled_back``);
* ``hand_out``: the drafts go to the requests still running, for the next step's plan.

A request's block (its drafts and its length) depends only on the committed tokens (through the rings, y and p),
never on the step's draws, so the rejection sampler stays exact whatever length a block has. A request that
finishes in the step drafted for nothing: its block is dropped.

Requests with a grammar do not draft (a grammar's mask follows accepted tokens only).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..models.model import DeepseekForCausalLM, ForwardOutput
from .propose_graphs import ProposeGraphs
from .rejection_sampler import DeviceVerdict
from .request import Request
from .scheduler import StepPlan
from .stats import EngineStats


@dataclass
class Proposal:
    """One step's drafts (``Drafter.propose``): per request its block [B, k] and how many of them it verifies [B],
    on the device until the host reads them with the step's verdict (``tensors``, then ``hand_out``)."""

    requests: list[Request]
    drafts: torch.Tensor | None = None
    lengths: torch.Tensor | None = None

    def tensors(self) -> list[torch.Tensor]:
        return [] if self.drafts is None else [self.drafts, self.lengths]


class Drafter:
    def __init__(
        self,
        model: DeepseekForCausalLM,
        num_speculative_tokens: int,
        stats: EngineStats,
        confidence_threshold: float = 0.0,
        graphs: ProposeGraphs | None = None,
    ):
        """``graphs``: the proposal's fixed shapes (CUDA graphs on a GPU; the engine's); None: buckets up to 8 blocks,
        run eagerly."""
        if model.mtp is None:
            raise ValueError(f"{model.cfg.name} has no DSpark stages (num_draft_layers 0, or a V4 model)")
        if not 1 <= num_speculative_tokens <= model.cfg.dspark_block_size:
            raise ValueError(
                f"num_speculative_tokens {num_speculative_tokens}: DSpark drafts 1..{model.cfg.dspark_block_size}"
            )
        if not 0.0 <= confidence_threshold < 1.0:
            raise ValueError(f"confidence_threshold {confidence_threshold}: adaptive K takes [0, 1) (0: off)")
        self.model, self.mtp, self.k, self.stats = model, model.mtp, num_speculative_tokens, stats
        self.threshold = confidence_threshold
        self.graphs = graphs or ProposeGraphs(model, 8, None)

    def before(self, plan: StepPlan) -> None:
        for c in plan.chunks:
            if c.num_drafts:
                c.request.kv.save_rows(c.request.num_computed_tokens, c.num_tokens)

    def ingest(self, plan: StepPlan, forward: ForwardOutput) -> None:
        """Every chunk's rows past its request's rings into them, drafted rows included (every request's in one
        pass)."""
        if not forward.taps:
            return
        spans = []
        for c, rows in zip(plan.chunks, forward.seqs):
            r = c.request
            if r.draft_state is None:
                r.draft_state = self.mtp.new_state(spare=self.model.cfg.dspark_block_size)
            end = r.num_computed_tokens + c.num_tokens  # one past the position of the chunk's last row
            first = end - (rows.rows.stop - rows.rows.start)
            lo = max(first, r.draft_state.last_position + 1)
            if lo < end:
                spans.append((r.draft_state, slice(rows.rows.start + lo - first, rows.rows.stop), lo))
        if spans:
            self.mtp.ingest_spans(forward.taps, spans)

    def inputs(
        self, plan: StepPlan, verdict: DeviceVerdict
    ) -> tuple[list[Request], torch.Tensor | None, torch.Tensor | None]:
        """Who proposes after this step, and from where: the requests whose chunks sampled (the verdict's, in its
        order), that have no grammar and whose rings reach their chunk's last row; with, on the device, each one's
        target token after its committed rows (the verdict's last token) and its committed position (its chunk's
        last row before the drafts + the drafts accepted). (requests, last tokens [B], positions [B])."""
        cfg, ready, at, base = self.model.cfg, [], [], []
        for i, c in enumerate(c for c in plan.chunks if c.samples):
            r = c.request
            last = r.num_computed_tokens + c.num_tokens - 1 - c.num_drafts  # committed whatever the verdict
            if r.grammar is not None or r.draft_state is None:
                continue
            if r.draft_state.last_position != last + c.num_drafts:  # (its rings do not reach this chunk)
                continue
            if last + c.num_drafts + 1 + cfg.dspark_block_size <= cfg.max_position_embeddings:
                ready.append(r)
                at.append(i)
                base.append(last)
        if not ready:
            return [], None, None
        dev = verdict.num_accepted.device
        up = torch.tensor(at + base, dtype=torch.long).to(dev, non_blocking=True)
        idx = up[: len(at)]
        return ready, verdict.last_token[idx], up[len(at) :] + verdict.num_accepted[idx]

    @torch.no_grad()
    def propose(self, requests: list[Request], last_tokens: torch.Tensor, positions: torch.Tensor) -> Proposal:
        """Each request's next block, from its rings at its committed position ``positions[i]`` with
        ``last_tokens[i]`` after it (device tensors, ``inputs``), every request's block in one batched pass; the
        drafts stay on the device (``Proposal``)."""
        if not requests:
            return Proposal([])
        runs = self.graphs.runs
        drafts, conf = self.graphs.propose(last_tokens, positions, [r.draft_state for r in requests])
        if self.stats is not None:
            self.stats.propose_graph_steps += self.graphs.runs - runs
        return Proposal(requests, drafts[:, : self.k], self.block_lengths(conf[:, : self.k]))

    def settle(self, plan: StepPlan, accepted: dict[str, list[int]]) -> dict[str, int]:
        """``accepted``: request id -> the tokens the step accepted for it (its accepted drafts, then the target's
        token). Drops each verify chunk's rejected rows from its rings, rolls its cache back, counts; returns
        request id -> rows rolled back."""
        rolled, multiple = {}, None
        for c in plan.chunks:
            if not c.num_drafts:
                continue
            r = c.request
            end = r.num_computed_tokens + c.num_tokens
            n_acc = len(accepted[r.request_id]) - 1
            committed = end - c.num_drafts + n_acc  # one past the last committed row
            self.stats.spec_counted(c.num_drafts, n_acc)
            if r.draft_state is not None:
                r.draft_state.drop_after(committed - 1)
            multiple = multiple or r.kv.cache.rollback_multiple
            keep = committed - committed % multiple
            r.kv.rollback(keep, r.all_token_ids + accepted[r.request_id])
            rolled[r.request_id] = end - keep
        return rolled

    @staticmethod
    def hand_out(sampled: list[Request], proposal: Proposal, host: list[torch.Tensor]) -> None:
        """The next step's drafts (``Request.draft_token_ids``) from the host's copies of ``proposal.tensors()``:
        a block to each proposer still running; none to the step's other sampled requests."""
        for r in sampled:
            r.draft_token_ids = []
        if not host:
            return
        for r, d, n in zip(proposal.requests, host[0].tolist(), host[1].tolist()):
            if not r.status.finished:
                r.draft_token_ids = d[:n]

    def report(self) -> dict:
        """The proposal graphs' counts (``ProposeGraphs.report``)."""
        return {"proposal_graphs": self.graphs.report()}

    def block_lengths(self, conf: torch.Tensor) -> torch.Tensor:
        """``conf`` [B, K]: the confidence logits of B blocks. Per block [B], the drafts it verifies: K, or with a
        threshold t the longest prefix whose running product of sigmoid(conf) is >= t (0 when the first is below)."""
        if not self.threshold:
            return torch.full(conf.shape[:1], conf.shape[1], dtype=torch.long, device=conf.device)
        keep = torch.sigmoid(conf.float()).cumprod(1) >= self.threshold  # falls with i: a prefix is True
        return keep.sum(1)
