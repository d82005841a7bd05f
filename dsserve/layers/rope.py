"""Partial interleaved RoPE on the last ``rope_dim`` channels, with optional YaRN (spec 1.3).

Pairs are adjacent channels (2i, 2i+1), not split halves. No YaRN attention scale is applied: the
release multiplies cos/sin by nothing and uses a softmax scale of exactly 1/sqrt(head_dim).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from .numerics import acc


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


class Rope:
    """Rotates the tail channels of vectors at given absolute positions (and back, for de-rotation)."""

    def __init__(self, spec: RopeSpec):
        self.spec = spec
        self.inv_freq = inv_freq(spec)
        self._on_device = {self.inv_freq.device: self.inv_freq}

    def _cos_sin(self, positions: torch.Tensor):
        """(cos, sin) [T, rope_dim/2] in fp64 for these positions, on their device."""
        f = self._on_device.get(positions.device)
        if f is None:
            f = self._on_device[positions.device] = self.inv_freq.to(positions.device)
        ang = positions.to(torch.float64)[:, None] * f[None, :]
        return torch.cos(ang), torch.sin(ang)

    def __call__(self, x: torch.Tensor, positions: torch.Tensor, inverse: bool = False) -> torch.Tensor:
        """x: [T, ..., D]; positions: [T]. Returns x with its last rope_dim channels rotated."""
        rd = self.spec.rope_dim
        cos, sin = self._cos_sin(positions)
        shape = (x.shape[0],) + (1,) * (x.dim() - 2) + (rd // 2,)
        cos, sin = cos.view(shape), sin.view(shape)
        if inverse:
            sin = -sin
        tail = acc(x[..., -rd:]).unflatten(-1, (rd // 2, 2))
        cos, sin = cos.to(tail.dtype), sin.to(tail.dtype)
        a, b = tail[..., 0], tail[..., 1]
        rot = torch.stack((a * cos - b * sin, a * sin + b * cos), dim=-1).flatten(-2)
        return torch.cat((x[..., :-rd], rot.to(x.dtype)), dim=-1)
