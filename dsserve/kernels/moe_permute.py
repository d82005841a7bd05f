"""Expert-sorted order and the tile table of the grouped MoE GEMMs (grouped_moe), from torch index ops only.

* ids int64 [T, k] (int32 accepted), expert ids in [0, E); the (token, slot) pair t*k + j is one row of the GEMMs.
* order int64 [T*k]: the pair indices sorted by expert (stable: token order inside an expert, so deterministic).
* tiles int32 [3, n_tiles]: per tile of BM consecutive sorted positions, its expert (E marks a tile past the last
  real one), its first sorted position and the end of its expert's run (rows at or past it are masked).

Each expert's run is cut into ceil(count / BM) tiles; at most min(E, T*k) experts are used, each wasting at most
BM - 1 rows, so n_tiles = (T*k + min(E, T*k) * (BM - 1)) // BM bounds the real tile count whatever the routing.
The launch grid therefore depends only on (T, k, E, BM): no host sync, and the whole call is CUDA-graph capturable.
The E-sized work (two searchsorted, one cumsum) is tiny index math, so decode pays nothing per empty expert.
"""
from __future__ import annotations

import torch


def tile_count(n_pairs: int, n_experts: int, block_m: int) -> int:
    """Upper bound on the number of BM-row tiles over all experts (exact when every used expert gets one pair)."""
    return (n_pairs + min(n_experts, n_pairs) * (block_m - 1)) // block_m


def expert_tiles(ids: torch.Tensor, n_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(order int64 [T*k], tiles int32 [3, tile_count]) as described in the module docstring. Ids outside
    [0, E) sort before or after every run and land in no tile: their rows are never computed."""
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
