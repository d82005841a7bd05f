"""The KV compressor over the paged pools, batched over every sequence of the step (V4.1: ratio-2 gated pairs, or
ratio 1): the projections of the rows that need them, then pooling, norm, RoPE, FP4 quantisation and the paged
store of the main and index rows fused, for all sequences at once.

A sequence's not-yet-pooled rows (at most r - 1) live on the device in ``PagedKVCache.carry``, indexed by its
window slot; how many it has is host state (``SequenceKV.carried``). Two forms:
- ``compress_paged`` (any step): entry counts, pool rows and the carried rows' places are host arithmetic on
  positions and block tables, uploaded without a wait; no launches per sequence;
- ``compress_decode`` (a ``DecodeBatch``: one row per sequence, fixed shapes, CUDA-graph capturable): every row
  pools its carried rows with itself and the pool row is -1 (computed, not stored) where no group completes; the
  row becomes the carry. The host's counts follow in ``commit_decode``;
- ``compress_rows`` (an ``EncoderBatch``: several rows per sequence, fixed shapes): every row pools the group
  ending at it, taking each earlier member from this step's rows or, before the sequence's first row, from the
  carry; the rows of each sequence's last incomplete group become the carry. The host's counts follow in
  ``EncoderBatch.commit``.
"""

from __future__ import annotations

import torch

from ..kv.block_pool import InvariantError
from ..kv.paged_batch import FORMAT_KIND
from .context import ForwardContext
from .numerics import acc, acc_param


def _projections(comp, x: torch.Tensor, r: int):
    """(u, z): ratio 1 passes the projection through (z None); ratio r > 1 pools fp32 projections, as
    Compressor.projected does."""
    if r == 1:
        return comp.wkv(x), None
    return acc(x) @ acc_param(comp.wkv.weight).t(), acc(x) @ acc_param(comp.wgate.weight).t()


def _store(attn, ctx: ForwardContext, u, z, r: int, cos_sin, rows: torch.Tensor, dtype) -> None:
    """Pool ``u``/``z`` (groups of r rows, one per entry), normalise, rotate by the entries' (cos, sin), quantise and
    store main and index rows at pool ``rows`` (-1: compute, store nothing)."""
    layer, comp, ops = attn.role.index, attn.compressor, ctx.ops
    cache, lay = ctx.paged.cache, ctx.paged.cache.layout
    cos, sin = cos_sin
    latent, _ = ops.store_main(
        u,
        z,
        r,
        comp.norm.weight,
        comp.norm.eps,
        cos,
        sin,
        cache.main[layer].flatten(0, 1),
        rows,
        FORMAT_KIND[lay.main_fmt.name],
        qat=ctx.qat,
        out_dtype=dtype,
    )
    ix = attn.indexer
    ops.store_index(
        ix.wk(latent),
        ix.k_norm.weight,
        ix.eps,
        cos,
        sin,
        cache.index[layer].flatten(0, 1),
        rows,
        FORMAT_KIND[lay.index_fmt.name],
        qat=ctx.qat,
    )


def compress_paged(attn, x: torch.Tensor, ctx: ForwardContext) -> None:
    """Every sequence's new global entries of the step in one pass (see the module's docstring)."""
    if getattr(ctx.paged, "is_decode", False):
        return compress_decode(attn, x, ctx)
    if getattr(ctx.paged, "is_fixed_rows", False):
        return compress_rows(attn, x, ctx)
    layer, r = attn.role.index, attn.role.ratio
    cache, dev = ctx.paged.cache, x.device
    epb = cache.layout.sources[layer][1]
    spans = []  # per sequence with rows to compress: (its cache, first row in x, row count, first position)
    for seq in ctx.seqs:
        n = seq.rows.stop - seq.rows.start
        # Entries below published_until came from the prefix cache: read-only. At an odd boundary the last
        # cached raw row is pooled again to rebuild the carried half-group.
        pub = seq.cache.published_until
        start = max(seq.first, pub - pub % r)
        if start < seq.first + n:
            spans.append((seq.cache, seq.rows.start + start - seq.first, seq.first + n - start, start))
    if not spans:
        return
    whole = sum(m for _, _, m, _ in spans) == x.shape[0]  # every row (the spans are in order and disjoint)
    xs = x if whole else x[_upload(torch.cat([torch.arange(k, k + m) for _, k, m, _ in spans]), dev)]
    u, z = _projections(attn.compressor, xs, r)
    carry = cache.carry(layer, u.shape[1], u.dtype) if r > 1 else None
    # Each sequence pools its carried rows then its new rows. As host lists of indices into "both" (the carried
    # rows of every sequence, gathered, then u): the flat order, the rows each entry pools, the rows to carry on.
    gather, flat, pick, carry_src, carry_dst, entries, rows, off = [], [], [], [], [], [], [], 0
    n_carried = sum(kv.carried.get(layer, 0) for kv, *_ in spans) if r > 1 else 0
    for seq_kv, _, m, start in spans:
        emitted, c = seq_kv.num_entries(layer), seq_kv.carried.get(layer, 0) if r > 1 else 0
        first_pos = start - c
        at = len(flat)
        flat.extend(range(len(gather), len(gather) + c))
        gather.extend(seq_kv.slot * (r - 1) + j for j in range(c))
        flat.extend(range(n_carried + off, n_carried + off + m))
        width = m + c
        done = (first_pos + width) // r  # groups [0, done) are complete
        n = done - emitted if r > 1 else m
        if n > 0:
            s = emitted * r - first_pos if r > 1 else 0
            pick.extend(flat[at + s : at + s + n * r])
            bt = seq_kv.block_table
            if (emitted + n - 1) // epb >= len(bt):
                raise InvariantError(
                    f"entry {emitted + n - 1} of source {layer} has no block: the scheduler under-allocated"
                )
            entries.extend(range(emitted, emitted + n))
            rows.extend(bt[e // epb] * epb + e % epb for e in range(emitted, emitted + n))
            seq_kv._entries[layer] = emitted + n
        if r > 1:  # what the next step prepends: rows from the first incomplete group on
            keep_from = max(done * r, first_pos)
            kept = flat[at + keep_from - first_pos : at + width]
            carry_src.extend(kept)
            carry_dst.extend(seq_kv.slot * (r - 1) + j for j in range(len(kept)))
            seq_kv.carried[layer] = len(kept)
        off += m
    if gather:  # the carried rows, read before this step's rows overwrite them
        g = _upload(torch.tensor(gather), dev)
        u = torch.cat((carry[0].flatten(0, 1)[g], u))
        z = torch.cat((carry[1].flatten(0, 1)[g], z))
    if carry_src:
        src, dst = _upload(torch.tensor(carry_src), dev), _upload(torch.tensor(carry_dst), dev)
        carry[0].flatten(0, 1).index_copy_(0, dst, u[src])
        carry[1].flatten(0, 1).index_copy_(0, dst, z[src])
    if not entries:
        return
    if pick != list(range(u.shape[0])):  # all rows in order (a one-shot prefill) needs no gather
        idx = _upload(torch.tensor(pick), dev)
        u, z = u[idx], None if z is None else z[idx]
    _store(
        attn,
        ctx,
        u,
        z,
        r,
        attn.rope.kernel_tables(_upload(torch.tensor(entries) * r, dev), x.dtype),
        _upload(torch.tensor(rows, dtype=torch.long), dev),
        x.dtype,
    )


def compress_decode(attn, x: torch.Tensor, ctx: ForwardContext) -> None:
    """A decode batch's entries in fixed shapes: row t (position p) completes the group ending at p when
    (p + 1) % r == 0, pooling the carried rows p-r+1..p-1 with itself; its projections become the carry either way
    (a sequence whose group just completed carries nothing: the host's count says so). Padding rows store nothing
    and carry into the spare slot."""
    layer, r = attn.role.index, attn.role.ratio
    step = ctx.paged
    u, z = _projections(attn.compressor, x, r)
    rows, cos_sin = step.entry_stores(r, attn.rope, x.dtype)  # the same for every source of this ratio
    if r > 1:
        p = step.positions
        cu, cz = step.cache.carry(layer, u.shape[1], u.dtype)
        slot = step.carry_slots
        pu, pz = torch.cat((cu[slot], u[:, None]), 1), torch.cat((cz[slot], z[:, None]), 1)  # [T, r, width]
        # carry row j holds the group's position j; the group's last row writes a row that nothing reads
        dst = slot * (r - 1) + (p % r).clamp(max=r - 2)
        cu.flatten(0, 1).index_copy_(0, dst, u)
        cz.flatten(0, 1).index_copy_(0, dst, z)
        u, z = pu.flatten(0, 1), pz.flatten(0, 1)
    _store(attn, ctx, u, z, r, cos_sin, rows, x.dtype)


def compress_rows(attn, x: torch.Tensor, ctx: ForwardContext) -> None:
    """An encoder batch's entries in fixed shapes (kv.encoder_batch): row t (position p) completes the group ending
    at p when (p + 1) % r == 0 and its entry is not the prefix cache's; member q < p is row t - (p - q) of the step
    when q is at or after the sequence's first row of the step, else carry row q % r. Rows in their sequence's last
    incomplete group write the carry; other rows (and padding) write the spare slot, which nothing reads."""
    layer, r = attn.role.index, attn.role.ratio
    step = ctx.paged
    u, z = _projections(attn.compressor, x, r)
    rows, cos_sin = step.entry_stores(r, attn.rope, x.dtype)
    if r > 1:
        p, dev = step.positions, x.device
        cu, cz = step.cache.carry(layer, u.shape[1], u.dtype)
        slot = step.carry_slots
        j = torch.arange(r - 1, device=dev)
        in_step = (p[:, None] - (r - 1) + j) >= step.first_positions()[:, None]  # [T, r - 1]
        src = (torch.arange(u.shape[0], device=dev)[:, None] - (r - 1) + j).clamp_min(0)
        pu = torch.cat((torch.where(in_step[..., None], u[src], cu[slot]), u[:, None]), 1)  # [T, r, width]
        pz = torch.cat((torch.where(in_step[..., None], z[src], cz[slot]), z[:, None]), 1)
        carries = p >= torch.div(step.seq_last() + 1, r, rounding_mode="floor") * r
        dst = torch.where(carries, slot * (r - 1) + p % r, step.cache.slots.num_blocks * (r - 1))
        cu.flatten(0, 1).index_copy_(0, dst, u)  # after the gathers above: they read the carry first
        cz.flatten(0, 1).index_copy_(0, dst, z)
        u, z = pu.flatten(0, 1), pz.flatten(0, 1)
    _store(attn, ctx, u, z, r, cos_sin, rows, x.dtype)


def _upload(t: torch.Tensor, device) -> torch.Tensor:
    return t.to(device, non_blocking=True)
