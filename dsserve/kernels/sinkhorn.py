"""mHC's Sinkhorn normalisation with its backward, one launch each, for training (issue 10).

* sinkhorn_trainable(c [T, n, n] fp32, iters, eps) -> [T, n, n]: layers.mhc.sinkhorn (columns first, then
  ``iters - 1`` rounds of rows-then-columns), differentiable. n a power of two (mHC's 4).

Why: under autograd torch takes ~120 ops forward and ~250 backward per site (2 x iters normalisations of a 4 x 4
matrix a row, each recorded and replayed), a third of a tiny-model training step's ops; training on a GPU is bound by
launching them, not by the work. The forward kernel stores each normalisation's denominators (2 x iters - 1 vectors
of n a row); the backward walks them in reverse: for y = x / d with d = sum(x) + eps over the normalised axis,
dx = (dy - sum(dy * y)) / d, and x = y * d recovers the step's input (up to one rounding a step) without storing it.
The reference is layers.mhc.sinkhorn under torch autograd (the tests compare both directions).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..layers.mhc import sinkhorn as sinkhorn_ref

_ROWS = 32  # rows a program takes


@triton.jit
def _fwd(c_ptr, out_ptr, den_ptr, T, eps, N: tl.constexpr, ITERS: tl.constexpr, BLOCK_R: tl.constexpr):
    rows, kk = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R), tl.arange(0, N)
    rmask, r64 = rows < T, rows.to(tl.int64)
    at = r64[:, None, None] * (N * N) + kk[None, :, None] * N + kk[None, None, :]
    c = tl.load(c_ptr + at, mask=rmask[:, None, None], other=1.0)
    dp = den_ptr + r64[:, None] * N + kk[None, :]  # den [2 ITERS - 1, T, N]
    s = tl.sum(c, axis=1, keep_dims=True) + eps  # columns first (sum over the input copy j)
    tl.store(dp, tl.reshape(s, (BLOCK_R, N)), mask=rmask[:, None])
    c = c / s
    for it in tl.static_range(ITERS - 1):
        s = tl.sum(c, axis=2, keep_dims=True) + eps
        tl.store(dp + (2 * it + 1) * T * N, tl.reshape(s, (BLOCK_R, N)), mask=rmask[:, None])
        c = c / s
        s = tl.sum(c, axis=1, keep_dims=True) + eps
        tl.store(dp + (2 * it + 2) * T * N, tl.reshape(s, (BLOCK_R, N)), mask=rmask[:, None])
        c = c / s
    tl.store(out_ptr + at, c, mask=rmask[:, None, None])


@triton.jit
def _bwd(g_ptr, out_ptr, den_ptr, gin_ptr, T, N: tl.constexpr, ITERS: tl.constexpr, BLOCK_R: tl.constexpr):
    rows, kk = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R), tl.arange(0, N)
    rmask, r64 = rows < T, rows.to(tl.int64)
    at = r64[:, None, None] * (N * N) + kk[None, :, None] * N + kk[None, None, :]
    g = tl.load(g_ptr + at, mask=rmask[:, None, None], other=0.0)
    y = tl.load(out_ptr + at, mask=rmask[:, None, None], other=0.0)
    dp = den_ptr + r64[:, None] * N + kk[None, :]
    for back in tl.static_range(2 * ITERS - 1):
        step = 2 * ITERS - 2 - back  # normalisations in reverse; even: over columns (axis 1), odd: over rows
        d = tl.load(dp + step * T * N, mask=rmask[:, None], other=1.0)
        # each branch its own names: the compiler (unlike the interpreter) refuses a variable whose shape a branch
        # changes
        if step % 2 == 0:
            d_col = tl.reshape(d, (BLOCK_R, 1, N))
            g = (g - tl.sum(g * y, axis=1, keep_dims=True)) / d_col
            y = y * d_col
        else:
            d_row = tl.reshape(d, (BLOCK_R, N, 1))
            g = (g - tl.sum(g * y, axis=2, keep_dims=True)) / d_row
            y = y * d_row
    tl.store(gin_ptr + at, g, mask=rmask[:, None, None])


class _Sinkhorn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, c: torch.Tensor, iters: int, eps: float):
        t, n = c.shape[0], c.shape[1]
        c = c.contiguous()
        out = torch.empty_like(c)
        den = torch.empty(2 * iters - 1, t, n, dtype=c.dtype, device=c.device)
        if t:
            _fwd[(triton.cdiv(t, _ROWS),)](c, out, den, t, eps, N=n, ITERS=iters, BLOCK_R=_ROWS)
        ctx.save_for_backward(out, den)
        ctx.iters = iters
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        out, den = ctx.saved_tensors
        t, n = out.shape[0], out.shape[1]
        gin = torch.empty_like(out)
        if t:
            _bwd[(triton.cdiv(t, _ROWS),)](grad.contiguous(), out, den, gin, t, N=n, ITERS=ctx.iters, BLOCK_R=_ROWS)
        return gin, None, None


def sinkhorn_trainable(c: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    """layers.mhc.sinkhorn with a fused forward and backward (fp32 [T, n, n], n a power of two); the reference for
    any other input."""
    n = c.shape[-1]
    if c.dtype != torch.float32 or c.dim() != 3 or c.shape[1] != n or n & (n - 1) or iters < 1:
        return sinkhorn_ref(c, iters, eps)
    return _Sinkhorn.apply(c, iters, eps)
