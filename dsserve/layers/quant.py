"""Quantisation formats of the release checkpoint and the fake-quant (QAT) numerics of spec 2.12.

Pure torch functions; every computation runs in float32. Formats:

* e8m0 scale byte e  ->  2^(e - 127)                      (e = 255 is NaN and never produced here)
* FP8 e4m3 (torch.float8_e4m3fn): finite range +-448, RNE rounding, saturated by clamping first.
* e2m1 (FP4) nibble: bit 3 = sign, bits 0-2 index the magnitudes {0, .5, 1, 1.5, 2, 3, 4, 6}.
"""

from __future__ import annotations

import functools

import torch

FP8_MAX = 448.0
FP4_MAX = 6.0
E2M1_VALUES = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])
MX_BLOCK = 32  # MXFP4 and Engram: one e8m0 scale per 32 values along the last dim


def e2m1_decode(codes: torch.Tensor) -> torch.Tensor:
    """float32 E2M1_VALUES[codes], the table built where the codes are: copying it from the host would be an upload
    per call, and one CUDA graph capture refuses (the reference ops run inside the decode graphs). Built per call,
    not cached: a table made during a capture holds nothing until the graph replays."""
    c = torch.arange(16, dtype=torch.int32, device=codes.device)
    mant, exp = (c & 1).float(), ((c >> 1) & 3).float()
    mag = torch.where(exp == 0, 0.5 * mant, (1 + 0.5 * mant) * torch.exp2(exp - 1))
    return torch.where((c & 8) != 0, -mag, mag)[codes.long()]


# ------------------------------------------------------------------ e8m0 scales
def _exp2_biased(e: torch.Tensor) -> torch.Tensor:
    """float32 2^(e - 127) for integer e in [0, 255], built from the bits (exact; e = 255 gives NaN)."""
    e = e.to(torch.int32)
    bits = torch.where(e == 0, 1 << 22, torch.where(e == 255, 0x7FC00000, e << 23))
    return bits.to(torch.int32).view(torch.float32)


def e8m0_to_float(scale: torch.Tensor) -> torch.Tensor:
    """Decode e8m0 scales: s = 2^(e - 127), e the uint8 exponent (uint8 or float8_e8m0fnu input)."""
    return _exp2_biased(scale.view(torch.uint8) if scale.dtype == torch.float8_e8m0fnu else scale)


def float_to_e8m0(scale: torch.Tensor) -> torch.Tensor:
    """Encode power-of-two scales 2^k (k in [-127, 127]) as e8m0: e = k + 127, dtype float8_e8m0fnu.
    A scale that is not a power of two is truncated to the power of two below it."""
    m, e = torch.frexp(scale.float())  # scale = m * 2^e, m in [0.5, 1)
    return (e - 1 + 127).clamp(0, 254).to(torch.uint8).view(torch.float8_e8m0fnu)


def pow2_ceil(y: torch.Tensor) -> torch.Tensor:
    """2^ceil(log2(y)) computed exactly (via frexp), with the exponent clamped to [-127, 127]."""
    m, e = torch.frexp(y.float().clamp(2.0**-127, 2.0**127))
    return _exp2_biased(torch.where(m == 0.5, e - 1, e).clamp(-127, 127) + 127)


def _groups(x: torch.Tensor, group: int) -> torch.Tensor:
    if x.shape[-1] % group:
        raise ValueError(f"last dim {x.shape[-1]} is not a multiple of the group size {group}")
    return x.float().unflatten(-1, (-1, group))


def _fp8_groups(x: torch.Tensor, group: int, amax_floor: float):
    """Per-group FP8: s = 2^ceil(log2(max(amax, floor)/448)), q = e4m3(clamp(x/s, +-448))."""
    g = _groups(x, group)
    s = pow2_ceil(g.abs().amax(-1, keepdim=True).clamp_min(amax_floor) / FP8_MAX)
    return (g / s).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn), s


# ------------------------------------------------------------------ dense FP8 block weights
def dequant_fp8_block(weight: torch.Tensor, scale: torch.Tensor, block: int) -> torch.Tensor:
    """W[i, j] = e4m3(weight[i, j]) * 2^(scale[i // b, j // b] - 127); scale is [ceil(n/b), ceil(k/b)]
    (edge tiles may be partial). Returns float32."""
    n, k = weight.shape
    if tuple(scale.shape) != (-(-n // block), -(-k // block)):
        raise ValueError(f"scale shape {tuple(scale.shape)} does not fit weight [{n}, {k}] with block {block}")
    s = e8m0_to_float(scale).repeat_interleave(block, 0)[:n].repeat_interleave(block, 1)[:, :k]
    return weight.view(torch.float8_e4m3fn).float() * s


def quant_fp8_block(w: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse of dequant_fp8_block: per b x b tile s = 2^ceil(log2(amax/448)) (amax of the tile),
    q = e4m3(w / s). Returns (float8_e4m3fn [n, k], float8_e8m0fnu [ceil(n/b), ceil(k/b)])."""
    n, k = w.shape
    nb, kb = -(-n // block), -(-k // block)
    padded = torch.zeros(nb * block, kb * block, dtype=torch.float32, device=w.device)
    padded[:n, :k] = w.float()
    tiles = padded.view(nb, block, kb, block)
    s = pow2_ceil(tiles.abs().amax(dim=(1, 3), keepdim=True) / FP8_MAX)
    q = (tiles / s).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).view(nb * block, kb * block)
    return q[:n, :k].contiguous(), float_to_e8m0(s.view(nb, kb))


# ------------------------------------------------------------------ e2m1 / MXFP4 routed experts
def round_to_e2m1(x: torch.Tensor) -> torch.Tensor:
    """Round to the nearest e2m1 value (+-{0, .5, 1, 1.5, 2, 3, 4, 6}), ties to the even code, clamp +-6.
    The grid step is 0.5 below 2, 1 in [2, 4) and 2 from 4 on; torch.round is RNE within each step,
    which coincides with ties-to-even on the code (e.g. 0.25->0, 0.75->1, 2.5->2, 5->4)."""
    a = x.abs()
    r = torch.where(a < 2, torch.round(a * 2) / 2, torch.where(a < 4, torch.round(a), torch.round(a / 2) * 2))
    return torch.copysign(r.clamp(max=FP4_MAX), x)


def _e2m1_codes(q: torch.Tensor) -> torch.Tensor:
    """Nibble codes (uint8 0..15) of values already on the e2m1 grid."""
    a = q.abs()
    idx = torch.where(a < 2, a * 2, torch.where(a < 4, a + 2, a / 2 + 4)).to(torch.uint8)
    return idx | (torch.signbit(q).to(torch.uint8) << 3)


def _fp4_pow2_groups(x: torch.Tensor, group: int):
    """s = 2^ceil(log2(max(amax, 6*2^-126)/6)), q = e2m1(x/s) (RNE); returns (q on the grid, s)."""
    g = _groups(x, group)
    s = pow2_ceil(g.abs().amax(-1, keepdim=True).clamp_min(FP4_MAX * 2.0**-126) / FP4_MAX)
    return round_to_e2m1(g / s), s


def pack_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """MXFP4 of w [..., k]: per 32 values s = 2^ceil(log2(amax/6)) and e2m1 codes of w/s (RNE).
    Element k goes to the low nibble of byte k//2 when k is even, to the high nibble when odd.
    Returns (int8 [..., k/2], float8_e8m0fnu [..., k/32])."""
    q, s = _fp4_pow2_groups(w, MX_BLOCK)
    codes = _e2m1_codes(q).flatten(-2)
    packed = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return packed.view(torch.int8), float_to_e8m0(s.squeeze(-1))


def dequant_mxfp4(packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """W[..., k] = e2m1(nibble k) * 2^(scale[..., k // 32] - 127); nibble k is the low half of byte k//2
    for even k and the high half for odd k. Returns float32 [..., 2 * packed.shape[-1]]."""
    b = packed.view(torch.uint8)
    codes = torch.stack([b & 0xF, b >> 4], dim=-1).flatten(-2)
    vals = e2m1_decode(codes)
    return vals * e8m0_to_float(scale).repeat_interleave(MX_BLOCK, dim=-1)


# ------------------------------------------------------------------ Engram tables
def quant_engram(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Engram table [rows, D]: per row and 32 columns s = 2^ceil(log2(amax/448)), q = e4m3(w/s).
    Returns (float8_e4m3fn [rows, D], float8_e8m0fnu [rows, D/32])."""
    q, s = _fp8_groups(w, MX_BLOCK, 0.0)
    return q.flatten(-2), float_to_e8m0(s.squeeze(-1))


def dequant_engram(weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """T[r, c] = e4m3(weight[r, c]) * 2^(scale[r, c // 32] - 127). Returns float32."""
    return weight.view(torch.float8_e4m3fn).float() * e8m0_to_float(scale).repeat_interleave(MX_BLOCK, dim=-1)


# ------------------------------------------------------------------ fake quant (spec 2.12)
def _straight_through(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Training (x carries a gradient): y forward, the identity backward (the rounding has no useful gradient).
    Otherwise y itself: x + (y - x) need not round back to y."""
    return x + (y - x).detach() if x.requires_grad and torch.is_grad_enabled() else y


def fake_quant_fp8_pow2(x: torch.Tensor, group: int = 32) -> torch.Tensor:
    """Per `group` values of the last dim: s = 2^ceil(log2(max(amax, 1e-4)/448)),
    y = e4m3(clamp(x/s, +-448)) * s. Same dtype as x (SWA K=V QAT)."""
    q, s = _fp8_groups(x, group, 1e-4)
    return _straight_through(x, (q.float() * s).flatten(-2).to(x.dtype))


def fake_quant_fp4_e4m3scale(x: torch.Tensor, group: int = 16) -> torch.Tensor:
    """Per `group` values: s = e4m3(max(amax, 6*2^-9)/6) (RNE, saturated at 448),
    y = e2m1(x/s) * s with RNE on the grid and clamp +-6. Same dtype as x (main-KV QAT)."""
    g = _groups(x, group)
    s = (g.abs().amax(-1, keepdim=True).clamp_min(FP4_MAX * 2.0**-9) / FP4_MAX).clamp(max=FP8_MAX)
    s = s.to(torch.float8_e4m3fn).float()
    return _straight_through(x, (round_to_e2m1(g / s) * s).flatten(-2).to(x.dtype))


def fake_quant_fp4_pow2(x: torch.Tensor, group: int = 32) -> torch.Tensor:
    """Per `group` values: s = 2^ceil(log2(max(amax, 6*2^-126)/6)), y = e2m1(x/s) * s (RNE, clamp +-6).
    Same dtype as x (index q/k QAT). With group 32 it equals dequant_mxfp4(pack_mxfp4(x))."""
    q, s = _fp4_pow2_groups(x, group)
    return _straight_through(x, (q * s).flatten(-2).to(x.dtype))


@functools.lru_cache(maxsize=16)
def _hadamard(n: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Kept per device: copying it from the host at every call would be an upload (and a wait) per indexer layer."""
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < n:
        h = torch.cat((torch.cat((h, h), 1), torch.cat((h, -h), 1)), 0)
    return (h / n**0.5).to(dtype).to(device)


def hadamard_rotate(x: torch.Tensor) -> torch.Tensor:
    """Orthonormal Walsh-Hadamard transform (Sylvester order, scale n^-1/2) of the last dim, a power of two.

    V4's indexer rotates q and k with it before FP4, which spreads outliers across channels; q.k is unchanged.
    """
    n = x.shape[-1]
    if n & (n - 1):
        raise ValueError(f"Hadamard rotation needs a power-of-two width, got {n}")
    dt = torch.float64 if x.dtype == torch.float64 else torch.float32
    return (x.to(dt) @ _hadamard(n, dt, x.device)).to(x.dtype)
