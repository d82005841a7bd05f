"""Which share of the model one rank holds: its tensor-parallel and expert-parallel coordinates (spec parallel 2-3).

TP splits attention heads, ``wo_a`` by group, ``wo_b``'s and the shared expert's inputs, the routed experts'
intermediate (when not EP) and the vocabulary; EP gives each rank a contiguous block of routed experts. The
loader reads only the slices a layout owns (models.release_loader); the parallel-execution issue builds on it.
"""

from __future__ import annotations

from dataclasses import dataclass


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

    def experts(self, n_experts: int) -> range:
        """The routed experts this rank holds: expert-parallel ranks take contiguous equal blocks."""
        if n_experts % self.ep_size:
            raise ValueError(
                f"{n_experts} routed experts do not split evenly over {self.ep_size} expert-parallel ranks"
            )
        per = n_experts // self.ep_size
        return range(self.ep_rank * per, (self.ep_rank + 1) * per)

    def tp_part(self, n: int, what: str, align: int = 1) -> tuple[int, int]:
        """This TP rank's [lo, hi) of `n` indices split evenly (each share a multiple of `align`)."""
        if n % self.tp_size or (n // self.tp_size) % align:
            raise ValueError(
                f"{what}: {n} does not split over {self.tp_size} tensor-parallel ranks"
                + (f" in multiples of {align}" if align > 1 else "")
            )
        per = n // self.tp_size
        return self.tp_rank * per, (self.tp_rank + 1) * per

    @property
    def is_single(self) -> bool:
        return self.tp_size == 1 and self.ep_size == 1
