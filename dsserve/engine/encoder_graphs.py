"""A replayed prefill step's encoder layers in fixed shapes, one per (row bucket, context bucket), captured as CUDA
graphs: the other piece of the split at the encoder/decoder boundary (``ReplayGraphs`` runs the decoder's).

A prefix hit with bounded replay runs the encoder on the replayed window rows plus the new tokens (128 + a few
hundred on the release proxy) and the decoder on the last 128: eagerly, thousands of launches whose host time
(~110-170 ms) was most of the hit's TTFT. Here the embedding and layers 0-19 run on ``EncoderBatch`` buffers of
``row_bucket(T)`` rows, compressors and Engram included; the decoder's KV source layer then publishes its global
entries from every row and narrows, eagerly, and the decoder rows follow through ``ReplayGraphs``. Steps past the
largest bucket (long cold chunks: matmul-bound) stay eager. Without capture (the CPU) the same fixed-shape forward
runs eagerly: the tests check it against the eager path.

On by default (``--no-encoder-graphs`` turns it off): four live runs at 32 agent sessions ran clean with it
(docs/decode_graphs.md has the history of the failures that kept it off before).
Engram rows come in buffers: host tables' rows from the step's prefetch (started before the graph), tables on the
device as row ids hashed on the host (the eager path hashes them on the host too, for the prefetch).
``run`` returns None, counted in ``fallbacks`` by reason, for a step it does not take. With ``ahead_rows`` set (the
engine's warm-up: engine.warmup) a step also builds the larger row buckets at its context bucket, from its rows
padded. Not the smaller ones: cut short, a hit's rows could lie inside its cached prefix, which the encoder's
fixed shapes do not take (``EncoderBatch.fits``); live traffic on the release proxy met encoder buckets of 256 rows
and up only (benchmarks/results/agentx-grid-300s-h200).
"""

from __future__ import annotations

from collections import Counter

import torch

from ..kv.encoder_batch import EncoderBatch
from ..kv.paged import PagedKVCache
from ..kv.paged_batch import PagedBatch
from ..layers.context import ForwardContext
from ..models.model import DeepseekForCausalLM
from .decode_graphs import batch_bucket, bucket_sizes
from .graph_capture import GraphCapture, SharedOutputs
from .replay_graphs import ROW_BUCKETS, decoder_context_bucket


class EncoderGraphs:
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
        """``max_rows``: the largest row bucket (longer steps run eagerly); ``capture``: None runs the fixed-shape
        forward eagerly (the CPU, the tests)."""
        if min_context % (2 * kv.layout.block_size):
            raise ValueError(
                f"min_context {min_context} must be a multiple of twice the block size {kv.layout.block_size}"
            )
        cfg = model.cfg
        self.model, self.kv, self.max_rows, self.max_seqs = model, kv, max_rows, max_seqs
        self.capture, self.min_context, self.row_buckets = capture, min_context, row_buckets
        self.split = cfg.encoder_layers
        self.sources = {i: r for i, (r, _) in kv.layout.sources.items() if i < self.split}  # encoder KV sources
        self.engram = [b.engram for b in model.layers[: self.split] if b.engram is not None]
        self._steps: dict[tuple[int, int], tuple] = {}
        self._streams = SharedOutputs(max_rows)  # every graph's streams and collapse weights, in its first rows
        self.reset_counts()
        self.last_key = None  # the (row bucket, context bucket) of the latest run
        self.ahead_rows = False  # a step also builds the larger row buckets of its context bucket (the warm-up)

    def reset_counts(self) -> None:
        self.replays, self.runs, self.padded_rows, self.fallbacks = 0, 0, 0, Counter()

    def _unfit(self, ctx: ForwardContext) -> str | None:
        cfg = self.model.cfg
        if not cfg.is_v41:
            return "no encoder/decoder split (V4)"
        if self.model.kernel_ops is None or type(ctx.paged) is not PagedBatch or ctx.paged.cache is not self.kv:
            return "not the paged batched path"
        if any(i < self.split for i in cfg.dspark_target_layer_ids):
            return "DSpark taps in the encoder"
        if ctx.trace is not None or ctx.is_image is not None or ctx.qat != cfg.qat:
            return "traced, image rows or a qat override"
        live = [s for s in ctx.seqs if s.rows.stop > s.rows.start]
        if ctx.tokens.shape[0] > self.max_rows or len(live) > self.max_seqs:
            return "rows outside the buckets"
        return EncoderBatch.fits(live, self.sources)

    def key(self, ctx: ForwardContext) -> tuple[int, int]:
        last = max(s.first + s.rows.stop - s.rows.start for s in ctx.seqs if s.rows.stop > s.rows.start)
        return (
            batch_bucket(ctx.tokens.shape[0], self.max_rows, self.row_buckets),
            decoder_context_bucket(last, self.min_context),
        )

    @torch.no_grad()
    def run(self, ctx: ForwardContext, host_ids: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(streams [T, n, d], collapse weights [T, n]) of every row of ``ctx`` entering the decoder's KV source
        layer, the encoder's host counts committed; None: not taken. ``host_ids``: the rows' Engram compressed ids on
        the host (None without Engram)."""
        why = self._unfit(ctx)
        if why is not None:
            self.fallbacks[why] += 1
            return None
        key = self.key(ctx)
        wanted = [key]
        if self.ahead_rows:
            wanted += [(r, key[1]) for r in bucket_sizes(self.max_rows, self.row_buckets) if r > key[0]]
        for k in sorted(wanted, reverse=True):  # largest first: the smaller captures reuse its freed scratch
            if k not in self._steps:
                self._steps[k] = self._build(k, ctx, host_ids)
        batch, engram, graph, out = self._steps[key]
        self._fill(batch, engram, ctx, host_ids)
        rows = ctx.tokens.shape[0]
        self.runs, self.last_key = self.runs + 1, key
        self.padded_rows += batch.capacity - rows
        if graph is None:
            out = self.model.forward_encoder_rows(batch, engram)
        else:
            graph.replay()
            self.replays += 1
        EncoderBatch.commit([s for s in ctx.seqs if s.rows.stop > s.rows.start], self.sources)
        # copies: the graph's output buffers are its own, rewritten by its next replay
        return out[0][:rows].clone(), out[1][:rows].clone()

    def _engram_rows(self, ctx: ForwardContext, host_ids: torch.Tensor | None) -> dict[int, torch.Tensor]:
        """Engram layer -> this step's [T, columns, D] table rows (host tables: the prefetch's) or [T, columns] row
        ids (device tables: hashed on the host, as for a prefetch, then uploaded)."""
        out, dev = {}, ctx.tokens.device
        for e in self.engram:
            layer = e.hasher.layer_id
            if e.table is not None:
                out[layer] = ctx.engram_rows[layer].for_seqs([s.rows for s in ctx.seqs])
            else:
                hist = [h.cpu() for h in ctx.engram_history]
                out[layer] = e.row_ids(host_ids, [s.rows for s in ctx.seqs], hist).to(dev, non_blocking=True)
        return out

    def _fill(self, batch: EncoderBatch, engram: dict, ctx: ForwardContext, host_ids) -> None:
        index = batch.fill(ctx.seqs, ctx.tokens, ctx.positions)
        for layer, t in self._engram_rows(ctx, host_ids).items():
            torch.index_select(t, 0, index, out=engram[layer])

    def _build(self, key, ctx: ForwardContext, host_ids):
        rows, bound = key
        batch = EncoderBatch(self.kv, rows, min(rows, self.max_seqs), bound)
        engram = {
            layer: t.new_empty((rows,) + tuple(t.shape[1:])) for layer, t in self._engram_rows(ctx, host_ids).items()
        }
        if self.capture is None:
            return batch, engram, None, None
        # Warm up on this step's inputs with every write masked (window, entries, carry); the step refills the
        # buffers before the replay.
        self._fill(batch, engram, ctx, host_ids)
        batch.mask_writes()
        graph, out = self.capture(
            lambda: self.model.forward_encoder_rows(batch, engram),
            f"encoder rows: {rows} rows, context {bound}",
            batch.forget_derived,
            self._streams,
        )
        return batch, engram, graph, out

    def report(self) -> dict:
        return {
            "graphs": sorted(k for k, v in self._steps.items() if v[2] is not None),
            "fixed_shape_steps": sorted(self._steps),
            "runs": self.runs,
            "replays": self.replays,
            "padded_rows": self.padded_rows,
            "fallbacks": dict(self.fallbacks),
        }
