"""The clamped SwiGLU of an expert whose w1 and w3 are one fused product, in one launch (torch takes 4).

* h: [T, 2I] bfloat16 / float16 / float32, the gate in columns [0, I) and the up projection in [I, 2I); rows may
  be strided (h.stride(0) >= 2I), columns contiguous.
-> [T, I] of h's dtype, contiguous: ``clamped_swiglu(*h.chunk(2, -1), limit)`` (layers/moe.py), i.e.
   silu(min(gate, limit)) * clamp(up, -limit, limit), with torch's roundings: the limit rounded to h's dtype
   (torch's clamp casts its scalar bounds to the tensor's dtype), silu as x / (1 + exp(-x)) in fp32 rounded to
   h's dtype, then the product of the two h-dtype values in fp32 rounded to h's dtype. NaN propagates like clamp.

On the GPU exp is libdevice's expf and the division IEEE (div_rn): the ops torch's CUDA silu kernel calls, so the
result should equal torch's bitwise. The CPU interpreter uses numpy's exp, which differs from torch's CPU silu in
the last fp32 bit for a few percent of inputs (bf16 / fp16 results then differ by one ulp very rarely).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from .kv_write import _round_to
from .launch import launch

DTYPES = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}
_MAX_BLOCK = 256  # columns a program covers: I = 2304 (the release) is 9 whole blocks
_MAX_ROWS = 8  # rows a program covers for large T: 2048 values, 16 per thread at 4 warps (two 16-byte bf16 loads)


def _check(h: torch.Tensor, limit: float) -> None:
    if h.dtype not in DTYPES:
        raise ValueError(f"h must be one of {tuple(DTYPES)}, got {h.dtype}")
    if h.dim() != 2 or h.shape[1] % 2 or h.shape[1] == 0:
        raise ValueError(f"h must be [T, 2I] with an even last dim >= 2, got {tuple(h.shape)}")
    if h.stride(1) != 1 and h.shape[0] > 0:
        raise ValueError(f"h's columns must be contiguous (stride 1), got strides {h.stride()}")
    if not isinstance(limit, (int, float)) or not limit > 0:
        raise ValueError(f"limit must be a positive number, got {limit!r}")


def swiglu_ref(h: torch.Tensor, limit: float) -> torch.Tensor:
    """Torch on any device: the engine's composition (4 launches). The fallback and the kernel's oracle."""
    from ..layers.moe import clamped_swiglu

    _check(h, limit)
    return clamped_swiglu(*h.chunk(2, dim=-1), limit)


@triton.jit(do_not_specialize=["t"])  # the row count: only a row mask
def _swiglu_kernel(
    h_ptr,
    out_ptr,
    t,
    stride,
    limit,
    I: tl.constexpr,
    DT: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK: tl.constexpr,
    CUDA: tl.constexpr,
):
    r = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = (r[:, None] < t) & (c[None, :] < I)
    at = h_ptr + r.to(tl.int64)[:, None] * stride + c[None, :]
    # clamping the exact fp32 images of h-dtype values by an h-dtype limit is the clamp in h's dtype
    # (propagating NaN as torch's clamp does; min/max would drop it)
    g = tl.minimum(tl.load(at, mask=m, other=0.0).to(tl.float32), limit, propagate_nan=tl.PropagateNan.ALL)
    u = tl.load(at + I, mask=m, other=0.0).to(tl.float32)
    u = tl.maximum(u, -limit, propagate_nan=tl.PropagateNan.ALL)
    u = tl.minimum(u, limit, propagate_nan=tl.PropagateNan.ALL)
    if CUDA:
        e = libdevice.exp(-g)  # expf, as torch's silu_kernel; tl.exp is the approximate ex2 form
    else:
        e = tl.exp(-g)  # libdevice is missing from the interpreter
    s = _round_to(tl.math.div_rn(g, 1.0 + e), DT)  # torch rounds silu's result to h's dtype
    tl.store(out_ptr + r.to(tl.int64)[:, None] * I + c[None, :], _round_to(s * u, DT).to(DT), mask=m)


def _tiles(t: int, inter: int) -> tuple[int, int, int]:
    """(rows, columns, warps) per program: small T (decode) one row per program for more programs in flight."""
    block = min(triton.next_power_of_2(inter), _MAX_BLOCK)
    rows = min(_MAX_ROWS, triton.next_power_of_2(triton.cdiv(t, 64)))
    return rows, block, min(4, max(1, rows * block // 256))


def swiglu(h: torch.Tensor, limit: float) -> torch.Tensor:
    """[T, I] = clamped_swiglu(*h.chunk(2, -1), limit) in one launch (see the module docstring); allocates only
    its output, no host sync (graph-capturable). fp64 (the tests' models) runs the reference."""
    if h.dtype == torch.float64:
        return swiglu_ref(h, limit)
    _check(h, limit)
    if not h.is_cuda and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(f"h must be on a CUDA device (or TRITON_INTERPRET=1), got {h.device}")
    t, inter = h.shape[0], h.shape[1] // 2
    out = torch.empty(t, inter, dtype=h.dtype, device=h.device)
    if t == 0:
        return out
    lim = float(torch.tensor(float(limit), dtype=torch.float32).to(h.dtype))  # torch's clamp bound
    rows, block, warps = _tiles(t, inter)
    grid = (triton.cdiv(t, rows), triton.cdiv(inter, block))
    meta = dict(I=inter, DT=DTYPES[h.dtype], ROWS=rows, BLOCK=block, CUDA=h.is_cuda, num_warps=warps)
    launch(_swiglu_kernel, grid, h.device, h, out, t, h.stride(0), lim, **meta)
    return out
