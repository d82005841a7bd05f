"""A mixing site's sublayer input alone: h = RMSNorm(collapse(x, pre_in)), without the site's mixes.

* x [T, n, d] fp32 / bf16 / fp16, pre_in [T, n] (any float, read as fp32), norm_w [d] -> h [T, d] in x's dtype,
  exactly as ``mhc_site`` computes its h: the collapse sum_k pre_in[k] x[k] in fp32 (k in order), rounded to x's
  dtype, its mean square in fp32, then coll * (1 / sqrt(ms + eps)) * w rounded to x's dtype (only the order of the
  mean square's sum differs from ``mhc_site``'s d-split partials).

Why apart from ``mhc_site``: the sublayer needs only h; the site's mixes (projection, Sinkhorn) are first read by the
expand after the sublayer. For a few rows (decode) the block computes h here on the main stream and the whole site
on a side stream (``layers.side_stream``), so the mixes overlap the attention or the MoE instead of preceding it.
One program per row holds the whole row (d <= MAX_D).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..layers.mhc import collapse
from ..layers.norm import rms_norm
from .kv_write import _round_to
from .launch import launch
from .mhc import _TL

MAX_D = 16384  # a row in registers: 64 fp32 a thread at 8 warps


def _check(x, pre_in, norm_w, kernel: bool):
    if x.dim() != 3 or not x.is_floating_point():
        raise ValueError(f"mhc_collapse_norm: x must be a float [T, n, d] tensor, got {x.dtype} {tuple(x.shape)}")
    t, n, d = x.shape
    for name, ten, shape in (("pre_in", pre_in, (t, n)), ("norm_w", norm_w, (d,))):
        if tuple(ten.shape) != shape or not ten.is_floating_point() or ten.device != x.device:
            raise ValueError(
                f"mhc_collapse_norm: {name} must be a float {list(shape)} tensor on {x.device}, got "
                f"{ten.dtype} {tuple(ten.shape)} on {ten.device}"
            )
    if kernel and (x.dtype not in _TL or d > MAX_D):
        raise ValueError(
            f"mhc_collapse_norm: the kernel needs fp32/bf16/fp16 x and d <= {MAX_D}, got {x.dtype}, "
            f"d = {d} (mhc_collapse_norm_ref takes any)"
        )


def mhc_collapse_norm_ref(x, pre_in, norm_w, norm_eps):
    _check(x, pre_in, norm_w, False)
    return rms_norm(collapse(x, pre_in), norm_w, norm_eps)


@triton.jit
def _collapse_norm_kernel(
    x_ptr, pre_ptr, w_ptr, h_ptr, D, eps, N: tl.constexpr, BLOCK_D: tl.constexpr, DT: tl.constexpr
):
    t = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_D)
    m = cols < D
    coll = tl.zeros([BLOCK_D], tl.float32)
    for k in tl.static_range(N):
        xk = tl.load(x_ptr + t * (N * D) + k * D + cols, mask=m, other=0.0).to(tl.float32)
        coll += tl.load(pre_ptr + t * N + k) * xk
    coll = _round_to(coll, DT)
    inv = 1.0 / tl.sqrt(tl.sum(coll * coll, axis=0) / D + eps)
    w = tl.load(w_ptr + cols, mask=m, other=0.0).to(tl.float32)
    tl.store(h_ptr + t * D + cols, _round_to(coll * inv * w, DT).to(h_ptr.dtype.element_ty), mask=m)


def mhc_collapse_norm(x, pre_in, norm_w, norm_eps):
    _check(x, pre_in, norm_w, True)
    t, n, d = x.shape
    h = torch.empty(t, d, dtype=x.dtype, device=x.device)
    if t:
        block = triton.next_power_of_2(d)
        launch(
            _collapse_norm_kernel,
            (t,),
            x.device,
            x.contiguous(),
            pre_in.float().contiguous(),
            norm_w.contiguous(),
            h,
            d,
            float(norm_eps),
            N=n,
            BLOCK_D=block,
            DT=_TL[x.dtype],
            num_warps=max(1, min(8, block // 512)),
        )
    return h
