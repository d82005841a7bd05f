"""Routed experts with 8-bit activations on FP8 tensor cores: W4A8 (MXFP4 experts) and W8A8 (FP8 32x32 experts).

The release quantises the input of every FP8 / FP4-weight linear to e4m3 per 32 channels with a power-of-two scale
(spec 2.12, `act_quant`; quant.fake_quant_fp8_pow2), so these are the release's own numerics, not a deviation:

* x rows -> e4m3 + pow2 scale per (token, 32 channels) (fp8_linear.act_quant_rows: T rows, before the pair gather);
* up: h = clamped_swiglu(W1 xq, W3 xq) (x-dtype matmul outputs and SwiGLU) times the routing weight (fp32), rounded
  to x's dtype, then quantised again per (pair, 32 channels) in the same kernel's epilogue (e4m3 bytes + scales);
* down: W2 hq, stored per pair; y = the fp32 sum over the k picks (as grouped_moe).

The reference is grouped_moe.routed_experts_ref(..., act_quant=True): fake-quantised x and h, exact weights.

In the K loop, one 32-wide K group at a time: the weight group is turned into e4m3 in registers (MXFP4: each byte's
two e2m1 nibbles become e4m3 bytes `s 0 0 e e m 0 0`, the e2m1 value times 2^-6 exactly, 7 integer ops per 8 weights
by inline PTX on CUDA, low nibbles first, so the activation bytes are stored in that order: each group's even
channels, then its odd ones; FP8 experts are e4m3 already), an fp8 x fp8 -> fp32 tl.dot of K = 32 gives the group's
partial, and `acc += partial * (a_scale x w_scale)` applies both pow2 scales (2^6 folded into the weight scale) on
the fp32 accumulator. Products of e4m3 values are exact; only the fp32 sums round (order differs from the
reference: tests compare to a tolerance). SWAP (the decode default): the weight rows are the dot's M side and
the tokens its N side (wgmma needs M = 64; an expert holds 1-32 tokens at decode). Prefill-sized calls take
grouped_moe's bf16 tiles instead (dequantised experts, x fake-quantised in its dtype, h in the up kernel's
epilogue): the same numbers, without rescaling the accumulator every 32 K.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from . import fp8_linear
from .dequant import _e8m0
from .fp8_linear import act_quant_rows, group_dot
from .kv_write import _e4m3, _pow2_ceil_exp, _round_to
from .moe_permute import expert_tiles

GROUP = 32  # activation and weight scale granularity along K
_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
_empty = torch.empty  # scratch and output allocation; tests swap in a NaN fill so that unwritten rows show


@triton.jit
def quant_e4m3_pow2(x):
    """fp32 [R, 32] -> (e4m3 bytes uint8 [R, 32], fp32 scale [R]): s = 2^ceil(log2(max(amax, 1e-4) / 448)) per row,
    byte = e4m3(clamp(x / s, +-448)) RNE (quant.fake_quant_fp8_pow2; by bits, as the interpreter's cast mis-rounds)."""
    ex = _pow2_ceil_exp(tl.math.div_rn(tl.maximum(tl.max(tl.abs(x), axis=1), 1e-4), 448.0))
    inv = tl.where(ex == 254, 1 << 22, (254 - ex) << 23).to(tl.float32, bitcast=True)  # 1 / s exactly
    _, code = _e4m3(tl.minimum(tl.maximum(x * inv[:, None], -448.0), 448.0))
    return code.to(tl.uint8), (ex << 23).to(tl.float32, bitcast=True)


@triton.jit
def e2m1x2_to_e4m3(b, BN: tl.constexpr, BH: tl.constexpr, ASM: tl.constexpr, SPLIT: tl.constexpr = False):
    """Packed MXFP4 bytes uint8 [BN, BH] (element 2j in the low nibble of byte j) -> float8e4nv [BN, 2 BH] holding
    e2m1 * 2^-6 exactly: sign to bit 7, the exponent-mantissa bits e1 e0 m to bits 4-2. ASM: four bytes a 32-bit
    register by PTX (CUDA); else the same bit operations byte by byte (the interpreter runs no PTX)."""
    if ASM:
        lo, hi = tl.inline_asm_elementwise(
            """
            {
            .reg .b32 t, u;
            shl.b32 t, $2, 4;
            shl.b32 u, $2, 2;
            and.b32 t, t, 0x80808080;
            and.b32 u, u, 0x1C1C1C1C;
            or.b32 $0, t, u;
            shr.b32 u, $2, 2;
            and.b32 t, $2, 0x80808080;
            and.b32 u, u, 0x1C1C1C1C;
            or.b32 $1, t, u;
            }
            """,
            "=r,=r,r",
            [b],
            dtype=(tl.uint8, tl.uint8),
            is_pure=True,
            pack=4,
        )
    else:
        c = b.to(tl.int32)
        lo = (((c & 0x08) << 4) | ((c & 0x07) << 2)).to(tl.uint8)
        hi = ((c & 0x80) | ((c & 0x70) >> 2)).to(tl.uint8)
    if SPLIT:  # all low nibbles, then all high ones: each 32-bit word's two outputs are one wgmma A fragment's
        return tl.reshape(tl.permute(tl.join(lo, hi), (0, 2, 1)), (BN, 2 * BH)).to(tl.float8e4nv, bitcast=True)
    return tl.reshape(tl.join(lo, hi), (BN, 2 * BH)).to(tl.float8e4nv, bitcast=True)


@triton.jit
def _w_group(
    w_ptr, s_ptr, e, rn, g, N: tl.constexpr, K: tl.constexpr, FMT: tl.constexpr, BN: tl.constexpr, ASM: tl.constexpr
):
    """K group g of expert e's rows rn: (e4m3 [BN, 32], fp32 scale [BN]) with W = e4m3 * scale exactly (0 past N).
    FMT 1: e4m3 [E, N, K] + e8m0 [E, ceil(N/32), K/32]; FMT 2: MXFP4 [E, N, K/2] + e8m0 [E, N, K/32]."""
    nm = rn < N
    e = e.to(tl.int64)
    if FMT == 2:
        kh = g * 16 + tl.arange(0, 16)
        b = tl.load(w_ptr + (e * N + rn[:, None]) * (K // 2) + kh[None, :], mask=nm[:, None], other=0)
        w = e2m1x2_to_e4m3(b, BN, 16, ASM, SPLIT=True)
        s = tl.load(s_ptr + (e * N + rn) * (K // 32) + g, mask=nm, other=0).to(tl.int32)
        sw = ((s + 6) << 23).to(tl.float32, bitcast=True)  # 2^(s - 127) * 2^6, exact for every byte <= 248
    else:
        kk = g * 32 + tl.arange(0, 32)
        b = tl.load(w_ptr + (e * N + rn[:, None]) * K + kk[None, :], mask=nm[:, None], other=0)
        w = b.to(tl.float8e4nv, bitcast=True)
        sw = _e8m0(tl.load(s_ptr + (e * ((N + 31) // 32) + rn // 32) * (K // 32) + g, mask=nm, other=127))
    return w, sw


@triton.jit
def _a_group(q_ptr, qs_ptr, rows, rm, g, K: tl.constexpr):
    """K group g of the quantised activation rows: (e4m3 [BM, 32], fp32 scale [BM]); 0 where ~rm."""
    kk = g * 32 + tl.arange(0, 32)
    a = tl.load(q_ptr + rows[:, None] * K + kk[None, :], mask=rm[:, None], other=0).to(tl.float8e4nv, bitcast=True)
    return a, tl.load(qs_ptr + rows * (K // 32) + g, mask=rm, other=0.0)


@triton.jit
def _tile(tiles_ptr, n_tiles, N: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, GROUP_M: tl.constexpr):
    """(expert, sorted positions [BM], their mask, first output column) of this program (grouped_moe._tile)."""
    n_n: tl.constexpr = (N + BN - 1) // BN
    pid = tl.program_id(0)
    first = (pid // (GROUP_M * n_n)) * GROUP_M
    size = tl.minimum(n_tiles - first, GROUP_M)
    pid_m = first + (pid % (GROUP_M * n_n)) % size
    pid_n = (pid % (GROUP_M * n_n)) // size
    e = tl.load(tiles_ptr + pid_m)
    p = tl.load(tiles_ptr + n_tiles + pid_m) + tl.arange(0, BM)
    return e, p.to(tl.int64), p < tl.load(tiles_ptr + 2 * n_tiles + pid_m), pid_n * BN


@triton.jit(do_not_specialize=["n_tiles"])
def _up_a8_kernel(
    q_ptr,
    qs_ptr,
    tiles_ptr,
    order_ptr,
    rw_ptr,
    w1_ptr,
    s1_ptr,
    w3_ptr,
    s3_ptr,
    hq_ptr,
    hs_ptr,
    n_tiles,
    n_experts,
    limit,
    KSLOT: tl.constexpr,
    D: tl.constexpr,
    I: tl.constexpr,
    FMT: tl.constexpr,
    DT: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    GROUP_M: tl.constexpr,
    SWAP: tl.constexpr,
    ASM: tl.constexpr,
    F16_MMA: tl.constexpr,
):
    e, p, pm, n0 = _tile(tiles_ptr, n_tiles, I, BM, BN, GROUP_M)
    if e >= n_experts:  # past the last real tile
        return
    rn = n0 + tl.arange(0, BN)
    pair = tl.load(order_ptr + p, mask=pm, other=0)
    tok = pair // KSLOT
    if SWAP:
        acc1 = tl.zeros((BN, BM), tl.float32)
    else:
        acc1 = tl.zeros((BM, BN), tl.float32)
    acc3 = tl.zeros_like(acc1)
    for t in range(D // BK):
        for j in tl.static_range(BK // 32):
            g = t * (BK // 32) + j
            a, sa = _a_group(q_ptr, qs_ptr, tok, pm, g, D)
            w, sw = _w_group(w1_ptr, s1_ptr, e, rn, g, I, D, FMT, BN, ASM)
            acc1 = group_dot(acc1, a, sa, w, sw, SWAP, F16_MMA)
            w, sw = _w_group(w3_ptr, s3_ptr, e, rn, g, I, D, FMT, BN, ASM)
            acc3 = group_dot(acc3, a, sa, w, sw, SWAP, F16_MMA)
    if SWAP:
        acc1 = tl.trans(acc1)
        acc3 = tl.trans(acc3)
    # the reference's roundings: x-dtype matmul outputs, x-dtype silu and product, then the fp32 routing weight
    # (_round_to: RNE by bits, which the interpreter's bf16 cast is not)
    g1 = tl.minimum(_round_to(acc1, DT), limit)
    u = tl.minimum(tl.maximum(_round_to(acc3, DT), -limit), limit)
    s = _round_to(g1 / (1.0 + tl.exp(-g1)), DT)
    h = _round_to(_round_to(s * u, DT) * tl.load(rw_ptr + pair, mask=pm, other=0.0)[:, None], DT)
    # then the down projection's act_quant, one 32-column group at a time (BN is a multiple of 32)
    hq, hs = quant_e4m3_pow2(tl.reshape(h, (BM * (BN // 32), 32)))
    cq = rn
    if FMT == 2:  # in the K order of the MXFP4 conversion (act_quant_rows split): even channels first, then odd
        cq = (rn // 32) * 32 + (rn % 2) * 16 + (rn % 32) // 2
    tl.store(hq_ptr + p[:, None] * I + cq[None, :], tl.reshape(hq, (BM, BN)), mask=pm[:, None] & (rn[None, :] < I))
    gc = n0 // 32 + tl.arange(0, BN // 32)
    tl.store(
        hs_ptr + p[:, None] * (I // 32) + gc[None, :],
        tl.reshape(hs, (BM, BN // 32)),
        mask=pm[:, None] & (gc[None, :] < I // 32),
    )


@triton.jit(do_not_specialize=["n_tiles"])
def _down_a8_kernel(
    hq_ptr,
    hs_ptr,
    tiles_ptr,
    order_ptr,
    w2_ptr,
    s2_ptr,
    y_ptr,
    n_tiles,
    n_experts,
    D: tl.constexpr,
    I: tl.constexpr,
    FMT: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    GROUP_M: tl.constexpr,
    SWAP: tl.constexpr,
    ASM: tl.constexpr,
    F16_MMA: tl.constexpr,
):
    e, p, pm, n0 = _tile(tiles_ptr, n_tiles, D, BM, BN, GROUP_M)
    if e >= n_experts:
        return
    rn = n0 + tl.arange(0, BN)
    if SWAP:
        acc = tl.zeros((BN, BM), tl.float32)
    else:
        acc = tl.zeros((BM, BN), tl.float32)
    for t in range(I // BK):
        for j in tl.static_range(BK // 32):
            g = t * (BK // 32) + j
            a, sa = _a_group(hq_ptr, hs_ptr, p, pm, g, I)
            w, sw = _w_group(w2_ptr, s2_ptr, e, rn, g, D, I, FMT, BN, ASM)
            acc = group_dot(acc, a, sa, w, sw, SWAP, F16_MMA)
    if SWAP:
        acc = tl.trans(acc)
    pair = tl.load(order_ptr + p, mask=pm, other=0)
    tl.store(
        y_ptr + pair[:, None] * D + rn[None, :],
        _round_to(acc, y_ptr.dtype.element_ty).to(y_ptr.dtype.element_ty),
        mask=pm[:, None] & (rn[None, :] < D),
    )


_TL = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}


def _bk(k: int, want: int) -> int:
    """The largest power of two <= want (and >= 32) dividing k (a multiple of 32): the K loop has no tail."""
    bk = want
    while k % bk:
        bk //= 2
    return bk


def config_a8(n_pairs: int, n_exp: int, d: int, inter: int, cfg: dict | None = None, sms: int = 132) -> dict:
    """Tiles for n_pairs (token, expert) pairs on `sms` SMs: BM covers an expert's rows under even routing (8..64;
    8 and 16 only swapped, where the tokens are the MMA's N side), BK 256 / 128 (unrolled 32-wide groups), SWAP
    below 64 rows, BN 128 (fewer instructions a weight: offline SASS, benchmarks/kernel_sass.py) unless the up
    kernel would then run fewer than two programs an SM (B = 1 decode: 6 experts x 18 column tiles), then 64;
    cfg overrides any key."""
    cfg = dict(cfg or {})
    used = max(1, min(n_pairs, n_exp))
    rows = -(-n_pairs // used)
    swap = cfg.get("SWAP", rows < 64)
    bm = cfg.pop("BM", min(64, max(8 if swap else 16, triton.next_power_of_2(rows))))
    big = bm >= 64
    bn = 128 if big or used * triton.cdiv(inter, 128) >= 2 * sms else 64
    c = {"BM": bm, "BN": bn, "BK": 128 if big else 256, "GROUP_M": 8, "SWAP": swap, "mma": fp8_linear.MMA}
    c.update(num_warps=8 if big else 4, num_stages=3 if big else 4)
    c.update(cfg)
    for key, low in (("BM", 8 if c["SWAP"] else 16), ("BN", 32), ("BK", 32)):
        if c[key] < low or c[key] & (c[key] - 1):
            raise ValueError(f"config {key}={c[key]} must be a power of two >= {low} (SWAP={c['SWAP']})")
    if c["mma"] not in ("fp8", "fp16"):
        raise ValueError(f"config mma={c['mma']!r}: the tiles' MMA is 'fp8' or 'fp16' (exact sums, see group_dot)")
    c["BN_UP"], c["BN_DOWN"] = (max(32, min(c["BN"], triton.next_power_of_2(m))) for m in (inter, d))
    c["BK_UP"], c["BK_DOWN"] = _bk(d, c["BK"]), _bk(inter, c["BK"])
    return c


def routed_experts_a8(
    x, ids, weights, experts, limit: float, *, accumulate_into=None, accumulate_after=None, config: dict | None = None
):
    """grouped_moe.routed_experts with act_quant=True (the module docstring); experts in fmt "mxfp4" or "fp8", d and
    inter multiples of 32. config overrides BM, BN, BK, GROUP_M, SWAP, num_warps, num_stages, mma (default
    fp8_linear.MMA), asm (the PTX nibble conversion: default on CUDA; False runs the byte-wise Triton ops, the
    interpreter's path) and dequant (default: grouped_moe's prefill threshold, bf16 rows): the experts dequantised
    to x's dtype and run on grouped_moe's bf16 tiles with x and h fake-quantised, the same numbers where the FP8 tiles
    would rescale every 32 K."""
    from . import grouped_moe as G
    from .grouped_moe import _check, _check_into, _wait

    _check(x, ids, weights, experts, kernel=True)
    _check_into(x, accumulate_into)
    if experts.fmt not in ("mxfp4", "fp8"):
        raise ValueError(f"act_quant runs quantised experts (fmt mxfp4 or fp8), got fmt {experts.fmt!r}")
    (t, k), (n_exp, d, inter) = ids.shape, experts.shape
    if d % GROUP or inter % GROUP:
        raise ValueError(f"act_quant needs d and inter multiples of {GROUP}, got d={d}, inter={inter}")
    if t * k == 0:
        _wait(accumulate_after, x)
        return accumulate_into if accumulate_into is not None else torch.zeros(t, d, dtype=x.dtype, device=x.device)
    cfg = dict(config or {})
    dense = cfg.pop("dequant", None)
    if dense is None:  # prefill-sized calls, as grouped_moe's own threshold
        dense = (
            x.dtype == torch.bfloat16
            and t * k >= G.DEQUANT_MIN_ROWS_PER_EXPERT * n_exp
            and 2 * experts.w1.shape[0] * inter * d * 2 <= G.DEQUANT_MAX_BYTES
        )
    if dense:  # the same numbers on bf16 tiles: x fake-quantised in its dtype, h in the up kernel's epilogue
        from .rowwise import fake_quant_fp8_pow2

        own = {key: v for key, v in cfg.items() if key not in ("asm", "SWAP", "mma")}  # bf16 tiles sum exactly
        return G.routed_experts(
            fake_quant_fp8_pow2(x, GROUP),
            ids,
            weights,
            experts,
            limit,
            accumulate_into=accumulate_into,
            accumulate_after=accumulate_after,
            config={**own, "dequant": True, "act_quant_h": True},
        )
    asm = cfg.pop("asm", x.is_cuda and not _INTERPRET)
    if asm and (_INTERPRET or not x.is_cuda):
        raise ValueError("config asm=True needs CUDA (the interpreter runs no PTX)")
    sms = torch.cuda.get_device_properties(x.device).multi_processor_count if x.is_cuda else 1
    c = config_a8(t * k, n_exp, d, inter, cfg, sms)
    q, qs = act_quant_rows(x, GROUP, split=experts.fmt == "mxfp4")
    order, tiles = expert_tiles(ids, n_exp, c["BM"])
    nt, fmt = tiles.shape[1], 2 if experts.fmt == "mxfp4" else 1
    hq = _empty((t * k, inter), dtype=torch.uint8, device=x.device)
    hs = _empty((t * k, inter // GROUP), dtype=torch.float32, device=x.device)
    yk = _empty((t * k, d), dtype=x.dtype, device=x.device)
    common = dict(
        FMT=fmt,
        BM=c["BM"],
        GROUP_M=c["GROUP_M"],
        SWAP=c["SWAP"],
        ASM=asm,
        F16_MMA=c["mma"] == "fp16",
        num_warps=c["num_warps"],
        num_stages=c["num_stages"],
    )
    _up_a8_kernel[(nt * triton.cdiv(inter, c["BN_UP"]),)](
        q,
        qs,
        tiles,
        order,
        weights.float().contiguous(),
        experts.w1,
        experts.s1,
        experts.w3,
        experts.s3,
        hq,
        hs,
        nt,
        n_exp,
        float(limit),
        KSLOT=k,
        D=d,
        I=inter,
        DT=_TL[x.dtype],
        BN=c["BN_UP"],
        BK=c["BK_UP"],
        **common,
    )
    _down_a8_kernel[(nt * triton.cdiv(d, c["BN_DOWN"]),)](
        hq,
        hs,
        tiles,
        order,
        experts.w2,
        experts.s2,
        yk,
        nt,
        n_exp,
        D=d,
        I=inter,
        BN=c["BN_DOWN"],
        BK=c["BK_DOWN"],
        **common,
    )
    routed = yk.view(t, k, d).sum(1, dtype=torch.float32)
    if accumulate_into is not None:
        _wait(accumulate_after, x)
        return accumulate_into.add_(routed)
    return routed.to(x.dtype)
