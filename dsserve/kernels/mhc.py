"""Fused mHC for the V4.1 single-pass schedule (spec 2.2): one read of the stream X yields a site's mixes and the
next sublayer's normalised input; and the expand that writes the new stream.

* x [T, n, d] fp32/bf16/fp16 (the refs also take fp64), n = hc_mult a power of two; fn [(2+n)n, n*d], base
  [(2+n)n], scale [3], pre_in [T, n], norm_w [d]: any float, read as fp32. Last dims contiguous (else copied).
* mhc_site(x, fn, base, scale, pre_in, norm_w, norm_eps, rms_eps, hc_eps, sinkhorn_iters) -> (h [T, d] x.dtype,
  pre [T, n], post [T, n], comb [T, n, n] fp32): h = rms_norm(collapse(x, pre_in)), the rest hc_mix(x, ...),
  i.e. what Block.forward computes before a sublayer (the _ref calls exactly those functions).
* mhc_expand(y [T, d], x, post, comb) -> x_new [T, n, d] x.dtype, x_new[k] = post_k y + sum_j comb[j, k] x[j].

mhc_site is two launches. (1) grid (row blocks, d splits): a program streams BLOCK_T rows x its d range of all n
copies once, accumulating the projection by tl.dot (fn rows padded to 32), the sum of squares, and the collapse
sum_k pre_in[k] x[k], which is rounded to x.dtype (as the reference's is) and written un-normalised into h, with its
sum of squares; per-split partials go to fp32 scratch. (2) grid (row blocks, d chunks): sums the partials (one
vector load, deterministic, no atomics), rescales h in place; chunk-0 programs finish the mixes (sigmoid, softmax,
Sinkhorn on [rows, n, n] register tiles). Not kept in registers: a full fp32 row (d = 5120) allows 1-2 rows a
program, below tl.dot's 16, so fn (2 MB) would be re-read per row, and without a d split decode would run 1-4
programs on 132 SMs; the price is re-reading and rewriting h (4d bytes on top of 10d per bf16 row). mhc_expand
is not fused into the next site (that would save a read of x). Dots use "tf32x3" (~fp32 accuracy on tensor cores;
the interpreter computes fp32); from BF16X3_MIN_ROWS bf16 rows, bf16 x against fn's three bf16 parts instead
(compiled for sm_90: 96 registers and 976 instructions vs 143 and 1680, a third of the shared-memory traffic;
0.50 vs 0.90 ms for 8192 rows on the H200).
bf16 results are rounded on their bits (RNE): the interpreter's bf16 cast truncates.
"""

from __future__ import annotations

import os
import weakref

import torch
import triton
import triton.language as tl

from dsserve.layers.mhc import collapse, expand, hc_mix
from dsserve.layers.norm import rms_norm
from dsserve.layers.numerics import fp32_param

from .kv_write import _round_to  # fp32 -> nearest DT value, in fp32 (bf16 by its bits, NaN kept)

_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"  # read when the kernels are decorated, as Triton does
_TL = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}
_alloc = torch.empty  # a seam: tests poison every output and scratch buffer through it


@triton.jit(do_not_specialize=["T"])
def _site_partial(
    x_ptr,
    fn_ptr,
    pre_ptr,
    h_ptr,
    pm_ptr,
    ps_ptr,
    T,
    D,
    MIX,
    N: tl.constexpr,
    MIXP: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_D: tl.constexpr,
    D_ITERS: tl.constexpr,
    PREC: tl.constexpr,
    DT: tl.constexpr,
    UPCAST: tl.constexpr = False,
):
    # PREC "bf16x3": x is bf16 and fn_ptr holds fn's three bf16 parts [3, MIX, N * D] (_fn_parts); each x tile
    # enters three bf16 dots as it was loaded. Otherwise fn is fp32 and the dot runs at PREC on fp32 x.
    rows, mcol = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T), tl.arange(0, MIXP)
    rmask, r64 = rows < T, rows.to(tl.int64)
    acc = tl.zeros([BLOCK_T, MIXP], tl.float32)
    ssq, cssq = tl.zeros([BLOCK_T], tl.float32), tl.zeros([BLOCK_T], tl.float32)  # of x, of the collapse
    for it in range(D_ITERS):
        cols = (tl.program_id(1) * D_ITERS + it) * BLOCK_D + tl.arange(0, BLOCK_D)
        cmask, coll = cols < D, tl.zeros([BLOCK_T, BLOCK_D], tl.float32)
        m2 = rmask[:, None] & cmask[None, :]
        for k in tl.static_range(N):
            xr = tl.load(x_ptr + r64[:, None] * (N * D) + k * D + cols[None, :], mask=m2, other=0.0)
            xk = xr.to(tl.float32)
            fat = mcol[None, :] * (N * D) + k * D + cols[:, None]
            fm = cmask[:, None] & (mcol < MIX)[None, :]
            if PREC == "bf16x3":
                xd = xk if UPCAST else xr  # the interpreter's bf16 dot multiplies raw bits: fp32 of the same values
                for j in tl.static_range(3):
                    fk = tl.load(fn_ptr + j * (MIX * N * D) + fat, mask=fm, other=0.0)  # [BLOCK_D, MIXP]
                    acc = tl.dot(xd, fk.to(tl.float32) if UPCAST else fk, acc)
            else:
                fk = tl.load(fn_ptr + fat, mask=fm, other=0.0)  # [BLOCK_D, MIXP]
                acc = tl.dot(xk, fk, acc, input_precision=PREC)
            ssq += tl.sum(xk * xk, axis=1)
            coll += tl.load(pre_ptr + rows * N + k, mask=rmask, other=0.0)[:, None] * xk
        coll = _round_to(coll, DT)
        cssq += tl.sum(coll * coll, axis=1)
        tl.store(h_ptr + r64[:, None] * D + cols[None, :], coll.to(h_ptr.dtype.element_ty), mask=m2)
    part = tl.program_id(1) * T + r64
    tl.store(pm_ptr + part[:, None] * MIXP + mcol[None, :], acc, mask=rmask[:, None])
    tl.store(ps_ptr + part * 2, ssq, mask=rmask)
    tl.store(ps_ptr + part * 2 + 1, cssq, mask=rmask)


@triton.jit(do_not_specialize=["T"])
def _site_finish(
    h_ptr,
    w_ptr,
    pm_ptr,
    ps_ptr,
    base_ptr,
    scale_ptr,
    pre_ptr,
    post_ptr,
    comb_ptr,
    T,
    D,
    SPLIT,
    norm_eps,
    rms_eps,
    hc_eps,
    N: tl.constexpr,
    MIXP: tl.constexpr,
    SPLIT_P: tl.constexpr,
    ITERS: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_H: tl.constexpr,
    DT: tl.constexpr,
):
    rows, sp = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R), tl.arange(0, SPLIT_P)
    rmask, r64 = rows < T, rows.to(tl.int64)
    part = sp[None, :] * T + r64[:, None]  # [BLOCK_R, SPLIT_P]: one load and a tl.sum per statistic, no loop
    pmask = rmask[:, None] & (sp < SPLIT)[None, :]
    cssq = tl.sum(tl.load(ps_ptr + part * 2 + 1, mask=pmask, other=0.0), axis=1)
    inv = 1.0 / tl.sqrt(cssq / D + norm_eps)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    m2 = rmask[:, None] & (cols < D)[None, :]
    hp = h_ptr + r64[:, None] * D + cols[None, :]
    w = tl.load(w_ptr + cols, mask=cols < D, other=0.0).to(tl.float32)
    h = tl.load(hp, mask=m2, other=0.0).to(tl.float32) * inv[:, None] * w[None, :]
    tl.store(hp, _round_to(h, DT).to(h_ptr.dtype.element_ty), mask=m2)
    if tl.program_id(1) == 0:
        kk, p = tl.arange(0, N), pm_ptr + part * MIXP
        ssq = tl.sum(tl.load(ps_ptr + part * 2, mask=pmask, other=0.0), axis=1)
        m_pre = tl.sum(tl.load(p[:, :, None] + kk[None, None, :], mask=pmask[:, :, None], other=0.0), axis=1)
        m_post = tl.sum(tl.load(p[:, :, None] + N + kk[None, None, :], mask=pmask[:, :, None], other=0.0), axis=1)
        m_comb = tl.sum(
            tl.load(
                p[:, :, None, None] + 2 * N + kk[None, None, :, None] * N + kk[None, None, None, :],
                mask=pmask[:, :, None, None],
                other=0.0,
            ),
            axis=1,
        )
        r = 1.0 / tl.sqrt(ssq / (N * D) + rms_eps)
        pre = tl.sigmoid(m_pre * r[:, None] * tl.load(scale_ptr) + tl.load(base_ptr + kk)[None, :]) + hc_eps
        post = 2.0 * tl.sigmoid(m_post * r[:, None] * tl.load(scale_ptr + 1) + tl.load(base_ptr + N + kk)[None, :])
        logit = (
            m_comb * r[:, None, None] * tl.load(scale_ptr + 2)
            + tl.load(base_ptr + 2 * N + kk[:, None] * N + kk[None, :])[None, :, :]
        )
        e = tl.exp(logit - tl.max(logit, axis=2, keep_dims=True))
        c = e / tl.sum(e, axis=2, keep_dims=True) + hc_eps
        c = c / (tl.sum(c, axis=1, keep_dims=True) + hc_eps)  # columns first (sum over the input copy j)
        for _ in range(ITERS - 1):
            c = c / (tl.sum(c, axis=2, keep_dims=True) + hc_eps)
            c = c / (tl.sum(c, axis=1, keep_dims=True) + hc_eps)
        tl.store(pre_ptr + r64[:, None] * N + kk[None, :], pre, mask=rmask[:, None])
        tl.store(post_ptr + r64[:, None] * N + kk[None, :], post, mask=rmask[:, None])
        tl.store(
            comb_ptr + r64[:, None, None] * (N * N) + kk[None, :, None] * N + kk[None, None, :],
            c,
            mask=rmask[:, None, None],
        )


@triton.jit(do_not_specialize=["T"])
def _expand_kernel(
    y_ptr,
    x_ptr,
    post_ptr,
    comb_ptr,
    o_ptr,
    T,
    D,
    N: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_D: tl.constexpr,
    DT: tl.constexpr,
):
    rows, cols = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T), tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    rmask, r64, kk = rows < T, rows.to(tl.int64), tl.arange(0, N)
    m2 = rmask[:, None] & (cols < D)[None, :]
    mix = tl.zeros([BLOCK_T, N, BLOCK_D], tl.float32)
    for j in tl.static_range(N):
        xj = tl.load(x_ptr + r64[:, None] * (N * D) + j * D + cols[None, :], mask=m2, other=0.0).to(tl.float32)
        cj = tl.load(comb_ptr + r64[:, None] * (N * N) + j * N + kk[None, :], mask=rmask[:, None], other=0.0)
        mix += cj.to(tl.float32)[:, :, None] * xj[:, None, :]
    y = tl.load(y_ptr + r64[:, None] * D + cols[None, :], mask=m2, other=0.0).to(tl.float32)
    post = tl.load(post_ptr + r64[:, None] * N + kk[None, :], mask=rmask[:, None], other=0.0).to(tl.float32)
    out = post[:, :, None] * y[:, None, :] + mix
    tl.store(
        o_ptr + r64[:, None, None] * (N * D) + kk[None, :, None] * D + cols[None, None, :],
        _round_to(out, DT).to(o_ptr.dtype.element_ty),
        mask=m2[:, None, :],
    )


# ------------------------------------------------------------------ checks, references, launchers
def _check(op: str, x, kernel: bool, iters: int = 1, **named):
    """x [T, n, d] float; each named tensor float, on x's device, of its shape below; the kernels' limits."""
    if x.dim() != 3 or not x.is_floating_point():
        raise ValueError(f"{op}: x must be a float [T, n, d] tensor, got {x.dtype} {tuple(x.shape)}")
    t, n, d = x.shape
    shapes = dict(
        fn=((2 + n) * n, n * d),
        base=((2 + n) * n,),
        scale=(3,),
        pre_in=(t, n),
        norm_w=(d,),
        y=(t, d),
        post=(t, n),
        comb=(t, n, n),
    )
    for name, ten in named.items():
        if tuple(ten.shape) != shapes[name] or not ten.is_floating_point() or ten.device != x.device:
            raise ValueError(
                f"{op}: {name} must be a float {list(shapes[name])} tensor on {x.device}, got "
                f"{ten.dtype} {tuple(ten.shape)} on {ten.device}"
            )
    if not isinstance(iters, int) or iters < 1:
        raise ValueError(f"{op}: sinkhorn_iters must be an int >= 1, got {iters!r}")
    if kernel and (x.dtype not in _TL or n & (n - 1)):
        raise ValueError(
            f"{op}: the kernel needs fp32/bf16/fp16 x and a power-of-two hc_mult, got {x.dtype}, "
            f"n = {n} ({op}_ref takes any)"
        )


def mhc_site_ref(x, fn, base, scale, pre_in, norm_w, norm_eps, rms_eps, hc_eps, sinkhorn_iters):
    """(h, pre, post, comb): the model's own hc_mix, collapse and rms_norm."""
    _check("mhc_site", x, False, sinkhorn_iters, fn=fn, base=base, scale=scale, pre_in=pre_in, norm_w=norm_w)
    pre, post, comb = hc_mix(x, fn, base, scale, rms_eps, hc_eps, sinkhorn_iters)
    return rms_norm(collapse(x, pre_in), norm_w, norm_eps), pre, post, comb


def mhc_expand_ref(y, x, post, comb):
    _check("mhc_expand", x, False, y=y, post=post, comb=comb)
    return expand(y, x, post, comb)


# From this many bf16 rows the projection's dots take fn in three bf16 parts against x as loaded (hi + lo + lo2
# carry fn's 24 significant bits and x is bf16: the products are exact, as in fp32) instead of tf32x3 on fp32 x,
# which splits both operands. Decode keeps tf32x3 (no parts to look up).
BF16X3_MIN_ROWS = 1024  # H200, 8192 rows x 4 x 5120: 0.50 ms against tf32x3's 0.90 (results/prefill-kernels-h200)
_PARTS: dict = {}


def _fn_parts(fn: torch.Tensor) -> torch.Tensor:
    """fn's bf16 parts [3, MIX, N * D] (hi, lo, lo2 with hi + lo + lo2 = fn to fp32's precision), cached for as
    long as that tensor lives unchanged (a weak reference and its version)."""
    hit = _PARTS.get(id(fn))
    if hit is not None and hit[0]() is fn and hit[1] == fn._version:
        return hit[2]
    for k in [k for k, v in _PARTS.items() if v[0]() is None]:
        del _PARTS[k]
    f = fp32_param(fn).contiguous()
    hi = f.to(torch.bfloat16)
    lo = (f - hi.float()).to(torch.bfloat16)
    parts = torch.stack((hi, lo, (f - hi.float() - lo.float()).to(torch.bfloat16)))
    _PARTS[id(fn)] = (weakref.ref(fn), fn._version, parts)
    return parts


def _site_tiles(t: int, d: int, device: torch.device):
    """(BLOCK_T, D_ITERS, SPLIT) of the first launch (BLOCK_D = 32, 8 warps: at 64 ptxas spills for sm_90). The d
    split fills the GPU (>= 2 programs per SM where rows allow; the interpreter pays per program: 3) but stays <= 64
    for the second launch's one load. BLOCK_T = 64 for long batches: fn is re-read from L2 once per row block."""
    if _INTERPRET:
        block_t, target = 16, 3
    else:
        block_t, target = (16 if t <= 128 else 64), 2 * torch.cuda.get_device_properties(device).multi_processor_count
    rb, tiles, d_iters = triton.cdiv(t, block_t), triton.cdiv(d, 32), 1
    while triton.cdiv(tiles, d_iters) > 64 or (d_iters * 2 <= tiles and rb * triton.cdiv(tiles, d_iters * 2) >= target):
        d_iters *= 2  # a power of two keeps the compiled variants few
    return block_t, d_iters, triton.cdiv(tiles, d_iters)


def mhc_site(x, fn, base, scale, pre_in, norm_w, norm_eps, rms_eps, hc_eps, sinkhorn_iters):
    """mhc_site_ref's (h, pre, post, comb) in two launches over one read of x (see module doc)."""
    _check("mhc_site", x, True, sinkhorn_iters, fn=fn, base=base, scale=scale, pre_in=pre_in, norm_w=norm_w)
    t, n, d = x.shape
    dev, f32, mixp = x.device, torch.float32, max(16, triton.next_power_of_2((2 + n) * n))
    h, comb = _alloc(t, d, dtype=x.dtype, device=dev), _alloc(t, n, n, dtype=f32, device=dev)
    pre, post = _alloc(t, n, dtype=f32, device=dev), _alloc(t, n, dtype=f32, device=dev)
    if t == 0:
        return h, pre, post, comb
    block_t, d_iters, split = _site_tiles(t, d, dev)
    pm, ps = _alloc(split, t, mixp, dtype=f32, device=dev), _alloc(split, t, 2, dtype=f32, device=dev)
    x = x.contiguous()
    parts = x.dtype == torch.bfloat16 and t >= BF16X3_MIN_ROWS
    _site_partial[(triton.cdiv(t, block_t), split)](
        x,
        _fn_parts(fn) if parts else fp32_param(fn).contiguous(),
        pre_in.to(f32).contiguous(),
        h,
        pm,
        ps,
        t,
        d,
        (2 + n) * n,
        N=n,
        MIXP=mixp,
        BLOCK_T=block_t,
        BLOCK_D=32,
        D_ITERS=d_iters,
        PREC="bf16x3" if parts else "tf32x3",
        DT=_TL[x.dtype],
        UPCAST=_INTERPRET,
        num_warps=8,
        num_stages=3,
    )
    split_p = triton.next_power_of_2(split)
    block_r = max(1, min(16, (8 if _INTERPRET else 256) // split_p))  # [BLOCK_R, SPLIT_P, n, n] comb partials
    block_h = 64 if _INTERPRET else 256
    _site_finish[(triton.cdiv(t, block_r), triton.cdiv(d, block_h))](
        h,
        norm_w.contiguous(),
        pm,
        ps,
        fp32_param(base).contiguous(),
        fp32_param(scale).contiguous(),
        pre,
        post,
        comb,
        t,
        d,
        split,
        float(norm_eps),
        float(rms_eps),
        float(hc_eps),
        N=n,
        MIXP=mixp,
        SPLIT_P=split_p,
        ITERS=sinkhorn_iters,
        BLOCK_R=block_r,
        BLOCK_H=block_h,
        DT=_TL[x.dtype],
        num_warps=4,
    )
    return h, pre, post, comb


def mhc_expand(y, x, post, comb):
    """mhc_expand_ref's x_new in one launch: x and y read once, x_new written once."""
    _check("mhc_expand", x, True, y=y, post=post, comb=comb)
    t, n, d = x.shape
    out = _alloc(t, n, d, dtype=x.dtype, device=x.device)
    if t:
        block_t, block_d = (4, 32) if _INTERPRET else (4, 256)  # [4, n, 256] fp32 = 32 registers a thread
        _expand_kernel[(triton.cdiv(t, block_t), triton.cdiv(d, block_d))](
            y.contiguous(),
            x.contiguous(),
            post.to(torch.float32).contiguous(),
            comb.to(torch.float32).contiguous(),
            out,
            t,
            d,
            N=n,
            BLOCK_T=block_t,
            BLOCK_D=block_d,
            DT=_TL[x.dtype],
            num_warps=4,
        )
    return out


# ------------------------------------------------------------------ inputs and benchmark
def example_inputs(t: int, n: int, d: int, dtype=torch.float32, device="cpu", seed: int = 0) -> list:
    """Random mhc_site arguments at the model's scales: mixes ~ N(0, 1), pre_in > 0, norm weight ~ 1."""
    g, mix = torch.Generator().manual_seed(seed), (2 + n) * n
    x = torch.randn(t, n, d, generator=g).to(dtype)
    fn = torch.randn(mix, n * d, generator=g) / (n * d) ** 0.5
    base, scale = torch.randn(mix, generator=g) * 0.5, 1 + torch.rand(3, generator=g)
    pre_in, norm_w = torch.rand(t, n, generator=g) + 0.1, 1 + 0.1 * torch.randn(d, generator=g)
    return [a.to(device) for a in (x, fn, base, scale, pre_in, norm_w)] + [1e-20, 1e-20, 1e-6, 20]


def bench(device="cuda", n: int = 4, d: int = 5120, copies: int = 32) -> dict:
    """Median device ms (CUDA graphs) of mhc_site / mhc_expand and their refs (the unfused torch path) at T in
    {1, 16, 64, 4096}, bf16 x; fn rotates over `copies` (32 x 2 MB > the 50 MB L2) as 80 sites would. GB/s: the
    ideal traffic, site = x read + h written, expand = x, y read + x_new written; *_ratio = ref ms / fused ms."""
    from ..bench.device_timing import graph_ms

    res = {}
    for t in (1, 16, 64, 4096):
        a = example_inputs(t, n, d, torch.bfloat16, device, seed=t)
        fns = [a[1]] + [torch.randn_like(a[1]) / (n * d) ** 0.5 for _ in range(copies - 1)]
        x, y, post, comb = a[0], a[0][:, 0].clone(), a[4], a[4][:, :, None] * a[4][:, None, :]
        row = res[f"T={t}"] = {}
        for name, op in (
            ("site", mhc_site),
            ("site_ref", mhc_site_ref),
            ("expand", mhc_expand),
            ("expand_ref", mhc_expand_ref),
        ):
            if name.startswith("site"):
                row[name], nbytes = graph_ms(lambda i: op(x, fns[i % copies], *a[2:]), copies), x.nbytes + y.nbytes
            else:
                row[name], nbytes = graph_ms(lambda i: op(y, x, post, comb)), 2 * x.nbytes + y.nbytes
            row[name + "_GBps"] = nbytes / row[name] / 1e6
        row["site_ratio"], row["expand_ratio"] = row["site_ref"] / row["site"], row["expand_ref"] / row["expand"]
    return res
