"""Which expert-parallel rank holds which routed experts."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .groups import ParallelConfigError


@dataclass(frozen=True)
class ExpertPlacement:
    """``owned[r]``: the routed experts rank r holds, in its local order (its stacked weights' rows). Every expert
    is held by exactly one rank (redundant replicas, EPLB's, are later work: docs/parallel.md)."""

    n_experts: int
    owned: tuple[tuple[int, ...], ...]

    def __post_init__(self):
        held = sorted(e for r in self.owned for e in r)
        if held != list(range(self.n_experts)):
            raise ParallelConfigError(
                f"an expert placement must hold each of the {self.n_experts} experts exactly once; got {self.owned}"
            )
        if any(len(r) == 0 for r in self.owned):
            raise ParallelConfigError(f"every EP rank must hold at least one expert; got {self.owned}")

    @classmethod
    def contiguous(cls, n_experts: int, ep_size: int) -> ExpertPlacement:
        """Rank r holds [r * E / EP, (r + 1) * E / EP): EP must divide E (the spec's P % EP == 0)."""
        if ep_size < 1 or n_experts % ep_size:
            raise ParallelConfigError(f"expert parallel size {ep_size} must divide the {n_experts} routed experts")
        n = n_experts // ep_size
        return cls(n_experts, tuple(tuple(range(r * n, (r + 1) * n)) for r in range(ep_size)))

    @property
    def ep_size(self) -> int:
        return len(self.owned)

    @property
    def max_local(self) -> int:
        return max(len(r) for r in self.owned)

    def owner(self) -> torch.Tensor:
        """[E] int64: the rank holding each expert."""
        out = torch.empty(self.n_experts, dtype=torch.long)
        for r, experts in enumerate(self.owned):
            out[list(experts)] = r
        return out

    def local_index(self) -> torch.Tensor:
        """[E] int64: each expert's row in its rank's stacked weights."""
        out = torch.empty(self.n_experts, dtype=torch.long)
        for experts in self.owned:
            out[list(experts)] = torch.arange(len(experts))
        return out
