"""mHC: manifold-constrained hyper-connections over ``hc_mult`` residual copies (spec 2.2).

A mixing site owns ``fn`` [(2+n)n, n*d], ``base`` [(2+n)n] and ``scale`` [3]. From the stream it yields
``pre`` (collapse weights), ``post`` (expand weights) and ``comb`` (an n x n matrix made nearly doubly
stochastic by Sinkhorn). Everything is computed in fp32.
"""

from __future__ import annotations

import torch

from .numerics import acc


def sinkhorn(c: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    """Columns first, then ``iters - 1`` rounds of rows-then-columns. c: [..., n, n] (j = input copy, k = output).
    eps is added as a 0-d tensor of c's dtype, the value a Python float would be cast to: a float is wrapped and cast
    on every add, a copy op beside each of the 2 x iters adds, most of a few rows' cost on the CPU. Without autograd
    the rounds run in place on this function's own tensor: the same values."""
    e = c.new_full((), eps)
    c = c / (c.sum(-2, keepdim=True) + e)
    if c.requires_grad and torch.is_grad_enabled():
        for _ in range(iters - 1):
            c = c / (c.sum(-1, keepdim=True) + e)
            c = c / (c.sum(-2, keepdim=True) + e)
        return c
    for _ in range(iters - 1):
        c.div_(c.sum(-1, keepdim=True).add_(e))
        c.div_(c.sum(-2, keepdim=True).add_(e))
    return c


def hc_mix(
    x: torch.Tensor,
    fn: torch.Tensor,
    base: torch.Tensor,
    scale: torch.Tensor,
    rms_eps: float,
    hc_eps: float,
    sinkhorn_iters: int,
    sinkhorn_fn=None,
):
    """x: [T, n, d] -> pre [T, n], post [T, n], comb [T, n, n]. ``sinkhorn_fn``: another implementation of
    ``sinkhorn`` (training's fused kernel)."""
    n = x.shape[1]
    flat = acc(x.flatten(1))
    m = (flat @ fn.to(flat.dtype).t()) * torch.rsqrt(flat.pow(2).mean(-1, keepdim=True) + rms_eps)
    base, scale = base.to(flat.dtype), scale.to(flat.dtype)
    pre = torch.sigmoid(m[:, :n] * scale[0] + base[:n]) + hc_eps
    post = 2 * torch.sigmoid(m[:, n : 2 * n] * scale[1] + base[n : 2 * n])
    logits = (m[:, 2 * n :] * scale[2] + base[2 * n :]).view(-1, n, n)
    comb = torch.softmax(logits, dim=-1) + hc_eps
    return pre, post, (sinkhorn_fn or sinkhorn)(comb, sinkhorn_iters, hc_eps)


def hc_head_pre(
    x: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, rms_eps: float, hc_eps: float
) -> torch.Tensor:
    """V4's final collapse weights: sigmoid(mix * s + b) + eps from its own ``hc_head`` parameters."""
    flat = acc(x.flatten(1))
    m = (flat @ fn.to(flat.dtype).t()) * torch.rsqrt(flat.pow(2).mean(-1, keepdim=True) + rms_eps)
    return torch.sigmoid(m * scale.to(m.dtype)[0] + base.to(m.dtype)) + hc_eps


def collapse(x: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
    """sum_k pre_k x[k]: [T, n, d] -> [T, d]."""
    xf = acc(x)
    return torch.einsum("tn,tnd->td", pre.to(xf.dtype), xf).to(x.dtype)


def expand(y: torch.Tensor, x: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """out[k] = post_k y + sum_j comb[j, k] x[j]."""
    xf = acc(x)
    out = post.to(xf.dtype)[:, :, None] * acc(y)[:, None, :] + torch.einsum("tjk,tjd->tkd", comb.to(xf.dtype), xf)
    return out.to(x.dtype)
