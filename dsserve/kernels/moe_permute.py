"""Expert-sorted order and the tile table of the grouped MoE GEMMs (grouped_moe): one Triton launch, or torch ops.

* ids int64 [T, k] (int32 accepted), expert ids in [0, E); the (token, slot) pair t*k + j is one row of the GEMMs.
* order int64 [T*k]: the pair indices sorted by expert (stable: token order inside an expert, so deterministic).
* tiles int32 [3, n_tiles]: per tile of BM consecutive sorted positions, its expert (E marks a tile past the last
  real one), its first sorted position and the end of its expert's run (rows at or past it are masked).

Each expert's run is cut into ceil(count / BM) tiles; at most min(E, T*k) experts are used, each wasting at most
BM - 1 rows, so n_tiles = (T*k + min(E, T*k) * (BM - 1)) // BM bounds the real tile count whatever the routing.
The launch grid therefore depends only on (T, k, E, BM): no host sync, and the whole call is CUDA-graph capturable.

The kernel, for decode-sized calls (T*k <= MAX_KERNEL_PAIRS: B <= 170 at top-6), is one launch of E + 1 small
programs. Program e reads all ids, counts the pairs of every expert by one-hot sums, ranks its own pairs by a cumsum
(pair order: stable) and writes its run of the order and its tiles. Program E places the ids outside [0, E) after
every run (expert_tiles_ref sorts negative ones first; they land in no tile) and fills the table past the last real
tile. On the H200 (2026-12-02, benchmarks/results/decode-gemms-h200/expert_tiles_ab.json) it takes 1.6 us at 6
pairs, 4.6 us at 192 and 7.8 us at 1020, where the single program it replaced (pairwise ranking over [128, 128]
blocks) took 8.2 and 24 us and torch's ~12 launches 57-68 us from 384 pairs on. Larger calls keep the torch version.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# larger calls take the torch version: every program reads every id, a [pairs, E] one-hot a program
MAX_KERNEL_PAIRS = 1024


def tile_count(n_pairs: int, n_experts: int, block_m: int) -> int:
    """Upper bound on the number of BM-row tiles over all experts (exact when every used expert gets one pair)."""
    return (n_pairs + min(n_experts, n_pairs) * (block_m - 1)) // block_m


@triton.jit(do_not_specialize=["n", "n_tiles"])
def _expert_run_kernel(
    ids_ptr,
    n,
    order_ptr,
    tiles_ptr,
    n_tiles,
    E: tl.constexpr,
    EP: tl.constexpr,
    BM: tl.constexpr,
    PMAX: tl.constexpr,
    TMAX: tl.constexpr,
    TAIL: tl.constexpr,
):
    """Program e < E: expert e's run (its pairs' sorted positions) and its tiles; program E: the pairs with ids
    outside [0, E) (after every run) and the table's slots past the last real tile. Each program reads all ids."""
    e = tl.program_id(0)
    i = tl.arange(0, PMAX)
    ex = tl.arange(0, EP)
    ids = tl.load(ids_ptr + i, mask=i < n, other=-1).to(tl.int32)
    key = tl.where((ids >= 0) & (ids < E), ids, E)  # out-of-range ids sort after every run, in pair order
    key = tl.where(i < n, key, E + 1)  # padding: in no run
    counts = tl.sum((key[:, None] == ex[None, :]).to(tl.int32), axis=0)  # [EP]: pairs per expert (ex < E)
    counts = tl.where(ex < E, counts, 0)
    per = (counts + BM - 1) // BM  # tiles per expert
    mine = key == e
    start = tl.sum(tl.where(ex < e, counts, 0), axis=0)  # program E: every valid pair sorts before its own
    rank = tl.cumsum(mine.to(tl.int32), axis=0) - 1  # stable: pair order inside the run
    tl.store(order_ptr + start + rank, i.to(tl.int64), mask=mine)
    if e < E:
        cnt = tl.sum(tl.where(ex == e, counts, 0), axis=0)
        first = tl.sum(tl.where(ex < e, per, 0), axis=0)
        j = tl.arange(0, TMAX)
        m = j < (cnt + BM - 1) // BM
        tl.store(tiles_ptr + first + j, e + j * 0, mask=m)
        tl.store(tiles_ptr + n_tiles + first + j, start + j * BM, mask=m)
        tl.store(tiles_ptr + 2 * n_tiles + first + j, start + cnt + j * 0, mask=m)
    else:  # past the last real tile: expert E, and the last expert's run continued (as expert_tiles_ref writes)
        last_start = tl.sum(tl.where(ex < E - 1, counts, 0), axis=0)
        last_first = tl.sum(tl.where(ex < E - 1, per, 0), axis=0)
        last_end = last_start + tl.sum(tl.where(ex == E - 1, counts, 0), axis=0)
        jt = tl.sum(per, axis=0) + tl.arange(0, TAIL)
        mt = jt < n_tiles
        tl.store(tiles_ptr + jt, E + jt * 0, mask=mt)
        tl.store(tiles_ptr + n_tiles + jt, last_start + (jt - last_first) * BM, mask=mt)
        tl.store(tiles_ptr + 2 * n_tiles + jt, last_end + jt * 0, mask=mt)


def expert_tiles(ids: torch.Tensor, n_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(order int64 [T*k], tiles int32 [3, tile_count]) as described in the module docstring: the kernel on CUDA
    for up to MAX_KERNEL_PAIRS pairs, expert_tiles_ref otherwise (also on the CPU: under the Triton interpreter
    the kernel takes ~30 ms a call, which engine tests would pay in every MoE layer; its own tests call
    expert_tiles_kernel)."""
    if not ids.is_cuda or ids.numel() > MAX_KERNEL_PAIRS:
        return expert_tiles_ref(ids, n_experts, block_m)
    return expert_tiles_kernel(ids, n_experts, block_m)


def run_constexprs(n: int, n_experts: int, block_m: int) -> dict:
    """The expert-run kernel's sizes for n pairs: loop trip counts are compile-time (the interpreter needs that), so
    pairs round up to a power of two and a changing T reuses one of few compiled variants."""
    cap = triton.next_power_of_2(n)
    pmax = max(16, cap)
    return dict(
        E=n_experts,
        EP=triton.next_power_of_2(n_experts),
        BM=block_m,
        PMAX=pmax,
        TMAX=max(2, triton.next_power_of_2(triton.cdiv(pmax, block_m))),
        TAIL=max(2, triton.next_power_of_2(tile_count(cap, n_experts, block_m))),
    )


def expert_tiles_kernel(ids: torch.Tensor, n_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """expert_tiles by the kernel, whatever the size and device (CUDA or the Triton interpreter)."""
    flat = ids.reshape(-1).contiguous()
    n = flat.numel()
    n_tiles = tile_count(n, n_experts, block_m)
    order = torch.empty(n, dtype=torch.int64, device=ids.device)
    tiles = torch.empty((3, n_tiles), dtype=torch.int32, device=ids.device)
    if n == 0:
        return order, tiles
    _expert_run_kernel[(n_experts + 1,)](
        flat, n, order, tiles, n_tiles, **run_constexprs(n, n_experts, block_m), num_warps=4
    )
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
