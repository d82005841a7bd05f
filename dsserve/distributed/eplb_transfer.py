"""Moving expert weights to a new placement between steps: layer by layer, in bounded chunks of point-to-point sends.

``plan_layer`` lists the slots whose expert changes: from a slot of the same rank (a local copy), else from a rank
that holds the expert now (the one with the fewest sends so far: the senders share the work). ``Transfer`` runs one
model's plan: each ``advance`` (called at a step boundary, the same on every rank) runs at most one chunk of sends
(``chunk`` moves over the whole group, each a send and a receive posted together, then waited for), into a staging
buffer of that layer's incoming experts; after a layer's last chunk it copies the staging into the slots and swaps
the layer's ``ReplicaMap``, on every rank at the same boundary, so a step routes by one map that every rank's weights
already hold. Memory for moved weights: at most one layer's slots of this rank (``staging_bound``); the peak reached
is ``staging_peak``. Decoding continues between chunks on the old map, whose slots are untouched until the commit.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from .eplb_replicas import ReplicaMap


@dataclass(frozen=True)
class Move:
    """One expert's weights from a physical slot (on rank ``src``) into another (on rank ``dst``)."""

    src: int
    src_slot: int
    dst: int
    dst_slot: int


@dataclass(frozen=True)
class LayerMoves:
    layer: int
    new: tuple[int, ...]  # the layer's phy2log after the move
    moves: tuple[Move, ...]  # every slot whose expert changes (src == dst: a local copy)

    @property
    def remote(self) -> tuple[Move, ...]:
        return tuple(m for m in self.moves if m.src != m.dst)


def plan_layer(layer: int, old: tuple[int, ...], new: tuple[int, ...], ep_size: int) -> LayerMoves:
    per = len(old) // ep_size
    sends = [0] * ep_size
    moves = []
    for s, e in enumerate(new):
        if old[s] == e:
            continue
        dst = s // per
        local = [t for t in range(dst * per, (dst + 1) * per) if old[t] == e]
        if local:
            moves.append(Move(dst, local[0], dst, s))
            continue
        src_slot = min((t for t, x in enumerate(old) if x == e), key=lambda t: (sends[t // per], t))
        sends[src_slot // per] += 1
        moves.append(Move(src_slot // per, src_slot, dst, s))
    return LayerMoves(layer, tuple(new), tuple(moves))


def expert_tensors(moe: nn.Module) -> list[torch.Tensor]:
    """Every tensor of an ``ExpertParallelMoE`` indexed by its local slot: the dense experts, the packed ones."""
    out = [moe.experts[k].data for k in sorted(moe.experts)]
    p = moe.packed
    if p is not None:
        out += [t for t in (p.w1, p.w3, p.w2, p.s1, p.s3, p.s2) if t is not None]
    return out


def expert_bytes(moe: nn.Module) -> int:
    """Bytes of one expert's weights (every tensor's row)."""
    return sum(t[0].numel() * t.element_size() for t in expert_tensors(moe))


class Transfer:
    """One model's rebalance in flight. ``advance()`` at each step boundary; ``done`` when every layer switched."""

    def __init__(
        self,
        moes: list[nn.Module],
        plans: list[LayerMoves],
        ep_rank: int,
        ep_size: int,
        group: dist.ProcessGroup | None,
        chunk: int,
    ):
        if chunk < 1:
            raise ValueError(f"an EPLB transfer chunk must be >= 1 expert move, got {chunk}")
        self.moes, self.rank, self.ep_size, self.group = moes, ep_rank, ep_size, group
        self.per = moes[0].dispatcher.placement.max_local
        self.items: list[tuple[LayerMoves, tuple[Move, ...], bool]] = []  # (layer, the chunk's moves, last)
        for plan in plans:
            remote = plan.remote
            cuts = [remote[i : i + chunk] for i in range(0, len(remote), chunk)] or [()]
            self.items += [(plan, c, i == len(cuts) - 1) for i, c in enumerate(cuts)]
        self.staged: dict[int, list[torch.Tensor]] = {}  # this rank's incoming slot -> its tensors
        self.staged_bytes = self.staging_peak = 0
        self.staging_bound = self.per * max((expert_bytes(m) for m in moes), default=0)
        self.bytes_sent = 0  # by this rank
        self.bytes_moved = sum(len(p.remote) for p in plans) * max((expert_bytes(m) for m in moes), default=0)
        self.chunks = sum(1 for _, c, _ in self.items if c)
        self.layers = len(plans)
        self.switched: list[tuple[int, int]] = []  # (layer, step boundary) as each layer switched

    @property
    def done(self) -> bool:
        return not self.items

    def _peer(self, r: int) -> int:
        return r if self.group is None else dist.get_global_rank(self.group, r)

    def advance(self, step: int, chunk_allowed: bool = True) -> bool:
        """Layers with local copies only switch at once; then at most one chunk of sends (returns True when this
        boundary ran one: a step that waited on a transfer), and its layer switches if it was the last. ``step``:
        the boundary's step number, kept in ``switched`` per layer."""
        ran = False
        while self.items:
            plan, moves, last = self.items[0]
            if moves:
                if ran or not chunk_allowed:
                    break
                self._exchange(plan, moves)
                ran = True
            self.items.pop(0)
            if last:
                self._commit(plan)
                self.switched.append((plan.layer, step))
        return ran

    def _exchange(self, plan: LayerMoves, moves: tuple[Move, ...]) -> None:
        moe = self.moes[plan.layer]
        tensors = expert_tensors(moe)
        ops = []
        for i, m in enumerate(moves):
            if m.src == self.rank:
                for j, t in enumerate(tensors):
                    row = t[m.src_slot - self.rank * self.per].contiguous()
                    ops.append(dist.P2POp(dist.isend, row, self._peer(m.dst), self.group, tag=i * len(tensors) + j))
                    self.bytes_sent += row.numel() * row.element_size()
            if m.dst == self.rank:
                into = self._stage(m.dst_slot, tensors)
                for j, t in enumerate(into):
                    ops.append(dist.P2POp(dist.irecv, t, self._peer(m.src), self.group, tag=i * len(tensors) + j))
        if ops:
            for work in dist.batch_isend_irecv(ops):
                work.wait()

    def _stage(self, slot: int, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        into = [torch.empty_like(t[0]) for t in tensors]
        self.staged[slot] = into
        self.staged_bytes += sum(t.numel() * t.element_size() for t in into)
        self.staging_peak = max(self.staging_peak, self.staged_bytes)
        return into

    @torch.no_grad()
    def _commit(self, plan: LayerMoves) -> None:
        moe = self.moes[plan.layer]
        tensors = expert_tensors(moe)
        base = self.rank * self.per
        for m in plan.moves:  # local copies read the old slots before any slot is written
            if m.src == m.dst == self.rank:
                for t, into in zip(tensors, self._stage(m.dst_slot, tensors)):
                    into.copy_(t[m.src_slot - base])
        for slot, rows in self.staged.items():
            for t, row in zip(tensors, rows):
                t[slot - base].copy_(row)
        self.staged.clear()
        self.staged_bytes = 0
        moe.replicas = ReplicaMap(plan.new, moe.replicas.n_experts)
