"""Lightning-indexer scoring over a paged index-K pool: every visible entry, or candidate blocks only.

score[t, j] = sum_h w[t, h] * relu(q[t, h, :] . k[j, :]) for visible entries j, -inf elsewhere.

Layouts and dtypes:
* q [T, Hi, Di] float, already RoPE'd and fake-quantised. Triton: bf16 q -> bf16 operands (FP4 and bf16 keys
  are exact in bf16), any other float -> IEEE fp32 dots (fp64/fp16 q cast to fp32: exact for FP4-fake-quantised
  q); fp32 accumulation. The refs compute in acc(q) precision (fp64 stays fp64).
* w [T, Hi] fp32, already multiplied by Di**-0.5 * Hi**-0.5.
* pool [Nrows, B] uint8 packed rows: fmt "fp4" = INDEX_FP4 with Di channels (Di/2 e2m1 bytes, even element in the
  low nibble, then Di/32 ue8m0 bytes; 68 B at Di=128) or "bf16" = BF16_ROWS (2*Di bytes).
* Entry e of row t lives in physical row block_table[t, e // epb] * epb + e % epb (block_table [T, MB] int32).
  Entry e is visible to row t iff e < n_visible[t] and e < MB * epb (past the table's reach nothing is mapped).
  Physical block ids of visible entries must be valid pool blocks (not checked: that would need a device sync).
* index_scores -> [T, n_max] fp32 (the refs return fp64 for fp64 q).
* index_scores_candidates: cand_blocks [T, NB] int32 candidate-block ids (block b = entries [b*cbs, (b+1)*cbs)),
  -1 = none, any order. Output column c is entry cand_blocks[t, c // cbs] * cbs + c % cbs -> [T, NB*cbs] fp32,
  -inf where the block is -1 or the entry is not visible. Its cost is NB*cbs per row whatever the context.
Both ops take an optional `out` (written in full, returned) so callers and tests can reuse or poison buffers.
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from dsserve.kv.formats import BF16_ROWS, INDEX_FP4, RowFormat
from dsserve.layers.numerics import acc

BLOCK_N = 64   # entries per program: 64 x Di/2 key halves keep registers low; decode grids stay >= 1 wave at 8K+
MAX_BLOCK_H = 64
NUM_WARPS = 4
_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"  # read when the kernels are decorated, as Triton does
_REF_CHUNK = 1 << 19  # ref: rows per chunk * n bounded so gathered keys stay ~0.5 GB at Di = 128


# ------------------------------------------------------------------ checks shared by refs and kernels
def _row_format(fmt: str, di: int) -> RowFormat:
    if fmt == "fp4":
        return INDEX_FP4.with_channels(di)
    if fmt == "bf16":
        return BF16_ROWS.with_channels(di)
    raise ValueError(f"unknown index pool format {fmt!r}; expected 'fp4' or 'bf16'")


def _check(q, w, pool, fmt, block_table, epb, n_visible) -> RowFormat:
    if q.dim() != 3:
        raise ValueError(f"q must be [T, Hi, Di], got {tuple(q.shape)}")
    t, h, di = q.shape
    if tuple(w.shape) != (t, h):
        raise ValueError(f"w must be [T, Hi] = {(t, h)}, got {tuple(w.shape)}")
    rf = _row_format(fmt, di)
    if pool.dtype != torch.uint8 or pool.dim() != 2 or pool.shape[1] != rf.row_bytes:
        raise ValueError(f"pool must be uint8 [Nrows, {rf.row_bytes}] for {fmt} with Di={di}, "
                         f"got {pool.dtype} {tuple(pool.shape)}")
    if block_table.dim() != 2 or block_table.shape[0] != t or block_table.is_floating_point():
        raise ValueError(f"block_table must be integer [T={t}, MB], got {block_table.dtype} {tuple(block_table.shape)}")
    if not isinstance(epb, int) or epb <= 0:
        raise ValueError(f"epb (entries per block) must be a positive int, got {epb!r}")
    if tuple(n_visible.shape) != (t,) or n_visible.is_floating_point():
        raise ValueError(f"n_visible must be integer [T={t}], got {n_visible.dtype} {tuple(n_visible.shape)}")
    return rf


def _check_cands(cand_blocks, cbs, t):
    if cand_blocks.dim() != 2 or cand_blocks.shape[0] != t or cand_blocks.is_floating_point():
        raise ValueError(f"cand_blocks must be integer [T={t}, NB], got {cand_blocks.dtype} {tuple(cand_blocks.shape)}")
    if not isinstance(cbs, int) or cbs <= 0:
        raise ValueError(f"cand_block_size must be a positive int, got {cbs!r}")


def _out(out, t, n, dtype, device):
    if out is None:
        return torch.empty(t, n, dtype=dtype, device=device)
    if tuple(out.shape) != (t, n) or out.dtype != dtype or not out.is_contiguous():
        raise ValueError(f"out must be contiguous {dtype} [{t}, {n}], got {out.dtype} {tuple(out.shape)}")
    return out


# ------------------------------------------------------------------ references
def _entry_scores(q, w, pool, rf, block_table, epb, n_visible, entries):
    """Scores of entries [T, N] (int64, any value) for each row; -inf where not visible."""
    mb = block_table.shape[1]
    vis = (entries >= 0) & (entries < n_visible.long()[:, None]) & (entries < mb * epb)
    col = torch.where(vis, entries // epb, 0)
    phys = torch.where(vis, block_table.long().gather(1, col) * epb + entries % epb, 0)
    dt = acc(q).dtype
    out = torch.empty(entries.shape, dtype=dt, device=q.device)
    step = max(1, _REF_CHUNK // max(1, entries.shape[1]))
    for a in range(0, q.shape[0], step):  # chunks bound the gathered [rows, N, Di] keys
        keys = rf.unpack(pool[phys[a:a + step]], dt)
        logits = torch.relu(torch.einsum("thd,tnd->thn", acc(q[a:a + step]), keys))
        out[a:a + step] = torch.einsum("thn,th->tn", logits, acc(w[a:a + step]).to(dt))
    return out.masked_fill(~vis, float("-inf"))


def index_scores_ref(q, w, pool, fmt, block_table, epb, n_visible, n_max, out=None):
    rf = _check(q, w, pool, fmt, block_table, epb, n_visible)
    entries = torch.arange(n_max, device=q.device).expand(q.shape[0], n_max)
    s = _entry_scores(q, w, pool, rf, block_table, epb, n_visible, entries)
    return s if out is None else _out(out, *s.shape, s.dtype, s.device).copy_(s)


def index_scores_candidates_ref(q, w, pool, fmt, block_table, epb, cand_blocks, cand_block_size, n_visible,
                                out=None):
    """Dense then mask: every entry the block table reaches, then the candidate columns gathered."""
    _check(q, w, pool, fmt, block_table, epb, n_visible)
    _check_cands(cand_blocks, cand_block_size, q.shape[0])
    reach = block_table.shape[1] * epb
    dense = index_scores_ref(q, w, pool, fmt, block_table, epb, n_visible, reach)
    ent = candidate_entries(cand_blocks, cand_block_size,
                            torch.arange(cand_blocks.shape[1] * cand_block_size, device=q.device))
    ok = (ent >= 0) & (ent < reach)
    s = dense.gather(1, torch.where(ok, ent, 0)).masked_fill(~ok, float("-inf"))
    return s if out is None else _out(out, *s.shape, s.dtype, s.device).copy_(s)


def candidate_entries(cand_blocks: torch.Tensor, cand_block_size: int, idx: torch.Tensor) -> torch.Tensor:
    """Compact column indices idx ([T, k] or [k]) -> entry ids int64 [T, k]; -1 where the block is -1."""
    idx = idx.long().expand(cand_blocks.shape[0], -1) if idx.dim() == 1 else idx.long()
    blk = cand_blocks.long().gather(1, idx // cand_block_size)
    return torch.where(blk >= 0, blk * cand_block_size + idx % cand_block_size, -1)


# ------------------------------------------------------------------ Triton
@triton.jit
def _e2m1(code):
    """e2m1 nibble -> fp32 from the bits: magnitude code m = 2e + b is 0.5*b (e = 0) or (1 + b/2) * 2^(e-1)."""
    c = code.to(tl.int32)
    e = (c >> 1) & 3
    b = c & 1
    normal = (((e + 126) << 23) | (b << 22)).to(tl.float32, bitcast=True)
    mag = tl.where(e == 0, b.to(tl.float32) * 0.5, normal)
    return tl.where((c & 8) != 0, -mag, mag)  # code 8 is -0.0, as in formats


@triton.jit
def _score_tile(q_ptr, w_ptr, pool_ptr, t, phys, vis, H, row_stride,
                DI: tl.constexpr, BLOCK_H: tl.constexpr, NUM_HB: tl.constexpr, BLOCK_N: tl.constexpr,
                FP4: tl.constexpr, BF16_DOT: tl.constexpr):
    """[BLOCK_N] scores of the key rows phys (int64) of row t; keys decoded once as even/odd channel halves."""
    i = tl.arange(0, DI // 2)
    row = pool_ptr + phys[:, None] * row_stride
    if FP4:
        byte = tl.load(row + i[None, :], mask=vis[:, None], other=0)
        e8 = tl.load(row + DI // 2 + i[None, :] // 16, mask=vis[:, None], other=127).to(tl.int32)
        scale = tl.where(e8 == 0, 1 << 22, e8 << 23).to(tl.float32, bitcast=True)  # 2^(e8-127), e8=0 subnormal
        k_e = _e2m1(byte & 15) * scale
        k_o = _e2m1(byte >> 4) * scale
    else:
        k_e = tl.load(row + 2 * i[None, :], mask=vis[:, None], other=0.0).to(tl.float32)
        k_o = tl.load(row + 2 * i[None, :] + 1, mask=vis[:, None], other=0.0).to(tl.float32)
    k_e = tl.trans(k_e)
    k_o = tl.trans(k_o)
    if BF16_DOT:
        k_e = k_e.to(tl.bfloat16)
        k_o = k_o.to(tl.bfloat16)
    total = tl.zeros([BLOCK_N], dtype=tl.float32)
    for hb in tl.static_range(NUM_HB):
        h = hb * BLOCK_H + tl.arange(0, BLOCK_H)
        hm = h < H
        qp = q_ptr + (t * H + h[:, None]).to(tl.int64) * DI + 2 * i[None, :]
        q_e = tl.load(qp, mask=hm[:, None], other=0.0)  # padded heads: q = 0 and w = 0 contribute nothing
        q_o = tl.load(qp + 1, mask=hm[:, None], other=0.0)
        if BF16_DOT:
            lg = tl.dot(q_o.to(tl.bfloat16), k_o, tl.dot(q_e.to(tl.bfloat16), k_e))
        else:  # fp32 q, or bf16 q under the interpreter (its bf16 dot multiplies the raw uint16 bits)
            lg = tl.dot(q_e.to(tl.float32), k_e, input_precision="ieee")
            lg = tl.dot(q_o.to(tl.float32), k_o, lg, input_precision="ieee")
        wv = tl.load(w_ptr + t * H + h, mask=hm, other=0.0)
        total += tl.sum(tl.maximum(lg, 0.0) * wv[:, None], axis=0)
    return total


# Rows are 68 B apart, so a row start is only 4-byte aligned. With epb (64) specialised as a multiple of 16,
# Triton 3.6 inferred 16-byte aligned row starts and issued misaligned 16-byte loads on the H200; keep the
# integers that enter the row address unspecialised.
_ROW_ARGS = ["row_stride", "epb", "bt_stride", "reach"]


@triton.jit(do_not_specialize=_ROW_ARGS)
def _index_scores_kernel(q_ptr, w_ptr, pool_ptr, bt_ptr, nvis_ptr, out_ptr, n_max, H, row_stride, bt_stride, epb,
                         reach, DI: tl.constexpr, BLOCK_H: tl.constexpr, NUM_HB: tl.constexpr,
                         BLOCK_N: tl.constexpr, FP4: tl.constexpr, BF16_DOT: tl.constexpr):
    t = tl.program_id(0)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    limit = tl.minimum(tl.load(nvis_ptr + t), reach)
    dst = out_ptr + t.to(tl.int64) * n_max + n
    if tl.program_id(1) * BLOCK_N < limit:
        vis = n < limit
        blk = tl.load(bt_ptr + t.to(tl.int64) * bt_stride + n // epb, mask=vis, other=0)
        phys = blk.to(tl.int64) * epb + n % epb
        s = _score_tile(q_ptr, w_ptr, pool_ptr, t, phys, vis, H, row_stride, DI, BLOCK_H, NUM_HB, BLOCK_N,
                        FP4, BF16_DOT)
        tl.store(dst, tl.where(vis, s, float("-inf")), mask=n < n_max)
    else:  # the whole tile is past n_visible: no key traffic
        tl.store(dst, tl.full([BLOCK_N], float("-inf"), tl.float32), mask=n < n_max)


@triton.jit(do_not_specialize=_ROW_ARGS + ["cbs", "cand_stride"])
def _index_scores_cand_kernel(q_ptr, w_ptr, pool_ptr, bt_ptr, nvis_ptr, cand_ptr, out_ptr, ncols, cand_stride, cbs,
                              H, row_stride, bt_stride, epb, reach, DI: tl.constexpr, BLOCK_H: tl.constexpr,
                              NUM_HB: tl.constexpr, BLOCK_N: tl.constexpr, FP4: tl.constexpr,
                              BF16_DOT: tl.constexpr):
    t = tl.program_id(0)
    c = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    cm = c < ncols
    blk = tl.load(cand_ptr + t.to(tl.int64) * cand_stride + c // cbs, mask=cm, other=-1)
    e = blk * cbs + c % cbs
    vis = cm & (blk >= 0) & (e < tl.minimum(tl.load(nvis_ptr + t), reach))
    dst = out_ptr + t.to(tl.int64) * ncols + c
    if tl.max(vis.to(tl.int32), axis=0) > 0:
        pb = tl.load(bt_ptr + t.to(tl.int64) * bt_stride + e // epb, mask=vis, other=0)
        phys = pb.to(tl.int64) * epb + e % epb
        s = _score_tile(q_ptr, w_ptr, pool_ptr, t, phys, vis, H, row_stride, DI, BLOCK_H, NUM_HB, BLOCK_N,
                        FP4, BF16_DOT)
        tl.store(dst, tl.where(vis, s, float("-inf")), mask=cm)
    else:  # -1 padding (short contexts) costs only this store
        tl.store(dst, tl.full([BLOCK_N], float("-inf"), tl.float32), mask=cm)


def _prepare(q, w, pool, fmt, block_table, epb, n_visible):
    """Validated, contiguous kernel operands plus the constexpr meta-parameters."""
    rf = _check(q, w, pool, fmt, block_table, epb, n_visible)
    t, h, di = q.shape
    if not q.is_floating_point():
        raise ValueError(f"q must be a float tensor, got {q.dtype}")
    if q.dtype not in (torch.float32, torch.bfloat16):  # fp64/fp16: fp32 math (exact for FP4-fake-quantised q)
        q = q.float()
    if di < 32 or di & (di - 1):
        raise ValueError(f"Di must be a power of two >= 32 for the Triton kernel, got {di}")
    pool_t = pool.contiguous() if fmt == "fp4" else pool.contiguous().view(torch.bfloat16)
    block_h = min(MAX_BLOCK_H, max(16, triton.next_power_of_2(h)))  # tl.dot needs M >= 16
    args = (q.contiguous(), w.float().contiguous(), pool_t, block_table.to(torch.int32).contiguous(),
            n_visible.to(torch.int32).contiguous())
    meta = dict(DI=di, BLOCK_H=block_h, NUM_HB=triton.cdiv(h, block_h), BLOCK_N=BLOCK_N, FP4=fmt == "fp4",
                BF16_DOT=q.dtype == torch.bfloat16 and not _INTERPRET, num_warps=NUM_WARPS)
    return args, meta, pool_t.stride(0), block_table.shape[1] * epb


def index_scores(q, w, pool, fmt, block_table, epb, n_visible, n_max, out=None):
    """Scores of every entry < n_max -> [T, n_max] fp32; programs past n_visible[t] only write -inf."""
    (q, w, pool_t, bt, nv), meta, row_stride, reach = _prepare(q, w, pool, fmt, block_table, epb, n_visible)
    out = _out(out, q.shape[0], n_max, torch.float32, q.device)
    if out.numel():
        grid = (q.shape[0], triton.cdiv(n_max, BLOCK_N))
        _index_scores_kernel[grid](q, w, pool_t, bt, nv, out, n_max, q.shape[1], row_stride, bt.stride(0), epb,
                                   reach, **meta)
    return out


def index_scores_candidates(q, w, pool, fmt, block_table, epb, cand_blocks, cand_block_size, n_visible, out=None):
    """Scores of the candidate blocks' entries only -> [T, NB * cand_block_size] fp32 (see module doc)."""
    (q, w, pool_t, bt, nv), meta, row_stride, reach = _prepare(q, w, pool, fmt, block_table, epb, n_visible)
    _check_cands(cand_blocks, cand_block_size, q.shape[0])
    cand = cand_blocks.to(torch.int32).contiguous()
    ncols = cand.shape[1] * cand_block_size
    out = _out(out, q.shape[0], ncols, torch.float32, q.device)
    if out.numel():
        grid = (q.shape[0], triton.cdiv(ncols, BLOCK_N))
        _index_scores_cand_kernel[grid](q, w, pool_t, bt, nv, cand, out, ncols, cand.stride(0), cand_block_size,
                                        q.shape[1], row_stride, bt.stride(0), epb, reach, **meta)
    return out
