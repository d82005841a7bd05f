"""Packed byte rows of the KV cache (spec 3.1): the real 528 / 288 / 68-byte formats, plus a BF16 debug format.

Every row is [data bytes | scale bytes], one row per token entry, vectorised over any leading dims:

* SWA_FP8   (SWA K=V):   C e4m3 bytes, then C/32 ue8m0 bytes (2^(e-127))      -> 512 ch: 528 B, 64 ch: 66 B
* MAIN_FP4  (main KV):   C/2 e2m1 bytes, then C/16 E4M3 scale bytes            -> 512 ch: 288 B, 64 ch: 36 B
* INDEX_FP4 (index K):   C/2 e2m1 bytes, then C/32 ue8m0 bytes                 -> 128 ch:  68 B, 32 ch: 17 B
* BF16_ROWS (debug):     2C bytes, the bf16 values in native (little-endian) byte order; no QAT, just a cast.

e2m1 pairs: element 2i in the low nibble of byte i, element 2i+1 in the high nibble (as in the checkpoint's MXFP4).
Scale byte g covers channels [g*group, (g+1)*group).

Exactness: unpack(pack(x), dtype) == fake_quant(x).to(dtype) bit for bit (signed zeros included) for any finite x:
pack runs the fake-quant's own scale/rounding code (dsserve.layers.quant), unpack redoes its fp32 product q * s and
the cast. Edge cases (the fake-quant is the truth):
* pow2 scales are clamped to 2^[-127, 127] by pow2_ceil, so they always fit ue8m0; with the amax floors the bytes
  produced are e in [105, 254] (SWA: floor 1e-4 -> 2^-22) and [1, 254] (index: floor -> 2^-126).
* main scales are e4m3 in [2^-9, 448]: the floor gives the smallest subnormal (0x01); subnormal scales (0x01..0x07)
  are stored as is; saturation gives 448 (0x7E).
* fp64 inputs beyond the fp32 range become inf inside the fp32 fake-quant; its result (inf for SWA/index, +-2688
  for main) is what the packed row decodes to as well.
* fake_quant_fp8_pow2 / fake_quant_fp4_pow2 are idempotent, so packing an already fake-quantised row is lossless.
  fake_quant_fp4_e4m3scale is NOT when its scale is an e4m3 subnormal (group amax ~0.01..0.09): amax 9*2^-9 picks
  s = 2*2^-9, the max becomes 4s = 8*2^-9, and re-quantising picks 2^-9 and clamps it to 6*2^-9. The model caches
  fake-quantised main KV, so pass prequantized=True there: pack then picks a scale that represents the row exactly
  (one always exists for a fake-quant output).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from dsserve.layers import quant
from dsserve.layers.quant import (
    FP4_MAX,
    FP8_MAX,
    _e2m1_codes,
    _exp2_biased,
    _fp4_pow2_groups,
    _fp8_groups,
    _groups,
    e2m1_decode,
    round_to_e2m1,
)

SWA_GROUP, MAIN_GROUP, INDEX_GROUP = 32, 16, 32
SWA_AMAX_FLOOR = 1e-4  # fake_quant_fp8_pow2
MAIN_AMAX_FLOOR = FP4_MAX * 2.0**-9  # fake_quant_fp4_e4m3scale


# ------------------------------------------------------------------ helpers
def _channels(b: torch.Tensor, num: int, den: int, what: str) -> int:
    """Channels C of a row of b.shape[-1] = C * num / den bytes."""
    if b.dtype != torch.uint8 or b.dim() == 0 or (b.shape[-1] * den) % num:
        raise ValueError(f"{what}: expected uint8 rows, got {b.dtype} {tuple(b.shape)}")
    return b.shape[-1] * den // num


def _pow2_byte(s: torch.Tensor) -> torch.Tensor:  # ue8m0 of fp32 2^k, k in [-127, 127]: the exponent field
    return (s.float().view(torch.int32) >> 23).to(torch.uint8)


def _pack_nibbles(q: torch.Tensor) -> torch.Tensor:  # e2m1 values [..., G, g] -> uint8 [..., G*g/2]
    c = _e2m1_codes(q).flatten(-2)
    return c[..., 0::2] | (c[..., 1::2] << 4)


def _unpack_nibbles(b: torch.Tensor) -> torch.Tensor:  # uint8 [..., n] -> fp32 [..., 2n]; code 8 is -0.0
    codes = torch.stack((b & 0xF, b >> 4), dim=-1).flatten(-2)
    return e2m1_decode(codes)


def _scaled(vals: torch.Tensor, s: torch.Tensor, group: int, dtype: torch.dtype) -> torch.Tensor:  # fp32 q*s, cast
    return (vals.unflatten(-1, (-1, group)) * s.unsqueeze(-1)).flatten(-2).to(dtype)


# ------------------------------------------------------------------ SWA: e4m3 + ue8m0 per 32
def pack_swa_fp8(x: torch.Tensor, group: int = SWA_GROUP, prequantized: bool = False) -> torch.Tensor:
    """[..., C] -> uint8 [..., C + C/group]; decodes to fake_quant_fp8_pow2(x, group).
    prequantized: no-op (idempotent)."""
    q, s = _fp8_groups(x, group, SWA_AMAX_FLOOR)
    return torch.cat((q.flatten(-2).view(torch.uint8), _pow2_byte(s).squeeze(-1)), dim=-1)


def unpack_swa_fp8(b: torch.Tensor, dtype: torch.dtype = torch.float32, group: int = SWA_GROUP) -> torch.Tensor:
    c = _channels(b, group + 1, group, "swa_fp8")
    return _scaled(b[..., :c].view(torch.float8_e4m3fn).float(), _exp2_biased(b[..., c:]), group, dtype)


# ------------------------------------------------------------------ main KV: e2m1 + E4M3 scale per 16
def _main_scale(g: torch.Tensor) -> torch.Tensor:
    """fake_quant_fp4_e4m3scale's scale as e4m3 bytes [..., G, 1]: e4m3(min(max(amax, 6*2^-9)/6, 448))."""
    s = (g.abs().amax(-1, keepdim=True).clamp_min(MAIN_AMAX_FLOOR) / FP4_MAX).clamp(max=FP8_MAX)
    return s.to(torch.float8_e4m3fn).view(torch.uint8)


def _lossless_main_scale(g: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """Per group, the first of [fake-quant scale, subnormal e4m3 k*2^-9 for k = 1..7] that represents the group
    exactly; the fake-quant scale where none does. For a fake-quant output one always does: a normal scale s gives
    a group max of exactly 6s (so its own fake-quant scale is s again), a subnormal one is in the list."""
    sub = torch.arange(1, 8, dtype=torch.uint8, device=g.device).expand(*s.shape[:-1], 7)
    cand = torch.cat((s, sub), dim=-1)  # [..., G, 8] e4m3 bytes
    sf = cand.view(torch.float8_e4m3fn).float().unsqueeze(-1)  # [..., G, 8, 1]
    ok = (round_to_e2m1(g.unsqueeze(-2) / sf) * sf == g.unsqueeze(-2)).all(-1)
    pick = torch.where(ok.any(-1), ok.int().argmax(-1), 0)  # argmax: the first True
    return cand.gather(-1, pick.unsqueeze(-1))


def pack_main_fp4(x: torch.Tensor, group: int = MAIN_GROUP, prequantized: bool = False) -> torch.Tensor:
    """[..., C] -> uint8 [..., C/2 + C/group]; decodes to fake_quant_fp4_e4m3scale(x, group). With prequantized,
    a row already on a representable grid (e.g. a fake-quant output) decodes to itself instead (see module doc)."""
    g = _groups(x, group)
    s = _main_scale(g)
    if prequantized:
        s = _lossless_main_scale(g, s)
    q = round_to_e2m1(g / s.view(torch.float8_e4m3fn).float())
    return torch.cat((_pack_nibbles(q), s.squeeze(-1)), dim=-1)


def unpack_main_fp4(b: torch.Tensor, dtype: torch.dtype = torch.float32, group: int = MAIN_GROUP) -> torch.Tensor:
    c = _channels(b, group + 2, 2 * group, "main_fp4")
    s = b[..., c // 2 :].view(torch.float8_e4m3fn).float()
    return _scaled(_unpack_nibbles(b[..., : c // 2]), s, group, dtype)


# ------------------------------------------------------------------ index K: e2m1 + ue8m0 per 32
def pack_index_fp4(x: torch.Tensor, group: int = INDEX_GROUP, prequantized: bool = False) -> torch.Tensor:
    """[..., C] -> uint8 [..., C/2 + C/group]; decodes to fake_quant_fp4_pow2(x, group). prequantized: no-op."""
    q, s = _fp4_pow2_groups(x, group)
    return torch.cat((_pack_nibbles(q), _pow2_byte(s).squeeze(-1)), dim=-1)


def unpack_index_fp4(b: torch.Tensor, dtype: torch.dtype = torch.float32, group: int = INDEX_GROUP) -> torch.Tensor:
    c = _channels(b, group + 2, 2 * group, "index_fp4")
    return _scaled(_unpack_nibbles(b[..., : c // 2]), _exp2_biased(b[..., c // 2 :]), group, dtype)


# ------------------------------------------------------------------ BF16 debug rows
def pack_bf16(x: torch.Tensor, group: int = 0, prequantized: bool = False) -> torch.Tensor:
    """[..., C] -> uint8 [..., 2C]: a plain cast to bf16, bytes in native order (no QAT)."""
    return x.to(torch.bfloat16).contiguous().view(torch.uint8)


def unpack_bf16(b: torch.Tensor, dtype: torch.dtype = torch.float32, group: int = 0) -> torch.Tensor:
    _channels(b, 2, 1, "bf16")
    return b.contiguous().view(torch.bfloat16).to(dtype)


# ------------------------------------------------------------------ format descriptors
_CODECS = {
    "swa_fp8": (pack_swa_fp8, unpack_swa_fp8),
    "main_fp4": (pack_main_fp4, unpack_main_fp4),
    "index_fp4": (pack_index_fp4, unpack_index_fp4),
    "bf16": (pack_bf16, unpack_bf16),
}
_REFERENCE = {
    "swa_fp8": quant.fake_quant_fp8_pow2,
    "main_fp4": quant.fake_quant_fp4_e4m3scale,
    "index_fp4": quant.fake_quant_fp4_pow2,
}


@dataclass(frozen=True)
class RowFormat:
    """One cache row format: `channels` values of `elem_bits` each, plus one scale byte per `group` (0: none)."""

    name: str
    channels: int
    group: int
    elem_bits: int

    def __post_init__(self):
        if (
            self.name not in _CODECS
            or self.channels <= 0
            or (self.channels * self.elem_bits) % 8
            or (self.group and self.channels % self.group)
        ):
            raise ValueError(f"invalid row format {self}")

    data_bytes = property(lambda self: self.channels * self.elem_bits // 8)
    scale_bytes = property(lambda self: self.channels // self.group if self.group else 0)
    row_bytes = property(lambda self: self.data_bytes + self.scale_bytes)

    def with_channels(self, channels: int) -> RowFormat:
        return replace(self, channels=channels)

    def pack(self, x: torch.Tensor, prequantized: bool = False) -> torch.Tensor:
        """float [..., channels] -> uint8 [..., row_bytes]."""
        if x.shape[-1] != self.channels:
            raise ValueError(f"{self.name}: expected {self.channels} channels, got {tuple(x.shape)}")
        return _CODECS[self.name][0](x, self.group, prequantized)

    def unpack(self, b: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """uint8 [..., row_bytes] -> dtype [..., channels]."""
        if b.shape[-1] != self.row_bytes:
            raise ValueError(f"{self.name}: expected rows of {self.row_bytes} B, got {tuple(b.shape)}")
        return _CODECS[self.name][1](b, dtype, self.group)

    def reference(self, x: torch.Tensor) -> torch.Tensor:
        """What unpack(pack(x), x.dtype) equals: the QAT fake-quant (packed formats) or a bf16 round trip."""
        fq = _REFERENCE.get(self.name)
        return fq(x, self.group) if fq else x.to(torch.bfloat16).to(x.dtype)


SWA_FP8 = RowFormat("swa_fp8", 512, SWA_GROUP, 8)  # 528 B
MAIN_FP4 = RowFormat("main_fp4", 512, MAIN_GROUP, 4)  # 288 B
INDEX_FP4 = RowFormat("index_fp4", 128, INDEX_GROUP, 4)  # 68 B
BF16_ROWS = RowFormat("bf16", 512, 0, 16)  # 1024 B
_PACKED = {"swa": SWA_FP8, "main": MAIN_FP4, "index": INDEX_FP4}


def format_for(kind: str, kv_dtype: str, channels: int) -> RowFormat:
    """kind in {"swa", "main", "index"}; kv_dtype "auto" (the packed formats) or "bf16" (debug rows)."""
    if kind not in _PACKED:
        raise ValueError(f"unknown KV kind {kind!r}; expected one of {sorted(_PACKED)}")
    if kv_dtype == "auto":
        return _PACKED[kind].with_channels(channels)
    if kv_dtype == "bf16":
        return BF16_ROWS.with_channels(channels)
    raise ValueError(f"unknown kv_dtype {kv_dtype!r}; expected 'auto' or 'bf16'")
