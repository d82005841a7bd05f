"""Quantised weights back to bf16 (or any float dtype) in one pass, for compute-bound products.

A prefill chunk of thousands of rows is bound by tensor-core FLOPs, not by weight bytes; there the kernels that
decode FP8 / MXFP4 tiles in registers reach 415-460 TFLOP/s (W8A16, M = 8192) and 326 TFLOP/s (MXFP4 experts,
8192 tokens), where cuBLAS on the same weights in bf16 reaches 680-730 and the grouped MoE kernel on bf16 experts
~500 (H200, 2026-11-30, scratch sweep). Writing the bf16 weights once costs ~3 bytes of traffic per weight, paid
back from ~1K rows on. Both decodes are exact: an e4m3 or e2m1 value times a power of two fits in bf16.

* dequant_fp8(w_q, w_s, block, dtype): w_q float8_e4m3fn / uint8 [N, K], w_s e8m0 bytes [ceil(N/b), ceil(K/b)]
  -> [N, K] dtype: W[n, k] = e4m3(w_q[n, k]) * 2^(w_s[n // b, k // b] - 127) (quant.dequant_fp8_block).
* dequant_mxfp4(packed, scale, dtype): packed uint8 / int8 [R, K/2] (channel 2j in the low nibble of byte j, 2j+1
  in the high), scale e8m0 bytes [R, K/32] -> [R, K] dtype (quant.dequant_mxfp4). Leading dims are flattened
  into R (an expert stack [E, out, in/2] dequantises as one [E*out, in/2] table).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..layers.quant import MX_BLOCK, dequant_fp8_block
from ..layers.quant import dequant_mxfp4 as dequant_mxfp4_f32
from .kv_write import _round_to
from .launch import launch

_TORCH_TO_TL = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}
BR, BC = 32, 256  # output tile: rows x columns (8 KB of fp8 in, 16 KB of bf16 out per program)


def _check_dtype(dtype):
    if dtype not in _TORCH_TO_TL:
        raise ValueError(f"dtype {dtype}: expected one of {list(_TORCH_TO_TL)}")


def dequant_fp8_ref(w_q: torch.Tensor, w_s: torch.Tensor, block: int, dtype=torch.bfloat16) -> torch.Tensor:
    return dequant_fp8_block(w_q, w_s, block).to(dtype)


def dequant_mxfp4_ref(packed: torch.Tensor, scale: torch.Tensor, dtype=torch.bfloat16) -> torch.Tensor:
    return dequant_mxfp4_f32(packed, scale).to(dtype)


@triton.jit
def _e8m0(e):  # exponent byte -> fp32 2^(e - 127); e = 0 is the subnormal 2^-127
    e = e.to(tl.int32)
    return tl.where(e == 0, 1 << 22, e << 23).to(tl.float32, bitcast=True)


@triton.jit
def _e2m1(c):  # nibble (int32) -> fp32: bit 3 sign, bits 1-2 exponent (bias 1, 0 = subnormal), bit 0 mantissa
    ex, m = (c >> 1) & 3, c & 1
    bits = tl.where(ex == 0, m * (126 << 23), ((ex + 126) << 23) | (m << 22))
    return (bits | ((c & 8) << 28)).to(tl.float32, bitcast=True)


@triton.jit
def weight_tile(
    w_ptr, s_ptr, e, rn, k0, N: tl.constexpr, K: tl.constexpr, FMT: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr
):
    """fp32 [BN, BK] tile W_e[rn, k0:k0 + BK] (0 outside) of an expert stack [E, N, K] (FMT 0: float, 1: e4m3 +
    32x32 e8m0 blocks, 2: MXFP4 packed [E, N, K/2] + e8m0 [E, N, K/32]), exactly the reference's dequantised weight."""
    kk = k0 + tl.arange(0, BK)
    nm = rn[:, None] < N
    e = e.to(tl.int64)  # E * N * K passes 2^31 for a whole (non-EP) layer
    if FMT == 0:
        w = tl.load(w_ptr + e * N * K + rn[:, None] * K + kk[None, :], mask=nm & (kk[None, :] < K), other=0.0)
        w = w.to(tl.float32)
    else:
        KS: tl.constexpr = (K + 31) // 32  # scale columns (MXFP4: K is a multiple of 32)
        kb = k0 // 32 + tl.arange(0, BK // 32)  # the tile's scale columns (k0 is a multiple of BK >= 32)
        if FMT == 1:
            q = tl.load(w_ptr + e * N * K + rn[:, None] * K + kk[None, :], mask=nm & (kk[None, :] < K), other=0)
            w = q.to(tl.float8e4nv, bitcast=True).to(tl.float32)
            sp = s_ptr + e * ((N + 31) // 32) * KS + (rn[:, None] // 32) * KS + kb[None, :]
        else:
            KH: tl.constexpr = K // 2
            kh = k0 // 2 + tl.arange(0, BK // 2)
            b = tl.load(w_ptr + e * N * KH + rn[:, None] * KH + kh[None, :], mask=nm & (kh[None, :] < KH), other=0)
            b = b.to(tl.int32)
            w = tl.reshape(tl.join(_e2m1(b & 15), _e2m1(b >> 4)), (BN, BK))  # element 2i: low nibble, 2i+1: high
            sp = s_ptr + e * N * KS + rn[:, None] * KS + kb[None, :]
        sc = tl.load(sp, mask=nm & (kb[None, :] < KS), other=127)
        w = w * tl.reshape(tl.broadcast_to(_e8m0(sc)[:, :, None], (BN, BK // 32, 32)), (BN, BK))
    return w


# e2m1 -> bf16 for 8 nibbles of a 32-bit word at once (Hopper has no FP4 conversion). Nibble q (element q: the low
# nibble of byte j is element 2j) sits at bits 4q; nibbles p and p + 4 lie 16 bits apart and fill the two halves of
# one bf16x2 register. Masked to those two nibbles (the word shifted right by 8 first for p = 2, 3), one integer
# multiply by 2^a + 2^b copies each nibble to two places, with no carries: its sign bit lands on bf16 bit 15 and its
# exponent-mantissa bits e1 e0 m on bits 8-6; a mask keeps those. That bf16 is the e2m1 value times 2^-126 exactly
# (e = 0 lands on bf16 subnormals, which mul.bf16x2 keeps), so one multiply by f = 2^(s - 1) = 2^126 * 2^(s - 127),
# a bf16 for e8m0 bytes s <= MXFP4_FAST_MAX_SCALE, gives W exactly: 17 instructions for 8 weights.
MXFP4_FAST_MAX_SCALE = 128


@triton.jit
def mxfp4_tile_bf16(w32_ptr, s_ptr, e, rn, k0, N: tl.constexpr, K: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    """bf16 [BN, BK] tile W_e[rn, k0:k0 + BK] (0 outside) of an MXFP4 expert stack read as int32 words [E, N, K/8]
    (the packed bytes' view) + e8m0 [E, N, K/32] by inline PTX (the comment above): exact for scale bytes <=
    MXFP4_FAST_MAX_SCALE (the caller checks), CUDA only (the interpreter runs no PTX)."""
    KW: tl.constexpr = K // 8
    KS: tl.constexpr = K // 32
    kw = k0 // 8 + tl.arange(0, BK // 8)
    ks = k0 // 32 + tl.arange(0, BK // 32)
    nm = rn[:, None] < N
    base = e.to(tl.int64) * N
    w = tl.load(w32_ptr + (base + rn[:, None]) * KW + kw[None, :], mask=nm & (kw[None, :] < KW), other=0)
    s = tl.load(s_ptr + (base + rn[:, None]) * KS + ks[None, :], mask=nm & (ks[None, :] < KS), other=127)
    f = (s.to(tl.int32) + 126) << 7  # bf16 bits of 2^(s - 1), in both halves: once per 32 weights
    f = tl.reshape(tl.broadcast_to((f | (f << 16))[:, :, None], (BN, BK // 32, 4)), (BN, BK // 8))
    v0, v1, v2, v3, v4, v5, v6, v7 = tl.inline_asm_elementwise(
        """
        {
        .reg .b32 u, t, o0, o1, o2, o3;
        and.b32 t, $8, 0x000F000F;
        mul.lo.u32 t, t, 0x1040;
        and.b32 o0, t, 0x81C081C0;
        mul.rn.bf16x2 o0, o0, $9;
        and.b32 t, $8, 0x00F000F0;
        mul.lo.u32 t, t, 0x104;
        and.b32 o1, t, 0x81C081C0;
        mul.rn.bf16x2 o1, o1, $9;
        shr.b32 u, $8, 8;
        and.b32 t, u, 0x000F000F;
        mul.lo.u32 t, t, 0x1040;
        and.b32 o2, t, 0x81C081C0;
        mul.rn.bf16x2 o2, o2, $9;
        and.b32 t, u, 0x00F000F0;
        mul.lo.u32 t, t, 0x104;
        and.b32 o3, t, 0x81C081C0;
        mul.rn.bf16x2 o3, o3, $9;
        mov.b32 {$0, $4}, o0;
        mov.b32 {$1, $5}, o1;
        mov.b32 {$2, $6}, o2;
        mov.b32 {$3, $7}, o3;
        }
        """,
        "=h,=h,=h,=h,=h,=h,=h,=h,r,r",
        [w, f],
        dtype=(tl.bfloat16,) * 8,
        is_pure=True,
        pack=1,
    )
    # [BN, BK/8, 2, 2, 2]: element 4a + 2b + c of each word at [a, b, c]
    v = tl.join(tl.join(tl.join(v0, v4), tl.join(v2, v6)), tl.join(tl.join(v1, v5), tl.join(v3, v7)))
    return tl.reshape(v, (BN, BK))


@triton.jit
def _fp8_kernel(
    w_ptr, s_ptr, o_ptr, N, K, KS, BLOCK: tl.constexpr, BR: tl.constexpr, BC: tl.constexpr, DT: tl.constexpr
):
    r = tl.program_id(0) * BR + tl.arange(0, BR)
    c = tl.program_id(1) * BC + tl.arange(0, BC)
    m = (r[:, None] < N) & (c[None, :] < K)
    at = r.to(tl.int64)[:, None] * K + c[None, :]
    w = tl.load(w_ptr + at, mask=m, other=0).to(tl.float8e4nv, bitcast=True).to(tl.float32)
    s = _e8m0(tl.load(s_ptr + (r // BLOCK)[:, None] * KS + (c // BLOCK)[None, :], mask=m, other=127))
    tl.store(o_ptr + at, _round_to(w * s, DT).to(DT), mask=m)


@triton.jit
def _mxfp4_kernel(p_ptr, s_ptr, o_ptr, R, KH, BR: tl.constexpr, BC: tl.constexpr, DT: tl.constexpr):
    """Program: BR rows x BC packed bytes -> BR x 2*BC values."""
    r = tl.program_id(0) * BR + tl.arange(0, BR)
    j = tl.program_id(1) * BC + tl.arange(0, BC)
    m = (r[:, None] < R) & (j[None, :] < KH)
    b = tl.load(p_ptr + r.to(tl.int64)[:, None] * KH + j[None, :], mask=m, other=0).to(tl.int32)
    # one scale byte per 16 packed bytes, loaded once and broadcast (a per-byte gather ran at 1.7 TB/s)
    g = tl.program_id(1) * (BC // 16) + tl.arange(0, BC // 16)
    s = _e8m0(
        tl.load(
            s_ptr + r.to(tl.int64)[:, None] * (KH // 16) + g[None, :],
            mask=(r[:, None] < R) & (g[None, :] < KH // 16),
            other=127,
        )
    )
    s = tl.reshape(tl.broadcast_to(s[:, :, None], [BR, BC // 16, 16]), [BR, BC])
    v = tl.interleave(_e2m1(b & 15) * s, _e2m1(b >> 4) * s)  # channel 2j, 2j+1: one contiguous store
    # (two stride-2 stores of the halves wrote 134 GB/s on the H200)
    c = tl.program_id(1) * 2 * BC + tl.arange(0, 2 * BC)
    tl.store(
        o_ptr + r.to(tl.int64)[:, None] * (2 * KH) + c[None, :],
        _round_to(v, DT).to(DT),
        mask=(r[:, None] < R) & (c[None, :] < 2 * KH),
    )


def dequant_fp8(w_q: torch.Tensor, w_s: torch.Tensor, block: int, dtype=torch.bfloat16) -> torch.Tensor:
    _check_dtype(dtype)
    if w_q.dim() != 2 or w_q.element_size() != 1:
        raise ValueError(
            f"w_q: expected a 1-byte [N, K] tensor (float8_e4m3fn or uint8), got {w_q.dtype} {tuple(w_q.shape)}"
        )
    n, k = w_q.shape
    if tuple(w_s.shape) != (-(-n // block), -(-k // block)) or w_s.element_size() != 1:
        raise ValueError(
            f"w_s: expected e8m0 bytes [{-(-n // block)}, {-(-k // block)}], got {w_s.dtype} {tuple(w_s.shape)}"
        )
    out = torch.empty(n, k, dtype=dtype, device=w_q.device)
    if out.numel():
        launch(
            _fp8_kernel,
            (triton.cdiv(n, BR), triton.cdiv(k, BC)),
            w_q.device,
            w_q.contiguous().view(torch.uint8),
            w_s.contiguous().view(torch.uint8),
            out,
            n,
            k,
            w_s.shape[1],
            BLOCK=block,
            BR=BR,
            BC=BC,
            DT=_TORCH_TO_TL[dtype],
            num_warps=4,
        )
    return out


def dequant_mxfp4(packed: torch.Tensor, scale: torch.Tensor, dtype=torch.bfloat16) -> torch.Tensor:
    _check_dtype(dtype)
    if packed.element_size() != 1 or packed.dim() < 1 or packed.shape[-1] % (MX_BLOCK // 2):
        raise ValueError(
            f"packed: expected 1-byte [..., K/2] with K a multiple of {MX_BLOCK}, got {packed.dtype} "
            f"{tuple(packed.shape)}"
        )
    kh = packed.shape[-1]
    if tuple(scale.shape) != (*packed.shape[:-1], kh * 2 // MX_BLOCK) or scale.element_size() != 1:
        raise ValueError(
            f"scale: expected e8m0 bytes {(*packed.shape[:-1], kh * 2 // MX_BLOCK)}, got "
            f"{scale.dtype} {tuple(scale.shape)}"
        )
    out = torch.empty(*packed.shape[:-1], 2 * kh, dtype=dtype, device=packed.device)
    r = packed.numel() // kh if kh else 0
    if out.numel():
        launch(
            _mxfp4_kernel,
            (triton.cdiv(r, BR), triton.cdiv(kh, BC)),
            packed.device,
            packed.contiguous().view(torch.uint8),
            scale.contiguous().view(torch.uint8),
            out,
            r,
            kh,
            BR=BR,
            BC=BC,
            DT=_TORCH_TO_TL[dtype],
            num_warps=4,
        )
    return out
