"""Fused cache writes (V4.1): RMSNorm + partial RoPE + QAT fake-quant + packed store into a paged pool, one launch.

Layouts (T rows; each program takes ROWS of them, masking rows past T, as two [ROWS, D/32, 2, 8] fp32 tiles of channel
pairs, even and odd channels; D a power of two >= 32):
* inputs   kv_proj / k_proj [T, D] (fp32, bf16 or fp16); u, z [G*r, D] (the compressor's fp32 projections);
  norm_weight [D]; cos, sin [T, R/2] (any float; cast to fp32 as Rope does), pair i rotates channels
  (D-R+2i, D-R+2i+1); rows [T] int64, pool row per input row, -1 = compute but do not store.
* pool     uint8 [N, row_bytes] (rows may be strided, bytes contiguous) in the `formats` layout of fmt:
  "fp8" SWA_FP8, "fp4" MAIN_FP4 (store_main) or INDEX_FP4 (store_index), "bf16" BF16_ROWS, or a RowFormat.
* returns  the values the model attends to, in the input dtype (store_main: out_dtype), computed in fp32 with
  the reference's intermediate casts to that dtype.
Stored bytes: fmt.pack(pre-quant values) when fmt is the op's own QAT format (decodes to exactly the returned
values under qat, and quantises once), else fmt.pack(returned values). Rows must lie in [-1, N) and be distinct.
The quantiser is bit-exact with quant.* / formats.*: rounding is done on the bits (no fp8/bf16 casts, which the
Triton interpreter mis-rounds), signs are set on the bits (-0.0 kept), divisions by non-powers of two use div_rn,
and FMA contraction is off.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from dsserve.kv.formats import RowFormat

# The references and the checks live beside: kernel and reference take the same arguments through one check.
from .kv_write_ref import (  # noqa: F401  (re-exported: the references are looked up here by KernelOps)
    _BASE,
    _GROUP,
    _KIND,
    _OPS,
    NONE,
    _check,
    _check_main,
    _resolve,
    quantize_rows_ref,
    store_index_ref,
    store_main_ref,
    store_window_ref,
)

_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"  # read when the kernels are decorated, as Triton does


@triton.jit
def _pow2_ceil_exp(y):
    """Biased exponent of quant.pow2_ceil(y) for normal y > 0 or +inf (the amax floors keep y normal)."""
    bits = y.to(tl.int32, bitcast=True)
    e = ((bits >> 23) & 0xFF) + ((bits & 0x7FFFFF) != 0).to(tl.int32)
    return tl.minimum(e, 254)


@triton.jit
def _signed(mag, neg):
    """mag >= 0 with the sign bit set where neg, by bits: compiled Triton's `-x` is `0 - x`, which loses -0.0."""
    return (mag.to(tl.int32, bitcast=True) | (neg.to(tl.int32) << 31)).to(tl.float32, bitcast=True)


@triton.jit
def _e4m3(x):
    """fp32 |x| <= 448 -> (e4m3fn RNE value, byte) from the bits: the 3.9 interpreter's own fp8 cast mis-rounds."""
    bits = x.to(tl.int32, bitcast=True)
    a = bits & 0x7FFFFFFF
    rn = (a + 0x7FFFF + ((a >> 20) & 1)) & ~0xFFFFF  # normal range: keep 3 mantissa bits, ties to even
    m = a.to(tl.float32, bitcast=True) * 512.0  # subnormal range: n * 2^-9, n = rne(|x| * 2^9) in [0, 8]
    n = m.to(tl.int32)
    f = m - n.to(tl.float32)
    n = n + ((f > 0.5) | ((f == 0.5) & ((n & 1) == 1))).to(tl.int32)
    normal = a >= 0x3C800000  # 2^-6
    code = tl.where(normal, (rn >> 20) - (120 << 3), n)
    mag = tl.where(normal, rn.to(tl.float32, bitcast=True), n.to(tl.float32) * 0.001953125)
    neg = bits < 0
    return _signed(mag, neg), code | (neg.to(tl.int32) << 7)


@triton.jit
def _round_to(x, DT: tl.constexpr):
    """fp32 -> nearest DT value, back in fp32; bf16 by bits (RNE) since the interpreter's bf16 cast truncates."""
    if DT == tl.bfloat16:
        b = x.to(tl.int32, bitcast=True)
        r = ((b + 0x7FFF + ((b >> 16) & 1)) & ~0xFFFF).to(tl.float32, bitcast=True)
        return tl.where(x != x, x, r)  # CUDA's NaN 0x7FFFFFFF would carry into the sign bit: -0
    else:
        return x.to(DT).to(tl.float32)


@triton.jit
def _e2m1(x):
    """quant.round_to_e2m1 as midpoint compares (exact: no rounding arithmetic); -> (value, nibble code)."""
    a = tl.abs(x)
    m = (
        (a > 0.25).to(tl.int32)
        + (a >= 0.75).to(tl.int32)
        + (a > 1.25).to(tl.int32)
        + (a >= 1.75).to(tl.int32)
        + (a > 2.5).to(tl.int32)
        + (a >= 3.5).to(tl.int32)
        + (a > 5.0).to(tl.int32)
    )
    mf = m.to(tl.float32)
    mag = tl.where(m < 4, mf * 0.5, tl.where(m < 6, mf - 2.0, (mf - 4.0) * 2.0))
    neg = x.to(tl.int32, bitcast=True) < 0
    return _signed(mag, neg), m | (neg.to(tl.int32) << 3)


@triton.jit
def _quantize(e, o, KIND: tl.constexpr, G: tl.constexpr):
    """Channel pairs e, o [ROWS, D/32, 2, 8] fp32 (even/odd channels; axis 1: 32-groups, 2: 16-groups) ->
    (fake-quant e, o fp32, element codes e, o int32, scale bytes [ROWS, D/32, 32/G, 1] int32)."""
    amax = tl.max(tl.maximum(tl.abs(e), tl.abs(o)), axis=3, keep_dims=True)
    if G == 32:
        amax = tl.max(amax, axis=2, keep_dims=True)
    if KIND == 2:  # e4m3 scale per group; a real division, so IEEE div_rn to match torch
        s, sbyte = _e4m3(tl.minimum(tl.math.div_rn(tl.maximum(amax, 6.0 * 2.0**-9), 6.0), 448.0))
        ve, ce = _e2m1(tl.math.div_rn(e, s))
        vo, co = _e2m1(tl.math.div_rn(o, s))
    else:  # power-of-two scale: x * 2^-k is exactly x / 2^k (k = 127 needs the subnormal 2^-127)
        if KIND == 1:
            ex = _pow2_ceil_exp(tl.math.div_rn(tl.maximum(amax, 1e-4), 448.0))
        else:
            ex = _pow2_ceil_exp(tl.math.div_rn(tl.maximum(amax, 6.0 * 2.0**-126), 6.0))
        s = (ex << 23).to(tl.float32, bitcast=True)
        inv = tl.where(ex == 254, 1 << 22, (254 - ex) << 23).to(tl.float32, bitcast=True)
        if KIND == 1:
            ve, ce = _e4m3(tl.minimum(tl.maximum(e * inv, -448.0), 448.0))
            vo, co = _e4m3(tl.minimum(tl.maximum(o * inv, -448.0), 448.0))
        else:
            ve, ce = _e2m1(e * inv)
            vo, co = _e2m1(o * inv)
        sbyte = ex
    return ve * s, vo * s, ce, co, sbyte


@triton.jit
def _put(ptr, off, val, keep):
    """Bytes val to ptr [ROWS, 1, 1, 1] + off where keep [ROWS, 1, 1, 1]."""
    tl.store(ptr + off, val.to(tl.uint8), mask=keep & (off >= 0))


@triton.jit
def _load_pair(ptr, at, m, GATE: tl.constexpr, z_ptr, D: tl.constexpr):
    """fp32 channel at `at` of row t, or with GATE Compressor._pool's softmax-gated sum of rows 2t and 2t + 1."""
    if GATE:
        r0 = at + (at // D) * D  # same channel of row 2t
        z0 = tl.load(z_ptr + r0, mask=m, other=0.0).to(tl.float32)
        z1 = tl.load(z_ptr + r0 + D, mask=m, other=0.0).to(tl.float32)
        e0, e1 = tl.exp(z0 - tl.maximum(z0, z1)), tl.exp(z1 - tl.maximum(z0, z1))
        x = tl.math.div_rn(e0, e0 + e1) * tl.load(ptr + r0, mask=m, other=0.0).to(tl.float32) + tl.math.div_rn(
            e1, e0 + e1
        ) * tl.load(ptr + r0 + D, mask=m, other=0.0).to(tl.float32)
    else:
        x = tl.load(ptr + at, mask=m, other=0.0).to(tl.float32)
    return x


@triton.jit(do_not_specialize=["n"])
def _kv_write_kernel(
    x_ptr,
    z_ptr,
    w_ptr,
    cos_ptr,
    sin_ptr,
    rows_ptr,
    pool_ptr,
    out_ptr,
    lat_ptr,
    n,
    eps,
    pool_stride,
    ROWS: tl.constexpr,
    D: tl.constexpr,
    R_HALF: tl.constexpr,
    GATE: tl.constexpr,
    NORM_ROPE: tl.constexpr,
    HAS_LAT: tl.constexpr,
    FQ: tl.constexpr,
    FQ_G: tl.constexpr,
    ST: tl.constexpr,
    ST_G: tl.constexpr,
    ST_FROM_RET: tl.constexpr,
):
    # The tile is [ROWS, D/32, 2, 8] channel pairs, even channels in one tensor and odd in another: RoPE pairs,
    # quantisation groups (16 or 32 channels) and fp4 nibble pairs are then plain axes and elementwise ops, with no
    # reshape/split/join of int tensors and no layout-changing reshapes in the GPU code path.
    NG: tl.constexpr = D // 32
    t = (tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS))[:, None, None, None]
    live = t < n  # the last program's rows past T: computed on zeros, never loaded from or stored
    p = (
        tl.arange(0, NG)[None, :, None, None] * 16
        + tl.arange(0, 2)[None, None, :, None] * 8
        + tl.arange(0, 8)[None, None, None, :]
    )  # pair index: channels 2p, 2p + 1
    at = t * D + 2 * p
    m = live & (p < D // 2)
    DT = out_ptr.dtype.element_ty
    xe = _round_to(_load_pair(x_ptr, at, m, GATE, z_ptr, D), DT)  # the compressor's pooled.to(x.dtype)
    xo = _round_to(_load_pair(x_ptr, at + 1, m, GATE, z_ptr, D), DT)
    if NORM_ROPE:
        ss = tl.sum(tl.sum(tl.sum(xe * xe + xo * xo, axis=3), axis=2), axis=1)
        r = tl.math.div_rn(1.0, tl.math.sqrt_rn(ss / D + eps))[:, None, None, None]
        xe = _round_to((xe * r) * tl.load(w_ptr + 2 * p).to(tl.float32), DT)
        xo = _round_to((xo * r) * tl.load(w_ptr + 2 * p + 1).to(tl.float32), DT)
        if HAS_LAT:
            tl.store(lat_ptr + at, xe.to(DT), mask=m)
            tl.store(lat_ptr + at + 1, xo.to(DT), mask=m)
        j = p - (D // 2 - R_HALF)
        rope = (j >= 0) & live
        cs = tl.load(cos_ptr + t * R_HALF + j, mask=rope, other=1.0)
        sn = tl.load(sin_ptr + t * R_HALF + j, mask=rope, other=0.0)
        ra = tl.where(rope, xe * cs - xo * sn, xe)
        rb = tl.where(rope, xe * sn + xo * cs, xo)
        xe, xo = _round_to(ra, DT), _round_to(rb, DT)
    re, ro = xe, xo
    if FQ == 4:
        re, ro = _round_to(xe, tl.bfloat16), _round_to(xo, tl.bfloat16)
    elif FQ != 0:
        re, ro, _c0, _c1, _s0 = _quantize(xe, xo, FQ, FQ_G)
    re, ro = _round_to(re, DT), _round_to(ro, DT)
    tl.store(out_ptr + at, re.to(DT), mask=m)  # exact: on DT's grid
    tl.store(out_ptr + at + 1, ro.to(DT), mask=m)
    ve, vo = (re, ro) if ST_FROM_RET else (xe, xo)
    row = tl.load(rows_ptr + t, mask=live, other=-1)
    keep = row >= 0  # rows[t] = -1: computed, not stored
    base = pool_ptr + row * pool_stride
    if ST == 4:  # bf16 little-endian bytes
        be = _round_to(ve, tl.bfloat16).to(tl.int32, bitcast=True) >> 16
        bo = _round_to(vo, tl.bfloat16).to(tl.int32, bitcast=True) >> 16
        _put(base, 4 * p, be & 0xFF, keep)
        _put(base, 4 * p + 1, (be >> 8) & 0xFF, keep)
        _put(base, 4 * p + 2, bo & 0xFF, keep)
        _put(base, 4 * p + 3, (bo >> 8) & 0xFF, keep)
    else:
        _v0, _v1, ce, co, sbyte = _quantize(ve, vo, ST, ST_G)
        gi = tl.arange(0, NG)[None, :, None, None] * (32 // ST_G)
        if ST_G == 16:
            gi = gi + tl.arange(0, 2)[None, None, :, None]  # scale byte of 16-group (axis 1, axis 2)
        if ST == 1:
            _put(base, 2 * p, ce, keep)
            _put(base, 2 * p + 1, co, keep)
            _put(base + D, gi, sbyte, keep)
        else:  # element 2i in the low nibble of byte i
            _put(base, p, ce | (co << 4), keep)
            _put(base + D // 2, gi, sbyte, keep)


# ------------------------------------------------------------------ Triton entry points
def _rows_per_program(d: int) -> int:
    """Rows per program (a power of two): the interpreter pays ~20 ms a program whatever its size, so take many;
    on the GPU a [ROWS, D] tile of ~2K fp32 values (4 rows at D = 512) keeps registers low and grids wide."""
    return 64 if _INTERPRET else max(1, min(16, 2048 // d))


def _empty(n: int, d: int, dtype: torch.dtype, device) -> torch.Tensor:  # a seam: tests poison the outputs
    return torch.empty(n, d, dtype=dtype, device=device)


def _launch(op, f: RowFormat, x, z, w, eps, cos, sin, pool, rows, qat, out_dtype, latent=False):
    d, n = x.shape[1], rows.shape[0]
    _, kind, own = _OPS[op]
    if own is None:  # quantize_rows: its "fake quant" is what the format decodes to
        kind, own = _KIND[f.name], f.name
    ok = (torch.float32, torch.bfloat16, torch.float16)
    if d & (d - 1) or d < 32 or out_dtype not in ok or x.dtype not in ok:
        raise ValueError(
            f"{op}: the kernel needs a power-of-two width >= 32 and fp32/bf16/fp16 data, got "
            f"{d} channels, {x.dtype} -> {out_dtype} (the _ref handles any)"
        )
    if pool.stride(1) != 1 or any(t is not None and t.device != x.device for t in (z, w, cos, sin, rows, pool)):
        raise ValueError(f"{op}: pool rows must be contiguous and every tensor on {x.device}")
    out = _empty(n, d, out_dtype, x.device)
    lat = _empty(n, d, out_dtype, x.device) if latent else out
    if n:
        cs = [t.to(torch.float32).contiguous() if t is not None else out for t in (cos, sin)]
        rows_per = _rows_per_program(d)
        _kv_write_kernel[(triton.cdiv(n, rows_per),)](
            x.contiguous(),
            x if z is None else z.contiguous(),
            out if w is None else w.contiguous(),
            cs[0],
            cs[1],
            rows.to(torch.int64).contiguous(),
            pool,
            out,
            lat,
            n,
            float(eps),
            pool.stride(0),
            ROWS=rows_per,
            D=d,
            R_HALF=1 if cos is None else cos.shape[1],
            GATE=z is not None,
            NORM_ROPE=w is not None,
            HAS_LAT=latent,
            FQ=kind if qat else NONE,
            FQ_G=_GROUP[own] or 1,
            ST=_KIND[f.name],
            ST_G=f.group or 1,
            ST_FROM_RET=f.name != own,
            num_warps=max(1, min(8, rows_per * d // 512)),
            enable_fp_fusion=False,
        )  # no FMA contraction: the torch reference rounds every product
    return (lat, out) if latent else out


def store_window(kv_proj, norm_weight, eps, cos, sin, pool, rows, fmt="fp8", qat=True):
    """kv = fake_quant_fp8_pow2(rope(rms_norm(kv_proj) * w)) [T, D] in kv_proj.dtype; its row stored at pool[rows]."""
    f = _check("store_window", kv_proj, kv_proj.shape[0], pool, rows, fmt, norm_weight, cos, sin)
    return _launch("store_window", f, kv_proj, None, norm_weight, eps, cos, sin, pool, rows, qat, kv_proj.dtype)


def store_main(u, z, ratio, norm_weight, eps, cos, sin, pool, rows, fmt="fp4", qat=True, out_dtype=None):
    """(latent, main) [G, D] in out_dtype (default u.dtype): latent = rms_norm(pooled(u, z).to(out_dtype)) * w
    (pre-RoPE), main = fake_quant_fp4_e4m3scale(rope(latent)); main's row stored at pool[rows]."""
    f = _check("store_main", u, _check_main(u, z, ratio, rows), pool, rows, fmt, norm_weight, cos, sin)
    return _launch("store_main", f, u, z, norm_weight, eps, cos, sin, pool, rows, qat, out_dtype or u.dtype, True)


def store_index(k_proj, norm_weight, eps, cos, sin, pool, rows, fmt="fp4", qat=True):
    """k = fake_quant_fp4_pow2(rope(rms_norm(k_proj) * w)) [G, Di] in k_proj.dtype; stored at pool[rows]."""
    f = _check("store_index", k_proj, k_proj.shape[0], pool, rows, fmt, norm_weight, cos, sin)
    return _launch("store_index", f, k_proj, None, norm_weight, eps, cos, sin, pool, rows, qat, k_proj.dtype)


def quantize_rows(x, pool, rows, fmt):
    """The kernels' quantiser alone: stores fmt.pack(x) at pool[rows] (fmt: a RowFormat or its name) and returns
    fmt.reference(x), what those bytes decode to, in x.dtype."""
    f = _check("quantize_rows", x, x.shape[0], pool, rows, fmt)
    return _launch("quantize_rows", f, x, None, None, 0.0, None, None, pool, rows, True, x.dtype)
