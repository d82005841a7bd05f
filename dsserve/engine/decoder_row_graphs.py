"""Bounded replay's decoder rows in fixed shapes, one per (row bucket, context bucket), captured as CUDA graphs.

With bounded replay a prefill step narrows at the decoder's KV source (layer 20 of V4.1): the encoder and layer
20's compressor ran on every row, and from layer 20's attention on only each prefill's last ``replay_window``
prompt rows continue, plus the step's decode rows. That is a few hundred rows at most, however long the prompts,
through 20 layers: little device work and thousands of launches, so they run in fixed shapes: ``ReplayBatch``
buffers of ``row_bucket(R)`` rows whose index sources score ``decoder_context_bucket(max position + 1)`` positions'
worth of entries, and the narrowed stream, attention input and mHC coefficients copied into static buffers. The
encoder side runs through engine.encoder_graphs or eagerly. Without capture (the CPU) the same fixed-shape forward
runs eagerly: the tests check it against the eager path.

``run`` returns None, counted in ``fallbacks`` by reason, for a step it does not take. With ``ahead_rows`` set (the
engine's warm-up: engine.warmup) a step also builds every other row bucket at its context bucket: the larger ones
from its rows padded, the smaller ones from its first rows (the masked capture runs need valid rows, not these).
The skeleton (building, capture, replay, report) is engine.step_graphs'.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from ..kv.paged_batch import PagedBatch
from ..kv.replay_batch import ReplayBatch
from ..layers.context import ForwardContext
from .step_graphs import CapturedStep, StepGraphs, batch_bucket, bucket_sizes

ROW_BUCKETS = (16, 32, 64, 128, 192, 256, 384, 512, 768, 1024)


def decoder_context_bucket(n: int, min_context: int) -> int:
    """The position bound for decoder rows whose longest needs n positions: min_context doubled until it holds.
    Coarser than the decode steps' buckets: here only layer 20's index scores (a few hundred rows) widen with the
    bound (<= 2x), while every bucket pair costs a capture, and mixed steps vary in both rows and contexts."""
    b = min_context
    while b < n:
        b *= 2
    return b


class RowGraphs(StepGraphs):
    """The row graphs' common ground (decoder rows, encoder rows): buckets of rows of several sequences (at most
    ``max_seqs`` live) at the context bucket of the longest."""

    def __init__(self, model, kv, max_rows: int, max_seqs: int, capture, min_context=1024, row_buckets=ROW_BUCKETS):
        """As ``StepGraphs``'. ``max_seqs``: the most sequences a step's rows may come from."""
        super().__init__(model, kv, max_rows, capture, min_context, row_buckets)
        self.max_seqs = max_seqs
        self.split = model.cfg.encoder_layers  # the report form's narrowing: layer 20's attention on

    def rows(self, ctx: ForwardContext) -> int:
        """The step's rows (here: the narrowed ones)."""
        return sum(s.rows.stop - s.rows.start for s in ctx.seqs)

    def key(self, ctx: ForwardContext) -> tuple[int, int]:
        last = max(s.first + s.rows.stop - s.rows.start for s in ctx.seqs if s.rows.stop > s.rows.start)
        return (
            batch_bucket(self.rows(ctx), self.max_rows, self.row_buckets),
            decoder_context_bucket(last, self.min_context),
        )

    def _not_paged(self, ctx: ForwardContext) -> str | None:
        if self.model.kernel_ops is None or type(ctx.paged) is not PagedBatch or ctx.paged.cache is not self.kv:
            return "not the paged batched path"
        return None

    def _not_plain(self, ctx: ForwardContext) -> str | None:
        if ctx.trace is not None or ctx.is_image is not None or ctx.qat != self.model.cfg.qat:
            return "traced, image rows or a qat override"
        live = sum(s.rows.stop > s.rows.start for s in ctx.seqs)
        if self.rows(ctx) > self.max_rows or live > self.max_seqs:
            return "rows outside the buckets"
        return None


class DecoderRowGraphs(RowGraphs):
    label = "decoder rows: {0} rows, context {1}"

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.decoder_engram = any(b.engram is not None for b in self.model.layers[self.split :])

    def _unfit(self, start: int, ctx: ForwardContext) -> str | None:
        if start != self.split:
            return "not narrowed at the decoder's KV source (replay form)"
        if why := self._not_paged(ctx):
            return why
        if self.decoder_engram:  # its rows would need hashing on the host per step
            return "Engram in the decoder"
        return self._not_plain(ctx)

    @torch.no_grad()
    def run(self, start: int, parts: tuple, ctx: ForwardContext) -> torch.Tensor | None:
        """Final hidden states [R, d] of the narrowed rows of ``ctx`` from layer ``start``'s attention on, given
        that layer's ``Block.head`` outputs ``parts`` = (x, h, a_pre, a_post, a_comb); None: not taken."""
        if not self.fits(start, ctx):
            return None
        hidden, rows = self.launch(self.key(ctx), (parts, ctx))
        return hidden[:rows].clone()  # the next replay overwrites the graph's output buffer

    def ahead_keys(self, key: tuple[int, int]) -> list[tuple[int, int]]:
        return [(r, key[1]) for r in bucket_sizes(self.max_rows, self.row_buckets) if r != key[0]]

    def ahead_step(self, key: tuple[int, int], step):
        return first_rows(key[0], *step)

    def new_step(self, key: tuple[int, int], step) -> CapturedStep:
        rows, bound = key
        parts, _ = step
        inputs = [t.new_empty((rows,) + tuple(t.shape[1:])) for t in parts]
        return CapturedStep(ReplayBatch(self.kv, rows, min(rows, self.max_seqs), bound), inputs)

    def fill(self, s: CapturedStep, step) -> int:
        parts, ctx = step
        index = s.batch.fill(ctx.seqs, ctx.tokens, ctx.positions)
        for buf, t in zip(s.inputs, parts):
            torch.index_select(t, 0, index, out=buf)
        return parts[0].shape[0]

    def forward(self, s: CapturedStep) -> torch.Tensor:
        return self.model.forward_decoder_rows(s.batch, self.split, *s.inputs)


def first_rows(n: int, parts: tuple, ctx: ForwardContext) -> tuple[tuple, ForwardContext]:
    """``parts`` and the narrowed ``ctx`` cut to their first ``n`` rows (all of them if fewer): sequences in order,
    the last one kept cut short. What an ahead-built smaller row bucket runs its masked capture runs on."""
    rows = parts[0].shape[0]
    if n >= rows:
        return parts, ctx
    seqs, left = [], n
    for s in ctx.seqs:
        k = min(left, s.rows.stop - s.rows.start)
        seqs.append(replace(s, rows=slice(s.rows.start, s.rows.start + k)))
        left -= k
    return tuple(t[:n] for t in parts), replace(ctx, tokens=ctx.tokens[:n], positions=ctx.positions[:n], seqs=seqs)
