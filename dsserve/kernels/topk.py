"""Top-k with the indexer's tie rule, and the candidate-block choice of the hierarchical pool (torch only).

Both ops are GPU-friendly: no Python loops over rows, no .item() syncs, fixed output shapes.

* topk(scores [T, N] float, k) -> (idx int64 [T, min(k, N)] ascending, valid bool [T, min(k, N)]):
  exactly stable_topk (dsserve.layers.indexer): the k largest scores, ties to the LOWER index, -inf picked last
  (lowest indices first) and marked invalid. Rule: each fp32 score becomes an order-preserving int32 key (the
  bits as is for sign 0, the low 31 bits flipped for sign 1, so -inf < ... < -0.0 < +0.0 < ... < +inf); the int64
  key (key << 32) | (2^32 - 1 - index) is unique per row and orders ties by lower index, so one torch.topk on it
  is the stable top-k. The raw bit keys would order -0.0 below +0.0, unlike the float compare; scores are first
  folded with `+ 0.0` (-0.0 + 0.0 = +0.0), so signed zeros tie as in stable_topk; every NaN gets the key 2^31 - 1,
  above +inf, so NaN ranks first and is marked invalid, as torch.sort orders it in stable_topk.
  bf16/fp16 scores are upcast (exact); fp64 scores use stable_topk itself (the key has no room for 64 bits).
  (A variant with an fp32 radix select plus a running count for the ties was measured on the H200: no faster on
  long prefill rows, where scoring dominates, and 3x slower at decode, where its dozen launches dominate.)
  Rows of at most row_topk.MAX_N scores (decode: the consumers' 16384 candidates) go to row_topk, one Triton
  program per row with the same result; the int64 torch.topk above cost 280-330 us there on the H200. Longer rows
  (a prefill chunk's source layers past 16K entries) go to chunk_topk (row_topk per chunk, then over the chunks'
  picks) while ceil(N / MAX_N) * k <= MAX_N (CHUNKS).
* candidate_blocks(scores [T, N], n_visible [T], block, top_blocks) -> int32 [T, top_blocks]: the block ids whose
  entries candidate_pool keeps (block score = max over its entries, the block holding entry n_visible-1 pinned
  with +inf, best top_blocks by the rule above), valid ids ascending first, then -1 padding.
"""

from __future__ import annotations

import torch

from dsserve.kernels.ops import triton_runs_on
from dsserve.kernels.row_topk import MAX_N, chunk_topk, row_topk
from dsserve.layers.indexer import candidate_pool, stable_topk

NEG_INF = float("-inf")
# Rows past MAX_N through chunk_topk rather than torch.topk on int64 keys (H200, 8192 rows of 139K scores:
# 15.6 against 47.0 ms, benchmarks/results/prefill-kernels-h200)
CHUNKS = True
topk_ref = stable_topk


def _check_scores(scores: torch.Tensor, what: str):
    if scores.dim() != 2 or not scores.is_floating_point():
        raise ValueError(f"{what}: scores must be a float [T, N] tensor, got {scores.dtype} {tuple(scores.shape)}")
    if scores.shape[1] >= 1 << 32:
        raise ValueError(f"{what}: at most 2^32 - 1 columns, got {scores.shape[1]}")


def topk(scores: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """stable_topk's result through one integer torch.topk (see module doc)."""
    _check_scores(scores, "topk")
    if not isinstance(k, int) or k < 0:
        raise ValueError(f"topk: k must be a non-negative int, got {k!r}")
    if scores.dtype == torch.float64:
        return stable_topk(scores, k)
    if scores.shape[1] <= MAX_N and triton_runs_on(scores.device):
        return row_topk(scores, k)
    if CHUNKS and -(-scores.shape[1] // MAX_N) * min(k, scores.shape[1]) <= MAX_N and triton_runs_on(scores.device):
        return chunk_topk(scores, k)
    return topk_int64_keys(scores, k)


def topk_int64_keys(scores: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """topk's torch path (any N, fp32/bf16/fp16 scores): one torch.topk on the unique int64 keys."""
    t, n = scores.shape
    k = min(k, n)
    bits = (scores.float() + 0.0).view(torch.int32)
    key = torch.where(bits < 0, bits ^ 0x7FFFFFFF, bits)
    key = torch.where(scores.isnan(), (1 << 31) - 1, key).long()
    tie = (1 << 32) - 1 - torch.arange(n, dtype=torch.int64, device=scores.device)
    order = torch.topk(key * (1 << 32) + tie, k, dim=-1, sorted=False).indices
    idx = torch.sort(order, dim=-1).values
    return idx, torch.gather(scores, -1, idx) > NEG_INF


def candidate_blocks(scores: torch.Tensor, n_visible: torch.Tensor, block: int, top_blocks: int) -> torch.Tensor:
    """Block ids of candidate_pool's choice -> int32 [T, top_blocks], ascending, -1 padded (see module doc)."""
    _check_scores(scores, "candidate_blocks")
    t, n = scores.shape
    if tuple(n_visible.shape) != (t,) or n_visible.is_floating_point():
        raise ValueError(f"candidate_blocks: n_visible must be integer [T={t}], got {tuple(n_visible.shape)}")
    if not isinstance(block, int) or block <= 0 or not isinstance(top_blocks, int) or top_blocks < 0:
        raise ValueError(f"candidate_blocks: need block > 0 and top_blocks >= 0, got {block!r}, {top_blocks!r}")
    nb = -(-n // block)
    padded = torch.nn.functional.pad(scores, (0, nb * block - n), value=NEG_INF)
    bscore = padded.view(t, nb, block).amax(-1)
    newest = torch.div(n_visible.long() - 1, block, rounding_mode="floor")
    pin = (torch.arange(nb, device=scores.device) == newest[:, None]) & (n_visible > 0)[:, None]
    idx, valid = topk(bscore.masked_fill(pin, float("inf")), top_blocks)
    ids = torch.sort(torch.where(valid, idx, nb), dim=-1).values  # invalid picks sort behind the valid ones
    out = torch.full((t, top_blocks), -1, dtype=torch.int32, device=scores.device)
    out[:, : ids.shape[1]] = torch.where(ids == nb, -1, ids).to(torch.int32)
    return out


def candidate_blocks_ref(scores: torch.Tensor, n_visible: torch.Tensor, block: int, top_blocks: int) -> torch.Tensor:
    """The same ids read off candidate_pool's entry mask (which runs on the CPU; moved back to scores.device)."""
    _check_scores(scores, "candidate_blocks_ref")
    t, n = scores.shape
    keep = candidate_pool(scores.cpu(), n_visible.cpu(), block, top_blocks)
    nb = -(-n // block)
    kb = torch.nn.functional.pad(keep, (0, nb * block - n)).view(t, nb, block).any(-1)
    ids = torch.where(kb, torch.arange(nb), nb).sort(-1).values[:, :top_blocks]
    out = torch.full((t, top_blocks), -1, dtype=torch.int32)
    out[:, : ids.shape[1]] = torch.where(ids == nb, -1, ids).to(torch.int32)
    return out.to(scores.device)
