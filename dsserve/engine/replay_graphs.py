"""Bounded replay's decoder rows in fixed shapes, one per (row bucket, context bucket), captured as CUDA graphs.

With bounded replay a prefill step narrows at the decoder's KV source (layer 20 of V4.1): the encoder and layer
20's compressor ran on every row, and from layer 20's attention on only each prefill's last ``replay_window``
prompt rows continue, plus the step's decode rows. That is a few hundred rows at most, however long the prompts,
through 20 layers: little device work and thousands of launches, so the split (the seeds' piecewise graphs) runs
it as a graph: ``ReplayBatch`` buffers of ``row_bucket(R)`` rows whose index sources score
``decoder_context_bucket(max position + 1)`` positions' worth of entries, and the narrowed stream, attention input and
mHC coefficients copied into static buffers. The encoder side stays eager (its chunks are thousands of rows:
matmul-bound, and a graph would need a bucket per chunk length). Without capture (the CPU) the same fixed-shape
forward runs eagerly: the tests check it against the eager path.

``run`` returns None, counted in ``fallbacks`` by reason, for a step it does not take. With ``ahead_rows`` set (the
engine's warm-up: engine.warmup) a step also builds every other row bucket at its context bucket: the larger ones
from its rows padded, the smaller ones from its first rows (the masked capture runs need valid rows, not these).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import replace

import torch

from ..kv.paged import PagedKVCache
from ..kv.paged_batch import PagedBatch
from ..kv.replay_batch import ReplayBatch
from ..layers.context import ForwardContext
from ..models.model import DeepseekForCausalLM
from .decode_graphs import batch_bucket, bucket_sizes
from .graph_capture import GraphCapture, SharedOutputs

ROW_BUCKETS = (16, 32, 64, 128, 192, 256, 384, 512, 768, 1024)


def decoder_context_bucket(n: int, min_context: int) -> int:
    """The position bound for decoder rows whose longest needs n positions: min_context doubled until it holds.
    Coarser than the decode steps' buckets: here only layer 20's index scores (a few hundred rows) widen with the
    bound (<= 2x), while every bucket pair costs a capture, and mixed steps vary in both rows and contexts."""
    b = min_context
    while b < n:
        b *= 2
    return b


class ReplayGraphs:
    def __init__(
        self,
        model: DeepseekForCausalLM,
        kv: PagedKVCache,
        max_rows: int,
        max_seqs: int,
        capture: GraphCapture | None,
        min_context: int = 1024,
        row_buckets: tuple[int, ...] = ROW_BUCKETS,
    ):
        """``max_rows``: the largest row bucket (a step's kept rows past it run eagerly); ``capture``: None runs
        the fixed-shape forward eagerly (the CPU, the tests)."""
        if min_context % (2 * kv.layout.block_size):
            raise ValueError(
                f"min_context {min_context} must be a multiple of twice the block size {kv.layout.block_size}"
            )
        self.model, self.kv, self.max_rows, self.max_seqs = model, kv, max_rows, max_seqs
        self.capture, self.min_context, self.row_buckets = capture, min_context, row_buckets
        self.split = model.cfg.encoder_layers  # the report form's narrowing: layer 20's attention on
        self.decoder_engram = any(b.engram is not None for b in model.layers[self.split :])
        self._steps: dict[tuple[int, int], tuple[ReplayBatch, list[torch.Tensor], object, torch.Tensor]] = {}
        self._hidden = SharedOutputs(max_rows)  # every graph's hidden states, in its first rows
        self.reset_counts()
        self.last_key = None  # the (row bucket, context bucket) of the latest run
        self.ahead_rows = False  # a step also builds every row bucket of its context bucket (the warm-up)

    def reset_counts(self) -> None:
        self.replays, self.runs, self.padded_rows, self.fallbacks = 0, 0, 0, Counter()

    def _unfit(self, start: int, ctx: ForwardContext) -> str | None:
        cfg = self.model.cfg
        if start != self.split:
            return "not narrowed at the decoder's KV source (replay form)"
        if self.model.kernel_ops is None or type(ctx.paged) is not PagedBatch or ctx.paged.cache is not self.kv:
            return "not the paged batched path"
        if self.decoder_engram:  # its rows would need hashing on the host per step
            return "Engram in the decoder"
        if ctx.trace is not None or ctx.is_image is not None or ctx.qat != cfg.qat:
            return "traced, image rows or a qat override"
        rows = sum(s.rows.stop - s.rows.start for s in ctx.seqs)
        live = sum(s.rows.stop > s.rows.start for s in ctx.seqs)
        if rows > self.max_rows or live > self.max_seqs:
            return "rows outside the buckets"
        return None

    def key(self, ctx: ForwardContext) -> tuple[int, int]:
        rows = sum(s.rows.stop - s.rows.start for s in ctx.seqs)
        last = max(s.first + s.rows.stop - s.rows.start for s in ctx.seqs if s.rows.stop > s.rows.start)
        return (batch_bucket(rows, self.max_rows, self.row_buckets), decoder_context_bucket(last, self.min_context))

    @torch.no_grad()
    def run(self, start: int, parts: tuple, ctx: ForwardContext) -> torch.Tensor | None:
        """Final hidden states [R, d] of the narrowed rows of ``ctx`` from layer ``start``'s attention on, given
        that layer's ``Block.head`` outputs ``parts`` = (x, h, a_pre, a_post, a_comb); None: not taken."""
        why = self._unfit(start, ctx)
        if why is not None:
            self.fallbacks[why] += 1
            return None
        key = self.key(ctx)
        wanted = [key]
        if self.ahead_rows:
            wanted += [(r, key[1]) for r in bucket_sizes(self.max_rows, self.row_buckets) if r != key[0]]
        for k in sorted(wanted, reverse=True):  # largest first: the smaller captures reuse its freed scratch
            if k not in self._steps:
                self._steps[k] = self._build(k, *first_rows(k[0], parts, ctx))
        batch, inputs, graph, hidden = self._steps[key]
        rows = self._fill(batch, inputs, parts, ctx)
        self.runs, self.last_key = self.runs + 1, key
        self.padded_rows += batch.capacity - rows
        if graph is None:
            hidden = self.model.forward_decoder_rows(batch, start, *inputs)
        else:
            graph.replay()
            self.replays += 1
        return hidden[:rows].clone()  # the next replay overwrites the graph's output buffer

    def _fill(self, batch: ReplayBatch, inputs: list[torch.Tensor], parts: tuple, ctx: ForwardContext) -> int:
        index = batch.fill(ctx.seqs, ctx.tokens, ctx.positions)
        for buf, t in zip(inputs, parts):
            torch.index_select(t, 0, index, out=buf)
        return parts[0].shape[0]

    def _build(self, key, parts, ctx):
        rows, bound = key
        batch = ReplayBatch(self.kv, rows, min(rows, self.max_seqs), bound)
        inputs = [t.new_empty((rows,) + tuple(t.shape[1:])) for t in parts]
        if self.capture is None:
            return batch, inputs, None, None
        # Warm up on this step's inputs with every write masked; the step refills the buffers before the replay.
        self._fill(batch, inputs, parts, ctx)
        batch.mask_writes()
        graph, hidden = self.capture(
            lambda: self.model.forward_decoder_rows(batch, self.split, *inputs),
            f"decoder rows: {rows} rows, context {bound}",
            batch.forget_derived,
            self._hidden,
        )
        return batch, inputs, graph, hidden

    def report(self) -> dict:
        return {
            "graphs": sorted(k for k, v in self._steps.items() if v[2] is not None),
            "fixed_shape_steps": sorted(self._steps),
            "runs": self.runs,
            "replays": self.replays,
            "padded_rows": self.padded_rows,
            "fallbacks": dict(self.fallbacks),
        }


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
