"""Decode steps in fixed shapes, one per (batch bucket, context bucket), captured as CUDA graphs and replayed.

A decode step of B sequences runs as ``DecodeBatch`` buffers of ``batch_bucket(B)`` rows whose index sources
score ``context_bucket(max position + 1)`` positions' worth of entries (-inf past each row's own); the model's
``forward_decode`` over those buffers has no host reads or writes, so on a GPU it is captured once per bucket pair
(on first use) and replayed with the buffers refilled. Without capture (the CPU) the same fixed-shape step runs
eagerly: the tests check that path against the reference forward, and the GPU tests check replay against it.

With ``ahead_rows`` set (the engine's warm-up: engine.warmup) a step also builds, from its own rows, the steps of
every larger batch bucket at its context bucket: the capture masks every write and a replay refills all the buffers,
so a graph does not depend on the rows it was captured from.

Steps that are not plain decodes (prefill chunks, bounded replay's narrowing, a batch past the largest bucket) and
sequences whose compressor state a fixed-shape step cannot continue fall back to the eager ``forward_batch``;
``fallbacks`` counts why. The skeleton (building, capture, replay, report) is engine.step_graphs'.
"""

from __future__ import annotations

import torch

from ..kv.decode_batch import DecodeBatch
from ..kv.paged_batch import PagedBatch
from .scheduler import StepPlan
from .step_graphs import BATCH_BUCKETS, CapturedStep, StepGraphs, batch_bucket


def context_bucket(n: int, min_context: int) -> int:
    """The position bound for a step whose longest row needs n positions: min_context m, then steps of m up to
    8m, then a quarter of the power-of-two multiple of m below (8m, 10m, 12m, 14m, 16m, 20m, ...): the index sources
    score at most 1.25x the entries they need past 8m."""
    b = min_context
    while b < n:
        step = min_context
        while step * 8 <= b:
            step *= 2
        b += step
    return b


class DecodeGraphs(StepGraphs):
    label = "decode step: batch {0}, context {1}"

    def __init__(self, model, kv, max_batch: int, capture, min_context: int = 1024, batch_buckets=BATCH_BUCKETS):
        """As ``StepGraphs``' (rows here: batch). ``max_batch``: the largest batch bucket (the engine's
        max_num_seqs)."""
        super().__init__(model, kv, max_batch, capture, min_context, batch_buckets)
        self.max_batch, self.batch_buckets = max_batch, batch_buckets
        # A decode step gathers its Engram rows inside the step: a GPU reads host tables in place only when pinned
        # (registration can fail, e.g. past the locked-memory limit); otherwise every step takes the eager path.
        self._unpinned_tables = kv.device.type == "cuda" and any(
            b.engram is not None
            and b.engram.table is not None
            and not (b.engram.table.memory is not None and b.engram.table.memory.pinned)
            for b in model.layers
        )

    def key(self, plan: StepPlan, ahead: bool = False) -> tuple[int, int] | None:
        """(batch bucket, context bucket) of a plan that can run as a fixed-shape decode step, or None.
        ``ahead``: the rows' input tokens are still on the device (the previous step's samples, its progress not yet
        applied: each row's input goes at the request's ``num_tokens``)."""
        if not self.fits(plan, ahead):
            return None
        seqs = [c.request.kv for c in plan.chunks]
        return (
            batch_bucket(len(seqs), self.max_batch, self.batch_buckets),
            context_bucket(max(kv.num_tokens for kv in seqs) + 1, self.min_context),
        )

    def _unfit(self, plan: StepPlan, ahead: bool = False) -> str | None:
        if self.model.kernel_ops is None or not PagedBatch.layout_supported(self.kv.layout, self.model.kernel_ops):
            return "not the paged batched path"
        if self._unpinned_tables:
            return "Engram tables in unpinned host memory"
        if not plan.chunks or len(plan.chunks) > self.max_batch:
            return "batch size outside the buckets"
        for c in plan.chunks:
            r = c.request
            start = r.num_tokens if ahead else r.num_computed_tokens  # the row's position
            if c.num_tokens != 1 or not (ahead or c.samples):
                return "not a decode step"
            if r.decoder_start is not None and start < r.decoder_start:
                return "bounded replay narrows the step"
            if r.kv.cache is not self.kv:
                return "another cache"
        return DecodeBatch.fits([c.request.kv for c in plan.chunks], carried=self.model.cfg.is_v41)

    @torch.no_grad()
    def run(self, plan: StepPlan, key: tuple[int, int], tokens: torch.Tensor | None = None) -> torch.Tensor:
        """The step's logits [B, V] (copied out of the graph's output buffer, which the next replay overwrites).
        ``tokens``: the rows' input ids as a device tensor when the host does not have them yet (asynchronous
        scheduling: the previous step's samples; the Engram histories then wait for
        ``model.push_decode_history``); None: each request's last token."""
        seqs = [c.request.kv for c in plan.chunks]
        host = None
        if tokens is None:
            host = [c.request.token_ids(c.request.num_computed_tokens, c.request.num_tokens)[0] for c in plan.chunks]
        logits, rows = self.launch(key, (seqs, host if tokens is None else tokens))
        self.model.commit_decode(seqs, host)
        return logits[:rows].clone()

    def new_step(self, key: tuple[int, int], step) -> CapturedStep:
        cfg = self.model.cfg
        lookbacks = cfg.engram_max_ngram_size - 1 if cfg.engram_layer_ids else 0
        return CapturedStep(DecodeBatch(self.kv, *key, lookbacks=lookbacks))

    def fill(self, s: CapturedStep, step) -> int:
        seqs, tokens = step
        self.model.fill_decode(s.batch, seqs, tokens)
        return len(seqs)

    def forward(self, s: CapturedStep) -> torch.Tensor:
        return self.model.forward_decode(s.batch)
