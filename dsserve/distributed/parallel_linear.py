"""The modules a tensor-parallel split swaps in where it closes, keeping the parameter names of the modules they
replace (``wo_b.weight``, ``embed.weight``, ``head.weight``), so a checkpoint's shard loads by the same name.

- ``RowParallelLinear``: y = x_local @ W_local^T summed over the group (the input features are split).
- ``VocabParallelEmbedding``: this rank's rows of the table; ids outside them give zeros; summed over the group.
- ``VocabParallelHead``: this rank's rows of the output projection; the logits gathered along the vocabulary.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from .all_gather import all_gather_dim
from .all_reduce import all_reduce_sum


def vocab_shards(vocab: int, size: int) -> list[tuple[int, int]]:
    """Each rank's [start, end) of the vocabulary: contiguous, the first ``vocab % size`` ranks one row longer."""
    base, extra = divmod(vocab, size)
    bounds = [0]
    for r in range(size):
        bounds.append(bounds[-1] + base + (r < extra))
    return list(zip(bounds[:-1], bounds[1:]))


class RowParallelLinear(nn.Module):
    """A bias-free linear layer holding this rank's columns of the weight (a slice of the input features): its
    product on this rank's slice of the input is a partial sum, completed by an all-reduce over ``group``. Not an
    ``nn.Linear`` on purpose: a pass that swaps every ``nn.Linear`` (models.quantize.quantize_dense_fp8) leaves it
    as it is, so its all-reduce cannot be dropped."""

    def __init__(self, weight: torch.Tensor, group: dist.ProcessGroup | None):
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=weight.requires_grad)
        self.out_features, self.in_features = weight.shape
        self.group = group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return all_reduce_sum(F.linear(x, self.weight), self.group)


class VocabParallelEmbedding(nn.Embedding):
    """An ``nn.Embedding`` holding rows [start, end) of the table."""

    def __init__(self, weight: torch.Tensor, start: int, vocab: int, group: dist.ProcessGroup | None):
        super().__init__(weight.shape[0], weight.shape[1], device="meta")
        self.weight = nn.Parameter(weight, requires_grad=weight.requires_grad)
        self.start, self.vocab, self.group = start, vocab, group

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.start
        mine = (local >= 0) & (local < self.weight.shape[0])
        rows = F.embedding(local.clamp(0, self.weight.shape[0] - 1), self.weight)
        return all_reduce_sum(rows * mine[..., None].to(rows.dtype), self.group)


class VocabParallelHead(nn.Linear):
    """An ``nn.Linear`` holding output rows [start, end) of the vocabulary projection; returns every rank's logits
    gathered along the last dimension, so the caller sees the whole vocabulary."""

    def __init__(self, weight: torch.Tensor, sizes: list[int], group: dist.ProcessGroup | None):
        super().__init__(weight.shape[1], weight.shape[0], bias=False, device="meta")
        self.weight = nn.Parameter(weight, requires_grad=weight.requires_grad)
        self.sizes, self.group = sizes, group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return all_gather_dim(super().forward(x), -1, self.group, self.sizes)
