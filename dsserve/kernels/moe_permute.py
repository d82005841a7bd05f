"""Expert-sorted order and the tile table of the grouped MoE GEMMs (grouped_moe): one Triton launch, or torch ops.

* ids int64 [T, k] (int32 accepted), expert ids in [0, E); the (token, slot) pair t*k + j is one row of the GEMMs.
* order int64 [T*k]: the pair indices sorted by expert (stable: token order inside an expert, so deterministic).
* tiles int32 [3, n_tiles]: per tile of BM consecutive sorted positions, its expert (E marks a tile past the last
  real one), its first sorted position and the end of its expert's run (rows at or past it are masked).

Each expert's run is cut into ceil(count / BM) tiles; at most min(E, T*k) experts are used, each wasting at most
BM - 1 rows, so n_tiles = (T*k + min(E, T*k) * (BM - 1)) // BM bounds the real tile count whatever the routing.
The launch grid therefore depends only on (T, k, E, BM): no host sync, and the whole call is CUDA-graph capturable.

The kernel, for small decode calls (T*k <= MAX_KERNEL_PAIRS: B <= 42 at top-6), is one program: per-expert
counts by one-hot sums, each pair's sorted position by counting the pairs that sort before it (pairwise over
[BLK, BLK] blocks: no scan along the pairs), the tile table from the counts. It replaces a radix sort, three
searchsorted and a scan, ~12 launches and 20-40 us of a decode step's MoE layer on the H200: this kernel takes
9 us at 6 pairs and 29 us at 192 (2026-11-30; a first version with a 2-D cumsum over [pairs, E] one-hot blocks
took 190 us, Triton scans across that layout badly; unrolling the block loops made 192 pairs slower, 43 us).
Larger batches and prefill chunks keep the torch version. Ids outside [0, E) are placed after every run
(expert_tiles_ref sorts negative ones first) and land in no tile.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

BLK = 128  # pairs per block of the kernel's passes
# larger calls take the torch version: the kernel's pairwise ranking is O(pairs^2) and its block loops a chain of
# dependent loads (H200, 2026-11-30: 9 us at 6 pairs, 29 us at 192, 402 us at 768 where torch's ~12 launches
# take ~40 us)
MAX_KERNEL_PAIRS = 256


def tile_count(n_pairs: int, n_experts: int, block_m: int) -> int:
    """Upper bound on the number of BM-row tiles over all experts (exact when every used expert gets one pair)."""
    return (n_pairs + min(n_experts, n_pairs) * (block_m - 1)) // block_m


@triton.jit
def _expert_tiles_kernel(ids_ptr, n, order_ptr, tiles_ptr, n_tiles, E: tl.constexpr, EP: tl.constexpr,
                         BM: tl.constexpr, BLK: tl.constexpr, N_BLOCKS: tl.constexpr, T_BLOCKS: tl.constexpr):
    ex = tl.arange(0, EP)
    lane = tl.arange(0, BLK)
    counts = tl.zeros((EP,), tl.int32)
    for b in range(N_BLOCKS):  # pairs per expert (ids outside [0, E) count nowhere)
        i = b * BLK + lane
        e = tl.load(ids_ptr + i, mask=i < n, other=-1).to(tl.int32)
        counts += tl.sum(((e[:, None] == ex[None, :]) & (ex[None, :] < E)).to(tl.int32), axis=0)
    per = (counts + BM - 1) // BM
    tile_end = tl.cumsum(per, axis=0)
    start = tl.cumsum(counts, axis=0) - counts  # first sorted position of each expert's run
    for b in range(N_BLOCKS):  # each pair's sorted position: the pairs that sort before it, counted pairwise
        i = b * BLK + lane
        live = i < n
        e = tl.load(ids_ptr + i, mask=live, other=-1).to(tl.int32)
        key = tl.where((e >= 0) & (e < E), e, E)  # out-of-range ids sort after every run, in pair order
        pos = tl.zeros((BLK,), tl.int32)
        for c in range(N_BLOCKS):
            j = c * BLK + lane
            f = tl.load(ids_ptr + j, mask=j < n, other=-1).to(tl.int32)
            kj = tl.where((f >= 0) & (f < E), f, E)
            before = (kj[None, :] < key[:, None]) | ((kj[None, :] == key[:, None]) & (j[None, :] < i[:, None]))
            pos += tl.sum((before & (j[None, :] < n)).to(tl.int32), axis=1)
        tl.store(order_ptr + pos, i.to(tl.int64), mask=live)
    for b in range(T_BLOCKS):  # the tile table
        j = b * BLK + lane
        te = tl.sum(((tile_end[None, :] <= j[:, None]) & (ex[None, :] < E)).to(tl.int32), axis=1)
        sel = (ex[None, :] == tl.minimum(te, E - 1)[:, None]).to(tl.int32)
        first = tl.sum(sel * start[None, :], axis=1)
        lo = first + (j - tl.sum(sel * (tile_end - per)[None, :], axis=1)) * BM
        hi = first + tl.sum(sel * counts[None, :], axis=1)
        m = j < n_tiles
        tl.store(tiles_ptr + j, te, mask=m)
        tl.store(tiles_ptr + n_tiles + j, lo, mask=m)
        tl.store(tiles_ptr + 2 * n_tiles + j, hi, mask=m)


def expert_tiles(ids: torch.Tensor, n_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(order int64 [T*k], tiles int32 [3, tile_count]) as described in the module docstring: the kernel on CUDA
    for up to MAX_KERNEL_PAIRS pairs, expert_tiles_ref otherwise (also on the CPU: under the Triton interpreter
    the kernel takes ~30 ms a call, which engine tests would pay in every MoE layer; its own tests call
    expert_tiles_kernel)."""
    if not ids.is_cuda or ids.numel() > MAX_KERNEL_PAIRS:
        return expert_tiles_ref(ids, n_experts, block_m)
    return expert_tiles_kernel(ids, n_experts, block_m)


def expert_tiles_kernel(ids: torch.Tensor, n_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """expert_tiles by the one-program kernel, whatever the size and device (CUDA or the Triton interpreter)."""
    flat = ids.reshape(-1).contiguous()
    n = flat.numel()
    n_tiles = tile_count(n, n_experts, block_m)
    order = torch.empty(n, dtype=torch.int64, device=ids.device)
    tiles = torch.empty((3, n_tiles), dtype=torch.int32, device=ids.device)
    if n == 0:
        return order, tiles
    # loop trip counts are compile-time (the interpreter needs that); pairs round up to a power of two so a
    # changing T reuses one of few compiled variants
    cap = triton.next_power_of_2(n)
    _expert_tiles_kernel[(1,)](flat, n, order, tiles, n_tiles, E=n_experts, EP=triton.next_power_of_2(n_experts),
                               BM=block_m, BLK=BLK, N_BLOCKS=triton.cdiv(cap, BLK),
                               T_BLOCKS=triton.cdiv(tile_count(cap, n_experts, block_m), BLK), num_warps=4)
    return order, tiles


def expert_tiles_ref(ids: torch.Tensor, n_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """expert_tiles from torch index ops (a stable sort, searchsorted, a cumsum); ids outside [0, E) sort before or
    after every run."""
    flat = ids.reshape(-1).long()
    n, dev = flat.numel(), flat.device
    sorted_ids, order = torch.sort(flat, stable=True)
    experts = torch.arange(n_experts, device=dev)
    start = torch.searchsorted(sorted_ids, experts, right=False)
    end = torch.searchsorted(sorted_ids, experts, right=True)
    per_expert = torch.div(end - start + (block_m - 1), block_m, rounding_mode="floor")
    tile_end = torch.cumsum(per_expert, 0)
    j = torch.arange(tile_count(n, n_experts, block_m), device=dev)
    # tile j belongs to the first expert whose cumulative tile count exceeds j; E past the last real tile
    te = torch.searchsorted(tile_end, j, right=True)
    ec = te.clamp(max=n_experts - 1)
    lo = start[ec] + (j - (tile_end[ec] - per_expert[ec])) * block_m
    return order, torch.stack([te, lo, end[ec]]).to(torch.int32)
