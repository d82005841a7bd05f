"""A replayed prefill step's encoder layers in fixed shapes, one per (row bucket, context bucket), captured as CUDA
graphs: the other piece of the split at the encoder/decoder boundary (``DecoderRowGraphs`` runs the decoder's).

A prefix hit with bounded replay runs the encoder on the replayed window rows plus the new tokens and the decoder on
the last ``replay_window``. Here the embedding and layers 0-19 run on ``EncoderBatch`` buffers of ``row_bucket(T)``
rows, compressors and Engram included; the decoder's KV source layer then publishes its global entries from every
row and narrows, eagerly, and the decoder rows follow through ``DecoderRowGraphs``. Steps past the largest bucket
(long cold chunks: matmul-bound) stay eager. Without capture (the CPU) the same fixed-shape forward runs eagerly: the
tests check it against the eager path. ``--no-encoder-graphs`` turns it off.

Engram rows come in buffers: host tables' rows from the step's prefetch (started before the graph), tables on the
device as row ids hashed on the host (the eager path hashes them on the host too, for the prefetch).
``run`` returns None, counted in ``fallbacks`` by reason, for a step it does not take. With ``ahead_rows`` set (the
engine's warm-up: engine.warmup) a step also builds the larger row buckets at its context bucket, from its rows
padded. Not the smaller ones: cut short, a hit's rows could lie inside its cached prefix, which the encoder's
fixed shapes do not take (``EncoderBatch.fits``). The skeleton (building, capture, replay, report) is
engine.step_graphs'.
"""

from __future__ import annotations

import torch

from ..kv.encoder_batch import EncoderBatch
from ..layers.context import ForwardContext
from .decoder_row_graphs import RowGraphs
from .step_graphs import CapturedStep


class EncoderGraphs(RowGraphs):
    label = "encoder rows: {0} rows, context {1}"

    def __init__(self, *a, **kw):
        """As ``RowGraphs``'."""
        super().__init__(*a, **kw)
        self.sources = {i: r for i, (r, _) in self.kv.layout.sources.items() if i < self.split}  # encoder KV sources
        self.engram = [b.engram for b in self.model.layers[: self.split] if b.engram is not None]

    def rows(self, ctx: ForwardContext) -> int:
        return ctx.tokens.shape[0]

    def _unfit(self, ctx: ForwardContext) -> str | None:
        cfg = self.model.cfg
        if not cfg.is_v41:
            return "no encoder/decoder split (V4)"
        if why := self._not_paged(ctx):
            return why
        if any(i < self.split for i in cfg.dspark_target_layer_ids):
            return "DSpark taps in the encoder"
        return self._not_plain(ctx) or EncoderBatch.fits(
            [s for s in ctx.seqs if s.rows.stop > s.rows.start], self.sources
        )

    @torch.no_grad()
    def run(self, ctx: ForwardContext, host_ids: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(streams [T, n, d], collapse weights [T, n]) of every row of ``ctx`` entering the decoder's KV source
        layer, the encoder's host counts committed; None: not taken. ``host_ids``: the rows' Engram compressed ids on
        the host (None without Engram)."""
        if not self.fits(ctx):
            return None
        out, rows = self.launch(self.key(ctx), (ctx, host_ids))
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

    def new_step(self, key: tuple[int, int], step) -> CapturedStep:
        rows, bound = key
        engram = {layer: t.new_empty((rows,) + tuple(t.shape[1:])) for layer, t in self._engram_rows(*step).items()}
        return CapturedStep(EncoderBatch(self.kv, rows, min(rows, self.max_seqs), bound), engram)

    def fill(self, s: CapturedStep, step) -> int:
        ctx, host_ids = step
        index = s.batch.fill(ctx.seqs, ctx.tokens, ctx.positions)
        for layer, t in self._engram_rows(ctx, host_ids).items():
            torch.index_select(t, 0, index, out=s.inputs[layer])
        return ctx.tokens.shape[0]

    def forward(self, s: CapturedStep) -> tuple[torch.Tensor, torch.Tensor]:
        return self.model.forward_encoder_rows(s.batch, s.inputs)
