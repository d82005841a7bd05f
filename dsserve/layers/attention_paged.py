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

from ..kv.paged_batch import FORMAT_KIND
from .context import ForwardContext
from .numerics import fp32_param


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
    o = ops.sparse_attention(q, cos, sin, win_pool, win_fmt, step.old_window_rows(role.index, ops), kv,
                             step.row_first, main_pool, main_fmt, sel_rows, fp32_param(attn.attn_sink),
                             cfg.head_dim ** -0.5, out_dtype=x.dtype)

    rows = step.window_store_rows()
    ops.store_window(kv_proj, norm.weight, norm.eps, cos, sin, win_pool, rows, win_fmt, qat=ctx.qat)
    step.record_window(role.index, rows)
    return attn.project(o)

