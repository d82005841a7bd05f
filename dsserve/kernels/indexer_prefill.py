"""Lightning-indexer scores for long chunks over bf16 index keys: the kernel behind ``index_scores`` from
``PREFILL_ROWS`` rows of bf16 q with keys in the "bf16" row format (same contract: see kernels/indexer.py).

Why: on 128K of context a prefill chunk's source layers score every visible entry (8192 rows x 139K entries at
layer 20: 9.3 TFLOP), and the general kernel (FP4 keys decoded in registers, 4 query rows x 64 entries a tile, the
query reloaded every 4 tiles) ran at ~150 TFLOP/s on the H200: 157 ms of an 8K prefill on 128K. Here a program holds
ROWS query rows (ROWS x Hi dot rows, q loaded once) and walks SUPER tiles of BLOCK_N entries in a software-pipelined
loop whose bf16 key tiles go to shared memory by cp.async (the paged layer hands bf16 index-key tables,
kernels/kv_unpack). Rows of one sequence share each key tile; a program whose rows span sequences (a chunk beside
decode rows) takes one pass per row, each scoring the rows of that row's sequence (repeated passes store the same
values).
"""

from __future__ import annotations

import triton
import triton.language as tl

# From this many rows a chunk's sources score bf16 index-key tables here (H200, 8192 rows over 139K entries:
# 42.6 ms against 60.7 on the general kernel over FP4 keys, benchmarks/results/prefill-kernels-h200); fewer rows
# keep the general kernel.
PREFILL_ROWS = 1024
ROWS = 8  # query rows a program: 8 x 32 heads = 256 dot rows, each key tile scored for 8 rows
BLOCK_N = 32  # entries a tile (compiled for sm_90: 239 registers, no spills; 64 spills at 8 rows)
SUPER = 128  # tiles a program (4096 entries): q is read once per 4096 entries
STAGES = 3


@triton.jit
def _pass(
    q,
    w,
    pool_ptr,
    bt_ptr,
    seq_ptr,
    nvis_ptr,
    out_ptr,
    rows,
    rm,
    seq,
    row_stride,
    bt_stride,
    epb,
    reach,
    n_max,
    n0,
    DI: tl.constexpr,
    BLOCK_H: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SUPER: tl.constexpr,
    STAGES: tl.constexpr,
    UPCAST: tl.constexpr,
):
    """Scores of rows ``rm`` (all of sequence ``seq``) for entries [n0, n0 + SUPER * BLOCK_N)."""
    lim = tl.where(rm, tl.minimum(tl.load(nvis_ptr + rows, mask=rm, other=0), reach), 0)
    top = tl.max(lim, axis=0)
    jj = tl.arange(0, BLOCK_N)
    ch = tl.arange(0, DI)
    if n0 >= top:  # past every row's visible entries: -inf, no key traffic
        for i in range(SUPER):
            n = n0 + i * BLOCK_N + jj
            tl.store(
                out_ptr + rows.to(tl.int64)[:, None] * n_max + n[None, :],
                tl.full([ROWS, BLOCK_N], float("-inf"), tl.float32),
                mask=rm[:, None] & (n < n_max)[None, :],
            )
    else:
        for i in tl.range(0, SUPER, num_stages=STAGES):
            n = n0 + i * BLOCK_N + jj
            vis = n < top
            blk = tl.load(bt_ptr + seq.to(tl.int64) * bt_stride + n // epb, mask=vis, other=0)
            phys = blk.to(tl.int64) * epb + n % epb
            # a bf16 row is DI values: a constexpr stride (16-byte cp.async), not the unspecialised row_stride
            k = tl.load(
                pool_ptr.to(tl.pointer_type(tl.bfloat16)) + phys[:, None] * DI + ch[None, :],
                mask=vis[:, None],
                other=0.0,
            )
            if UPCAST:  # CPU interpreter: its bf16 dot multiplies raw bit patterns
                k = k.to(tl.float32)
            lg = tl.dot(q, tl.trans(k))  # [ROWS * BLOCK_H, BLOCK_N]
            s = tl.sum(tl.reshape(tl.maximum(lg, 0.0) * w[:, None], [ROWS, BLOCK_H, BLOCK_N]), axis=1)
            dst = out_ptr + rows.to(tl.int64)[:, None] * n_max + n[None, :]
            tl.store(
                dst, tl.where(n[None, :] < lim[:, None], s, float("-inf")), mask=rm[:, None] & (n < n_max)[None, :]
            )


# n_max (the step's entry count, also the scores' row stride) too: its alignment only shapes the score stores, a
# small part next to the dots, and specialised it compiled a kernel of its own for entry counts off 16
@triton.jit(do_not_specialize=["T", "n_max", "row_stride", "epb", "bt_stride", "reach"])
def _prefill_scores_kernel(
    q_ptr,
    w_ptr,
    pool_ptr,
    bt_ptr,
    seq_ptr,
    nvis_ptr,
    out_ptr,
    T,
    n_max,
    H,
    row_stride,
    bt_stride,
    epb,
    reach,
    DI: tl.constexpr,
    BLOCK_H: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SUPER: tl.constexpr,
    STAGES: tl.constexpr,
    UPCAST: tl.constexpr,
):
    row0 = tl.program_id(0) * ROWS
    n0 = tl.program_id(1) * (SUPER * BLOCK_N)
    i = tl.arange(0, ROWS * BLOCK_H)
    r, h = row0 + i // BLOCK_H, i % BLOCK_H
    ok = (r < T) & (h < H)  # padded rows / heads: q = 0 and w = 0
    qh = r.to(tl.int64) * H + h
    q = tl.load(q_ptr + qh[:, None] * DI + tl.arange(0, DI)[None, :], mask=ok[:, None], other=0.0)
    w = tl.load(w_ptr + qh, mask=ok, other=0.0)
    if UPCAST:
        q = q.to(tl.float32)
    rows = row0 + tl.arange(0, ROWS)
    rm = rows < T
    seq = tl.load(seq_ptr + rows, mask=rm, other=-1)
    s_lo = tl.min(tl.where(rm, seq, 2147483647), axis=0)
    s_hi = tl.max(tl.where(rm, seq, -1), axis=0)
    if s_lo == s_hi:
        _pass(
            q,
            w,
            pool_ptr,
            bt_ptr,
            seq_ptr,
            nvis_ptr,
            out_ptr,
            rows,
            rm,
            s_lo,
            row_stride,
            bt_stride,
            epb,
            reach,
            n_max,
            n0,
            DI,
            BLOCK_H,
            ROWS,
            BLOCK_N,
            SUPER,
            STAGES,
            UPCAST,
        )
    else:
        for p in range(ROWS):
            if row0 + p < T:
                sp = tl.load(seq_ptr + row0 + p)
                _pass(
                    q,
                    w,
                    pool_ptr,
                    bt_ptr,
                    seq_ptr,
                    nvis_ptr,
                    out_ptr,
                    rows,
                    rm & (seq == sp),
                    sp,
                    row_stride,
                    bt_stride,
                    epb,
                    reach,
                    n_max,
                    n0,
                    DI,
                    BLOCK_H,
                    ROWS,
                    BLOCK_N,
                    SUPER,
                    STAGES,
                    UPCAST,
                )


def prefill_scores(q, w, pool, bt, seq, nv, out, t, n_max, row_stride, epb, reach, di, bh):
    """index_scores' many-row path (called by it with operands checked and made contiguous)."""
    grid = (triton.cdiv(t, ROWS), triton.cdiv(n_max, SUPER * BLOCK_N))
    _prefill_scores_kernel[grid](
        q,
        w,
        pool,
        bt,
        seq,
        nv,
        out,
        t,
        n_max,
        q.shape[1],
        row_stride,
        bt.stride(0),
        epb,
        reach,
        DI=di,
        BLOCK_H=bh,
        ROWS=ROWS,
        BLOCK_N=BLOCK_N,
        SUPER=SUPER,
        STAGES=STAGES,
        UPCAST=q.device.type == "cpu",
        num_warps=8,
        num_stages=STAGES,
    )
    return out
