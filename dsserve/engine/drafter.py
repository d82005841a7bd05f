"""The drafter: DSpark speculative decoding's side of a step (spec 1.6, 2.10), around the target's verify forward.

A step with drafts runs, for a request that drafted k tokens, its pending rows then the k drafts as one chunk (mixed
with prefill chunks and plain decodes in the eager batched forward). Around it:

* ``before``: each verifying request's cache saves the window ring rows its chunk will overwrite
  (``SequenceKV.save_rows``);
* (the forward, then the rejection sampler decides how many drafts each request accepts);
* ``after``: committed rows only (prefill rows, a verify chunk's rows up to its last accepted draft) feed the
  request's DSpark rings (``DSpark.ingest_spans``, from the forward's taps: every request's rows in one pass); each
  verify chunk's cache is rolled back to its accepted rows (``SequenceKV.rollback``), down to a multiple of the
  compressors' ratio (2 on V4.1): a kept row past it would need the compressor's carried half-group rebuilt, so it
  is run again with the next step's rows instead (one more row, never a wrong state). Returns the rows each chunk
  gave back (``StepOutput.rolled_back``);
* ``propose``: each request that got tokens and is still running drafts its next block from its rings, at its last
  committed position, with the target's token y after it (``DSpark.propose_batch``: every request's block at once;
  with CUDA graphs on, ``ProposeGraphs``: the same pass in a batch bucket's fixed shapes, replayed); with a confidence
  threshold (adaptive K) a block keeps its drafts only while the confidence head's estimate that
  every draft so far is accepted (the product of sigmoid(kappa_i), spec 2.10) stays at or above it.

A block's length depends only on the committed tokens (through the rings and y), never on the step's draws, so the
rejection sampler stays exact whatever length a block has.

Requests with a grammar do not draft (a grammar's mask follows accepted tokens only).
"""

from __future__ import annotations

import torch

from ..models.model import DeepseekForCausalLM, ForwardOutput
from .propose_graphs import ProposeGraphs
from .request import Request
from .scheduler import StepPlan
from .stats import EngineStats


class Drafter:
    def __init__(
        self,
        model: DeepseekForCausalLM,
        num_speculative_tokens: int,
        stats: EngineStats,
        confidence_threshold: float = 0.0,
        graphs: ProposeGraphs | None = None,
    ):
        """``graphs``: the proposal in fixed shapes (CUDA graphs on a GPU); None: ``DSpark.propose_batch``."""
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
        self.graphs = graphs

    def before(self, plan: StepPlan) -> None:
        for c in plan.chunks:
            if c.num_drafts:
                c.request.kv.save_rows(c.request.num_computed_tokens, c.num_tokens)

    def after(self, plan: StepPlan, forward: ForwardOutput, accepted: dict[str, list[int]]) -> dict[str, int]:
        """``accepted``: request id -> the tokens the step accepted for it (its accepted drafts, then the target's
        token). Ingests committed rows (every request's in one pass), rolls back rejected ones, counts; returns
        request id -> rows rolled back."""
        rolled, spans = {}, []
        multiple = None
        for c, rows in zip(plan.chunks, forward.seqs):
            r = c.request
            end = r.num_computed_tokens + c.num_tokens  # one past the position of the chunk's last row
            committed = end
            if c.num_drafts:
                n_acc = len(accepted[r.request_id]) - 1
                committed = end - c.num_drafts + n_acc
                self.stats.spec_counted(c.num_drafts, n_acc)
            if forward.taps:
                spans += self._span(r, rows.rows, end, committed)
            if c.num_drafts:
                multiple = multiple or r.kv.cache.rollback_multiple
                keep = committed - committed % multiple
                r.kv.rollback(keep, r.all_token_ids + accepted[r.request_id])
                rolled[r.request_id] = end - keep
        if spans:
            self.mtp.ingest_spans(forward.taps, spans)
        return rolled

    def _span(self, r: Request, rows: slice, end: int, committed: int) -> list:
        """What ``r``'s chunk (``rows`` of the forward's output: its last ones, ending at position ``end`` - 1) gives
        its rings: its rows at positions before ``committed`` and after what the rings hold, as [(state, rows,
        first position)] (``DSpark.ingest_spans``), or []."""
        if r.draft_state is None:
            r.draft_state = self.mtp.new_state()
        first = end - (rows.stop - rows.start)
        lo = max(first, r.draft_state.last_position + 1)
        if lo >= committed:
            return []
        return [(r.draft_state, slice(rows.start + lo - first, rows.start + committed - first), lo)]

    @torch.no_grad()
    def propose(self, requests: list[Request]) -> None:
        """Drafts for each running request's next step (``Request.draft_token_ids``), from its last committed
        position, every request's block in one batched pass; a request whose rings do not reach it (or with a
        grammar) drafts nothing."""
        cfg, ready = self.model.cfg, []
        for r in requests:
            r.draft_token_ids = []
            p = r.num_tokens - 2  # the last position through the model; the token after it is the target's
            if r.grammar is not None or r.draft_state is None or r.draft_state.last_position != p:
                continue
            if p + 1 + cfg.dspark_block_size <= cfg.max_position_embeddings:
                ready.append(r)
        if not ready:
            return
        ys = [r.output_token_ids[-1] if r.output_token_ids else r.prompt_token_ids[-1] for r in ready]
        ps, states = [r.num_tokens - 2 for r in ready], [r.draft_state for r in ready]
        if self.graphs is not None:
            runs = self.graphs.runs
            drafts, conf = self.graphs.propose(ys, ps, states)
            if self.stats is not None:
                self.stats.propose_graph_steps += self.graphs.runs - runs
        else:
            drafts, conf = self.mtp.propose_batch(ys, ps, states, self.model.embed, self.model.head)
        lengths = self.block_lengths(conf[:, : self.k])
        for r, d, n in zip(ready, drafts[:, : self.k].tolist(), lengths):  # the host reads the drafts: next plan
            r.draft_token_ids = d[:n]

    def report(self) -> dict:
        """The proposal graphs' counts (``ProposeGraphs.report``), or {} without them."""
        return {} if self.graphs is None else {"proposal_graphs": self.graphs.report()}

    def block_lengths(self, conf: torch.Tensor) -> list[int]:
        """``conf`` [B, K]: the confidence logits of B blocks. Per block, the drafts it verifies: K, or with a
        threshold t the longest prefix whose running product of sigmoid(conf) is >= t (0 when the first is below)."""
        if not self.threshold:
            return [conf.shape[1]] * conf.shape[0]
        keep = torch.sigmoid(conf.float()).cumprod(1) >= self.threshold  # falls with i: a prefix is True
        return keep.sum(1).tolist()
