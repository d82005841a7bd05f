"""The logical -> physical map a MoE layer routes by under EPLB: which slot runs each (token, k) pair."""

from __future__ import annotations

from collections.abc import Sequence

import torch


class ReplicaMap:
    """One layer's ``phy2log`` [P] (the logical expert each physical slot holds) as a routing table.

    ``route(ids, ep_rank)`` picks replica ``(row + k + ep_rank) % replicas`` of each pair's expert: deterministic
    (the same batch always lands on the same slots), and a hot expert's rows alternate over its replicas, so each
    replica runs ~1/replicas of them, which is what the placement policy assumes. Replicas hold equal weights, so the
    choice never changes a product. Built once per placement and swapped whole between steps: a layer routes by
    one map for a whole step.
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
        t, k = ids.shape
        turn = torch.arange(t, device=ids.device)[:, None] + torch.arange(k, device=ids.device)[None, :] + ep_rank
        return table[ids, turn % counts[ids]]
