"""Indexer scoring kernels vs their torch refs (interpreter: tiny shapes; GPU: real shapes), and the consumer's
candidate path (candidate scores -> topk -> candidate_entries) vs the model's (masked full scores, stable_topk)."""
import pytest
import torch

from dsserve.kernels import indexer as ix
from dsserve.kernels.topk import candidate_blocks, topk
from dsserve.layers import quant
from dsserve.layers.indexer import candidate_pool, stable_topk

NEG_INF = float("-inf")
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _paged(fmt, t, di, epb, nblk, seed, distinct=None, device="cpu", shared_table=False):
    """(pool, block_table, logical keys [T, nblk*epb, Di]): every row maps its entries to shuffled physical blocks
    of one pool holding t*nblk blocks; `distinct` reuses that many keys so scores tie."""
    g = torch.Generator().manual_seed(seed)
    rf = ix._row_format(fmt, di)
    n = nblk * epb
    base = torch.randn(t * n if distinct is None else distinct, di, generator=g)
    keys = base[torch.arange(t * n) % base.shape[0]].view(t, n, di)
    perm = torch.randperm(t * nblk, generator=g).view(t, nblk)
    if shared_table:
        perm = perm[:1].expand(t, nblk)
    pool = torch.zeros(t * nblk * epb, rf.row_bytes, dtype=torch.uint8)
    phys = (perm[:, :, None] * epb + torch.arange(epb)).view(t, n)
    pool[phys.flatten()] = rf.pack(keys.flatten(0, 1))  # a shared table: later rows overwrite, read back below
    keys = rf.unpack(pool[phys])
    return pool.to(device), perm.int().to(device), keys.to(device)


def _qw(t, h, di, seed, exact=False, device="cpu", dtype=torch.float32):
    """Random q, w; exact=True puts them on dyadic grids (FP4 q, w in k/8) so every score is exact in fp32."""
    g = torch.Generator().manual_seed(seed)
    q, w = torch.randn(t, h, di, generator=g), torch.randn(t, h, generator=g)
    if exact:
        q, w = quant.fake_quant_fp4_pow2(q, 32), torch.randint(-4, 5, (t, h), generator=g) / 8.0
    return q.to(device, dtype), w.to(device), g


def _close(out, ref, tol):
    assert not out.isnan().any()
    assert torch.equal(out == NEG_INF, ref == NEG_INF)
    fin = ref > NEG_INF
    assert fin.any()
    err = (out[fin] - ref[fin]).norm() / ref[fin].norm()
    assert err < tol, err


@pytest.fixture
def small_tiles(monkeypatch):
    monkeypatch.setattr(ix, "BLOCK_N", 16)   # several tiles per row at tiny n
    monkeypatch.setattr(ix, "MAX_BLOCK_H", 16)  # H = 20 -> two head chunks, the second padded


@pytest.mark.parametrize("fmt", ["fp4", "bf16"])
def test_ref_follows_block_table(fmt):
    pool, bt, keys = _paged(fmt, 3, 32, 8, 4, seed=1)
    q, w, _ = _qw(3, 4, 32, seed=2)
    nv = torch.tensor([0, 9, 32])
    s = ix.index_scores_ref(q, w, pool, fmt, bt, 8, nv, 30)
    want = torch.einsum("thn,th->tn", torch.relu(torch.einsum("thd,tnd->thn", q, keys[:, :30])), w)
    want = want.masked_fill(torch.arange(30) >= nv[:, None], NEG_INF)
    _close(s, want, 1e-6)  # (torch.testing.assert_close would import torch.distributed: 2 s)


@pytest.mark.parametrize("fmt,h,di,qdt", [("fp4", 4, 64, torch.float32), ("bf16", 20, 32, torch.float32),
                                          ("fp4", 20, 32, torch.bfloat16)])
def test_index_scores(small_tiles, fmt, h, di, qdt):
    pool, bt, _ = _paged(fmt, 5, di, 8, 8, seed=3)
    q, w, _ = _qw(5, h, di, seed=4, dtype=qdt)
    nv = torch.tensor([0, 1, 17, 33, 64], dtype=torch.int32)  # 64 > n_max: cut at n_max
    out = torch.full((5, 50), float("nan"))
    got = ix.index_scores(q, w, pool, fmt, bt, 8, nv, 50, out=out)
    assert got is out
    _close(out, ix.index_scores_ref(q, w, pool, fmt, bt, 8, nv, 50), 1e-5)
    assert (out[0] == NEG_INF).all() and (out[1, 1:] == NEG_INF).all() and out[1, 0] > NEG_INF


def test_index_scores_raw_fp4_bytes(small_tiles):
    # every nibble code (-0.0 too) and the smallest scale bytes, 0 (2^-127, fp32 subnormal) included; q is scaled
    # up by 2^120 so those keys still dominate the scores
    g = torch.Generator().manual_seed(11)
    pool = torch.randint(0, 256, (32, 34), generator=g, dtype=torch.uint8)
    pool[:, 32:] = torch.randint(0, 4, (32, 2), generator=g, dtype=torch.uint8)
    bt = torch.randperm(4, generator=g).int().expand(3, 4)
    q, w, _ = _qw(3, 4, 64, seed=12)
    nv = torch.tensor([32, 20, 7])
    out = ix.index_scores(q * 2.0 ** 120, w, pool, "fp4", bt, 8, nv, 32)
    _close(out, ix.index_scores_ref(q * 2.0 ** 120, w, pool, "fp4", bt, 8, nv, 32), 1e-5)


@pytest.mark.parametrize("fmt,qdt", [("fp4", torch.float32), ("bf16", torch.float32), ("fp4", torch.bfloat16)])
def test_index_scores_candidates(small_tiles, fmt, qdt):
    pool, bt, _ = _paged(fmt, 4, 32, 8, 6, seed=5)
    q, w, g = _qw(4, 4, 32, seed=6, dtype=qdt)
    nv = torch.tensor([0, 5, 30, 48])
    # cbs 4: 12 blocks reachable; ids past n_visible, past the table (20), -1 anywhere, any order
    cand = torch.randint(0, 14, (4, 8), generator=g).int()
    cand[torch.rand(4, 8, generator=g) < 0.3] = -1
    cand[3, :3] = torch.tensor([20, 11, 1])
    out = torch.full((4, 32), float("nan"))
    ix.index_scores_candidates(q, w, pool, fmt, bt, 8, cand, 4, nv, out=out)
    ref = ix.index_scores_candidates_ref(q, w, pool, fmt, bt, 8, cand, 4, nv)
    _close(out, ref, 1e-5)
    ent = ix.candidate_entries(cand, 4, torch.arange(32))
    assert torch.equal(ref > NEG_INF, (ent >= 0) & (ent < nv[:, None]))


@pytest.mark.parametrize("fmt", ["fp4", "bf16"])
def test_consumer_selection_matches_model(small_tiles, fmt):
    # one sequence's chunk of rows sharing a table; few distinct keys so scores tie; dyadic inputs so the kernel
    # and the ref agree bit for bit and the comparison can be exact
    t, epb, cbs, top_blocks, k = 6, 8, 4, 5, 6
    pool, bt, _ = _paged(fmt, t, 32, epb, 8, seed=7, distinct=9, shared_table=True)
    nv = torch.tensor([0, 3, 13, 30, 47, 64])
    qs, ws, _ = _qw(t, 4, 32, seed=8, exact=True, dtype=torch.float64)  # fp64 like the tiny models
    qc, wc, _ = _qw(t, 4, 32, seed=9, exact=True, dtype=torch.float64)
    src = ix.index_scores(qs, ws, pool, fmt, bt, epb, nv, 64)
    cand = candidate_blocks(src, nv, cbs, top_blocks)
    full = ix.index_scores_ref(qc, wc, pool, fmt, bt, epb, nv, 64)
    m_idx, m_valid = stable_topk(full.masked_fill(~candidate_pool(src, nv, cbs, top_blocks), NEG_INF), k)
    cs = ix.index_scores_candidates(qc, wc, pool, fmt, bt, epb, cand, cbs, nv)
    c_idx, c_valid = topk(cs, k)
    ent = ix.candidate_entries(cand, cbs, c_idx)
    assert torch.equal(m_valid.sum(1), c_valid.sum(1)) and m_valid[-1].all()
    for r in range(t):
        assert torch.equal(m_idx[r][m_valid[r]], ent[r][c_valid[r]])


def test_input_errors():
    pool, bt, _ = _paged("fp4", 2, 32, 8, 2, seed=0)
    q, w, _ = _qw(2, 4, 32, seed=0)
    nv = torch.tensor([3, 4])
    with pytest.raises(ValueError, match="format"):
        ix.index_scores(q, w, pool, "fp8", bt, 8, nv, 16)
    with pytest.raises(ValueError, match="pool"):
        ix.index_scores_ref(q, w, pool, "bf16", bt, 8, nv, 16)
    with pytest.raises(ValueError, match="float tensor"):
        ix.index_scores(q.int(), w, pool, "fp4", bt, 8, nv, 16)
    with pytest.raises(ValueError, match="epb"):
        ix.index_scores(q, w, pool, "fp4", bt, 0, nv, 16)
    with pytest.raises(ValueError, match="cand_blocks"):
        ix.index_scores_candidates(q, w, pool, "fp4", bt, 8, torch.zeros(3, 2, dtype=torch.int32), 4, nv)


# ------------------------------------------------------------------ GPU: real shapes
def _real(fmt, t, epb, n_max, seed, prefill):
    """Random pool bytes (FP4 scale bytes kept in 2^[-9, 0]), per-row block tables and visible counts."""
    g = torch.Generator().manual_seed(seed)
    mb = -(-n_max // epb)
    nblk = mb if prefill else t * mb
    rb = 68 if fmt == "fp4" else 256
    pool = torch.randint(0, 256, (nblk * epb, rb), generator=g, dtype=torch.uint8)
    if fmt == "fp4":
        pool[:, 64:] = torch.randint(118, 128, (nblk * epb, 4), generator=g, dtype=torch.uint8)
    else:
        pool = torch.randn(nblk * epb, 128, generator=g).bfloat16().view(torch.uint8)
    if prefill:  # one sequence's chunk: shared table, consecutive positions ending at n_max
        bt = torch.randperm(nblk, generator=g)[None].expand(t, mb)
        nv = n_max - t + 1 + torch.arange(t)
    else:
        bt = torch.randperm(nblk, generator=g)[:t * mb].view(t, mb)
        nv = torch.randint(0, n_max + 1, (t,), generator=g)
        nv[0] = n_max
    return pool.cuda(), bt.int().cuda(), nv.int().cuda(), g


@cuda
@pytest.mark.parametrize("fmt", ["fp4", "bf16"])
@pytest.mark.parametrize("t,epb,prefill,qdt", [(1, 64, False, torch.bfloat16), (16, 32, False, torch.bfloat16),
                                               (64, 64, False, torch.bfloat16), (256, 64, True, torch.bfloat16),
                                               (16, 64, False, torch.float32)])
def test_index_scores_gpu(fmt, t, epb, prefill, qdt):
    n_max = 20000
    pool, bt, nv, g = _real(fmt, t, epb, n_max, seed=t + epb, prefill=prefill)
    q = torch.randn(t, 32, 128, generator=g).to("cuda", qdt)
    w = torch.randn(t, 32, generator=g).cuda() * 128 ** -0.5 * 32 ** -0.5
    out = torch.full((t, n_max), float("nan"), device="cuda")
    ix.index_scores(q, w, pool, fmt, bt, epb, nv, n_max, out=out)
    _close(out, ix.index_scores_ref(q, w, pool, fmt, bt, epb, nv, n_max), 1e-5 if qdt == torch.float32 else 1e-2)

    # consumer: the source's 2048 best blocks of 8 (-1 padded while the context is short)
    src = ix.index_scores(q, w.flip(1), pool, fmt, bt, epb, nv, n_max)
    cand = candidate_blocks(src, nv, 8, 2048)
    cand[:, ::7] = torch.where(cand[:, ::7] >= 0, cand[:, ::7], 5)  # a few ids in the -1 tail, unsorted
    out = torch.full((t, 2048 * 8), float("nan"), device="cuda")
    ix.index_scores_candidates(q, w, pool, fmt, bt, epb, cand, 8, nv, out=out)
    ref = ix.index_scores_candidates_ref(q, w, pool, fmt, bt, epb, cand, 8, nv)
    _close(out, ref, 1e-5 if qdt == torch.float32 else 1e-2)
