"""kernels.moe_permute: the one-launch counting sort equals the torch reference (order and tile table)."""

import pytest
import torch

from dsserve.kernels.moe_permute import (
    MAX_KERNEL_PAIRS,
    expert_tiles,
    expert_tiles_kernel,
    expert_tiles_ref,
    tile_count,
)

DEV = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize(
    "t,k,e,bm", [(1, 6, 48, 16), (7, 2, 8, 16), (120, 2, 8, 16), (40, 6, 48, 64), (5, 3, 5, 16), (170, 6, 48, 16)]
)
def test_kernel_equals_reference(t, k, e, bm):
    assert t * k <= MAX_KERNEL_PAIRS  # sizes the dispatcher sends to the kernel on CUDA
    g = torch.Generator().manual_seed(t * 100 + e)
    ids = torch.rand(t, e, generator=g).argsort(1)[:, :k]
    if t == 120:
        ids[:100] = 3  # one crowded expert over several tiles and both one-hot blocks
        ids[:100, 1] = 5
    ids = ids.to(DEV)
    order, tiles = expert_tiles_kernel(ids, e, bm)
    ref_order, ref_tiles = expert_tiles_ref(ids, e, bm)
    if DEV == "cuda":  # the dispatcher takes the kernel there at these sizes
        assert all(torch.equal(a, b) for a, b in zip(expert_tiles(ids, e, bm), (order, tiles)))
    assert tiles.shape == (3, tile_count(t * k, e, bm))
    assert torch.equal(order.cpu(), ref_order.cpu())
    assert torch.equal(tiles.cpu(), ref_tiles.cpu())


def test_int32_ids_and_ids_out_of_range():
    ids = torch.tensor([[0, 7], [7, 0], [-1, 8], [2, 7], [7, 7], [9, 3]], dtype=torch.int32).to(DEV)
    order, tiles = expert_tiles_kernel(ids, 8, 16)
    flat = ids.reshape(-1).long().cpu()
    assert sorted(order.cpu().tolist()) == list(range(flat.numel()))  # a permutation: every pair placed once
    seen = []
    for ex, lo, hi in tiles.cpu().t().tolist():
        if ex < 8:
            rows = order.cpu()[lo : min(lo + 16, hi)]
            assert (flat[rows] == ex).all()
            seen += rows.tolist()
    assert sorted(seen) == ((flat >= 0) & (flat < 8)).nonzero().flatten().tolist()
