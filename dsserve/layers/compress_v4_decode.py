"""V4's compressors in a fixed-shape decode step (a ``DecodeBatch``: one row per sequence, CUDA-graph capturable).

V4 pools groups of r rows with a softmax gate plus APE; its ratio-4 compressors (and every indexer compressor)
overlap: entry g mixes group g-1's first channel half with group g's second half. Between steps the rows not yet
pooled stay in a device ring per sequence (``PagedKVCache.pending_ring``: position p at row p % R, R = r, or 2r
when overlapping). Each step writes its row there, gathers the R positions its group's entry would pool (group -1
of an overlapping compressor is empty: u 0, z -inf, as ``Compressor._pool`` pads it), pools them, and stores the
entry only where the row completes its group (``DecodeBatch.entry_stores``: -1 elsewhere). The host's side (which
positions the ring holds) follows from the token count (``RingPending``); the eager path reads the ring back through
``SequenceKV.pending``.
"""

from __future__ import annotations

import torch

from . import quant
from .context import ForwardContext
from .numerics import acc_dtype, acc_param


def ring_specs(model) -> list[tuple[int, object, tuple[int, int, torch.dtype]]]:
    """(key, compressor, (ring rows, width, dtype)) of every V4 compressor of ``model`` that pools (r > 1)."""
    dtype = acc_dtype(model.embed.weight.dtype)  # the projections' (Compressor.project on the activations)
    out = []
    for block in model.layers:
        attn = block.attn
        comps = [(attn.role.index, attn.compressor)]
        if attn.indexer is not None and getattr(attn.indexer, "compressor", None) is not None:
            comps.append((-1 - attn.role.index, attn.indexer.compressor))
        for key, comp in comps:
            if comp is not None and comp.ratio > 1:
                out.append((key, comp, (comp.ratio * (2 if comp.overlap else 1), comp.wkv.weight.shape[0], dtype)))
    return out


def rings_before_step(specs, seqs) -> None:
    """Each sequence's pending rows into the rings (those an eager step left as tensors; a sequence whose rows are
    all there already costs nothing)."""
    for kv in seqs:
        if kv.rings_live:
            continue
        for key, comp, ring in specs:
            kv.pending_to_ring(key, ring, comp.ratio, comp.overlap)
        kv.rings_live = True


def _ring_rows(step, r: int, rows: int):
    """Per row of the step, for rings of ``rows`` rows pooling groups of r: the ring row its projections go to
    [T], the ring rows of the positions its group's entry pools [T, rows], their APE slots [T, rows], and whether
    each is a position at all [T, rows, 1] (group -1 of an overlapping compressor is not); once per step."""
    key = ("v4 ring", r, rows)
    if key not in step.derived:
        p = step.positions
        base = step.carry_slots * rows
        first = (torch.div(p, r, rounding_mode="floor") - (rows // r - 1)) * r
        q = first[:, None] + torch.arange(rows, device=p.device)  # [T, rows] the positions pooled
        step.derived[key] = (base + p % rows, base[:, None] + q.remainder(rows), q.remainder(r), (q >= 0)[:, :, None])
    return step.derived[key]


def _pooled(comp, key: int, x: torch.Tensor, step) -> torch.Tensor:
    """[capacity, head_dim] the pooled latent of the group each row's position belongs to (complete or not)."""
    r, c = comp.ratio, comp.head_dim
    u, z = comp.project(x)
    rows = r * (2 if comp.overlap else 1)
    ring_u, ring_z = step.cache.pending_ring(key, rows, u.shape[1], u.dtype)
    put, at, slot, live = _ring_rows(step, r, rows)
    ring_u.flatten(0, 1).index_copy_(0, put, u)
    ring_z.flatten(0, 1).index_copy_(0, put, z)
    uw, zw = ring_u.flatten(0, 1)[at], ring_z.flatten(0, 1)[at]
    if comp.ape is not None:
        zw = zw + acc_param(comp.ape)[slot]
    if (
        comp.overlap
    ):  # the empty group's weights are 0 (its stale u then counts for nothing, as the zeros it stands for)
        zw = torch.where(live, zw, float("-inf"))
        uw = torch.cat((uw[:, :r, :c], uw[:, r:, c:]), dim=1)
        zw = torch.cat((zw[:, :r, :c], zw[:, r:, c:]), dim=1)
    return (torch.softmax(zw, dim=1) * uw).sum(1).to(x.dtype)


def store_raw_rows(pool: torch.Tensor, fmt, rows: torch.Tensor, values: torch.Tensor, ops) -> None:
    """values [T, C] into a raw-row pool (uint8 [..., C * itemsize]) at rows (-1: none): bf16 rows by the kv_write
    quantiser kernel (no host wait), fp32 / fp64 rows (the CPU's references) by a masked store."""
    flat = pool.view(-1, pool.shape[-1])
    if fmt.dtype == torch.bfloat16 and ops.uses_triton("kv_write"):
        from ..kernels.kv_write import quantize_rows

        quantize_rows(values.to(torch.bfloat16), flat, rows, "bf16")
        return
    keep = rows >= 0
    flat[rows[keep]] = fmt.pack(values[keep])


def compress_decode_v4(attn, x: torch.Tensor, ctx: ForwardContext) -> None:
    """A decode batch's new V4 entries of this source layer (main and, on CSA layers, index keys), stored where
    a row completes its group."""
    step, ops, layer, r = ctx.paged, ctx.ops, attn.role.index, attn.role.ratio
    cache, lay = step.cache, step.cache.layout
    rows, tables = step.entry_stores(r, attn.rope, x.dtype)
    norm = attn.compressor.norm
    main = ops.rope_inplace(ops.rms_norm(_pooled(attn.compressor, layer, x, step), norm.weight, norm.eps), *tables)
    if ctx.qat:
        main = attn._kv_qat(main, True, ops)
    store_raw_rows(cache.main[layer], lay.main_fmt, rows, main, ops)
    icomp = None if attn.indexer is None else getattr(attn.indexer, "compressor", None)
    if icomp is not None and layer in cache.index:
        ik = ops.rope_inplace(
            ops.rms_norm(_pooled(icomp, -1 - layer, x, step), icomp.norm.weight, icomp.norm.eps), *tables
        )
        if ctx.qat:
            ik = ops.fake_quant_fp4_pow2(quant.hadamard_rotate(ik), 32)
        store_raw_rows(cache.index[layer], lay.index_fmt, rows, ik, ops)
