"""Engram's gated mix (the tail of ``Engram.forward`` after ``kv = self.wkv(e)``) in one launch, where torch takes
~29 per layer (a decode step's CUDA graph pays ~2-3 us of device time for each).

* x: the mHC stream [T, n, d], bf16 / fp16 / fp32 (fp64 runs the reference), last dim contiguous.
* kv: [T, (n + 1) * d] of x's dtype, last dim contiguous: n keys [n, d] then the shared value [d].
* q_weight, k_weight: [n, d], any float dtype (read as fp32). ids: [T] int64 / int32 compressed ids, DEAD = -1.
-> [T, n, d] of x's dtype, contiguous. All math fp32, per (t, copy i):
   dot = sum_d(x * qw * kw * key) * rsqrt(mean_d(x^2) + eps) * rsqrt(mean_d(key^2) + eps) / sqrt(d),
   gate = sigmoid(sign(dot) * sqrt(max(|dot|, 1e-6))), 0 where ids[t] is DEAD; out = x + gate * value.

One program per (t, copy): pass 1 reduces the three sums over d in constexpr chunks, pass 2 writes x + gate * value
(x and value re-read from L1/L2). bf16 / fp16 results are rounded like torch's casts (RNE on the bits for bf16: the
interpreter's own cast truncates). A dead row's gate is exactly 0, so its output is exactly x (finite values).
The call allocates only its output and never synchronises with the host: it can be captured in a CUDA graph.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from ..layers.engram_hash import DEAD, EngramHasher
from ..layers.numerics import acc
from .kv_write import _round_to
from .launch import launch

KERNEL_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_TL = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}
_MAX_BLOCK_D = 1024  # d per chunk: 4 warps x 8 values (16-byte bf16 loads); d = 4096 takes 4 chunks


def _check(x, kv, q_weight, k_weight, ids) -> tuple[int, int, int]:
    if x.dim() != 3:
        raise ValueError(f"x must be [T, n, d], got {tuple(x.shape)}")
    t, n, d = x.shape
    if kv.shape != (t, (n + 1) * d) or kv.dtype != x.dtype:
        raise ValueError(
            f"kv must be {x.dtype} [T, (n + 1) * d] = [{t}, {(n + 1) * d}], got {kv.dtype} {tuple(kv.shape)}"
        )
    for name, w in (("q_weight", q_weight), ("k_weight", k_weight)):
        if w.shape != (n, d) or not w.is_floating_point():
            raise ValueError(f"{name} must be a float [n, d] = [{n}, {d}], got {w.dtype} {tuple(w.shape)}")
    if ids.shape != (t,) or ids.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"ids must be int64 / int32 [T] = [{t}], got {ids.dtype} {tuple(ids.shape)}")
    return t, n, d


def engram_mix_ref(
    x: torch.Tensor, kv: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor, ids: torch.Tensor, eps: float
) -> torch.Tensor:
    """The torch lines of Engram.forward (any device, fp64 kept fp64): the fallback and the kernel's oracle."""
    t, n, d = _check(x, kv, q_weight, k_weight, ids)
    key, value = acc(kv[:, : n * d].view(t, n, d)), acc(kv[:, n * d :])
    xf = acc(x)
    dot = (xf * q_weight.to(xf.dtype) * k_weight.to(xf.dtype) * key).sum(-1)
    dot = dot * torch.rsqrt(xf.pow(2).mean(-1) + eps) * torch.rsqrt(key.pow(2).mean(-1) + eps) / d**0.5
    gate = torch.sigmoid(torch.sign(dot) * torch.sqrt(dot.abs().clamp_min(1e-6)))
    gate = gate.masked_fill(EngramHasher.is_dead(ids)[:, None], 0.0)
    return (xf + gate[:, :, None] * value[:, None, :]).to(x.dtype)


@triton.jit
def _engram_mix_kernel(
    x_ptr,
    kv_ptr,
    qw_ptr,
    kw_ptr,
    ids_ptr,
    out_ptr,
    sx_t,
    sx_n,
    skv_t,
    eps,
    sqrt_d,
    N: tl.constexpr,
    D: tl.constexpr,
    BLOCK_D: tl.constexpr,
    CHUNKS: tl.constexpr,
    DEAD_ID: tl.constexpr,
    DT: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    i = tl.program_id(1)
    c = tl.arange(0, BLOCK_D)
    x_row = x_ptr + t * sx_t + i * sx_n
    k_row = kv_ptr + t * skv_t + i * D
    v_row = kv_ptr + t * skv_t + N * D
    dot = tl.zeros([BLOCK_D], dtype=tl.float32)
    ssx = tl.zeros([BLOCK_D], dtype=tl.float32)
    ssk = tl.zeros([BLOCK_D], dtype=tl.float32)
    for j in tl.static_range(CHUNKS):
        cc = j * BLOCK_D + c
        m = cc < D
        xv = tl.load(x_row + cc, mask=m, other=0.0).to(tl.float32)
        kv = tl.load(k_row + cc, mask=m, other=0.0).to(tl.float32)
        qw = tl.load(qw_ptr + i * D + cc, mask=m, other=0.0).to(tl.float32)
        kw = tl.load(kw_ptr + i * D + cc, mask=m, other=0.0).to(tl.float32)
        dot += xv * qw * kw * kv
        ssx += xv * xv
        ssk += kv * kv
    s = tl.sum(dot, axis=0)
    # IEEE sqrt and division (tl.sqrt and / are approximate on the GPU): per-row scalars, free
    rx = tl.math.div_rn(1.0, tl.math.sqrt_rn(tl.math.div_rn(tl.sum(ssx, axis=0), D * 1.0) + eps))
    rk = tl.math.div_rn(1.0, tl.math.sqrt_rn(tl.math.div_rn(tl.sum(ssk, axis=0), D * 1.0) + eps))
    s = tl.math.div_rn(s * rx * rk, sqrt_d)
    sgn = tl.where(s > 0, 1.0, tl.where(s < 0, -1.0, 0.0))
    z = sgn * tl.math.sqrt_rn(tl.maximum(tl.abs(s), 1e-6))
    gate = tl.math.div_rn(1.0, 1.0 + tl.exp(-z))
    gate = tl.where(tl.load(ids_ptr + t) == DEAD_ID, 0.0, gate)
    o_row = out_ptr + (t * N + i) * D
    for j in tl.static_range(CHUNKS):
        cc = j * BLOCK_D + c
        m = cc < D
        xv = tl.load(x_row + cc, mask=m, other=0.0).to(tl.float32)
        vv = tl.load(v_row + cc, mask=m, other=0.0).to(tl.float32)
        tl.store(o_row + cc, _round_to(xv + gate * vv, DT).to(DT), mask=m)


def engram_mix(
    x: torch.Tensor, kv: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor, ids: torch.Tensor, eps: float
) -> torch.Tensor:
    """engram_mix_ref in one launch (see the module docstring); fp64 x runs the reference."""
    t, n, d = _check(x, kv, q_weight, k_weight, ids)
    if x.dtype == torch.float64:
        return engram_mix_ref(x, kv, q_weight, k_weight, ids, eps)
    if x.dtype not in KERNEL_DTYPES:
        raise ValueError(f"x: the kernel takes {KERNEL_DTYPES} (fp64 runs the reference), got {x.dtype}")
    if x.device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(f"x must be on a CUDA device (or TRITON_INTERPRET=1), got {x.device}")
    for name, u in (("kv", kv), ("q_weight", q_weight), ("k_weight", k_weight), ("ids", ids)):
        if u.device != x.device:
            raise ValueError(f"{name} must be on x's device {x.device}, got {u.device}")
    # the model's tensors already have these layouts: no copies there
    x = x if x.stride(2) == 1 else x.contiguous()
    kv = kv if kv.stride(1) == 1 else kv.contiguous()
    q_weight, k_weight, ids = q_weight.contiguous(), k_weight.contiguous(), ids.contiguous()
    out = torch.empty(t, n, d, dtype=x.dtype, device=x.device)
    if out.numel() == 0:
        return out
    block_d = min(triton.next_power_of_2(d), _MAX_BLOCK_D)
    args = (x, kv, q_weight, k_weight, ids, out, x.stride(0), x.stride(1), kv.stride(0), float(eps), d**0.5)
    meta = dict(
        N=n,
        D=d,
        BLOCK_D=block_d,
        CHUNKS=triton.cdiv(d, block_d),
        DEAD_ID=DEAD,
        DT=_TL[x.dtype],
        num_warps=4,
        enable_fp_fusion=False,
    )  # x + gate * value rounded as torch does
    launch(_engram_mix_kernel, (t, n), x.device, *args, **meta)
    return out
