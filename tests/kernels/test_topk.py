"""topk == stable_topk exactly (ties, -inf, signed zeros, k > N); candidate_blocks == candidate_pool's choice."""

import pytest
import torch

from dsserve.kernels.topk import candidate_blocks, candidate_blocks_ref, topk, topk_int64_keys, topk_ref
from dsserve.layers.indexer import candidate_pool, stable_topk

NEG_INF = float("-inf")
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _tied_scores(t, n, g, device="cpu"):
    """Few distinct values (ties everywhere), signed zeros, -inf runs, a whole -inf row 0, one +inf in the last row."""
    s = torch.randint(-3, 4, (t, n), generator=g).float() * 0.75
    s[torch.rand(t, n, generator=g) < 0.25] = NEG_INF
    s[torch.rand(t, n, generator=g) < 0.15] = -0.0
    s[0] = NEG_INF
    s[-1, n // 2] = float("inf")
    return s.to(device)


@pytest.mark.parametrize("fn", [topk, topk_int64_keys])  # topk sends rows this short to row_topk (Triton)
def test_topk_matches_stable_topk(fn):
    g = torch.Generator().manual_seed(0)
    for n in (1, 7, 33, 100):
        s = _tied_scores(5, n, g)
        for k in (0, 1, 5, n - 1, n, n + 3):
            for x in (s, s.bfloat16()) if fn is topk_int64_keys else (s, s.bfloat16(), s.double()):
                got, want = fn(x, max(k, 0)), topk_ref(x, max(k, 0))
                assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), (n, k, x.dtype)
    assert topk_ref is stable_topk


def test_topk_extremes_and_tiny_gaps():
    # finite extremes, subnormals and neighbouring floats must order exactly like the float compare
    v = torch.tensor([3.4e38, -3.4e38, 1e-45, -1e-45, 1.0, 1.0 + 2**-23, -1.0, -1.0 - 2**-23, 0.0, -0.0])
    s = v[torch.randperm(10, generator=torch.Generator().manual_seed(1))].repeat(2, 3)
    for k in range(0, 31, 3):
        for fn in (topk, topk_int64_keys):
            got, want = fn(s, k), stable_topk(s, k)
            assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def _mask(cand, block, n):
    keep = torch.zeros(cand.shape[0], -(-n // block) + 1, dtype=torch.bool)
    keep.scatter_(1, torch.where(cand >= 0, cand.long(), keep.shape[1] - 1), True)
    return keep[:, :-1].repeat_interleave(block, 1)[:, :n]


def test_candidate_blocks_matches_pool():
    g = torch.Generator().manual_seed(2)
    for n in (1, 13, 40):
        s = _tied_scores(6, n, g)
        s[-1] = s[-1].clamp(max=3.0)  # pinning uses +inf; a real +inf score could tie with it
        nv = torch.randint(0, n + 1, (6,), generator=g)
        nv[0], nv[-1] = 0, n
        s = s.masked_fill(torch.arange(n) >= nv[:, None], NEG_INF)
        for block in (1, 3, 4):
            for top in (0, 1, 2, 5, 50):
                cand = candidate_blocks(s, nv, block, top)
                assert cand.dtype == torch.int32 and cand.shape == (6, top)
                assert torch.equal(_mask(cand, block, n), candidate_pool(s, nv, block, top)), (n, block, top)
                valid = cand >= 0  # ascending ids first, then -1 padding
                assert torch.equal(valid, valid.cummin(1).values)
                assert (cand[:, 1:][valid[:, 1:]] > cand[:, :-1][valid[:, 1:]]).all()
                assert torch.equal(cand, candidate_blocks_ref(s, nv, block, top))


def test_input_errors():
    with pytest.raises(ValueError, match="scores"):
        topk(torch.zeros(3, dtype=torch.float32), 1)
    with pytest.raises(ValueError, match="k must"):
        topk(torch.zeros(2, 3), -1)
    with pytest.raises(ValueError, match="n_visible"):
        candidate_blocks(torch.zeros(2, 8), torch.zeros(3, dtype=torch.int64), 4, 2)
    with pytest.raises(ValueError, match="block"):
        candidate_blocks(torch.zeros(2, 8), torch.zeros(2, dtype=torch.int64), 0, 2)


@cuda
@pytest.mark.parametrize("t,n,k", [(1, 20000, 512), (64, 20000, 512), (256, 16384, 2048)])
def test_topk_gpu(t, n, k):
    g = torch.Generator().manual_seed(t)
    s = _tied_scores(t, n, g)
    s[:, 1:] += torch.randn(t, n - 1, generator=g).round(decimals=1)  # more distinct values, still ties
    got = topk(s.cuda(), k)
    want = stable_topk(s, k)
    assert torch.equal(got[0].cpu(), want[0]) and torch.equal(got[1].cpu(), want[1])


@cuda
@pytest.mark.parametrize("t,n", [(16, 20000), (256, 20000), (4, 5000)])
def test_candidate_blocks_gpu(t, n):
    g = torch.Generator().manual_seed(n + t)
    s = torch.randn(t, n, generator=g).round(decimals=2)
    nv = torch.randint(0, n + 1, (t,), generator=g)
    nv[0] = n
    s = s.masked_fill(torch.arange(n) >= nv[:, None], NEG_INF)
    cand = candidate_blocks(s.cuda(), nv.cuda(), 8, 2048)
    assert torch.equal(_mask(cand.cpu(), 8, n), candidate_pool(s, nv, 8, 2048))
