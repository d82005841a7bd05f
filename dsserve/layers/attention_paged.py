"""CSA2 attention over the paged pools, batched over every row of the step: the path the kernels plug into.

Same layer, same weights and the same function as ``CSA2Attention.forward``'s per-sequence reference loop,
but no sequence's rows are unpacked into dense tensors: the window entry is normalised, rotated and
quantised by ``store_window``; the indexer scores keys straight from the FP4 pool (consumers of the
candidate pool score only the candidate positions); the sparse attention reads FP8 window rows and FP4
global rows by physical row id and de-rotates its output. Each op runs its Triton kernel or its torch
reference (``ctx.ops``). A long bf16 chunk reads its keys from bf16 tables unpacked once (the many-row kernels
stream bf16 rows through shared memory). V4 takes the same path over its raw rows: its window entries carry
V4's own QAT and are stored raw, its HCA layers read every visible entry, its compressors pool per sequence.
"""

from __future__ import annotations

import torch

from ..kernels import indexer_prefill, sparse_attention_prefill
from ..kv.paged_batch import FORMAT_KIND
from .compress_v4_decode import store_raw_rows
from .context import ForwardContext
from .numerics import fp32_param

# A key table costs ~0.65 ns a row to unpack and saves ~0.2 us a query row of attention (H200, 64 heads x 512
# channels; scratch sweep of 128-4096 rows over 32K entries): built for at most TABLE_ROWS_PER_QUERY_ROW rows a query
# row and KEY_TABLE_MAX_BYTES; past either the prefill kernel decodes the packed rows in registers.
TABLE_ROWS_PER_QUERY_ROW = 128
KEY_TABLE_MAX_BYTES = 1 << 30


def _pad_topk(idx: torch.Tensor, valid: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Fewer columns than top-k (a short context): pad with invalid picks so kernels see a fixed K."""
    n = idx.shape[1]
    if n == k:
        return idx, valid
    pad = k - n
    return (
        torch.cat((idx, idx.new_zeros(idx.shape[0], pad)), 1),
        torch.cat((valid, valid.new_zeros(valid.shape[0], pad)), 1),
    )


def _select(attn, x, q_lat, ctx: ForwardContext, cos, sin):
    """This layer's top-k (entry ids [T, K], valid [T, K]): its own indexer's, or the latest published."""
    cfg, role, step, ops = attn.cfg, attn.role, ctx.paged, ctx.ops
    if attn.indexer is None and role.index_source is None:  # V4 HCA: every visible entry
        n = step.num_entries(role.kv_source)
        idx = torch.arange(n, device=x.device).expand(x.shape[0], n)
        # K padded to a power of two >= 16: the kernel compiles once per bucket as the entry count grows
        return _pad_topk(idx, idx < step.visible(role.ratio)[:, None], max(16, 1 << max(0, n - 1).bit_length()))
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
    tables, entries = step.seq_tables, epb
    if fmt != "bf16" and _index_tables(ops, q):  # a long chunk scores bf16 keys (kernels/indexer_prefill)
        made = _entry_table(ops, pool, "index_fp4", step, epb, q.shape[0], q.shape[-1], ("index", src))
        if made is not None:
            (pool, entries), fmt = made, "bf16"
            tables = torch.arange(tables.shape[0], device=q.device, dtype=torch.int32)[:, None]
    if role.candidate == "consumer":
        s = ops.index_scores_candidates(q, w, pool, fmt, tables, step.row_seq, entries, step.cand_blocks, cbs, n_vis)
        if ctx.probe is not None:
            ctx.probe.add(role.index, s)
        idx, valid = ops.topk(s, k)
        from ..kernels.indexer import candidate_entries

        idx = candidate_entries(step.cand_blocks, cbs, idx)
    else:
        s = ops.index_scores(q, w, pool, fmt, tables, step.row_seq, entries, n_vis, step.num_entries(src))
        if ctx.probe is not None:
            ctx.probe.add(role.index, s)
        if role.candidate == "source":
            step.cand_blocks = ops.candidate_blocks(s, n_vis, cbs, cfg.candidate_topk_blocks)
        idx, valid = ops.topk(s, k)
    step.topk = _pad_topk(idx, valid, k)
    return step.topk


def _key_tables(ops, q: torch.Tensor) -> bool:
    """A prefill chunk in bf16 on the attention kernel: its keys are read from bf16 tables (the prefill kernel
    then streams them into shared memory by cp.async: 2.7 vs 4.5 ms an 8K chunk with FP8 / FP4 decoded in
    registers on the H200, 8.1 ms on the general kernel; kernels/sparse_attention_prefill.py)."""
    return (
        q.dtype == torch.bfloat16
        and ops.uses_triton("attention")
        and q.shape[0] >= sparse_attention_prefill.PREFILL_MIN_ROWS
    )


def _index_tables(ops, q: torch.Tensor) -> bool:
    """A long chunk in bf16 on the indexer kernel: its source layers score bf16 index keys (the many-row kernel
    streams them into shared memory; kernels/indexer_prefill.py)."""
    return q.dtype == torch.bfloat16 and ops.uses_triton("indexer") and q.shape[0] >= indexer_prefill.PREFILL_ROWS


def _worth_it(table_rows: int, query_rows: int, channels: int) -> bool:
    return table_rows <= TABLE_ROWS_PER_QUERY_ROW * query_rows and table_rows * 2 * channels <= KEY_TABLE_MAX_BYTES


def _window_table(ops, pool: torch.Tensor, fmt: str, query_rows: int, channels: int):
    """The window pool unpacked whole (same row ids): a ring of W rows a slot, a few MB a layer."""
    if fmt == "bf16" or not _worth_it(pool.shape[0], query_rows, channels):
        return pool, fmt
    rows = torch.arange(pool.shape[0], device=pool.device, dtype=torch.int32)
    return ops.unpack_rows(pool, fmt, rows).view(torch.uint8), "bf16"


def _entry_table(ops, pool: torch.Tensor, fmt: str, step, epb: int, query_rows: int, channels: int, key):
    """Every entry of each sequence of the step unpacked into bf16 table row seq * E + entry (E = the block
    tables' width in entries) -> (table as uint8 rows, E), or None when not worth it. Built once a step per
    ``key`` (kind, source): the layers after a source read the entries it published, unchanged."""
    if key in step.key_tables:
        return step.key_tables[key]
    tables = step.seq_tables.long()
    s, e = tables.shape[0], tables.shape[1] * epb
    made = None
    if _worth_it(s * e, query_rows, channels):
        j = torch.arange(epb, device=tables.device)
        rows = torch.where(tables[:, :, None] >= 0, tables[:, :, None] * epb + j, -1).flatten()
        made = ops.unpack_rows(pool, fmt, rows).view(torch.uint8), e
    step.key_tables[key] = made
    return made


def _main_table(
    ops,
    pool: torch.Tensor,
    fmt: str,
    sel_rows: torch.Tensor,
    idx: torch.Tensor,
    step,
    epb: int,
    channels: int,
    src: int,
):
    """The main entries as an entry table; the selected rows renumbered into it (absent ones stay -1)."""
    made = (
        None if fmt == "bf16" else _entry_table(ops, pool, fmt, step, epb, sel_rows.shape[0], channels, ("main", src))
    )
    if made is None:
        return pool, fmt, sel_rows
    table, e = made
    sel = torch.where(sel_rows >= 0, step.row_seq.long()[:, None] * e + idx.long(), -1).to(torch.int32)
    return table, "bf16", sel


def forward_paged(attn, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
    cfg, role, step, ops = attn.cfg, attn.role, ctx.paged, ctx.ops
    cache, lay = step.cache, step.cache.layout
    cos, sin = step.cos_sin(attn.rope, x.dtype)
    q_lat, q = attn.query(x, ctx.positions, ops, (cos, sin))

    # The step's own window rows: computed now, stored after the attention (storing first would overwrite
    # ring rows that earlier rows of a long chunk still read), except in a decode batch: a row's ring row holds
    # position p - W, which no row of the step reads, so computing and storing are one launch. V4's entries (its own
    # QAT) are stored raw.
    win_pool = cache.window[role.index].flatten(0, 1)
    win_fmt = FORMAT_KIND[lay.window_fmt.name]
    norm = attn.kv_norm
    decode = getattr(step, "is_decode", False)
    if cfg.is_v41:
        kv_proj = attn.wkv(x)
        kv = ops.store_window(
            kv_proj,
            norm.weight,
            norm.eps,
            cos,
            sin,
            win_pool,
            step.window_store_rows() if decode else step.no_rows(),
            win_fmt,
            qat=ctx.qat,
        )
    else:
        kv = attn.window_entry(x, ctx.positions, ctx.qat, ops, (cos, sin))

    main_pool = sel_rows = None
    main_fmt = "fp4"
    tables = _key_tables(ops, q)
    win_keys, win_keys_fmt = win_pool, win_fmt
    if tables:
        win_keys, win_keys_fmt = _window_table(ops, win_pool, win_fmt, q.shape[0], cfg.head_dim)
    if role.ratio:
        idx, valid = _select(attn, x, q_lat, ctx, cos, sin)
        src = role.kv_source
        main_pool = cache.main[src].flatten(0, 1)
        main_fmt = FORMAT_KIND[lay.main_fmt.name]
        epb = lay.sources[src][1]
        sel_rows = ops.entry_rows(idx, valid, step.seq_tables, step.row_seq, epb)
        if tables:
            main_pool, main_fmt, sel_rows = _main_table(
                ops, main_pool, main_fmt, sel_rows, idx, step, epb, cfg.head_dim, src
            )
    o = ops.sparse_attention(
        q,
        cos,
        sin,
        win_keys,
        win_keys_fmt,
        step.old_window_rows(role.index, ops),
        kv,
        step.row_first,
        main_pool,
        main_fmt,
        sel_rows,
        fp32_param(attn.attn_sink),
        cfg.head_dim**-0.5,
        out_dtype=x.dtype,
    )

    rows = step.window_store_rows()
    if cfg.is_v41:
        if not decode:
            ops.store_window(kv_proj, norm.weight, norm.eps, cos, sin, win_pool, rows, win_fmt, qat=ctx.qat)
    elif decode:  # fixed shapes: rows that store nothing are -1
        store_raw_rows(win_pool, lay.window_fmt, rows, kv, ops)
    else:
        src_rows, dst_rows = step.window_store_pairs()
        win_pool.view(lay.window_fmt.dtype).index_copy_(0, dst_rows, kv[src_rows].to(lay.window_fmt.dtype))
    step.record_window(role.index, rows)
    return attn.project(o)
