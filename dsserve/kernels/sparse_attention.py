"""Fused sparse attention with sink (spec 2.3) over paged window rows and selected global-KV rows, Triton + reference.

One launch handles every query row of a step (rows of many sequences, ragged). Row t takes one softmax over its
window keys (old rows from the pool + this step's fresh rows) and its selected global entries, with a per-head sink
logit in the denominator only; values are the keys (one latent of D channels shared by all heads), scale given;
the output's last R channels are then de-rotated at the query position (inverse RoPE).

Layouts (T rows, H heads, D channels, R RoPE channels; W window, K top-k):
* q          [T, H, D]  bf16 / fp32 (fp64: sparse_attention runs the reference), RoPE'd at the query position.
* cos, sin   [T, R/2]   fp32 (the reference computes in fp64 when given fp64): Rope._cos_sin of the query position.
* window_pool [Nw, Bw]  uint8 rows; window_fmt "fp8" (formats.SWA_FP8: D e4m3 bytes + D/32 ue8m0) or "bf16".
* old_rows   [T, W]     int32 physical window rows written by earlier steps, any order, -1 = absent.
* fresh_kv   [T, D]     float, this step's window rows; row t also sees fresh rows [max(row_first[t], t-W+1), t].
* row_first  [T]        int32 step row of the first row of t's sequence (a sequence's rows are consecutive).
* main_pool  [Nm, Bm]   uint8 rows or None (SWA-only layer); main_fmt "fp4" (formats.MAIN_FP4: D/2 e2m1 bytes, even
                        channel in the low nibble, + D/16 e4m3 scales), "fp8" (SWA_FP8 layout) or "bf16".
* sel_rows   [T, K]     int32 physical main rows, -1 = invalid; None with main_pool None.
* sink       [H]        fp32.
Returns o [T, H, D] in out_dtype, or written into `out` (contiguous [T, H, D], its own dtype) when given.
A row with nothing valid gives o = 0. Row ids are not range-checked by the kernel (that would need a sync).
Decode (few rows) runs split-K: NUM_SPLITS programs per (row, head block) each take a contiguous share of the row's
key blocks and leave fp32 partials that sparse_attention_combine merges; see num_splits for the rule. From
sparse_attention_prefill.PREFILL_MIN_ROWS rows of bf16 q, that module's kernel runs instead (same contract).
"""

from __future__ import annotations

import math
import os

import torch
import triton
import triton.language as tl

from dsserve.kernels import sparse_attention_prefill as prefill
from dsserve.kernels.kv_unpack import FMT_CODE as _FMT_CODE
from dsserve.kernels.kv_unpack import decode_rows
from dsserve.kernels.sparse_attention_combine import _derotate_store, combine_splits, split_workspace
from dsserve.kv import formats
from dsserve.layers.numerics import acc

_WINDOW_FMTS = {"fp8": formats.SWA_FP8, "bf16": formats.BF16_ROWS}
_MAIN_FMTS = {"fp4": formats.MAIN_FP4, "fp8": formats.SWA_FP8, "bf16": formats.BF16_ROWS}
RAW_KINDS = {"raw-float32": torch.float32, "raw-float64": torch.float64}
_REF_CHUNK = 256  # reference: query rows per batched einsum (bounds the [rows, W + K, D] gathered keys)
_FILL = 264  # programs that fill the H200 (2 per SM x 132 SMs); fewer rows * head blocks than this get split-K
_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"  # read at import, as Triton does


def _row_format(name, pool, fmts, fmt, d):
    if fmt in RAW_KINDS:  # V4's fp32 / fp64 rows: the reference reads them (the kernel refuses them below)
        from dsserve.kv.layout import RawRows  # here: kv.layout imports the model config

        rf = RawRows(d, RAW_KINDS[fmt])
    elif fmt not in fmts:
        raise ValueError(f"{name} format {fmt!r}: expected one of {sorted(fmts) + sorted(RAW_KINDS)}")
    else:
        rf = fmts[fmt].with_channels(d)
    if pool.dim() != 2 or pool.dtype != torch.uint8 or pool.shape[1] != rf.row_bytes:
        raise ValueError(
            f"{name}: expected uint8 [N, {rf.row_bytes}] ({fmt}, D={d}), got {pool.dtype} {tuple(pool.shape)}"
        )
    return rf


def _check(
    q, cos, sin, window_pool, window_fmt, old_rows, fresh_kv, row_first, main_pool, main_fmt, sel_rows, sink, out
):
    """Validates shapes/formats; returns (T, H, D, R2, W, K, window RowFormat, main RowFormat or None)."""
    if q.dim() != 3 or not q.is_floating_point():
        raise ValueError(f"q: expected a float [T, H, D] tensor, got {q.dtype} {tuple(q.shape)}")
    t, h, d = q.shape
    if cos.dim() != 2 or cos.shape[0] != t or sin.shape != cos.shape or not 0 < 2 * cos.shape[1] <= d:
        raise ValueError(
            f"cos/sin: expected equal [T={t}, R/2] with 0 < R <= D={d}, got {tuple(cos.shape)} and {tuple(sin.shape)}"
        )
    wf = _row_format("window_pool", window_pool, _WINDOW_FMTS, window_fmt, d)
    if old_rows.dim() != 2 or old_rows.shape[0] != t or old_rows.shape[1] < 1:
        raise ValueError(f"old_rows: expected [T={t}, W>=1], got {tuple(old_rows.shape)}")
    if tuple(fresh_kv.shape) != (t, d) or tuple(row_first.shape) != (t,) or tuple(sink.shape) != (h,):
        raise ValueError(
            f"expected fresh_kv [{t}, {d}], row_first [{t}], sink [{h}]; got {tuple(fresh_kv.shape)}, "
            f"{tuple(row_first.shape)}, {tuple(sink.shape)}"
        )
    if (main_pool is None) != (sel_rows is None):
        raise ValueError("main_pool and sel_rows: pass both (a layer with global reads) or neither (SWA-only)")
    mf, k = None, 0
    if main_pool is not None:
        mf = _row_format("main_pool", main_pool, _MAIN_FMTS, main_fmt, d)
        if sel_rows.dim() != 2 or sel_rows.shape[0] != t:
            raise ValueError(f"sel_rows: expected [T={t}, K], got {tuple(sel_rows.shape)}")
        k = sel_rows.shape[1]
    if out is not None and (tuple(out.shape) != (t, h, d) or not out.is_contiguous()):
        raise ValueError(f"out: expected a contiguous [{t}, {h}, {d}] tensor, got {tuple(out.shape)}")
    return t, h, d, cos.shape[1], old_rows.shape[1], k, wf, mf


# ------------------------------------------------------------------ reference
def _gather(pool, fmt, ids, dtype):
    """Unpacked rows pool[ids] as dtype [..., D]; invalid ids (-1) give zero rows (never NaN from stale bytes)."""
    valid = ids >= 0
    if pool.shape[0] == 0:
        return torch.zeros(*ids.shape, fmt.channels, dtype=dtype, device=pool.device), valid
    rows = fmt.unpack(pool[ids.clamp(min=0).long()], dtype)
    return rows.masked_fill(~valid[..., None], 0), valid


def sparse_attention_ref(
    q,
    cos,
    sin,
    window_pool,
    window_fmt,
    old_rows,
    fresh_kv,
    row_first,
    main_pool,
    main_fmt,
    sel_rows,
    sink,
    scale,
    out_dtype=torch.bfloat16,
    out=None,
    splits=None,
):
    del splits  # the kernel's split-K factor; kept so both functions take the same arguments
    from dsserve.layers.attention import sparse_attention_with_sink  # import here: attention imports kernels

    t, h, d, r2, w, k, wf, mf = _check(
        q, cos, sin, window_pool, window_fmt, old_rows, fresh_kv, row_first, main_pool, main_fmt, sel_rows, sink, out
    )
    dt = acc(q).dtype
    o = torch.empty(t, h, d, dtype=dt, device=q.device)
    steps = torch.arange(t, device=q.device)
    for a in range(0, t, _REF_CHUNK):
        b = min(a + _REF_CHUNK, t)
        rows = steps[a:b, None]
        # Fresh rows [lo, b) are shared window keys; old window rows and selected entries are per-row keys.
        lo = max(0, a - w + 1)
        j = steps[None, lo:b]
        win_mask = (j >= torch.maximum(row_first[a:b, None].long(), rows - w + 1)) & (j <= rows)
        sel_k, sel_mask = _gather(window_pool, wf, old_rows[a:b], dt)
        if mf is not None:
            gk, gm = _gather(main_pool, mf, sel_rows[a:b], dt)
            sel_k, sel_mask = torch.cat((sel_k, gk), 1), torch.cat((sel_mask, gm), 1)
        o[a:b] = sparse_attention_with_sink(q[a:b], fresh_kv[lo:b].to(dt), win_mask, sel_k, sel_mask, sink, scale)
    # Inverse RoPE on the tail pairs (2i, 2i+1): (a, b) -> (a cos + b sin, -a sin + b cos).
    c, s = cos.to(dt)[:, None, :], sin.to(dt)[:, None, :]
    tail = o[..., d - 2 * r2 :].unflatten(-1, (r2, 2))
    ea, eb = tail[..., 0], tail[..., 1]
    o[..., d - 2 * r2 :] = torch.stack((ea * c + eb * s, eb * c - ea * s), dim=-1).flatten(-2)
    return o.to(out_dtype) if out is None else out.copy_(o)


# ------------------------------------------------------------------ Triton
@triton.jit
def _decode_rows(pool, stride, rows, valid, FMT: tl.constexpr, D: tl.constexpr, BLOCK_N: tl.constexpr):
    """Keys of BLOCK_N pool rows as fp32 (even, odd) channel halves [BLOCK_N, D/2]; invalid rows are 0.
    Each format is first decoded to natural channel order [BLOCK_N, D] (``decode_rows``), then split into pairs;
    join/split stay within a thread's registers."""
    v = decode_rows(pool, stride, rows, valid, FMT, D, BLOCK_N)
    return tl.split(tl.reshape(v, [BLOCK_N, D // 2, 2]))


@triton.jit
def _online(q_e, q_o, k_e, k_o, valid, m_i, l_i, acc_e, acc_o, qk_scale, DT: tl.constexpr, UPCAST: tl.constexpr):
    """One online-softmax step over a key block (log2 domain): dot operands in DT (q's dtype), fp32 accumulate."""
    k_e, k_o = k_e.to(DT), k_o.to(DT)
    if UPCAST:  # CPU interpreter: its bf16 dot multiplies raw bit patterns, so use the same values in fp32
        k_e, k_o = k_e.to(tl.float32), k_o.to(tl.float32)
    s = tl.dot(q_e, tl.trans(k_e), input_precision="ieee")  # "ieee": fp32 q must not drop to tf32
    s = tl.dot(q_o, tl.trans(k_o), s, input_precision="ieee")
    s = tl.where(valid[None, :], s * qk_scale, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    p = p.to(DT).to(k_e.dtype)
    acc_e = tl.dot(p, k_e, acc_e * alpha[:, None], input_precision="ieee")
    acc_o = tl.dot(p, k_o, acc_o * alpha[:, None], input_precision="ieee")
    return m_new, l_i, acc_e, acc_o


@triton.jit
def _sparse_attention_kernel(
    q,
    sq_t,
    sq_h,
    sq_d,
    cos,
    sin,
    wpool,
    w_stride,
    old_rows,
    fresh,
    sf_t,
    sf_d,
    row_first,
    mpool,
    m_stride,
    sel_rows,
    sink,
    o,
    m_ws,
    l_ws,
    acc_ws,
    H,
    qk_scale,
    D: tl.constexpr,
    R2: tl.constexpr,
    W: tl.constexpr,
    K: tl.constexpr,
    WFMT: tl.constexpr,
    MFMT: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    BPS: tl.constexpr,
    IT_W: tl.constexpr,
    IT_K: tl.constexpr,
    UPCAST: tl.constexpr,
    SKIP_EMPTY: tl.constexpr,
):
    D2: tl.constexpr = D // 2
    NB_W: tl.constexpr = (W + BLOCK_N - 1) // BLOCK_N
    DT: tl.constexpr = q.dtype.element_ty
    t = tl.program_id(0).to(tl.int64)
    offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    hm = offs_h < H
    # Split s walks virtual key blocks [lo, lo + BPS) of: NB_W old-window, NB_W fresh-window, cdiv(K, BLOCK_N)
    # selected; IT_W / IT_K = min(BPS, blocks in that range) bound its share of each range (constexpr trip counts).
    lo = tl.program_id(2).to(tl.int64) * BPS  # int64: also spares the interpreter's int32 overflow checks
    hi = lo + BPS
    ch = tl.arange(0, D)
    nn = tl.arange(0, BLOCK_N)
    qf = tl.load(q + t * sq_t + offs_h[:, None] * sq_h + ch[None, :] * sq_d, mask=hm[:, None], other=0.0)
    q_e, q_o = tl.split(tl.reshape(qf, [BLOCK_H, D2, 2]))
    if UPCAST:
        q_e, q_o = q_e.to(tl.float32), q_o.to(tl.float32)
    # Start the running max at the sink: m stays finite, so fully masked blocks or rows never give NaN. The sink's
    # own term (l = 1) enters here only without splits; with splits the combine adds it once.
    m_i = tl.load(sink + offs_h, mask=hm, other=0.0) * 1.4426950408889634
    if NUM_SPLITS == 1:
        l_i = tl.full([BLOCK_H], 1.0, tl.float32)
    else:
        l_i = tl.full([BLOCK_H], 0.0, tl.float32)
    acc_e = tl.full([BLOCK_H, D2], 0.0, tl.float32)
    acc_o = tl.full([BLOCK_H, D2], 0.0, tl.float32)
    # A split skips whole ranges it does not reach; in a range, blocks past its end or the split's load nothing.
    if lo < NB_W:
        for i in range(IT_W):  # old window rows; blocks with no valid row skip the decode and dots
            n0 = (lo + i) * BLOCK_N
            rows = tl.load(old_rows + t * W + n0 + nn, mask=n0 + nn < W, other=-1)
            valid = rows >= 0
            if (not SKIP_EMPTY) or tl.max(valid.to(tl.int32), 0) > 0:
                k_e, k_o = _decode_rows(wpool, w_stride, rows, valid, WFMT, D, BLOCK_N)
                m_i, l_i, acc_e, acc_o = _online(
                    q_e, q_o, k_e, k_o, valid, m_i, l_i, acc_e, acc_o, qk_scale, DT, UPCAST
                )
    if (lo < 2 * NB_W) & (hi > NB_W):
        start = tl.maximum(tl.load(row_first + t).to(tl.int64), t - W + 1)
        f0 = tl.maximum(lo - NB_W, 0)
        for i in range(IT_W):  # fresh rows [start, t]: at most W, usually one block for decode rows
            n0 = (f0 + i) * BLOCK_N
            if (start + n0 <= t) & (NB_W + f0 + i < hi):
                j = start + n0 + nn
                valid = j <= t
                kf = tl.load(fresh + j[:, None] * sf_t + ch[None, :] * sf_d, mask=valid[:, None], other=0.0)
                k_e, k_o = tl.split(tl.reshape(kf.to(tl.float32), [BLOCK_N, D2, 2]))
                m_i, l_i, acc_e, acc_o = _online(
                    q_e, q_o, k_e, k_o, valid, m_i, l_i, acc_e, acc_o, qk_scale, DT, UPCAST
                )
    if hi > 2 * NB_W:
        g0 = tl.maximum(lo - 2 * NB_W, 0)
        k_end = tl.minimum((hi - 2 * NB_W) * BLOCK_N, K)  # the split's selected entries end before k_end
        for i in range(IT_K):  # selected global entries (K = 0: SWA-only, no loop)
            n0 = (g0 + i) * BLOCK_N
            rows = tl.load(sel_rows + t * K + n0 + nn, mask=n0 + nn < k_end, other=-1)
            valid = rows >= 0
            if (not SKIP_EMPTY) or tl.max(valid.to(tl.int32), 0) > 0:
                k_e, k_o = _decode_rows(mpool, m_stride, rows, valid, MFMT, D, BLOCK_N)
                m_i, l_i, acc_e, acc_o = _online(
                    q_e, q_o, k_e, k_o, valid, m_i, l_i, acc_e, acc_o, qk_scale, DT, UPCAST
                )
    if NUM_SPLITS == 1:
        _derotate_store(o, cos, sin, t, offs_h, hm, acc_e / l_i[:, None], acc_o / l_i[:, None], H, D, R2, BLOCK_H)
    else:  # partials for the combine (sparse_attention_combine.py has the workspace layouts)
        ms = (t * H + offs_h) * NUM_SPLITS + tl.program_id(2)
        tl.store(m_ws + ms, m_i, mask=hm)
        tl.store(l_ws + ms, l_i, mask=hm)
        jj = tl.arange(0, D2)[None, :]
        tl.store(acc_ws + ms[:, None] * D + jj, acc_e, mask=hm[:, None])
        tl.store(acc_ws + ms[:, None] * D + D2 + jj, acc_o, mask=hm[:, None])


def num_splits(programs, blocks, fill=_FILL):
    """Split-K factor for `programs` = T * cdiv(H, BLOCK_H) programs over `blocks` virtual key blocks per row: 1 when
    they already fill the GPU (prefill), else enough splits for about `fill` programs, at most one per block."""
    return 1 if programs >= fill else max(1, min(blocks, triton.cdiv(fill, programs)))


def split_plan(t, h, w, k, cfg, splits=None):
    """(NUM_SPLITS, BPS, IT_W, IT_K) for T rows of H heads over a window of W keys and K selected entries, with
    _tiles' cfg; `splits` forces the factor (rounded so that no split is empty)."""
    nb_w, nb_k = triton.cdiv(w, cfg["block_n"]), triton.cdiv(k, cfg["block_n"])
    blocks = 2 * nb_w + nb_k
    bps = triton.cdiv(
        blocks, num_splits(t * triton.cdiv(h, cfg["block_h"]), blocks, cfg["fill"]) if splits is None else splits
    )  # key blocks per split; then no split is empty
    return triton.cdiv(blocks, bps), bps, min(bps, nb_w), min(bps, nb_k)


def split_rows(h, d, w, k, fill=_FILL):
    """The fewest rows of each split-K variant below the prefill kernel's rows: the four numbers of split_plan are
    constexprs, so each variant compiles apart, and they follow from the row count alone. A warm-up that runs
    these row counts builds every variant traffic can meet (engine.warmup)."""
    cfg = dict(_tiles(1, h, d), fill=fill)
    first = {}
    for t in range(1, prefill.PREFILL_MIN_ROWS):
        first.setdefault(split_plan(t, h, w, k, cfg), t)
    return sorted(first.values())


TILE_OVERRIDE: dict | None = None  # tuning sweeps only: keys of _tiles' result to force


def _tiles(t, h, d):
    """Tile and launch parameters for T rows of H heads x D channels, from a sweep on the H200 at D = 512, H = 64
    (benchmarks/results/attention-h200/tile_sweep.md): all heads in one program (BLOCK_H = 64) decode each key once
    instead of once per head block, which beat 16/32-head blocks at B = 1, 16, 64 and in 4096-row prefill
    (e.g. B = 64: 139 vs 179 us; prefill 4.6 vs 10.4 ms); BLOCK_N = 32 keys per step with 8 warps (16 warps were
    2-3x slower). num_stages = 2 (pipelined loads, so no skipping of empty blocks) was no faster at this tile."""
    block_h = min(64, max(16, triton.next_power_of_2(h)))  # dot dims >= 16
    # The interpreter runs one program at a time: split-K there only costs (tests force `splits` to cover it).
    cfg = dict(
        block_h=block_h,
        block_n=32 if d >= 256 else 16,
        num_warps=8 if block_h * d >= 64 * 256 else 4,
        num_stages=1,
        skip_empty=True,
        fill=1 if _INTERPRET else _FILL,
    )
    cfg.update(TILE_OVERRIDE or {})
    return cfg


def sparse_attention(
    q,
    cos,
    sin,
    window_pool,
    window_fmt,
    old_rows,
    fresh_kv,
    row_first,
    main_pool,
    main_fmt,
    sel_rows,
    sink,
    scale,
    out_dtype=torch.bfloat16,
    out=None,
    splits=None,
):
    """`splits` (tests/tuning only) forces the split-K factor; it is rounded to cdiv(blocks, cdiv(blocks, splits))
    so that no split is empty. None picks num_splits(...)."""
    t, h, d, r2, w, k, wf, mf = _check(
        q, cos, sin, window_pool, window_fmt, old_rows, fresh_kv, row_first, main_pool, main_fmt, sel_rows, sink, out
    )
    if splits is not None and (not isinstance(splits, int) or splits < 1):
        raise ValueError(f"splits: expected None or an int >= 1, got {splits!r}")
    if q.dtype == torch.float64:  # fp64 model tests (interpreter): the kernel's softmax and dots are fp32
        return sparse_attention_ref(
            q,
            cos,
            sin,
            window_pool,
            window_fmt,
            old_rows,
            fresh_kv,
            row_first,
            main_pool,
            main_fmt,
            sel_rows,
            sink,
            scale,
            out_dtype,
            out,
        )
    if window_fmt in RAW_KINDS or main_fmt in RAW_KINDS:
        raise ValueError(f"the kernel reads fp8 / fp4 / bf16 rows, not {window_fmt} / {main_fmt} (the reference does)")
    if q.dtype not in (torch.float32, torch.bfloat16):  # fp16 dot operands could not hold e4m3 * 2^-22 keys
        raise ValueError(f"q: the kernel takes fp32 or bf16 (fp64 runs the reference), got {q.dtype}")
    if d < 32 or d & (d - 1):
        raise ValueError(f"D={d}: the kernel needs a power of two >= 32 (Triton block dims)")
    out = torch.empty(t, h, d, dtype=out_dtype, device=q.device) if out is None else out
    if t == 0:
        return out
    for name, pool, fmt in (("window_pool", window_pool, window_fmt), ("main_pool", main_pool, main_fmt)):
        if pool is not None and (pool.stride(1) != 1 or fmt == "bf16" and (pool.stride(0) | pool.data_ptr()) % 4):
            raise ValueError(f"{name}: rows must be contiguous (bf16 rows: 4-byte aligned, as int32 pairs)")
    old_rows, row_first = (x.to(torch.int32).contiguous() for x in (old_rows, row_first))
    sel = old_rows if sel_rows is None else sel_rows.to(torch.int32).contiguous()  # dummy pointer when K = 0
    mpool = window_pool if main_pool is None else main_pool
    cos, sin, sink = cos.float().contiguous(), sin.float().contiguous(), sink.float().contiguous()
    if q.dtype == torch.bfloat16 and splits is None and t >= prefill.PREFILL_MIN_ROWS:
        return prefill.sparse_attention_prefill(
            q,
            cos,
            sin,
            window_pool,
            _FMT_CODE[window_fmt],
            old_rows,
            fresh_kv,
            row_first,
            main_pool,
            _FMT_CODE[main_fmt] if mf is not None else 0,
            None if sel_rows is None else sel,
            sink,
            scale,
            out,
        )
    cfg = _tiles(t, h, d)
    block_h, block_n = cfg["block_h"], cfg["block_n"]
    # Split-K (decode): few programs each walking ~20 key blocks serially is latency-bound, so spread each row's
    # blocks over S programs and merge the partial softmaxes in a second small launch.
    n_split, bps, it_w, it_k = split_plan(t, h, w, k, cfg, splits)
    # The single pass writes o directly; its workspace pointers are unused.
    m_ws, l_ws, acc_ws = split_workspace(t, h, n_split, d, q.device) if n_split > 1 else (sink, sink, sink)
    _sparse_attention_kernel[(t, triton.cdiv(h, block_h), n_split)](
        q,
        q.stride(0),
        q.stride(1),
        q.stride(2),
        cos,
        sin,
        window_pool,
        window_pool.stride(0),
        old_rows,
        fresh_kv,
        fresh_kv.stride(0),
        fresh_kv.stride(1),
        row_first,
        mpool,
        mpool.stride(0),
        sel,
        sink,
        out,
        m_ws,
        l_ws,
        acc_ws,
        h,
        float(scale) * math.log2(math.e),
        D=d,
        R2=r2,
        W=w,
        K=k,
        WFMT=_FMT_CODE[window_fmt],
        MFMT=_FMT_CODE[main_fmt] if mf is not None else 0,
        BLOCK_H=block_h,
        BLOCK_N=block_n,
        NUM_SPLITS=n_split,
        BPS=bps,
        IT_W=it_w,
        IT_K=it_k,
        UPCAST=q.device.type == "cpu" and q.dtype == torch.bfloat16,
        SKIP_EMPTY=cfg["skip_empty"],
        num_warps=cfg["num_warps"],
        num_stages=cfg["num_stages"],
    )
    if n_split > 1:
        combine_splits(m_ws, l_ws, acc_ws, sink, cos, sin, out, r2)
    return out
