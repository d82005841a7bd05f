"""CSA2 attention over the paged pools, batched over every row of the step: the path the kernels plug into.

Same layer, same weights and the same function as ``CSA2Attention.forward``'s per-sequence reference loop,
but no sequence's rows are unpacked into dense tensors: the window entry is normalised, rotated and
quantised by ``store_window``; the indexer scores keys straight from the FP4 pool (consumers of the
candidate pool score only the candidate positions); the sparse attention reads FP8 window rows and FP4
global rows by physical row id and de-rotates its output. Each op runs its Triton kernel or its torch
reference (``ctx.ops``).
"""
from __future__ import annotations

import torch

from ..kv.block_pool import InvariantError
from ..kv.paged_batch import FORMAT_KIND
from .context import ForwardContext
from .numerics import acc, acc_param, fp32_param


def _pad_topk(idx: torch.Tensor, valid: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Fewer columns than top-k (a short context): pad with invalid picks so kernels see a fixed K."""
    n = idx.shape[1]
    if n == k:
        return idx, valid
    pad = k - n
    return (torch.cat((idx, idx.new_zeros(idx.shape[0], pad)), 1),
            torch.cat((valid, valid.new_zeros(valid.shape[0], pad)), 1))


def _select(attn, x, q_lat, ctx: ForwardContext, cos, sin):
    """This layer's top-k (entry ids [T, K], valid [T, K]): its own indexer's, or the latest published."""
    cfg, role, step, ops = attn.cfg, attn.role, ctx.paged, ctx.ops
    if attn.indexer is None:
        ctx.log(role.index, "reuse")
        return step.topk
    ctx.log(role.index, "indexer")
    ix, cache = attn.indexer, step.cache
    q, w = ix.query(x, q_lat, ctx.positions, attn.rope, ctx.qat, ops, (cos, sin))
    w = w.float()
    src = role.kv_source
    pool = cache.index[src].flatten(0, 1)
    fmt = FORMAT_KIND[cache.layout.index_fmt.name]
    epb = cache.layout.sources[src][1]
    n_vis = step.visible(role.ratio)
    k, cbs = cfg.index_topk, cfg.candidate_block_size
    if role.candidate == "consumer":
        s = ops.index_scores_candidates(q, w, pool, fmt, step.seq_tables, step.row_seq, epb, step.cand_blocks, cbs,
                                        n_vis)
        idx, valid = ops.topk(s, k)
        from ..kernels.indexer import candidate_entries
        idx = candidate_entries(step.cand_blocks, cbs, idx)
    else:
        s = ops.index_scores(q, w, pool, fmt, step.seq_tables, step.row_seq, epb, n_vis, step.num_entries(src))
        if role.candidate == "source":
            step.cand_blocks = ops.candidate_blocks(s, n_vis, cbs, cfg.candidate_topk_blocks)
        idx, valid = ops.topk(s, k)
    step.topk = _pad_topk(idx, valid, k)
    return step.topk


def forward_paged(attn, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
    cfg, role, step, ops = attn.cfg, attn.role, ctx.paged, ctx.ops
    cache, lay = step.cache, step.cache.layout
    cos, sin = step.cos_sin(attn.rope, x.dtype)
    q_lat, q = attn.query(x, ctx.positions, ops, (cos, sin))

    # The step's own window rows: computed now, stored after the attention (storing first would overwrite
    # ring rows that earlier rows of a long chunk still read).
    kv_proj = attn.wkv(x)
    win_pool = cache.window[role.index].flatten(0, 1)
    win_fmt = FORMAT_KIND[lay.window_fmt.name]
    norm = attn.kv_norm
    kv = ops.store_window(kv_proj, norm.weight, norm.eps, cos, sin, win_pool, step.no_rows(), win_fmt, qat=ctx.qat)

    main_pool = sel_rows = None
    main_fmt = "fp4"
    if role.ratio:
        idx, valid = _select(attn, x, q_lat, ctx, cos, sin)
        src = role.kv_source
        main_pool = cache.main[src].flatten(0, 1)
        main_fmt = FORMAT_KIND[lay.main_fmt.name]
        sel_rows = ops.entry_rows(idx, valid, step.seq_tables, step.row_seq, lay.sources[src][1])
    o = ops.sparse_attention(q, cos, sin, win_pool, win_fmt, step.old_window_rows(role.index), kv,
                             step.row_first, main_pool, main_fmt, sel_rows, fp32_param(attn.attn_sink),
                             cfg.head_dim ** -0.5, out_dtype=x.dtype)

    rows = step.window_store_rows()
    ops.store_window(kv_proj, norm.weight, norm.eps, cos, sin, win_pool, rows, win_fmt, qat=ctx.qat)
    step.record_window(role.index, rows)
    return attn.project(o)


def compress_paged(attn, x: torch.Tensor, ctx: ForwardContext) -> None:
    """Every sequence's new global entries of the step (V4.1: ratio 2 gated pairs, or ratio 1) in one pass: the
    projections of the rows that need them, then pooling, norm, RoPE, FP4 quantisation and the paged store of the
    main and index rows fused, for all sequences at once. The bookkeeping (carried half-groups, entry counts, pool
    rows) is host arithmetic on positions and block tables: no read-back, and no launches per sequence."""
    layer, r, comp, ops = attn.role.index, attn.role.ratio, attn.compressor, ctx.ops
    cache, lay = ctx.paged.cache, ctx.paged.cache.layout
    epb, dev = lay.sources[layer][1], x.device
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
    if r == 1:
        u, z = comp.wkv(xs), None
    else:  # Compressor.projected's fp32 projections, for all sequences in one GEMM each
        u, z = acc(xs) @ acc_param(comp.wkv.weight).t(), acc(xs) @ acc_param(comp.wgate.weight).t()
    # The rows each sequence pools: its carried half-group (if any) then its new rows, one flat tensor for all;
    # host lists of the picked flat rows, the new entries and their pool rows (plain ints: decode adds one or none).
    pieces, carried, pick, entries, rows, off, at = [], [], [], [], [], 0, 0
    for seq_kv, _, m, start in spans:
        emitted, pend = seq_kv.num_entries(layer), seq_kv.pending(layer) if r > 1 else None
        first_pos = start if pend is None else pend[2]
        if pend is not None:
            pieces.append((pend[0], pend[1]))
        pieces.append((u[off:off + m], None if z is None else z[off:off + m]))
        width = m + (0 if pend is None else pend[0].shape[0])
        done = (first_pos + width) // r  # groups [0, done) are complete
        n = done - emitted if r > 1 else m
        if n > 0:
            s = emitted * r - first_pos if r > 1 else 0
            pick.extend(range(at + s, at + s + n * r))
            bt = seq_kv.block_table
            if (emitted + n - 1) // epb >= len(bt):
                raise InvariantError(f"entry {emitted + n - 1} of source {layer} has no block: the scheduler "
                                     "under-allocated")
            entries.extend(range(emitted, emitted + n))
            rows.extend(bt[e // epb] * epb + e % epb for e in range(emitted, emitted + n))
            seq_kv._entries[layer] = emitted + n
        if r > 1:  # what the next step prepends: rows from the first incomplete group on
            keep_from = max(done * r, first_pos)
            carried.append((seq_kv, at + keep_from - first_pos, at + width, keep_from))
        off, at = off + m, at + width
    if len(pieces) == len(spans):  # nothing was carried in: the new rows are the flat tensor
        flat_u, flat_z = u, z
    else:
        flat_u = torch.cat([p[0] for p in pieces])
        flat_z = torch.cat([p[1] for p in pieces]) if r > 1 else None
    for seq_kv, a, b, pos in carried:  # views of the flat tensors
        seq_kv.set_pending(layer, (flat_u[a:b], flat_z[a:b], pos) if a < b else None)
    if not entries:
        return
    if len(pick) != flat_u.shape[0]:  # each sequence's picks are one run inside its own rows: all, or a gather
        idx = _upload(torch.tensor(pick), dev)
        flat_u, flat_z = flat_u[idx], None if flat_z is None else flat_z[idx]
    entry_pos = _upload(torch.tensor(entries) * r, dev)
    dt = torch.float64 if x.dtype == torch.float64 else torch.float32
    cos, sin = (t.to(dt) for t in attn.rope._cos_sin(entry_pos))
    rows = _upload(torch.tensor(rows, dtype=torch.long), dev)
    latent, _ = ops.store_main(flat_u, flat_z, r, comp.norm.weight, comp.norm.eps, cos, sin,
                               cache.main[layer].flatten(0, 1), rows, FORMAT_KIND[lay.main_fmt.name], qat=ctx.qat,
                               out_dtype=x.dtype)
    ix = attn.indexer
    ops.store_index(ix.wk(latent), ix.k_norm.weight, ix.eps, cos, sin, cache.index[layer].flatten(0, 1), rows,
                    FORMAT_KIND[lay.index_fmt.name], qat=ctx.qat)


def _upload(t: torch.Tensor, device) -> torch.Tensor:
    return t.to(device, non_blocking=True)
