"""Sparse attention for many rows (prefill chunks, long replay batches): the kernel behind ``sparse_attention``
from ``PREFILL_MIN_ROWS`` rows of bf16 q (same contract: see that module's doc).

Why a second kernel: a prefill chunk is compute-bound, and the general kernel (keys decoded in registers and kept
as even and odd channel halves for the de-rotation, 32 keys a step) compiles for sm_90 to 255 registers with ~2 KB
of spills a thread and ran at 73-89 TFLOP/s on the H200. Here all H heads of a row are the score's M side, keys come
in blocks of 64 in natural channel order, the output [H, D] fp32 is split over two warpgroups (128 registers a
thread) and paired for the de-rotation once, after the loop. Keys in the "bf16" row format are loaded as they are,
so the selected entries' loop is software-pipelined (cp.async into shared memory, then both wgmma's read them
there); FP8 / FP4 rows are decoded in registers. The paged layer therefore hands a long chunk bf16 key tables
(``kernels/kv_unpack``, ``layers/attention_paged``). H200, 8192 rows x (128 window + 512 selected) keys, 64 heads
x 512 channels: 2.7 ms (227 TFLOP/s) on bf16 tables, 4.5 ms (138) on FP8 / FP4 rows, 8.1 ms (76) on the general
kernel (benchmarks/results/attention-prefill-h200). Not yet: the compiled score wgmma runs in both warpgroups
(each needs the whole P for its half of the output), so a third of the tensor work is repeated.
"""

from __future__ import annotations

import triton
import triton.language as tl

from dsserve.kernels.kv_unpack import decode_rows
from dsserve.kernels.sparse_attention_combine import _derotate_store

PREFILL_MIN_ROWS = 128  # fewer rows keep the general kernel (split-K); at 128 rows: 0.10 vs 0.20 ms
BLOCK_N = 64  # keys a step: 2 stages of 64 x 512 bf16 keys (128 KB) + q (64 KB) fit the H200's shared memory
STAGES = 2


@triton.jit
def _keys(pool, stride, rows, valid, FMT: tl.constexpr, D: tl.constexpr, BLOCK_N: tl.constexpr, UPCAST: tl.constexpr):
    """[BLOCK_N, D] keys of pool rows: bf16 rows (FMT 2) loaded as they are (cp.async-able), others decoded."""
    if FMT == 2:
        k = tl.load(
            pool.to(tl.pointer_type(tl.bfloat16))
            + rows.to(tl.int64)[:, None] * (stride // 2)
            + tl.arange(0, D)[None, :],
            mask=valid[:, None],
            other=0.0,
        )
    else:
        k = decode_rows(pool, stride, rows, valid, FMT, D, BLOCK_N).to(tl.bfloat16)
    if UPCAST:  # CPU interpreter: its bf16 dot multiplies raw bit patterns, so use the same values in fp32
        k = k.to(tl.float32)
    return k


@triton.jit
def _online(qf, k, valid, m_i, l_i, acc, qk_scale):
    s = tl.dot(qf, tl.trans(k))
    s = tl.where(valid[None, :], s * qk_scale, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = tl.dot(p.to(tl.bfloat16).to(k.dtype), k, acc * alpha[:, None])  # bf16 p (fp32 k: the interpreter)
    return m_new, l_i, acc


@triton.jit
def _prefill_kernel(
    q,
    sq_t,
    sq_h,
    cos,
    sin,
    wpool,
    w_stride,
    old_rows,
    fresh,
    sf_t,
    row_first,
    mpool,
    m_stride,
    sel_rows,
    sink,
    o,
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
    STAGES: tl.constexpr,
    UPCAST: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    hm = offs_h < H
    ch = tl.arange(0, D)
    nn = tl.arange(0, BLOCK_N)
    qf = tl.load(q + t * sq_t + offs_h[:, None] * sq_h + ch[None, :], mask=hm[:, None], other=0.0)
    if UPCAST:
        qf = qf.to(tl.float32)
    m_i = tl.load(sink + offs_h, mask=hm, other=0.0) * 1.4426950408889634  # the sink starts the max, l counts it
    l_i = tl.full([BLOCK_H], 1.0, tl.float32)
    acc = tl.zeros([BLOCK_H, D], tl.float32)
    for i in tl.range(0, (W + BLOCK_N - 1) // BLOCK_N, num_stages=1):  # window rows of earlier steps
        n = i * BLOCK_N + nn
        rows = tl.load(old_rows + t * W + n, mask=n < W, other=-1)
        valid = rows >= 0
        if tl.max(valid.to(tl.int32), 0) > 0:  # a chunk's first rows see old rows; the rest, blocks of -1
            k = _keys(wpool, w_stride, rows, valid, WFMT, D, BLOCK_N, UPCAST)
            m_i, l_i, acc = _online(qf, k, valid, m_i, l_i, acc, qk_scale)
    start = tl.maximum(tl.load(row_first + t).to(tl.int64), t - W + 1)
    for i in tl.range(0, (W + BLOCK_N - 1) // BLOCK_N, num_stages=1):  # this step's rows [start, t]
        j = start + i * BLOCK_N + nn
        if start + i * BLOCK_N <= t:
            valid = j <= t
            k = tl.load(fresh + j[:, None] * sf_t + ch[None, :], mask=valid[:, None], other=0.0)
            if UPCAST:
                k = k.to(tl.float32)
            m_i, l_i, acc = _online(qf, k, valid, m_i, l_i, acc, qk_scale)
    for i in tl.range(0, (K + BLOCK_N - 1) // BLOCK_N, num_stages=STAGES):  # selected global entries
        n = i * BLOCK_N + nn
        rows = tl.load(sel_rows + t * K + n, mask=n < K, other=-1)
        valid = rows >= 0
        k = _keys(mpool, m_stride, rows, valid, MFMT, D, BLOCK_N, UPCAST)
        m_i, l_i, acc = _online(qf, k, valid, m_i, l_i, acc, qk_scale)
    acc = acc / l_i[:, None]
    o_e, o_o = tl.split(tl.reshape(acc, [BLOCK_H, D // 2, 2]))
    _derotate_store(o, cos, sin, t, offs_h, hm, o_e, o_o, H, D, R2, BLOCK_H)


def sparse_attention_prefill(
    q,
    cos,
    sin,
    window_pool,
    wfmt,
    old_rows,
    fresh_kv,
    row_first,
    main_pool,
    mfmt,
    sel_rows,
    sink,
    scale,
    out,
    block_n=BLOCK_N,
    stages=STAGES,
):
    """``sparse_attention`` for bf16 q, called by it with arguments checked and normalised (uint8 pools with
    contiguous rows, format codes, int32 contiguous row ids, fp32 cos / sin / sink, out [T, H, D])."""
    t, h, d = q.shape
    w, k = old_rows.shape[1], 0 if sel_rows is None else sel_rows.shape[1]
    block_h = min(64, max(16, triton.next_power_of_2(h)))
    mpool = window_pool if main_pool is None else main_pool
    sel = old_rows if sel_rows is None else sel_rows
    fresh_kv = fresh_kv if fresh_kv.stride(1) == 1 else fresh_kv.contiguous()
    q = q if q.stride(2) == 1 else q.contiguous()
    _prefill_kernel[(t, triton.cdiv(h, block_h))](
        q,
        q.stride(0),
        q.stride(1),
        cos,
        sin,
        window_pool,
        window_pool.stride(0),
        old_rows,
        fresh_kv,
        fresh_kv.stride(0),
        row_first,
        mpool,
        mpool.stride(0),
        sel,
        sink,
        out,
        h,
        float(scale) * 1.4426950408889634,
        D=d,
        R2=cos.shape[1],
        W=w,
        K=k,
        WFMT=wfmt,
        MFMT=mfmt,
        BLOCK_H=block_h,
        BLOCK_N=block_n,
        STAGES=stages,
        UPCAST=q.device.type == "cpu",
        num_warps=8,
        num_stages=stages,
    )
    return out
