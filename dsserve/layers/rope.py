"""Partial interleaved RoPE on the last ``rope_dim`` channels, with optional YaRN (spec 1.3).

Pairs are adjacent channels (2i, 2i+1), not split halves. No YaRN attention scale is applied: the
release multiplies cos/sin by nothing and uses a softmax scale of exactly 1/sqrt(head_dim).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .numerics import acc, acc_dtype


@dataclass(frozen=True)
class RopeSpec:
    rope_dim: int
    theta: float
    yarn_factor: float = 1.0  # 1.0 = YaRN off
    original_max_position: int = 65536
    beta_fast: float = 32.0
    beta_slow: float = 1.0


def inv_freq(spec: RopeSpec) -> torch.Tensor:
    half = spec.rope_dim // 2
    base = 1.0 / spec.theta ** (torch.arange(half, dtype=torch.float64) * 2 / spec.rope_dim)
    if spec.yarn_factor == 1.0:
        return base

    def corr(beta: float) -> float:
        return spec.rope_dim * math.log(spec.original_max_position / (2 * math.pi * beta)) / (2 * math.log(spec.theta))

    low = max(math.floor(corr(spec.beta_fast)), 0)
    high = min(math.ceil(corr(spec.beta_slow)), spec.rope_dim - 1)
    if high == low:
        high += 0.001
    ramp = ((torch.arange(half, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)
    return base * (1 - ramp) + base / spec.yarn_factor * ramp


# One forward rotates several tensors per layer at the same positions: the cos / sin tables of the last positions
# tensor seen are kept per spec (a live reference, so its identity cannot be reused; its version guards in-place
# edits). On a GPU each table costs six small launches, ~25 a layer at decode.
_TABLES: dict = {}


def forget_tables() -> None:
    """Drop the kept tables: a CUDA graph's capture must record computing them (its positions are a buffer whose
    values change between replays, not its version)."""
    _TABLES.clear()


class Rope:
    """Rotates the tail channels of vectors at given absolute positions (and back, for de-rotation)."""

    def __init__(self, spec: RopeSpec):
        self.spec = spec
        self.inv_freq = inv_freq(spec)
        self._on_device = {self.inv_freq.device: self.inv_freq}

    def _cos_sin(self, positions: torch.Tensor):
        """(cos, sin) [T, rope_dim/2] in fp64 for these positions, on their device."""
        f = self._on_device.get(positions.device)
        if f is None:  # from pinned memory without waiting: a first call may come inside a step that must not sync
            src = self.inv_freq.pin_memory() if positions.device.type == "cuda" else self.inv_freq
            f = self._on_device[positions.device] = src.to(positions.device, non_blocking=True)
        ang = positions.to(torch.float64)[:, None] * f[None, :]
        return torch.cos(ang), torch.sin(ang)

    def kernel_tables(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin) [T, rope_dim/2] as the kernels take them: fp32, or fp64 for an fp64 model (``dtype``), whose
        reference path rotates in fp64."""
        dt = torch.float64 if dtype == torch.float64 else torch.float32
        c, s = self._cos_sin(positions)
        return c.to(dt).contiguous(), s.to(dt).contiguous()

    def tables(self, positions: torch.Tensor, dtype: torch.dtype, inverse: bool = False):
        """(cos, sin) [T, rope_dim/2] in ``dtype`` (sin negated for the inverse rotation), rounded from fp64."""
        try:
            version = positions._version
        except RuntimeError:  # an inference tensor keeps no version: no reuse
            version = None
        memo = _TABLES.get(self.spec)
        if memo is None or memo[0] is not positions or memo[1] != version or version is None:
            memo = _TABLES[self.spec] = (positions, version, {})
        key = (dtype, inverse)
        if key not in memo[2]:
            cos, sin = self._cos_sin(positions)
            memo[2][key] = (cos.to(dtype), (-sin if inverse else sin).to(dtype))
        return memo[2][key]

    def __call__(
        self, x: torch.Tensor, positions: torch.Tensor, inverse: bool = False, inplace: bool = False
    ) -> torch.Tensor:
        """x: [T, ..., D]; positions: [T]. Returns x with its last rope_dim channels rotated (see rotate)."""
        return rotate(x, *self.tables(positions, acc_dtype(x.dtype), inverse), inplace=inplace)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inplace: bool = False) -> torch.Tensor:
    """x [T, ..., D] with its last 2 * cos.shape[-1] channels rotated by the per-row tables [T, R/2] (cast to the
    rotation's dtype: fp32, or fp64 for fp64 x). inplace: x is the caller's own fresh tensor; its tail is
    overwritten and the other channels are not copied (a prefill's 64-head q is half a GB a layer)."""
    rd = 2 * cos.shape[-1]
    tail = acc(x[..., -rd:]).unflatten(-1, (rd // 2, 2))
    shape = (x.shape[0],) + (1,) * (x.dim() - 2) + (rd // 2,)
    cos, sin = cos.to(tail.dtype).view(shape), sin.to(tail.dtype).view(shape)
    a, b = tail[..., 0], tail[..., 1]
    rot = torch.stack((a * cos - b * sin, a * sin + b * cos), dim=-1).flatten(-2)
    if inplace:
        x[..., -rd:] = rot
        return x
    return torch.cat((x[..., :-rd], rot.to(x.dtype)), dim=-1)
