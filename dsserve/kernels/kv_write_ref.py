"""The torch references of kv_write's fused cache writes, and the argument checks both share.

Each ``<op>_ref`` has its kernel's signature and is built from the model's own code (rms_norm, Rope, the
compressor's pooling, quant.fake_quant_*, formats.*.pack), so it runs on any device and in any float dtype.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch

from dsserve.kv import formats
from dsserve.kv.formats import RowFormat
from dsserve.layers import quant
from dsserve.layers.compressor import Compressor
from dsserve.layers.norm import rms_norm
from dsserve.layers.rope import rotate

# Kinds of quantiser, shared by the fake-quant (FQ) and the store (ST) constexprs.
NONE, FP8_POW2, FP4_E4M3, FP4_POW2, BF16 = 0, 1, 2, 3, 4
_KIND = {"swa_fp8": FP8_POW2, "main_fp4": FP4_E4M3, "index_fp4": FP4_POW2, "bf16": BF16}
_GROUP = {"swa_fp8": formats.SWA_GROUP, "main_fp4": formats.MAIN_GROUP, "index_fp4": formats.INDEX_GROUP, "bf16": 0}
_FQ = {
    FP8_POW2: quant.fake_quant_fp8_pow2,
    FP4_E4M3: quant.fake_quant_fp4_e4m3scale,
    FP4_POW2: quant.fake_quant_fp4_pow2,
}


_BASE = {
    "swa_fp8": formats.SWA_FP8,
    "main_fp4": formats.MAIN_FP4,
    "index_fp4": formats.INDEX_FP4,
    "bf16": formats.BF16_ROWS,
}
_OPS = {  # op: (fmt names it accepts, fake-quant of its returned values, its own packed format)
    "store_window": ({"fp8": "swa_fp8", "bf16": "bf16"}, FP8_POW2, "swa_fp8"),
    "store_main": ({"fp4": "main_fp4", "fp8": "swa_fp8", "bf16": "bf16"}, FP4_E4M3, "main_fp4"),
    "store_index": ({"fp4": "index_fp4", "bf16": "bf16"}, FP4_POW2, "index_fp4"),
    "quantize_rows": ({name: name for name in _BASE}, None, None),
}


def _rope(cos: torch.Tensor, sin: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """The model's rotation, on the caller's cos/sin [T, R/2] instead of angles computed from positions."""
    return rotate(x, cos, sin)


def _resolve(op: str, fmt, channels: int) -> RowFormat:
    allowed = _OPS[op][0]
    if isinstance(fmt, RowFormat):
        if fmt.name not in allowed.values() or fmt.group != _GROUP[fmt.name] or fmt.channels != channels:
            raise ValueError(
                f"{op}: format {fmt} does not fit; expected {sorted(set(allowed.values()))} rows of "
                f"{channels} channels with the standard group size"
            )
        return fmt
    if fmt not in allowed:
        raise ValueError(f"{op}: unknown fmt {fmt!r}; expected one of {sorted(allowed)} or a RowFormat")
    return _BASE[allowed[fmt]].with_channels(channels)


def _check(op, x, n, pool, rows, fmt, weight=None, cos=None, sin=None) -> RowFormat:
    """Shape/dtype checks shared by the kernels and the references; returns the resolved row format."""
    if x.dim() != 2 or not x.is_floating_point():
        raise ValueError(f"{op}: expected a float [rows, channels] input, got {x.dtype} {tuple(x.shape)}")
    d = x.shape[1]
    if weight is not None and tuple(weight.shape) != (d,):
        raise ValueError(f"{op}: norm_weight must be [{d}], got {tuple(weight.shape)}")
    if cos is not None and (
        cos.dim() != 2 or cos.shape[0] != n or sin.shape != cos.shape or not 0 < 2 * cos.shape[1] <= d
    ):
        raise ValueError(
            f"{op}: cos/sin must both be [{n}, R/2] with 0 < R <= {d}, got {tuple(cos.shape)} / {tuple(sin.shape)}"
        )
    if rows.dim() != 1 or rows.shape[0] != n or rows.is_floating_point() or rows.dtype == torch.bool:
        raise ValueError(f"{op}: rows must be an integer [{n}] tensor, got {rows.dtype} {tuple(rows.shape)}")
    f = _resolve(op, fmt, d)
    if pool.dtype != torch.uint8 or pool.dim() != 2 or pool.shape[1] != f.row_bytes:
        raise ValueError(
            f"{op}: pool must be uint8 [N, {f.row_bytes}] for {f.name}, got {pool.dtype} {tuple(pool.shape)}"
        )
    return f


def _check_main(u, z, ratio, rows) -> int:
    if ratio not in (1, 2):
        raise ValueError(f"store_main: ratio must be 1 or 2 (V4.1), got {ratio}")
    if u.dim() != 2 or rows.dim() != 1 or u.shape[0] != ratio * rows.shape[0]:
        raise ValueError(
            f"store_main: u must be [G*ratio, D] for G = len(rows), got {tuple(u.shape)} with "
            f"ratio {ratio} and rows {tuple(rows.shape)}"
        )
    if (z is None) != (ratio == 1) or (z is not None and z.shape != u.shape):
        raise ValueError(f"store_main: z must be None for ratio 1 and shaped like u {tuple(u.shape)} for ratio 2")
    return rows.shape[0]


def _store_ref(op, pre, qat, f: RowFormat, pool, rows):
    """Fake-quantise the returned values; store fmt.pack of the pre-quant (own format) or of the returned values."""
    _, kind, own = _OPS[op]
    ret = _FQ[kind](pre, _GROUP[own]) if qat else pre
    keep = rows >= 0
    pool[rows[keep]] = f.pack(pre if f.name == own else ret)[keep].to(pool.device)
    return ret


def store_window_ref(kv_proj, norm_weight, eps, cos, sin, pool, rows, fmt="fp8", qat=True):
    f = _check("store_window", kv_proj, kv_proj.shape[0], pool, rows, fmt, norm_weight, cos, sin)
    pre = _rope(cos, sin, rms_norm(kv_proj, norm_weight, eps))
    return _store_ref("store_window", pre, qat, f, pool, rows)


def store_main_ref(u, z, ratio, norm_weight, eps, cos, sin, pool, rows, fmt="fp4", qat=True, out_dtype=None):
    f = _check("store_main", u, _check_main(u, z, ratio, rows), pool, rows, fmt, norm_weight, cos, sin)
    pooled = u
    if ratio == 2:  # the module's own pooling code, on a stand-in with V4.1's settings (no APE, no overlap)
        shim = SimpleNamespace(ratio=2, head_dim=u.shape[1], ape=None, overlap=False)
        pooled = Compressor._pool(shim, u, z, 0, 0, rows.shape[0])
    latent = rms_norm(pooled.to(out_dtype or u.dtype), norm_weight, eps)
    return latent, _store_ref("store_main", _rope(cos, sin, latent), qat, f, pool, rows)


def store_index_ref(k_proj, norm_weight, eps, cos, sin, pool, rows, fmt="fp4", qat=True):
    f = _check("store_index", k_proj, k_proj.shape[0], pool, rows, fmt, norm_weight, cos, sin)
    pre = _rope(cos, sin, rms_norm(k_proj, norm_weight, eps))
    return _store_ref("store_index", pre, qat, f, pool, rows)


def quantize_rows_ref(x, pool, rows, fmt):
    f = _check("quantize_rows", x, x.shape[0], pool, rows, fmt)
    keep = rows >= 0
    pool[rows[keep]] = f.pack(x)[keep].to(pool.device)
    return f.reference(x)
