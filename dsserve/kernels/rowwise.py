"""The attention query path's row-wise ops in one launch each, where torch takes 8 to 30: RMSNorm, RoPE in place
and the indexer query's FP4 fake-quant. Triton + references (the layers' own torch functions).

* rms_norm(x [..., D], weight [D] or None, eps) -> x's dtype: layers.norm.rms_norm (fp32 math: mean of squares,
  1 / sqrt, weight), D any size.
* rope_inplace(x [T, ..., D], cos, sin [T, R/2] fp32) -> x with its last R channels rotated in place, pair i =
  channels (D - R + 2i, D - R + 2i + 1): layers.rope.rotate(..., inplace=True), x contiguous.
* fake_quant_fp4_pow2(x [..., D], group) -> x's dtype: quant.fake_quant_fp4_pow2, D a multiple of group (a power
  of two >= 2); fake_quant_fp8_pow2 likewise (V4's window and main rows).
fp64 inputs run the reference (the fp64 model tests' oracle precision). The kernels reproduce the references'
roundings: IEEE division and square root (div_rn / sqrt_rn), no FMA contraction, casts to bf16 rounded on the bits
(the Triton interpreter truncates its own), the e2m1 grid by midpoint compares (kv_write's helpers). Only the
summation order of the mean of squares differs from torch's.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..layers import quant
from ..layers.norm import rms_norm as _rms_norm
from ..layers.rope import rotate
from .kv_write import _e2m1, _e4m3, _pow2_ceil_exp, _round_to

KERNEL_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_TL = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}
_ROWS = 16  # rows (or groups) a program takes


def _runs_kernel(x: torch.Tensor) -> bool:
    if x.dtype == torch.float64:
        return False
    if x.dtype not in KERNEL_DTYPES:
        raise ValueError(f"x: the kernels take {KERNEL_DTYPES} (fp64 runs the reference), got {x.dtype}")
    return True


# ------------------------------------------------------------------ RMSNorm
@triton.jit(do_not_specialize=["n_rows"])
def _rms_norm_kernel(
    x_ptr,
    w_ptr,
    y_ptr,
    n_rows,
    eps,
    D: tl.constexpr,
    BLOCK_D: tl.constexpr,
    ROWS: tl.constexpr,
    HAS_W: tl.constexpr,
    DT: tl.constexpr,
):
    r = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    c = tl.arange(0, BLOCK_D)
    m = (r[:, None] < n_rows) & (c[None, :] < D)
    at = r.to(tl.int64)[:, None] * D + c[None, :]
    x = tl.load(x_ptr + at, mask=m, other=0.0).to(tl.float32)
    ms = tl.math.div_rn(tl.sum(x * x, axis=1), D * 1.0)
    y = x * tl.math.div_rn(1.0, tl.math.sqrt_rn(ms + eps))[:, None]
    if HAS_W:
        y = y * tl.load(w_ptr + c, mask=c < D, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + at, _round_to(y, DT).to(DT), mask=m)


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """layers.norm.rms_norm in one launch."""
    if not _runs_kernel(x):
        return _rms_norm(x, weight, eps)
    d = x.shape[-1]
    if weight is not None and tuple(weight.shape) != (d,):
        raise ValueError(f"weight: expected [{d}], got {tuple(weight.shape)}")
    x = x.contiguous()
    y = torch.empty_like(x)
    rows = x.numel() // d if d else 0
    if rows:
        _rms_norm_kernel[(triton.cdiv(rows, _ROWS),)](
            x,
            x if weight is None else weight.contiguous(),
            y,
            rows,
            float(eps),
            D=d,
            BLOCK_D=triton.next_power_of_2(d),
            ROWS=_ROWS,
            HAS_W=weight is not None,
            DT=_TL[x.dtype],
            enable_fp_fusion=False,
        )
    return y


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    return _rms_norm(x, weight, eps)


# ------------------------------------------------------------------ RoPE
@triton.jit(do_not_specialize=["n_rows"])
def _rope_kernel(
    x_ptr,
    cos_ptr,
    sin_ptr,
    n_rows,
    per_t,
    D: tl.constexpr,
    R2: tl.constexpr,
    BLOCK_R: tl.constexpr,
    ROWS: tl.constexpr,
    DT: tl.constexpr,
):
    r = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    i = tl.arange(0, BLOCK_R)
    m = (r[:, None] < n_rows) & (i[None, :] < R2)
    t = (r // per_t).to(tl.int64)
    at = r.to(tl.int64)[:, None] * D + (D - 2 * R2) + 2 * i[None, :]
    a = tl.load(x_ptr + at, mask=m, other=0.0).to(tl.float32)
    b = tl.load(x_ptr + at + 1, mask=m, other=0.0).to(tl.float32)
    c = tl.load(cos_ptr + t[:, None] * R2 + i[None, :], mask=m, other=0.0)
    s = tl.load(sin_ptr + t[:, None] * R2 + i[None, :], mask=m, other=0.0)
    tl.store(x_ptr + at, _round_to(a * c - b * s, DT).to(DT), mask=m)
    tl.store(x_ptr + at + 1, _round_to(a * s + b * c, DT).to(DT), mask=m)


def rope_inplace(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """layers.rope.rotate(x, cos, sin, inplace=True) in one launch; returns x."""
    if not _runs_kernel(x):
        return rotate(x, cos, sin, inplace=True)
    t, d, r2 = x.shape[0], x.shape[-1], cos.shape[-1]
    if tuple(cos.shape) != (t, r2) or tuple(sin.shape) != (t, r2) or 2 * r2 > d:
        raise ValueError(f"cos, sin: expected [{t}, R/2] with R <= {d}, got {tuple(cos.shape)}, {tuple(sin.shape)}")
    if not x.is_contiguous():
        raise ValueError("x: rope_inplace writes x itself, so it must be contiguous")
    rows = x.numel() // d if d else 0
    if rows and r2:
        _rope_kernel[(triton.cdiv(rows, _ROWS),)](
            x,
            cos.float().contiguous(),
            sin.float().contiguous(),
            rows,
            rows // t,
            D=d,
            R2=r2,
            BLOCK_R=triton.next_power_of_2(r2),
            ROWS=_ROWS,
            DT=_TL[x.dtype],
            enable_fp_fusion=False,
        )
    return x


def rope_inplace_ref(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    return rotate(x, cos, sin, inplace=True)


# ------------------------------------------------------------------ FP4 / FP8 fake-quant (power-of-two scales)
@triton.jit
def _fq_pow2_kernel(x_ptr, y_ptr, n_groups, G: tl.constexpr, ROWS: tl.constexpr, DT: tl.constexpr, FP8: tl.constexpr):
    g = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    j = tl.arange(0, G)
    m = (g[:, None] < n_groups) & (j[None, :] < G)
    at = g.to(tl.int64)[:, None] * G + j[None, :]
    x = tl.load(x_ptr + at, mask=m, other=0.0).to(tl.float32)
    amax = tl.max(tl.abs(x), axis=1)[:, None]
    if FP8:  # s = 2^ceil(log2(max(amax, 1e-4) / 448)), e4m3 of the clamped x / s
        ex = _pow2_ceil_exp(tl.math.div_rn(tl.maximum(amax, 1e-4), 448.0))
    else:  # s = 2^ceil(log2(max(amax, 6 * 2^-126) / 6)), e2m1 of x / s
        ex = _pow2_ceil_exp(tl.math.div_rn(tl.maximum(amax, 6.0 * 2.0**-126), 6.0))
    s = (ex << 23).to(tl.float32, bitcast=True)
    inv = tl.where(ex == 254, 1 << 22, (254 - ex) << 23).to(tl.float32, bitcast=True)  # 1 / s exactly
    if FP8:
        v, _ = _e4m3(tl.minimum(tl.maximum(x * inv, -448.0), 448.0))
    else:
        v, _ = _e2m1(x * inv)
    tl.store(y_ptr + at, _round_to(v * s, DT).to(DT), mask=m)


def _fake_quant_pow2(x: torch.Tensor, group: int, fp8: bool) -> torch.Tensor:
    if not _runs_kernel(x):
        return (quant.fake_quant_fp8_pow2 if fp8 else quant.fake_quant_fp4_pow2)(x, group)
    if group < 2 or group & (group - 1) or x.shape[-1] % group:
        raise ValueError(f"group {group}: expected a power of two >= 2 dividing the last dim {x.shape[-1]}")
    x = x.contiguous()
    y = torch.empty_like(x)
    n = x.numel() // group
    if n:
        _fq_pow2_kernel[(triton.cdiv(n, _ROWS),)](
            x, y, n, G=group, ROWS=_ROWS, DT=_TL[x.dtype], FP8=fp8, enable_fp_fusion=False
        )
    return y


def fake_quant_fp4_pow2(x: torch.Tensor, group: int = 32) -> torch.Tensor:
    """quant.fake_quant_fp4_pow2 in one launch (the indexer's q and keys)."""
    return _fake_quant_pow2(x, group, False)


def fake_quant_fp8_pow2(x: torch.Tensor, group: int = 32) -> torch.Tensor:
    """quant.fake_quant_fp8_pow2 in one launch (V4's window and main rows under QAT)."""
    return _fake_quant_pow2(x, group, True)


def fake_quant_fp4_pow2_ref(x: torch.Tensor, group: int = 32) -> torch.Tensor:
    return quant.fake_quant_fp4_pow2(x, group)


def fake_quant_fp8_pow2_ref(x: torch.Tensor, group: int = 32) -> torch.Tensor:
    return quant.fake_quant_fp8_pow2(x, group)
