"""Which share of the model one rank holds: its tensor-parallel and expert-parallel coordinates (spec parallel 2-3).

The share rules are the parallel passes' own: a TP rank holds ``tensor_parallel.tp_slice`` of each tensor (what
``shard_tensor_parallel`` cuts), an EP rank the routed experts ``ExpertPlacement.contiguous`` gives it (what
``shard_expert_parallel`` keeps). The loader reads a rank's share by these methods (models.release_loader), so a
rank built from files holds exactly what the passes would have cut.
"""

from __future__ import annotations

from dataclasses import dataclass

from .expert_placement import ExpertPlacement
from .tensor_parallel import check_tp_split, tp_slice


@dataclass(frozen=True)
class ParallelLayout:
    tp_rank: int = 0
    tp_size: int = 1
    ep_rank: int = 0
    ep_size: int = 1

    def __post_init__(self):
        for rank, size, what in ((self.tp_rank, self.tp_size, "tp"), (self.ep_rank, self.ep_size, "ep")):
            if size < 1 or not 0 <= rank < size:
                raise ValueError(f"{what}_rank must lie in [0, {what}_size) with {what}_size >= 1, got {rank}/{size}")

    def experts(self, n_experts: int) -> tuple[int, ...]:
        """The routed experts this rank holds, in its local order (the EP pass's contiguous placement)."""
        return ExpertPlacement.contiguous(n_experts, self.ep_size).owned[self.ep_rank]

    def tp_slice(self, name: str, cfg) -> tuple[int, int, int] | None:
        """(dim, start, end) of model tensor ``name`` this TP rank holds, or None (replicated): ``tp_slice``, after
        ``check_tp_split`` (ParallelConfigError naming the counts that do not divide)."""
        check_tp_split(cfg, self.tp_size)
        return tp_slice(name, cfg, self.tp_rank, self.tp_size)

    @property
    def is_single(self) -> bool:
        return self.tp_size == 1 and self.ep_size == 1
