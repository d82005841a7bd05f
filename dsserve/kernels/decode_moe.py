"""Routed experts for decode batches: the routing resolved inside the GEMMs, the weights as the MMA's left operand.

grouped_moe's tile kernels serve every batch, but at decode (a few tokens, <= MAX_PAIRS (token, slot) pairs) they
leave weight bandwidth unused: an expert's tile holds 16 rows of which 1-6 are real, the upcast weights are the
MMA's right operand, the routing takes its own launch (moe_permute, 9-42 us a layer) and at B = 1 only 6 experts x
inter / BN programs stream weights (0.96-1.56 TB/s of MXFP4 weights on the H200, model-h200-6580e56/kernels.json).

Here a program is (expert e, BN output columns, one of SPLIT slices of K):
* it reads the T*k ids, ranks its expert's pairs by a cumsum (pair order: deterministic) and exits at once when
  it has none: no sort, no tile table, no host sync, so one launch grid fits every routing (CUDA graphs);
* acc^T [BN, BM] = W_e[columns, K slice] @ rows^T, in chunks of BM rows: MXFP4 weights by tl.dot_scaled with the
  packed tile on the left, other formats (and non-bf16 rows) by the kernels' own decode (dequant.weight_tile);
* SPLIT > 1: every program stores fp32 partials; the last to arrive on its (expert, columns) tile sums them in
  split order (split_k: deterministic) and runs the epilogue.
The up kernel writes h [T*k, inter] in pair order (clamped SwiGLU times the routing weight, the reference's
roundings, as grouped_moe's up kernel), the down kernel y [T*k, d] in pair order; the caller sums the k slots.
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from .dequant import weight_tile
from .split_k import arrive_last, sum_splits, tile_counters

MAX_PAIRS = 256  # T*k up to this (B <= 42 at top-6): every program ranks all pairs, O(pairs) each
_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit
def _expert_pairs(ids_ptr, n_pairs, e, PMAX: tl.constexpr):
    """(pair indices [PMAX], hit (1 where the pair picked expert e), each hit's rank among e's pairs, their count)."""
    i = tl.arange(0, PMAX)
    hit = (tl.load(ids_ptr + i, mask=i < n_pairs, other=-1) == e).to(tl.int32)
    return i, hit, tl.cumsum(hit, axis=0) - 1, tl.sum(hit, axis=0)


@triton.jit
def _chunk(i, hit, rank, count, c, BM: tl.constexpr):
    """The pair indices [BM] of expert e's rows c*BM .. c*BM + BM - 1 (0 past its count) and their mask."""
    slot = c * BM + tl.arange(0, BM)
    pair = tl.sum(tl.where((hit[:, None] != 0) & (rank[:, None] == slot[None, :]), i[:, None], 0), axis=0)
    return pair, slot < count


@triton.jit
def _wdot(acc, rows_t, w_ptr, s_ptr, e, rn, k0, N: tl.constexpr, K: tl.constexpr, FMT: tl.constexpr,
          BN: tl.constexpr, BK: tl.constexpr, SCALED: tl.constexpr, DOT_F32: tl.constexpr):
    """acc [BN, BM] + W_e[rn, k0:k0 + BK] @ rows_t [BK, BM] (rows_t zero past K)."""
    if SCALED:  # MXFP4, bf16 rows: tl.dot_scaled upcasts the packed nibbles and e8m0 scales (exact in bf16)
        KH: tl.constexpr = K // 2
        KS: tl.constexpr = K // 32
        kh = k0 // 2 + tl.arange(0, BK // 2)
        ks = k0 // 32 + tl.arange(0, BK // 32)
        nm = rn[:, None] < N
        base = e.to(tl.int64) * N
        b = tl.load(w_ptr + (base + rn[:, None]) * KH + kh[None, :], mask=nm & (kh[None, :] < KH), other=0)
        s = tl.load(s_ptr + (base + rn[:, None]) * KS + ks[None, :], mask=nm & (ks[None, :] < KS), other=127)
        acc = tl.dot_scaled(b, s, "e2m1", rows_t, None, "bf16", acc, fast_math=True)
    else:
        w = weight_tile(w_ptr, s_ptr, e, rn, k0, N, K, FMT, BN, BK).to(rows_t.dtype)  # the reference's W, exactly
        if DOT_F32:
            acc += tl.dot(w.to(tl.float32), rows_t.to(tl.float32), input_precision="ieee")
        else:
            acc = tl.dot(w, rows_t, acc)
    return acc


@triton.jit
def _swiglu_store(acc1, acc3, pair, pm, rn, rw_ptr, h_ptr, limit, I: tl.constexpr):
    # the reference's roundings: x-dtype matmul outputs, x-dtype silu and product, then the fp32 routing weight
    dt = h_ptr.dtype.element_ty
    g = tl.minimum(acc1.to(dt).to(tl.float32), limit)
    u = tl.minimum(tl.maximum(acc3.to(dt).to(tl.float32), -limit), limit)
    s = (g / (1.0 + tl.exp(-g))).to(dt).to(tl.float32)
    a = (s * u).to(dt).to(tl.float32) * tl.load(rw_ptr + pair, mask=pm, other=0.0)[None, :]
    tl.store(h_ptr + pair.to(tl.int64)[None, :] * I + rn[:, None], a.to(dt), mask=pm[None, :] & (rn[:, None] < I))


@triton.jit
def _up_kernel(x_ptr, sxm, ids_ptr, rw_ptr, w1_ptr, s1_ptr, w3_ptr, s3_ptr, h_ptr, part_ptr, cnt_ptr, n_pairs, limit,
               KSLOT: tl.constexpr, D: tl.constexpr, I: tl.constexpr, FMT: tl.constexpr, PMAX: tl.constexpr,
               BM: tl.constexpr, CHUNKS: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, K_TILES: tl.constexpr,
               SPLIT: tl.constexpr, SCALED: tl.constexpr, DOT_F32: tl.constexpr):
    e, nb, sp = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i, hit, rank, count = _expert_pairs(ids_ptr, n_pairs, e, PMAX)
    if count == 0:  # an expert no token picked: none of its weights are read
        return
    rn = nb * BN + tl.arange(0, BN)
    sps = n_pairs * 2 * I  # partials [SPLIT, T*k, 2 * inter]: W1's columns, then W3's
    for c in range(CHUNKS):
        if c * BM < count:
            pair, pm = _chunk(i, hit, rank, count, c, BM)
            xrow = x_ptr + (pair // KSLOT).to(tl.int64) * sxm
            acc1 = tl.zeros((BN, BM), tl.float32)
            acc3 = tl.zeros((BN, BM), tl.float32)
            for t in range(K_TILES):
                k0 = (sp * K_TILES + t) * BK
                kk = k0 + tl.arange(0, BK)
                xt = tl.load(xrow[None, :] + kk[:, None], mask=pm[None, :] & (kk[:, None] < D), other=0.0)
                acc1 = _wdot(acc1, xt, w1_ptr, s1_ptr, e, rn, k0, I, D, FMT, BN, BK, SCALED, DOT_F32)
                acc3 = _wdot(acc3, xt, w3_ptr, s3_ptr, e, rn, k0, I, D, FMT, BN, BK, SCALED, DOT_F32)
            if SPLIT == 1:
                _swiglu_store(acc1, acc3, pair, pm, rn, rw_ptr, h_ptr, limit, I)
            else:
                at = part_ptr + sp * sps + pair.to(tl.int64)[None, :] * (2 * I) + rn[:, None]
                m = pm[None, :] & (rn[:, None] < I)
                tl.store(at, acc1, mask=m)
                tl.store(at + I, acc3, mask=m)
    if SPLIT > 1:
        if arrive_last(cnt_ptr, e * tl.num_programs(1) + nb, SPLIT):
            for c in range(CHUNKS):
                if c * BM < count:
                    pair, pm = _chunk(i, hit, rank, count, c, BM)
                    at = part_ptr + pair.to(tl.int64)[None, :] * (2 * I) + rn[:, None]
                    m = pm[None, :] & (rn[:, None] < I)
                    _swiglu_store(sum_splits(at, sps, m, SPLIT), sum_splits(at + I, sps, m, SPLIT), pair, pm, rn,
                                  rw_ptr, h_ptr, limit, I)


@triton.jit
def _down_kernel(h_ptr, ids_ptr, w2_ptr, s2_ptr, y_ptr, part_ptr, cnt_ptr, n_pairs, D: tl.constexpr,
                 I: tl.constexpr, FMT: tl.constexpr, PMAX: tl.constexpr, BM: tl.constexpr, CHUNKS: tl.constexpr,
                 BN: tl.constexpr, BK: tl.constexpr, K_TILES: tl.constexpr, SPLIT: tl.constexpr,
                 SCALED: tl.constexpr, DOT_F32: tl.constexpr):
    e, nb, sp = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i, hit, rank, count = _expert_pairs(ids_ptr, n_pairs, e, PMAX)
    if count == 0:
        return
    rn = nb * BN + tl.arange(0, BN)
    sps = n_pairs * D  # partials [SPLIT, T*k, d]
    for c in range(CHUNKS):
        if c * BM < count:
            pair, pm = _chunk(i, hit, rank, count, c, BM)
            hrow = h_ptr + pair.to(tl.int64) * I
            acc = tl.zeros((BN, BM), tl.float32)
            for t in range(K_TILES):
                k0 = (sp * K_TILES + t) * BK
                kk = k0 + tl.arange(0, BK)
                ht = tl.load(hrow[None, :] + kk[:, None], mask=pm[None, :] & (kk[:, None] < I), other=0.0)
                acc = _wdot(acc, ht, w2_ptr, s2_ptr, e, rn, k0, D, I, FMT, BN, BK, SCALED, DOT_F32)
            at = pair.to(tl.int64)[None, :] * D + rn[:, None]
            m = pm[None, :] & (rn[:, None] < D)
            if SPLIT == 1:
                tl.store(y_ptr + at, acc.to(y_ptr.dtype.element_ty), mask=m)
            else:
                tl.store(part_ptr + sp * sps + at, acc, mask=m)
    if SPLIT > 1:
        if arrive_last(cnt_ptr, e * tl.num_programs(1) + nb, SPLIT):
            for c in range(CHUNKS):
                if c * BM < count:
                    pair, pm = _chunk(i, hit, rank, count, c, BM)
                    at = pair.to(tl.int64)[None, :] * D + rn[:, None]
                    m = pm[None, :] & (rn[:, None] < D)
                    tl.store(y_ptr + at, sum_splits(part_ptr + at, sps, m, SPLIT).to(y_ptr.dtype.element_ty), mask=m)


def decode_config(n_pairs: int, n_experts: int, d: int, inter: int, device: torch.device, cfg: dict) -> dict:
    """Tiles and K splits: BN output columns a program, BK a K step, SPLIT_UP / SPLIT_DOWN slices of K, chosen so
    that the programs of the experts in use fill the SMs about PROGRAMS_PER_SM times (cfg overrides any key)."""
    c = {"BM": 16, "BN": 64, "BK": 128, "num_warps": 4, "num_stages": 3, "programs_per_sm": 4}
    unknown = set(cfg) - set(c) - {"SPLIT_UP", "SPLIT_DOWN"}
    if unknown:
        raise ValueError(f"config keys {sorted(unknown)} do not apply to the decode path (allowed: "
                         f"{sorted(set(c) | {'SPLIT_UP', 'SPLIT_DOWN', 'scaled'})})")
    c.update(cfg)
    for key, low in (("BM", 16), ("BN", 16), ("BK", 32)):
        if c[key] < low or c[key] & (c[key] - 1):
            raise ValueError(f"config {key}={c[key]} must be a power of two >= {low}")
    sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4
    used = min(n_experts, n_pairs)  # experts a routing can touch (all of them at most)
    for name, n_out, k in (("UP", inter, d), ("DOWN", d, inter)):
        bn = max(16, min(c["BN"], triton.next_power_of_2(n_out)))
        bk = max(32, min(c["BK"], triton.next_power_of_2(k)))
        k_tiles = triton.cdiv(k, bk)
        split = c.get("SPLIT_" + name, triton.cdiv(c["programs_per_sm"] * sms, used * triton.cdiv(n_out, bn)))
        per = triton.cdiv(k_tiles, max(1, min(split, k_tiles)))
        c.update({"BN_" + name: bn, "BK_" + name: bk, "K_TILES_" + name: per,
                  "SPLIT_" + name: triton.cdiv(k_tiles, per)})  # no empty slices
    return c


def decode_experts(x, ids, rw, fmt: int, scaled: bool, weights: tuple, d: int, inter: int, n_experts: int,
                   limit: float, cfg: dict, empty=torch.empty) -> torch.Tensor:
    """y [T*k, d] in x's dtype: each (token, slot) pair's routed expert output times its routing weight, in pair
    order (routed_experts sums the slots). x [T, d] (row stride free, columns contiguous), ids [T, k] int, rw [T, k]
    fp32 contiguous; weights = (w1, s1, w3, s3, w2, s2) as ExpertWeights holds them; fmt the FMTS index; empty
    allocates h and y (tests pass a NaN fill, so that a row left unwritten shows)."""
    t, k = ids.shape
    n_pairs = t * k
    if n_pairs > MAX_PAIRS:
        raise ValueError(f"decode_experts takes at most {MAX_PAIRS} (token, slot) pairs, got {n_pairs}")
    c = decode_config(n_pairs, n_experts, d, inter, x.device, cfg)
    flat = ids.reshape(-1)
    pmax = max(16, triton.next_power_of_2(n_pairs))
    chunks = triton.cdiv(pmax, c["BM"])  # an expert may hold every pair (repeated ids); extra chunks are skipped
    w1, s1, w3, s3, w2, s2 = weights
    h = empty((n_pairs, inter), dtype=x.dtype, device=x.device)
    y = empty((n_pairs, d), dtype=x.dtype, device=x.device)
    split = max(c["SPLIT_UP"], c["SPLIT_DOWN"])
    part = torch.empty(split * n_pairs * max(2 * inter, d) if split > 1 else 1, dtype=torch.float32,
                       device=x.device)
    nb_up, nb_down = triton.cdiv(inter, c["BN_UP"]), triton.cdiv(d, c["BN_DOWN"])
    cnt = tile_counters(x.device, n_experts * max(nb_up, nb_down))  # up, then down: each leaves them at 0
    common = dict(FMT=fmt, PMAX=pmax, BM=c["BM"], CHUNKS=chunks, SCALED=scaled,
                  DOT_F32=_INTERPRET or x.dtype == torch.float32, num_warps=c["num_warps"],
                  num_stages=c["num_stages"])
    _up_kernel[(n_experts, nb_up, c["SPLIT_UP"])](
        x, x.stride(0), flat, rw, w1, s1, w3, s3, h, part, cnt, n_pairs, float(limit), KSLOT=k, D=d, I=inter,
        BN=c["BN_UP"], BK=c["BK_UP"], K_TILES=c["K_TILES_UP"], SPLIT=c["SPLIT_UP"], **common)
    _down_kernel[(n_experts, nb_down, c["SPLIT_DOWN"])](
        h, flat, w2, s2, y, part, cnt, n_pairs, D=d, I=inter, BN=c["BN_DOWN"], BK=c["BK_DOWN"],
        K_TILES=c["K_TILES_DOWN"], SPLIT=c["SPLIT_DOWN"], **common)
    return y
