"""Expert load recording for EPLB: tokens per (layer, logical expert) per step, in a sliding window on the device.

Each MoE forward adds its pairs' counts into the step's ``[L, E]`` row set (an ``index_add_`` of fixed shape: no host
sync, graph-safe) and the rows each destination rank will run (``[L, EP]``, from the physical slots); ``end_step``
copies both into ring slot ``step % W`` and clears the step's counts. Reading the window (``window_load``,
``window_rank_load``) is the only host sync, done at a rebalance or a figures refresh. A forward with zero rows (an
idle rank's, a dummy batch) records nothing.
"""

from __future__ import annotations

import torch


class ExpertLoad:
    def __init__(self, n_layers: int, n_experts: int, n_slots: int, ep_size: int, window: int, device=None):
        if window < 1:
            raise ValueError(f"the EPLB window must be >= 1 step, got {window}")
        self.n_layers, self.n_experts, self.ep_size, self.window = n_layers, n_experts, ep_size, window
        self.per_rank = n_slots // ep_size
        self.step = torch.zeros(n_layers, n_experts, dtype=torch.long, device=device)
        self.step_ranks = torch.zeros(n_layers, ep_size, dtype=torch.long, device=device)
        self.ring = torch.zeros(window, n_layers, n_experts, dtype=torch.long, device=device)
        self.ring_ranks = torch.zeros(window, n_layers, ep_size, dtype=torch.long, device=device)
        self.steps = 0  # steps ended (a host counter, advanced in lockstep by every rank)

    def layer(self, i: int) -> LayerLoad:
        return LayerLoad(self, i)

    def record(self, layer: int, ids: torch.Tensor, slots: torch.Tensor) -> None:
        """ids, slots [T, k]: the pairs' logical experts and the physical slots they run on."""
        flat = ids.reshape(-1).to(self.step.device)
        if flat.numel() == 0:
            return
        one = torch.ones_like(flat)
        self.step[layer].index_add_(0, flat, one)
        self.step_ranks[layer].index_add_(0, slots.reshape(-1).to(flat.device) // self.per_rank, one)

    def end_step(self) -> None:
        i = self.steps % self.window
        self.ring[i].copy_(self.step)
        self.ring_ranks[i].copy_(self.step_ranks)
        self.step.zero_()
        self.step_ranks.zero_()
        self.steps += 1

    def filled(self) -> int:
        return min(self.steps, self.window)

    def window_load(self) -> torch.Tensor:
        """[L, E] tokens per logical expert over the window (this rank's)."""
        return self.ring.sum(0)

    def window_rank_load(self) -> torch.Tensor:
        """[n, L, EP] the rows this rank sent to each rank, per step of the window, oldest first (n = filled)."""
        n = self.filled()
        idx = [(self.steps - n + j) % self.window for j in range(n)]
        return self.ring_ranks[idx]


class LayerLoad:
    """The recorder one MoE layer calls: ``load(ids, slots)``."""

    def __init__(self, load: ExpertLoad, layer: int):
        self.load, self.index = load, layer

    def __call__(self, ids: torch.Tensor, slots: torch.Tensor) -> None:
        self.load.record(self.index, ids, slots)
