"""The logical -> physical map a MoE layer routes by under EPLB: which slot runs each (token, k) pair."""

from __future__ import annotations

from collections.abc import Sequence

import torch


class ReplicaMap:
    """One layer's ``phy2log`` [P] (the logical expert each physical slot holds) as a routing table.

    ``route(ids, ep_rank)`` sends the j-th pair (in row, k order) of this rank's batch that picked expert e to
    replica ``(j + ep_rank) % replicas(e)``: each rank splits every expert's pairs over its replicas exactly evenly
    (to one pair; the offset rotates the remainders over the ranks), which is what the placement policy assumes.
    A split by row index instead leaves a binomial spread per replica and step (at EP32 with two slots a rank it
    costs the drafter ~0.02 of balance a step). Deterministic (the same batch always lands on the same slots), no
    host sync; replicas hold equal weights, so the choice never changes a product. Built once per placement and
    swapped whole between steps: a layer routes by one map for a whole step.
    """

    def __init__(self, phy2log: Sequence[int], n_experts: int):
        self.phy2log = tuple(int(e) for e in phy2log)
        counts = [0] * n_experts
        for e in self.phy2log:
            counts[e] += 1
        if min(counts) == 0:
            missing = [e for e, c in enumerate(counts) if c == 0]
            raise ValueError(f"a placement must hold every logical expert at least once; missing {missing}")
        table = torch.zeros(n_experts, max(counts), dtype=torch.long)
        seen = [0] * n_experts
        for slot, e in enumerate(self.phy2log):
            table[e, seen[e]] = slot
            seen[e] += 1
        self.n_experts = n_experts
        self._cpu = (table, torch.tensor(counts, dtype=torch.long))
        self._on: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}

    @property
    def n_slots(self) -> int:
        return len(self.phy2log)

    def replicas(self) -> list[int]:
        return self._cpu[1].tolist()

    def _tables(self, device: torch.device):
        if device not in self._on:
            self._on[device] = tuple(t.to(device) for t in self._cpu)
        return self._on[device]

    def route(self, ids: torch.Tensor, ep_rank: int = 0) -> torch.Tensor:
        """ids [T, k] logical -> [T, k] physical slots, on ids' device (no host sync)."""
        table, counts = self._tables(ids.device)
        flat = ids.reshape(-1)
        turn = occurrence(flat[None], self.n_experts)[0] + ep_rank
        return table[flat, turn % counts[flat]].view(ids.shape)


def occurrence(keys: torch.Tensor, n_keys: int) -> torch.Tensor:
    """keys [B, N] in [0, n_keys) -> [B, N]: how many earlier entries of its row hold the same key (a stable sort
    and a scatter of fixed shapes: no host sync)."""
    b, n = keys.shape
    order = torch.sort(keys, dim=1, stable=True).indices
    count = torch.zeros(b, n_keys, dtype=torch.long, device=keys.device)
    count.scatter_add_(1, keys, torch.ones_like(keys))
    start = count.cumsum(1) - count  # the first sorted position of each key
    rank_in_sorted = torch.arange(n, device=keys.device).expand(b, n) - start.gather(1, keys.gather(1, order))
    return torch.empty_like(keys).scatter_(1, order, rank_in_sorted)
