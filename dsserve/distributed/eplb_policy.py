"""The EPLB placement policy: how many replicas each logical expert gets and which physical slot holds each.

A MoE with E logical experts runs on P = E + R physical slots, rank r holding slots [r * P / EP, (r + 1) * P / EP)
(the spec's contiguous rule). Given a layer's recorded load (tokens per logical expert over the window):

1. **Replicas by load**: every expert one slot, then each of the R redundant slots, one at a time, to the expert
   whose load per replica is highest (at most one replica a rank: a second on the same rank halves nothing). Counts
   capped at 2, 3 and 4 replicas an expert are packed too and the best packing wins: with few slots a rank, the
   light experts are the fillers that even the ranks out.
2. **Packing**: replicas (each carrying load / replicas, as the replica choice shares an expert's rows evenly) into
   nodes, then into each node's ranks, heaviest first into the lightest pack with room that does not already hold
   the expert; then pairwise swaps out of the heaviest pack while they lower it (equal slot counts a pack).
3. **Slot preservation**: the packs are matched to the ranks that already hold most of their experts, and on a rank
   an expert keeps the slot it had, so a rebalance moves only what changed.

The reference point is DeepSeek's published hierarchical EPLB (groups -> nodes -> GPUs); V4.1 has no expert groups,
so the node level here packs replicas directly, and the swap pass and the rank matching are this module's own.
Everything is deterministic (ties by expert id, then rank): every rank computes the same placement from the same
all-reduced load, so no rank needs another's result.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence

from .groups import ParallelConfigError


def check_slots(n_experts: int, n_redundant: int, ep_size: int, n_nodes: int = 1) -> int:
    """P = E + R physical slots, checked: P % EP == 0, EP % nodes == 0, R >= 0. Returns P."""
    p = n_experts + n_redundant
    if n_redundant < 0:
        raise ParallelConfigError(f"num_redundant_experts must be >= 0, got {n_redundant}")
    if ep_size < 1 or p % ep_size:
        raise ParallelConfigError(
            f"{n_experts} experts + {n_redundant} redundant = {p} slots must split evenly over {ep_size} EP ranks"
        )
    if n_nodes < 1 or ep_size % n_nodes:
        raise ParallelConfigError(f"{n_nodes} nodes must divide the {ep_size} EP ranks")
    return p


def replica_counts(load: Sequence[float], n_slots: int, max_replicas: int) -> list[int]:
    """Replicas per expert: one each, then every extra slot to the highest load per replica (ties: lower id), no
    expert above ``max_replicas`` while another is below it."""
    e = len(load)
    counts = [1] * e
    heap = [(-float(load[i]), i) for i in range(e)]
    heapq.heapify(heap)
    parked = []  # experts at max_replicas: used only when every expert is there
    for _ in range(n_slots - e):
        while heap and counts[heap[0][1]] >= max_replicas:
            parked.append(heapq.heappop(heap)[1])
        if not heap:  # every expert at the cap: spread the rest from expert 0 on
            heap = [(-float(load[i]) / counts[i], i) for i in parked]
            heapq.heapify(heap)
            parked, max_replicas = [], max_replicas + 1
        _, i = heapq.heappop(heap)
        counts[i] += 1
        heapq.heappush(heap, (-float(load[i]) / counts[i], i))
    return counts


def _pack(items: list[tuple[float, int]], n_packs: int, size: int) -> list[list[tuple[float, int]]]:
    """items (weight, expert) into n_packs of exactly ``size`` each: heaviest first into the lightest pack with room
    that lacks the expert (else the lightest with room), then swaps out of the heaviest pack while one lowers it."""
    packs: list[list[tuple[float, int]]] = [[] for _ in range(n_packs)]
    total = [0.0] * n_packs
    for w, ex in sorted(items, key=lambda it: (-it[0], it[1])):
        room = [p for p in range(n_packs) if len(packs[p]) < size]
        fresh = [p for p in room if all(x != ex for _, x in packs[p])] or room
        p = min(fresh, key=lambda q: (total[q], q))
        packs[p].append((w, ex))
        total[p] += w
    for _ in range(4 * len(items)):  # bounded: every swap strictly lowers the heaviest pack or leaves the loop
        hi = max(range(n_packs), key=lambda q: (total[q], -q))
        best = None
        for lo in range(n_packs):
            if lo == hi:
                continue
            for i, (wi, ei) in enumerate(packs[hi]):
                for j, (wj, ej) in enumerate(packs[lo]):
                    d = wi - wj
                    if d <= 1e-12 or total[lo] + d >= total[hi] - 1e-12:
                        continue
                    if ei != ej and (any(x == ei for _, x in packs[lo]) or any(x == ej for _, x in packs[hi])):
                        continue
                    new_max = max(total[hi] - d, total[lo] + d)
                    if best is None or new_max < best[0] - 1e-12:
                        best = (new_max, lo, i, j, d)
        if best is None:
            break
        _, lo, i, j, d = best
        packs[hi][i], packs[lo][j] = packs[lo][j], packs[hi][i]
        total[hi] -= d
        total[lo] += d
    return packs


def _match(packs: list[list[int]], held: list[list[int]]) -> list[int]:
    """A rank for each pack (a permutation), pairing packs with the ranks that hold most of their experts already
    (greedy by overlap, ties by pack then rank)."""
    n = len(packs)
    overlap = []
    for p in range(n):
        for r in range(n):
            left = list(held[r])
            c = 0
            for ex in packs[p]:
                if ex in left:
                    left.remove(ex)
                    c += 1
            overlap.append((-c, p, r))
    overlap.sort()
    rank_of, used = [-1] * n, set()
    for _, p, r in overlap:
        if rank_of[p] < 0 and r not in used:
            rank_of[p] = r
            used.add(r)
    return rank_of


def _rank_packs(
    load: list[float], ep_size: int, n_slots: int, n_nodes: int, held: list[list[int]], cap: int
) -> list[list[int]]:
    """The experts of each rank (with repeats; at most ``cap`` replicas an expert while others have fewer), packs
    matched to the ranks holding most of them (``held``)."""
    e = len(load)
    per_rank, ranks_per_node = n_slots // ep_size, ep_size // n_nodes
    counts = replica_counts(load, n_slots, cap)
    items = [(load[i] / counts[i], i) for i in range(e) for _ in range(counts[i])]
    ranks: list[list[int]] = [[] for _ in range(ep_size)]
    node_packs = _pack(items, n_nodes, per_rank * ranks_per_node) if n_nodes > 1 else [items]
    node_held = [sum(held[n * ranks_per_node : (n + 1) * ranks_per_node], []) for n in range(n_nodes)]
    node_of = _match([[x for _, x in p] for p in node_packs], node_held) if n_nodes > 1 else [0]
    for pack, node in zip(node_packs, node_of):
        rank_packs = [[x for _, x in p] for p in _pack(pack, ranks_per_node, per_rank)]
        base = node * ranks_per_node
        for p, r in enumerate(_match(rank_packs, held[base : base + ranks_per_node])):
            ranks[base + r] = rank_packs[p]
    return ranks


def _max_rank(load: list[float], ranks: list[list[int]]) -> float:
    counts = [0] * len(load)
    for r in ranks:
        for x in r:
            counts[x] += 1
    return max(sum(load[x] / counts[x] for x in r) for r in ranks)


def place_layer(
    load: Sequence[float],
    ep_size: int,
    n_slots: int,
    n_nodes: int = 1,
    old: Sequence[int] | None = None,
) -> list[int]:
    """phy2log [P] for one layer: the logical expert each physical slot holds. ``old``: the layer's current phy2log
    (its experts keep their ranks and slots where the packing allows).

    Never worse than no redundancy: where E and R both split evenly over the ranks, the packing without redundant
    slots, each rank's extra slots repeating its own experts (a replica on the same rank changes no rank's load),
    is a candidate too, and the lower most-loaded rank wins."""
    e = len(load)
    check_slots(e, n_slots - e, ep_size, n_nodes)
    per_rank = n_slots // ep_size
    load = [max(float(x), 0.0) for x in load]
    if sum(load) == 0:
        load = [1.0] * e  # nothing recorded: balance the slots
    held = (
        [[] for _ in range(ep_size)]
        if old is None
        else [list(old[r * per_rank : (r + 1) * per_rank]) for r in range(ep_size)]
    )
    # replicas by load alone can starve the light experts a rank's last slots need: capped counts are candidates too
    caps = sorted({c for c in (2, 3, 4, ep_size) if c <= ep_size and c * e >= n_slots} or {ep_size}, reverse=True)
    ranks = None
    for cap in caps:
        got = _rank_packs(load, ep_size, n_slots, n_nodes, held, cap)
        if ranks is None or _max_rank(load, got) < _max_rank(load, ranks) - 1e-12:
            ranks = got
    if n_slots > e and e % ep_size == 0 and n_slots % ep_size == 0:
        plain = _rank_packs(load, ep_size, e, n_nodes, held, 1)
        plain = [r + sorted(r, key=lambda x: (-load[x], x))[: per_rank - len(r)] for r in plain]
        if _max_rank(load, plain) < _max_rank(load, ranks) - 1e-12:
            ranks = plain
    out = []
    for r in range(ep_size):
        mine = sorted(ranks[r])
        slots: list[int | None] = [None] * per_rank
        for s, ex in enumerate(held[r]):  # an expert keeps its slot on this rank
            if ex in mine:
                slots[s] = ex
                mine.remove(ex)
        it = iter(mine)
        out.extend(ex if ex is not None else next(it) for ex in slots)
    return out


def place(
    load: Sequence[Sequence[float]],
    ep_size: int,
    n_redundant: int,
    n_nodes: int = 1,
    old: Sequence[Sequence[int]] | None = None,
    min_gain: float = 0.0,
) -> list[list[int]]:
    """phy2log [L][P] for every layer of one MoE model from its load [L][E]. With ``old`` (the current placement), a
    layer keeps it where nothing was recorded or the new one would not lower the expected most loaded rank by more
    than the fraction ``min_gain`` (0: any gain moves; SGLang's utilisation threshold, per layer)."""
    n_slots = check_slots(len(load[0]), n_redundant, ep_size, n_nodes)
    out = []
    for i, row in enumerate(load):
        was = None if old is None else list(old[i])
        new = place_layer(row, ep_size, n_slots, n_nodes, was)
        if was is not None and (
            sum(row) <= 0 or max(rank_loads(row, new, ep_size)) >= max(rank_loads(row, was, ep_size)) * (1 - min_gain)
        ):
            new = was  # nothing recorded, or no better: no moves
        out.append(new)
    return out


def initial_layer(n_experts: int, n_redundant: int, ep_size: int) -> list[int]:
    """The placement before any load is known: experts in order, the redundant slots repeating them from 0 (with
    R = 0 the contiguous placement)."""
    n_slots = check_slots(n_experts, n_redundant, ep_size)
    return [s % n_experts for s in range(n_slots)]


def rank_loads(load: Sequence[float], phy2log: Sequence[int], ep_size: int) -> list[float]:
    """Expected tokens per rank when each expert's load splits evenly over its replicas."""
    counts = [0] * len(load)
    for ex in phy2log:
        counts[ex] += 1
    per_rank = len(phy2log) // ep_size
    return [
        sum(float(load[ex]) / counts[ex] for ex in phy2log[r * per_rank : (r + 1) * per_rank]) for r in range(ep_size)
    ]


def balance(per_rank: Sequence[float]) -> float:
    """mean / max of per-rank loads (1: perfectly even; 1 also when nothing ran)."""
    top = max(per_rank)
    return 1.0 if top <= 0 else sum(per_rank) / len(per_rank) / top
