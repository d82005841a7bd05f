"""Lightning-indexer scoring over a paged index-K pool: every visible entry, or candidate blocks only.

score[t, j] = sum_h w[t, h] * relu(q[t, h, :] . k[j, :]) for visible entries j, -inf elsewhere.

Layouts and dtypes:
* q [T, Hi, Di] float, already RoPE'd and fake-quantised. Triton: bf16 q -> bf16 operands (FP4 and bf16 keys
  are exact in bf16), any other float -> IEEE fp32 dots (fp64/fp16 q cast to fp32: exact for FP4-fake-quantised
  q); fp32 accumulation. The refs compute in acc(q) precision (fp64 stays fp64).
* w [T, Hi] fp32, already multiplied by Di**-0.5 * Hi**-0.5.
* pool [Nrows, B] uint8 packed rows: fmt "fp4" = INDEX_FP4 with Di channels (Di/2 e2m1 bytes, even element in the
  low nibble, then Di/32 ue8m0 bytes; 68 B at Di=128) or "bf16" = BF16_ROWS (2*Di bytes).
* Block tables are per sequence: block_table [S, MB] int32, row_seq [T] int (row t belongs to sequence
  row_seq[t]). Entry e of row t lives in physical row block_table[row_seq[t], e // epb] * epb + e % epb.
  Entry e is visible to row t iff e < n_visible[t] and e < MB * epb (past the table's reach nothing is mapped).
  row_seq values and the physical block ids of visible entries must be valid (not checked: that would need a
  device sync).
* index_scores -> [T, n_max] fp32 (the refs return fp64 for fp64 q).
* index_scores_candidates: cand_blocks [T, NB] int32 candidate-block ids (block b = entries [b*cbs, (b+1)*cbs)),
  -1 = none, any order. Output column c is entry cand_blocks[t, c // cbs] * cbs + c % cbs -> [T, NB*cbs] fp32,
  -inf where the block is -1 or the entry is not visible. Its cost is NB*cbs per row whatever the context.
Both ops take an optional `out` (written in full, returned) so callers and tests can reuse or poison buffers.

Kernels: index_scores tiles BLOCK_M consecutive rows x BLOCK_N entries. When the tile's rows share one sequence
(prefill chunks) each key is fetched and decoded once and scored for all rows in one dot of BLOCK_M*BLOCK_H
(row, head) pairs; otherwise (decode batches, the tile holding a sequence boundary) its rows are scored one by
one. Candidates differ per row, so index_scores_candidates scores one row per program. Key rows are read as int32
words when 4-byte aligned (68 B at Di = 128), else as bytes, and decoded to natural channel order: one dot over Di.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from dsserve.kernels import indexer_prefill
from dsserve.kernels.indexer_ref import (  # noqa: F401  (the refs are looked up here by KernelOps)
    _check,
    _check_cands,
    _out,
    _row_format,
    candidate_entries,
    index_scores_candidates_ref,
    index_scores_ref,
)

# Tuning (module constants so the H200 sweep can monkeypatch them; read at every call).
PREFILL_M = 128  # dot rows of a shared-key tile: BLOCK_M query rows x BLOCK_H heads (Hi = 32 -> 4 rows)
BLOCK_N = 64  # entries per index_scores tile
N_TILES = 4  # entry tiles per program (q loaded once), used when the grid still has _FILL programs:
_FILL = 8192  # ~60 per SM; smaller grids (decode batches, short chunks) keep one tile per program for latency
NUM_WARPS = 4
CAND_BLOCK_N = 128  # candidate columns per program (H200 sweep: B=1 10 us vs 52 at 64; B=64 108 vs 168)
CAND_WARPS = 4
_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"  # read when the kernels are decorated, as Triton does


# ------------------------------------------------------------------ Triton: key decoding and scoring
_SIGN = tl.constexpr(-(1 << 31))
_MAG = tl.constexpr(7 << 22)
_TWO126 = tl.constexpr(2.0**126)


@triton.jit
def _key_tile(
    pool_ptr,
    phys,
    vis,
    row_stride,
    DI: tl.constexpr,
    BLOCK_N: tl.constexpr,
    FP4: tl.constexpr,
    WORDS: tl.constexpr,
    BF16_DOT: tl.constexpr,
):
    """Keys of pool rows phys (int64 [BLOCK_N]) as the dot operand [DI, BLOCK_N]; rows not vis are 0."""
    m = vis[:, None]
    wrow = pool_ptr.to(tl.pointer_type(tl.int32)) + phys[:, None] * (row_stride // 4)
    brow = pool_ptr + phys[:, None] * row_stride
    if FP4:
        g = tl.arange(0, DI // 32)
        if WORDS:  # little-endian words: byte 4i + j is word i >> 8j (bits above the byte are masked below)
            x = tl.load(wrow + tl.arange(0, DI // 8)[None, :], mask=m, other=0)
            b = tl.reshape(tl.join(tl.join(x, x >> 16), tl.join(x >> 8, x >> 24)), [BLOCK_N, DI // 2])
            sw = tl.load(wrow + DI // 8 + (g // 4)[None, :], mask=m, other=0)  # 4 lanes share each scale word
            e8 = (sw >> ((g % 4) * 8)[None, :]) & 255
        else:
            b = tl.load(brow + tl.arange(0, DI // 2)[None, :], mask=m, other=0).to(tl.int32)
            e8 = tl.load(brow + DI // 2 + g[None, :], mask=m, other=0).to(tl.int32)
        # e2m1 nibble -> fp32 bits: sign to bit 31, exponent + mantissa to bits 24..22. That is the value times
        # 2^-126 exactly (e = 0 lands on fp32 subnormals as e2m1's own subnormals do), so no select is needed.
        lo = ((b << 28) & _SIGN) | ((b << 22) & _MAG)
        hi = ((b << 24) & _SIGN) | ((b << 18) & _MAG)
        bits = tl.reshape(tl.join(lo, hi), [BLOCK_N, DI])  # even channel in the low nibble
        s = tl.where(e8 == 0, 1 << 22, e8 << 23).to(tl.float32, bitcast=True)  # 2^(e8-127), e8 = 0 subnormal
        k = bits.to(tl.float32, bitcast=True) * _TWO126  # exact: the e2m1 value; then fp32 v * s as formats does
        k = tl.reshape(tl.reshape(k, [BLOCK_N, DI // 32, 32]) * s[:, :, None], [BLOCK_N, DI])
    elif WORDS and BF16_DOT:  # bf16 rows into a bf16 dot: loaded as they are (a bf16 row is DI values: the
        # constexpr stride gives 16-byte loads, which the unspecialised row_stride would not)
        k = tl.load(
            pool_ptr.to(tl.pointer_type(tl.bfloat16)) + phys[:, None] * DI + tl.arange(0, DI)[None, :],
            mask=m,
            other=0.0,
        )
    elif WORDS:  # bf16 pairs as one little-endian int32: channel 2i in the low half
        x = tl.load(wrow + tl.arange(0, DI // 2)[None, :], mask=m, other=0)
        k = tl.reshape(
            tl.join((x << 16).to(tl.float32, bitcast=True), (x & -65536).to(tl.float32, bitcast=True)), [BLOCK_N, DI]
        )
    else:
        j = 2 * tl.arange(0, DI)[None, :]
        lo = tl.load(brow + j, mask=m, other=0).to(tl.int32)
        hi = tl.load(brow + j + 1, mask=m, other=0).to(tl.int32)
        k = ((hi << 24) | (lo << 16)).to(tl.float32, bitcast=True)
    if BF16_DOT:
        k = k.to(tl.bfloat16)
    return tl.trans(k)


@triton.jit
def _q_tile(q_ptr, w_ptr, row0, T, H, RM: tl.constexpr, RH: tl.constexpr, DI: tl.constexpr, BF16_DOT: tl.constexpr):
    """q of rows row0 + i // RH, heads i % RH as the dot operand [RM*RH, DI], and w [RM*RH]; padding is 0."""
    i = tl.arange(0, RM * RH)
    h = i % RH
    r = row0 + i // RH
    ok = (r < T) & (h < H)  # padded rows/heads: q = 0 and w = 0 contribute nothing
    qh = r.to(tl.int64) * H + h
    q = tl.load(q_ptr + qh[:, None] * DI + tl.arange(0, DI)[None, :], mask=ok[:, None], other=0.0)
    w = tl.load(w_ptr + qh, mask=ok, other=0.0)
    if BF16_DOT:
        q = q.to(tl.bfloat16)
    else:  # fp32 q, or bf16 q in the interpreter (its bf16 dot multiplies the raw bits)
        q = q.to(tl.float32)
    return q, w


@triton.jit
def _score(q, w, kT, RM: tl.constexpr, RH: tl.constexpr, BLOCK_N: tl.constexpr, BF16_DOT: tl.constexpr):
    """Scores [RM, BLOCK_N] ([BLOCK_N] for RM = 1): one dot for every (row, head), ReLU, weights, sum over heads."""
    if BF16_DOT:
        lg = tl.dot(q, kT)
    else:
        lg = tl.dot(q, kT, input_precision="ieee")  # "ieee": fp32 q must not drop to tf32
    p = tl.maximum(lg, 0.0) * w[:, None]
    if RM == 1:
        s = tl.sum(p, axis=0)
    else:
        s = tl.sum(tl.reshape(p, [RM, RH, BLOCK_N]), axis=1)
    return s


# Rows are 68 B apart, so a row start is only 4-byte aligned. With epb (64) specialised as a multiple of 16,
# Triton 3.6 inferred 16-byte aligned row starts (it carried phys's divisibility into the broadcast row axis) and
# issued misaligned 16-byte loads on the H200. The word path has the same row-address arithmetic in words, so
# the integers that enter a row address stay unspecialised (T too: it only masks, and would recompile per batch).
_ROW_ARGS = ["T", "row_stride", "epb", "bt_stride", "reach"]


# n_max (the longest row's entry count, also the output's row stride): a new one each step, and an odd one compiled
# a second kernel in traffic (benchmarks/results/agentx-shared-outputs-h200); the scoring dots, not the stores, set
# this kernel's time
@triton.jit(do_not_specialize=_ROW_ARGS + ["n_max"])
def _index_scores_kernel(
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
    BLOCK_H1: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    N_TILES: tl.constexpr,
    FP4: tl.constexpr,
    WORDS: tl.constexpr,
    BF16_DOT: tl.constexpr,
):
    row0 = tl.program_id(0) * BLOCK_M
    rows = row0 + tl.arange(0, BLOCK_M)
    rm = rows < T
    seq = tl.load(seq_ptr + rows, mask=rm, other=0)
    lim = tl.where(rm, tl.minimum(tl.load(nvis_ptr + rows, mask=rm, other=0), reach), 0)
    top = tl.max(lim, axis=0)
    s_lo = tl.min(tl.where(rm, seq, 2147483647), axis=0)
    s_hi = tl.max(tl.where(rm, seq, -1), axis=0)
    jj = tl.arange(0, BLOCK_N)
    tile0 = tl.program_id(1) * N_TILES
    if s_lo == s_hi:  # one sequence: decode each key once for all rows of the tile
        q, w = _q_tile(q_ptr, w_ptr, row0, T, H, BLOCK_M, BLOCK_H, DI, BF16_DOT)
        for i in range(N_TILES):  # constexpr trip count (runtime bounds break the Triton 3.6 interpreter)
            n = (tile0 + i) * BLOCK_N + jj
            dst = out_ptr + rows.to(tl.int64)[:, None] * n_max + n[None, :]
            om = rm[:, None] & (n < n_max)[None, :]
            if (tile0 + i) * BLOCK_N < top:
                vis = n < top
                blk = tl.load(bt_ptr + s_lo.to(tl.int64) * bt_stride + n // epb, mask=vis, other=0)
                kT = _key_tile(
                    pool_ptr, blk.to(tl.int64) * epb + n % epb, vis, row_stride, DI, BLOCK_N, FP4, WORDS, BF16_DOT
                )
                s = _score(q, w, kT, BLOCK_M, BLOCK_H, BLOCK_N, BF16_DOT)
                tl.store(dst, tl.where(n[None, :] < lim[:, None], s, float("-inf")), mask=om)
            else:  # the whole tile is past every row's n_visible: no key traffic
                tl.store(dst, tl.full([BLOCK_M, BLOCK_N], float("-inf"), tl.float32), mask=om)
    else:  # rows of several sequences: one at a time (a loop, not static_range: tiny Hi gives BLOCK_M up to 64)
        for r in range(BLOCK_M):
            t = row0 + r
            if t < T:
                q1, w1 = _q_tile(q_ptr, w_ptr, t, T, H, 1, BLOCK_H1, DI, BF16_DOT)
                lim1 = tl.minimum(tl.load(nvis_ptr + t), reach)
                bt_row = bt_ptr + tl.load(seq_ptr + t).to(tl.int64) * bt_stride
                for i in range(N_TILES):
                    n = (tile0 + i) * BLOCK_N + jj
                    dst = out_ptr + t.to(tl.int64) * n_max + n
                    if (tile0 + i) * BLOCK_N < lim1:
                        vis = n < lim1
                        blk = tl.load(bt_row + n // epb, mask=vis, other=0)
                        kT = _key_tile(
                            pool_ptr,
                            blk.to(tl.int64) * epb + n % epb,
                            vis,
                            row_stride,
                            DI,
                            BLOCK_N,
                            FP4,
                            WORDS,
                            BF16_DOT,
                        )
                        s = _score(q1, w1, kT, 1, BLOCK_H1, BLOCK_N, BF16_DOT)
                        tl.store(dst, tl.where(vis, s, float("-inf")), mask=n < n_max)
                    else:
                        tl.store(dst, tl.full([BLOCK_N], float("-inf"), tl.float32), mask=n < n_max)


@triton.jit(do_not_specialize=_ROW_ARGS + ["cbs", "cand_stride"])
def _index_scores_cand_kernel(
    q_ptr,
    w_ptr,
    pool_ptr,
    bt_ptr,
    seq_ptr,
    nvis_ptr,
    cand_ptr,
    out_ptr,
    T,
    ncols,
    cand_stride,
    cbs,
    H,
    row_stride,
    bt_stride,
    epb,
    reach,
    DI: tl.constexpr,
    BLOCK_H1: tl.constexpr,
    BLOCK_N: tl.constexpr,
    FP4: tl.constexpr,
    WORDS: tl.constexpr,
    BF16_DOT: tl.constexpr,
):
    t = tl.program_id(0)
    c = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    cm = c < ncols
    blk = tl.load(cand_ptr + t.to(tl.int64) * cand_stride + c // cbs, mask=cm, other=-1)
    e = blk * cbs + c % cbs
    vis = cm & (blk >= 0) & (e < tl.minimum(tl.load(nvis_ptr + t), reach))
    dst = out_ptr + t.to(tl.int64) * ncols + c
    if tl.max(vis.to(tl.int32), axis=0) > 0:
        bt_row = bt_ptr + tl.load(seq_ptr + t).to(tl.int64) * bt_stride
        pb = tl.load(bt_row + e // epb, mask=vis, other=0)
        kT = _key_tile(pool_ptr, pb.to(tl.int64) * epb + e % epb, vis, row_stride, DI, BLOCK_N, FP4, WORDS, BF16_DOT)
        q, w = _q_tile(q_ptr, w_ptr, t, T, H, 1, BLOCK_H1, DI, BF16_DOT)
        s = _score(q, w, kT, 1, BLOCK_H1, BLOCK_N, BF16_DOT)
        tl.store(dst, tl.where(vis, s, float("-inf")), mask=cm)
    else:  # -1 padding (short contexts) costs only this store
        tl.store(dst, tl.full([BLOCK_N], float("-inf"), tl.float32), mask=cm)


def _prepare(q, w, pool, fmt, block_table, row_seq, epb, n_visible):
    """Validated, contiguous kernel operands, the shared constexprs, BLOCK_H, the row stride and the table reach."""
    _check(q, w, pool, fmt, block_table, row_seq, epb, n_visible)
    if fmt not in ("fp4", "bf16"):
        raise ValueError(f"the kernels read fp4 / bf16 index rows, not {fmt} (the references do)")
    t, h, di = q.shape
    if not q.is_floating_point():
        raise ValueError(f"q must be a float tensor, got {q.dtype}")
    if q.dtype not in (torch.float32, torch.bfloat16):  # fp64/fp16: fp32 math (exact for FP4-fake-quantised q)
        q = q.float()
    if di < 32 or di & (di - 1):
        raise ValueError(f"Di must be a power of two >= 32 for the Triton kernel, got {di}")
    pool = pool.contiguous()
    words = pool.stride(0) % 4 == 0 and pool.data_ptr() % 4 == 0
    args = (
        q.contiguous(),
        w.float().contiguous(),
        pool,
        block_table.to(torch.int32).contiguous(),
        row_seq.to(torch.int32).contiguous(),
        n_visible.to(torch.int32).contiguous(),
    )
    meta = dict(DI=di, FP4=fmt == "fp4", WORDS=words, BF16_DOT=q.dtype == torch.bfloat16 and not _INTERPRET)
    return args, meta, triton.next_power_of_2(h), pool.stride(0), block_table.shape[1] * epb


def index_scores(q, w, pool, fmt, block_table, row_seq, epb, n_visible, n_max, out=None):
    """Scores of every entry < n_max -> [T, n_max] fp32; tiles past every row's n_visible only write -inf."""
    (q, w, pool, bt, seq, nv), meta, bh, row_stride, reach = _prepare(
        q, w, pool, fmt, block_table, row_seq, epb, n_visible
    )
    t = q.shape[0]
    out = _out(out, t, n_max, torch.float32, q.device)
    if (
        out.numel()
        and fmt == "bf16"
        and q.dtype == torch.bfloat16
        and t >= indexer_prefill.PREFILL_ROWS
        and meta["WORDS"]
    ):
        return indexer_prefill.prefill_scores(
            q, w, pool, bt, seq, nv, out, t, n_max, row_stride, epb, reach, meta["DI"], bh
        )
    if out.numel():
        # about PREFILL_M dot rows; no more rows than the batch has (decode), but >= 16 dot rows (tl.dot's minimum)
        bm = max(min(max(1, PREFILL_M // bh), triton.next_power_of_2(t)), triton.cdiv(16, bh))
        tiles = N_TILES if triton.cdiv(t, bm) * triton.cdiv(n_max, BLOCK_N * N_TILES) >= _FILL else 1
        grid = (triton.cdiv(t, bm), triton.cdiv(n_max, BLOCK_N * tiles))
        _index_scores_kernel[grid](
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
            BLOCK_H=bh,
            BLOCK_H1=max(16, bh),
            BLOCK_M=bm,
            BLOCK_N=BLOCK_N,
            N_TILES=tiles,
            num_warps=NUM_WARPS,
            **meta,
        )
    return out


def index_scores_candidates(
    q, w, pool, fmt, block_table, row_seq, epb, cand_blocks, cand_block_size, n_visible, out=None
):
    """Scores of the candidate blocks' entries only -> [T, NB * cand_block_size] fp32 (see module doc)."""
    (q, w, pool, bt, seq, nv), meta, bh, row_stride, reach = _prepare(
        q, w, pool, fmt, block_table, row_seq, epb, n_visible
    )
    _check_cands(cand_blocks, cand_block_size, q.shape[0])
    cand = cand_blocks.to(torch.int32).contiguous()
    ncols = cand.shape[1] * cand_block_size
    out = _out(out, q.shape[0], ncols, torch.float32, q.device)
    if out.numel():
        grid = (q.shape[0], triton.cdiv(ncols, CAND_BLOCK_N))
        _index_scores_cand_kernel[grid](
            q,
            w,
            pool,
            bt,
            seq,
            nv,
            cand,
            out,
            q.shape[0],
            ncols,
            cand.stride(0),
            cand_block_size,
            q.shape[1],
            row_stride,
            bt.stride(0),
            epb,
            reach,
            BLOCK_H1=max(16, bh),
            BLOCK_N=CAND_BLOCK_N,
            num_warps=CAND_WARPS,
            **meta,
        )
    return out
