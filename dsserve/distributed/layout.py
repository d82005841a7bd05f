"""Which share of the model one rank holds: its tensor-parallel and expert-parallel coordinates (spec parallel 2-3).

The share rules are the parallel passes' own: a TP rank holds ``tensor_parallel.tp_slice`` of each tensor (what
``shard_tensor_parallel`` cuts), an EP rank the routed experts ``ExpertPlacement.contiguous`` gives it (what
``shard_expert_parallel`` keeps); with EPLB's redundant slots (``redundant``) the experts of its slots under the
initial placement (``eplb_policy.initial_layer``, what ``Eplb.shard`` places). The loader reads a rank's share by
these methods (models.release_loader), so a rank built from files holds exactly what the passes would have cut.
"""

from __future__ import annotations

from dataclasses import dataclass

from .eplb_policy import initial_layer
from .expert_placement import ExpertPlacement
from .tensor_parallel import check_tp_split, tp_slice


@dataclass(frozen=True)
class ParallelLayout:
    tp_rank: int = 0
    tp_size: int = 1
    ep_rank: int = 0
    ep_size: int = 1
    # EPLB (--enable-eplb): the redundant slots of the target's and of the drafter's MoE layers; None: no EPLB
    redundant: tuple[int, int] | None = None

    def __post_init__(self):
        for rank, size, what in ((self.tp_rank, self.tp_size, "tp"), (self.ep_rank, self.ep_size, "ep")):
            if size < 1 or not 0 <= rank < size:
                raise ValueError(f"{what}_rank must lie in [0, {what}_size) with {what}_size >= 1, got {rank}/{size}")
        if self.redundant is not None and min(self.redundant) < 0:
            raise ValueError(f"redundant slots must be >= 0, got {self.redundant}")

    def phy2log(self, n_experts: int, draft: bool = False) -> tuple[int, ...] | None:
        """The logical expert of each physical slot of an MoE of ``n_experts`` (the drafter's with ``draft``) under
        EPLB's initial placement; None without EPLB (slot = expert)."""
        if self.redundant is None:
            return None
        return tuple(initial_layer(n_experts, self.redundant[draft], self.ep_size))

    def experts(self, n_experts: int, draft: bool = False) -> tuple[int, ...]:
        """The routed experts this rank holds, in its local order: the EP pass's contiguous placement, over the
        physical slots with EPLB (an expert of a redundant slot counts once per slot)."""
        slots = self.phy2log(n_experts, draft)
        if slots is None:
            return ExpertPlacement.contiguous(n_experts, self.ep_size).owned[self.ep_rank]
        return tuple(slots[s] for s in ExpertPlacement.contiguous(len(slots), self.ep_size).owned[self.ep_rank])

    def tp_slice(self, name: str, cfg) -> tuple[int, int, int] | None:
        """(dim, start, end) of model tensor ``name`` this TP rank holds, or None (replicated): ``tp_slice``, after
        ``check_tp_split`` (ParallelConfigError naming the counts that do not divide)."""
        check_tp_split(cfg, self.tp_size)
        return tp_slice(name, cfg, self.tp_rank, self.tp_size)

    @property
    def is_single(self) -> bool:
        return self.tp_size == 1 and self.ep_size == 1
