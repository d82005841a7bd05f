"""Engram (spec 2.7): hashed n-gram memory added to every mHC copy before the layer's attention mixing.

Rows come from the token ids alone (``EngramHasher``); the gathered [columns x head_dim] row concatenation is
projected to one key per copy and one shared value, and a per-copy gate from the dot product of two RMS
norms decides how much value each copy receives. Dead tokens (image spans) get gate 0.
"""
from __future__ import annotations

import torch
from torch import nn

from ..models.config import ModelConfig
from .engram_hash import EngramHasher, engram_rows_per_layer
from .numerics import acc


class Engram(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int):
        super().__init__()
        self.cfg = cfg
        d, n = cfg.hidden_size, cfg.hc_mult
        self.hasher = EngramHasher(cfg, layer_id)
        rows = engram_rows_per_layer(cfg)[layer_id]
        self.embed = nn.Embedding(rows, cfg.engram_head_dim)
        self.wkv = nn.Linear(cfg.engram_columns * cfg.engram_head_dim, (n + 1) * d, bias=False)
        self.q_weight = nn.Parameter(torch.ones(n, d))
        self.k_weight = nn.Parameter(torch.ones(n, d))

    def forward(self, x: torch.Tensor, compressed_ids: torch.Tensor, seq_rows: list[slice],
                histories: list[torch.Tensor]) -> torch.Tensor:
        """x: the mHC stream [T, n, d]; compressed_ids [T] (-1 = dead); per sequence its rows and the ids
        before them (hashing looks back across chunk boundaries, never across sequences)."""
        t, n, d = x.shape
        eps = self.cfg.rms_norm_eps
        rows = torch.cat([self.hasher.rows(compressed_ids[r], h) for r, h in zip(seq_rows, histories)])
        e = self.embed.weight[rows].flatten(1).to(x.dtype)
        kv = self.wkv(e)
        key, value = acc(kv[:, : n * d].view(t, n, d)), acc(kv[:, n * d:])
        xf = acc(x)
        dot = (xf * self.q_weight.to(xf.dtype) * self.k_weight.to(xf.dtype) * key).sum(-1)
        dot = dot * torch.rsqrt(xf.pow(2).mean(-1) + eps) * torch.rsqrt(key.pow(2).mean(-1) + eps) / d ** 0.5
        gate = torch.sigmoid(torch.sign(dot) * torch.sqrt(dot.abs().clamp_min(1e-6)))
        gate = gate.masked_fill(EngramHasher.is_dead(compressed_ids)[:, None], 0.0)
        return (xf + gate[:, :, None] * value[:, None, :]).to(x.dtype)
