"""Speculative verify steps in fixed shapes, one per (row bucket, context bucket), captured as CUDA graphs and replayed.

A verify step (engine.drafter) runs, for each request, its pending row then its K drafts (1 + K rows; one more when
the last step's rollback gave back a row past the compressors' ratio), and needs the logits of the last 1 + k rows
of each request and the DSpark taps of every row. Here such a step of B requests runs through every layer on
``EncoderBatch`` buffers (several consecutive rows a sequence, the compressors' carry included) of a row bucket
``b (1 + K)`` or ``b (2 + K)``, b a decode batch bucket, whose index sources score ``context_bucket(max position +
1)`` positions' worth of entries: ``DeepseekForCausalLM.forward_verify``, no host reads or writes, so on a GPU it is
captured once per bucket pair (on first use) and replayed with the buffers refilled. The logits come from the rows a
buffer of sample rows picks, the taps from every row; the host's counts follow in ``commit_rows``. Without capture
(the CPU, the tests) the same fixed-shape forward runs eagerly: the tests check it against the eager verify step.

Plain decode rows (a request that drafted nothing) and a prompt's last one or two rows ride along: every chunk that
samples with at most 2 + K rows, the drafts last. Steps with a longer prefill chunk, a chunk that does not sample,
bounded replay's narrowing, prompt logprobs, or a batch past the largest bucket fall back to the eager
``forward_batch``; ``fallbacks`` counts why. The skeleton (building, capture, replay, report) is engine.step_graphs'.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..kv.encoder_batch import EncoderBatch
from ..kv.paged_batch import PagedBatch
from ..layers.context import SeqRows
from ..models.model import ForwardOutput
from .decode_graphs import context_bucket
from .request import Request
from .scheduler import StepPlan
from .step_graphs import BATCH_BUCKETS, CapturedStep, StepGraphs, batch_bucket, bucket_sizes

MAX_VERIFY_ROWS = 512  # the engine's largest verify step in fixed shapes (``verify_max_seqs``)


def verify_max_seqs(max_num_seqs: int, k: int, max_rows: int = MAX_VERIFY_ROWS) -> int:
    """The most requests the engine's verify graphs take: every step of them fits ``max_rows`` rows (2 + k a
    request). Past that a step is matmul-bound, graphs save little, and the graphs' shared logits buffer (rows x
    vocabulary x 4 bytes: 0.5 GiB at 1024 rows of V4.1's vocabulary) would grow with it; such steps run eagerly."""
    return max(1, min(max_num_seqs, max_rows // (2 + k)))


def verify_row_buckets(max_seqs: int, k: int, batch_buckets: tuple[int, ...] = BATCH_BUCKETS) -> tuple[int, ...]:
    """The row buckets of verify steps with ``k`` drafts a request: b (1 + k) and b (2 + k) for each decode batch
    bucket b up to ``max_seqs``."""
    return tuple(sorted({b * n for b in bucket_sizes(max_seqs, batch_buckets) for n in (1 + k, 2 + k)}))


@dataclass
class VerifyStep:
    """One verify step's inputs, built on the host from the plan."""

    seqs: list[SeqRows]  # per request its rows in the packed order, with its first position (host)
    tokens: torch.Tensor  # [R] on the device
    positions: torch.Tensor  # [R] on the device
    sample_rows: list[int]  # the rows whose logits are sampled, in order (each request's last 1 + k)
    host_ids: torch.Tensor | None  # [R] Engram compressed ids on the host (None without Engram)
    engram: dict  # Engram layer -> [R, columns(, D)] table rows or row ids on the device


class VerifyGraphs(StepGraphs):
    label = "verify step: {0} rows, context {1}"

    def __init__(
        self,
        model,
        kv,
        max_seqs: int,
        num_speculative_tokens: int,
        capture,
        min_context: int = 1024,
        batch_buckets: tuple[int, ...] = BATCH_BUCKETS,
    ):
        """As ``StepGraphs``'. ``max_seqs``: the most requests a step (the engine's max_num_seqs);
        ``num_speculative_tokens``: K, the drafts a request."""
        self.k, self.max_seqs = num_speculative_tokens, max_seqs
        buckets = verify_row_buckets(max_seqs, num_speculative_tokens, batch_buckets)
        super().__init__(model, kv, buckets[-1], capture, min_context, buckets)
        cfg = model.cfg
        self.tap_layers = [b.role.index for b in model.layers if b.role.index in cfg.dspark_target_layer_ids]
        self.sources = {src: r for src, (r, _) in kv.layout.sources.items()}
        self.engram = [b.engram for b in model.layers if b.engram is not None]

    def key(self, plan: StepPlan) -> tuple[int, int] | None:
        """(row bucket, context bucket) of a plan that can run as a fixed-shape verify step, or None."""
        if not self.fits(plan):
            return None
        last = max(c.request.num_computed_tokens + c.num_tokens for c in plan.chunks)
        rows = sum(c.num_tokens for c in plan.chunks)
        return batch_bucket(rows, self.max_rows, self.row_buckets), context_bucket(last, self.min_context)

    def _unfit(self, plan: StepPlan) -> str | None:
        cfg = self.model.cfg
        if self.model.kernel_ops is None or not PagedBatch.layout_supported(self.kv.layout, self.model.kernel_ops):
            return "not the paged batched path"
        if not cfg.is_v41 or self.model.mtp is None:
            return "no DSpark stages"
        if not plan.chunks or len(plan.chunks) > self.max_seqs:
            return "batch size outside the buckets"
        for c in plan.chunks:
            r, start = c.request, c.request.num_computed_tokens
            if not c.samples or c.num_tokens - c.num_drafts > 2:
                return "not a verify step (a prefill chunk)"
            if r.decoder_start is not None and start < r.decoder_start:
                return "bounded replay narrows the step"
            if r.kv.cache is not self.kv:
                return "another cache"
            if r.prompt_logprobs is not None and start < r.num_prompt_tokens - 1:
                return "prompt logprobs"
        if sum(c.num_tokens for c in plan.chunks) > self.max_rows:
            return "rows outside the buckets"
        return EncoderBatch.fits(self._seqs(plan), self.sources)

    @staticmethod
    def _seqs(plan: StepPlan) -> list[SeqRows]:
        seqs, row = [], 0
        for c in plan.chunks:
            seqs.append(SeqRows(slice(row, row + c.num_tokens), c.request.kv, first=c.request.num_computed_tokens))
            row += c.num_tokens
        return seqs

    @torch.no_grad()
    def run(self, plan: StepPlan, key: tuple[int, int]) -> tuple[torch.Tensor, ForwardOutput]:
        """The step's logits [sum(1 + k), V] (each request's last 1 + k rows, in order: copied out of the graph's
        output buffer, which the next replay overwrites) and its forward output for the drafter: the DSpark taps of
        every row and the rows of each request (no hidden rows: ``hidden`` is None)."""
        step = self._step(plan)
        (logits, taps), rows = self.launch(key, step)
        n = len(step.sample_rows)
        logits, taps = logits[:n].clone(), taps[:rows].clone()
        self.model.commit_rows(step.seqs, step.host_ids)
        by_layer = {layer: taps[:, j] for j, layer in enumerate(self.tap_layers)}
        return logits, ForwardOutput(None, step.positions, by_layer, step.seqs)

    def _step(self, plan: StepPlan) -> VerifyStep:
        ids, pos, sample = [], [], []
        seqs = self._seqs(plan)
        for c, s in zip(plan.chunks, seqs):
            r: Request = c.request
            ids += r.token_ids(s.first, s.first + c.num_tokens - c.num_drafts) + list(c.draft_token_ids)
            pos += range(s.first, s.first + c.num_tokens)
            sample += range(s.rows.stop - 1 - c.num_drafts, s.rows.stop)
        dev = self.kv.device
        host = torch.tensor(ids, dtype=torch.long)
        host_ids, engram = None, {}
        if self.engram:
            host_ids = self.model._engram_ids(host, None)
            rows = [s.rows for s in seqs]
            hist = [s.cache.engram_history.cpu() for s in seqs]
            for e in self.engram:
                layer = e.hasher.layer_id
                if e.table is not None:  # host table: its rows, gathered and copied
                    engram[layer] = e.prefetch(host_ids, rows, hist, dev, self.model.embed.weight.dtype).for_seqs(rows)
                else:  # on the device: the row ids, hashed here as the eager path does
                    engram[layer] = e.row_ids(host_ids, rows, hist).to(dev, non_blocking=True)
        return VerifyStep(
            seqs,
            host.to(dev, non_blocking=True),
            torch.tensor(pos, dtype=torch.long).to(dev, non_blocking=True),
            sample,
            host_ids,
            engram,
        )

    def new_step(self, key: tuple[int, int], step: VerifyStep) -> CapturedStep:
        rows, bound = key
        dev = self.kv.device
        engram = {layer: t.new_empty((rows,) + tuple(t.shape[1:])) for layer, t in step.engram.items()}
        inputs = {"engram": engram, "sample": torch.zeros(rows, dtype=torch.long, device=dev)}
        return CapturedStep(EncoderBatch(self.kv, rows, min(rows, self.max_seqs), bound), inputs)

    def fill(self, s: CapturedStep, step: VerifyStep) -> int:
        index = s.batch.fill(step.seqs, step.tokens, step.positions)
        for layer, t in step.engram.items():
            torch.index_select(t, 0, index, out=s.inputs["engram"][layer])
        pad = s.batch.capacity - len(step.sample_rows)
        sample = torch.tensor(step.sample_rows + step.sample_rows[-1:] * pad, dtype=torch.long)
        s.inputs["sample"].copy_(sample, non_blocking=True)
        return step.tokens.shape[0]

    def forward(self, s: CapturedStep) -> tuple[torch.Tensor, torch.Tensor]:
        return self.model.forward_verify(s.batch, s.inputs["engram"], s.inputs["sample"])
