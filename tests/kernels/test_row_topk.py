"""row_topk == topk (hence stable_topk) bit for bit: idx and valid, on random, tie-heavy and -inf-heavy rows."""

import pytest
import torch

from dsserve.kernels.row_topk import MAX_N, chunk_topk, row_topk
from dsserve.kernels.topk import topk, topk_int64_keys

NEG_INF = float("-inf")
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _scores(kind, t, n, g):
    """fp32 [t, n]. randn: distinct (the search stops early). ties: few values, signed zeros and -inf runs, so the
    cut falls inside a tie and the full 32-bit search runs. sparse: rows with 0..n finite scores (a decode row
    past its context is -inf), row 0 all -inf."""
    if kind == "randn":
        return torch.randn(t, n, generator=g)
    if kind == "ties":
        s = torch.randint(-3, 3, (t, n), generator=g).float() / 2
        s[torch.rand(t, n, generator=g) < 0.2] = NEG_INF
        s[torch.rand(t, n, generator=g) < 0.2] = -0.0
        return s
    s = torch.randn(t, n, generator=g)
    n_fin = torch.randint(0, n + 1, (t,), generator=g)
    n_fin[0] = 0
    return s.masked_fill(torch.arange(n) >= n_fin[:, None], NEG_INF)


def _check(scores, k, **kw):
    want_idx, want_valid = topk(scores, k)
    # poisoned buffers: every slot must be written, and with the right value
    idx = torch.full_like(want_idx, -1)
    valid = ~want_valid
    got_idx, got_valid = row_topk(scores, k, out=(idx, valid), **kw)
    assert got_idx is idx and got_valid is valid
    assert torch.equal(idx, want_idx), (tuple(scores.shape), k, scores.dtype)
    assert torch.equal(valid, want_valid), (tuple(scores.shape), k, scores.dtype)


@pytest.mark.parametrize("kind", ["randn", "ties", "sparse"])
def test_matches_topk(kind):
    g = torch.Generator().manual_seed(0)
    for n in (1, 2, 7, 33, 300):
        s = _scores(kind, 3, n, g)
        for k in sorted({1, n // 2, n - 1, n, n + 5} - {0}):
            _check(s, k)


def test_dtypes_extremes_and_strides():
    g = torch.Generator().manual_seed(1)
    s = torch.randn(3, 77, generator=g) * 4
    s[1, ::5] = -0.0
    s[2, 30:] = NEG_INF
    for dt in (torch.bfloat16, torch.float16):  # rounding to 8 / 11 bits makes ties across the cut
        _check(s.to(dt), 20)
    # finite extremes, subnormals, neighbouring floats, infinities: ordered exactly as the float compare
    v = torch.tensor(
        [3.4e38, -3.4e38, 1e-45, -1e-45, 1.0, 1.0 + 2**-23, -1.0, -1.0 - 2**-23, 0.0, -0.0, float("inf"), NEG_INF]
    )
    x = v[torch.randperm(12, generator=g)].repeat(2, 3)
    for k in (3, 11, 12, 13, 30):
        _check(x, k)
    wide = torch.randint(-2, 2, (40, 3), generator=g).float()  # a [3, 40] view with stride (1, 3)
    _check(wide.t(), 10)


def _nan_rows(t, n, g):
    """fp32 [t, n] with NaNs of every kind: the GPU's 0x7FFFFFFF, the CPU's 0x7FC00000, negative and payload NaNs
    (garbage read as scores), mixed with -inf and ties. Rows 0-1 mostly NaN, row 2 all NaN, row 3 a few."""
    nans = torch.tensor([0x7FFFFFFF, 0x7FC00000, -0x400000, -0x7FFFFF], dtype=torch.int32).view(torch.float32)
    s = torch.randint(-3, 3, (t, n), generator=g).float() / 2
    s[torch.rand(t, n, generator=g) < 0.2] = NEG_INF
    share = torch.tensor([0.9, 0.6, 1.0] + [0.05] * (t - 3))[:, None]
    pick = nans[torch.randint(0, 4, (t, n), generator=g)]
    s = torch.where(torch.rand(t, n, generator=g) < share, pick, s)
    s[0, : n // 2] = nans[0]  # the GPU's NaN only: its key was the largest int32, where the search ended unwritten
    return s


def test_nan_scores_rank_first_and_invalid():
    # NaN ranks above +inf (torch.sort's order, hence stable_topk's) and is never valid; every slot is written
    from dsserve.layers.indexer import stable_topk

    g = torch.Generator().manual_seed(6)
    for n in (7, 64, 300):
        s = _nan_rows(5, n, g)
        for k in sorted({1, n // 4, n // 2, n}):
            want = stable_topk(s, k)
            for name, got in (("int64 keys", topk_int64_keys(s, k)), ("row_topk", row_topk(s, k))):
                assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), (name, n, k)
            _check(s, k)
            if k <= 64 and n > 64:
                _check_chunks(s, k, 64)


def test_longest_row_and_warps():
    g = torch.Generator().manual_seed(2)
    s = torch.randint(-40, 40, (1, MAX_N), generator=g).float() / 8  # 640 values: a tie at the cut
    _check(s, 512)
    _check(s[:, :600], 512, num_warps=1)


def _check_chunks(scores, k, chunk):
    want = topk_int64_keys(scores, k)
    got = chunk_topk(scores, k, chunk)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), (tuple(scores.shape), k, chunk)


@pytest.mark.parametrize("kind", ["randn", "ties", "sparse"])
def test_chunk_topk_matches_topk(kind):
    # rows of several 64-score chunks: the last one shorter than k (its -1 slots), k above a chunk's length,
    # ties and -inf runs across chunk boundaries, and a strided bf16 view
    g = torch.Generator().manual_seed(4)
    for n in (65, 130, 300):
        s = _scores(kind, 3, n, g)
        for k in (1, 5, 40, 64):
            _check_chunks(s, k, 64)
    s = _scores("ties", 4, 500, g).to(torch.bfloat16)
    _check_chunks(s[:, ::2], 30, 64)
    for bad in (48, 16):  # not a power of two; shorter than k
        with pytest.raises(ValueError, match="chunk"):
            chunk_topk(s, 30, bad)


def test_topk_sends_long_rows_to_chunks(monkeypatch):
    import dsserve.kernels.topk as T

    calls, real = [], T.chunk_topk
    monkeypatch.setattr(T, "chunk_topk", lambda *a: calls.append(1) or real(*a))
    monkeypatch.setattr(T, "MAX_N", 64)
    monkeypatch.setattr(T, "CHUNKS", True)
    g = torch.Generator().manual_seed(5)
    s = _scores("sparse", 2, 200, g)
    assert torch.equal(T.topk(s, 20)[0], topk_int64_keys(s, 20)[0]) and calls == []  # 4 chunks x 20 > 64: torch
    assert torch.equal(T.topk(s, 8)[0], topk_int64_keys(s, 8)[0]) and calls == [1]


def test_empty_shapes():
    for t, n, k in ((0, 10, 3), (2, 10, 0), (2, 0, 4)):
        idx, valid = row_topk(torch.randn(t, n), k)
        assert idx.shape == valid.shape == (t, min(k, n)) and idx.dtype == torch.int64 and valid.dtype == torch.bool


def test_input_errors():
    with pytest.raises(ValueError, match="MAX_N"):
        row_topk(torch.zeros(1, MAX_N + 1), 4)
    with pytest.raises(ValueError, match=r"\[T, N\]"):
        row_topk(torch.zeros(5), 1)
    with pytest.raises(ValueError, match="float32/bfloat16/float16"):
        row_topk(torch.zeros(2, 5, dtype=torch.float64), 1)
    with pytest.raises(ValueError, match="non-negative int"):
        row_topk(torch.zeros(2, 5), -1)
    with pytest.raises(ValueError, match="out buffers"):
        row_topk(torch.zeros(2, 5), 3, out=(torch.empty(2, 3, dtype=torch.int32), torch.empty(2, 3, dtype=torch.bool)))


# ------------------------------------------------------------------ GPU: real shapes, exact equality
@cuda
@pytest.mark.parametrize("kind", ["randn", "ties", "sparse"])
@pytest.mark.parametrize("n", [16384, 12000, 600])
@pytest.mark.parametrize("t", [1, 16, 64])
def test_gpu_decode_shapes(t, n, kind):
    g = torch.Generator().manual_seed(1000 * t + n)
    _check(_scores(kind, t, n, g).cuda(), 512)


@cuda
@pytest.mark.parametrize("n,k", [(139264, 512), (69632, 512), (20000, 2048), (16385, 512)])
def test_gpu_chunk_topk(n, k, monkeypatch):
    # a prefill chunk's source rows past 16K entries (topk sends them here), sparse rows: causal visibility
    import dsserve.kernels.topk as T

    monkeypatch.setattr(T, "CHUNKS", True)
    g = torch.Generator().manual_seed(n)
    s = _scores("sparse", 8, n, g)
    s[1] = s[1].round(decimals=1)  # ties at the cut
    s = s.cuda()
    assert torch.equal(topk(s, k)[0], topk_int64_keys(s, k)[0]) and torch.equal(topk(s, k)[1], topk_int64_keys(s, k)[1])


@cuda
def test_gpu_edge_cases():
    g = torch.Generator().manual_seed(3)
    s = torch.randn(8, MAX_N, generator=g)
    s[0] = NEG_INF
    s[1, 100:] = NEG_INF  # fewer finite scores than k
    s[2] = torch.where(torch.rand(MAX_N, generator=g) < 0.5, 0.0, -0.0)  # signed zeros tie
    s[3] = 1.5  # one value everywhere
    s[4, 7::3] = float("inf")
    s[5] = s[5].round()  # integer ties straddle the cut
    s = s.cuda()
    for k in (1, 511, 512, 513, 4096, MAX_N, MAX_N + 1):
        _check(s, k)
    for nw in (4, 8, 32):
        _check(s, 512, num_warps=nw)
    for dt in (torch.bfloat16, torch.float16):
        _check(s.to(dt), 512)
    _check(s[:, :600], 1024)  # k >= N
    _check(s[:, ::2], 512)  # strided rows
    _check(_scores("ties", 300, 2048, g).cuda(), 512)  # more rows than SMs


@cuda
@pytest.mark.parametrize("n", [16384, 24576])
def test_gpu_arithmetic_nan(n):
    # NaN made by the GPU's own arithmetic (0 * inf: 0x7FFFFFFF) over many entries, as a garbage index key gives: the
    # decode path's top-k (one row_topk, or chunk_topk past MAX_N) still writes every slot, as stable_topk orders
    from dsserve.layers.indexer import stable_topk

    g = torch.Generator().manual_seed(n)
    s = torch.randn(6, n, generator=g).cuda()
    hit = torch.rand(6, n, generator=g).cuda() < torch.tensor([1.0, 0.5, 0.03, 0.0, 0.2, 0.9], device="cuda")[:, None]
    s = torch.where(hit, s * 0 * float("inf"), s)
    s[3, n // 2 :] = NEG_INF
    assert (s[0].view(torch.int32) == 0x7FFFFFFF).all()
    for k in (512, 2048):
        got = topk(s, k)
        want = stable_topk(s.cpu(), k)
        assert torch.equal(got[0].cpu(), want[0]) and torch.equal(got[1].cpu(), want[1]), k
