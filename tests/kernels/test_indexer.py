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


def _paged(fmt, s, di, epb, nblk, seed, distinct=None, device="cpu", offset=0):
    """(pool, block_table [S, nblk], logical keys [S, nblk*epb, Di]): every sequence maps its entries to shuffled
    physical blocks of one pool of S*nblk blocks; `distinct` reuses that many keys so scores tie; `offset` puts
    the pool that many bytes into its storage (a misaligned view: the kernels' byte path)."""
    g = torch.Generator().manual_seed(seed)
    rf = ix._row_format(fmt, di)
    n = nblk * epb
    base = torch.randn(s * n if distinct is None else distinct, di, generator=g)
    keys = base[torch.arange(s * n) % base.shape[0]].view(s, n, di)
    perm = torch.randperm(s * nblk, generator=g).view(s, nblk)
    store = torch.zeros(s * n * rf.row_bytes + offset, dtype=torch.uint8, device=device)
    pool = store[offset:].view(s * n, rf.row_bytes)
    phys = (perm[:, :, None] * epb + torch.arange(epb)).view(s, n)
    pool[phys.flatten()] = rf.pack(keys.flatten(0, 1)).to(device)
    return pool, perm.int().to(device), rf.unpack(pool.cpu()[phys]).to(device)


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
    err = (out[fin] - ref[fin]).double().norm() / ref[fin].double().norm()
    assert err < tol, err


@pytest.fixture
def small_tiles(monkeypatch):
    monkeypatch.setattr(ix, "BLOCK_N", 16)  # several entry tiles per row at tiny n
    monkeypatch.setattr(ix, "CAND_BLOCK_N", 16)
    monkeypatch.setattr(ix, "PREFILL_M", 16)  # Hi = 4 -> tiles of 4 rows
    monkeypatch.setattr(ix, "N_TILES", 2)  # two entry tiles per program, the second past n_max at times
    monkeypatch.setattr(ix, "_FILL", 0)


@pytest.mark.parametrize("fmt", ["fp4", "bf16"])
def test_ref_follows_block_table(fmt):
    pool, bt, keys = _paged(fmt, 3, 32, 8, 4, seed=1)
    q, w, _ = _qw(4, 4, 32, seed=2)
    seq, nv = torch.tensor([2, 0, 2, 1]), torch.tensor([0, 9, 32, 20])
    s = ix.index_scores_ref(q, w, pool, fmt, bt, seq, 8, nv, 30)
    want = torch.einsum("thn,th->tn", torch.relu(torch.einsum("thd,tnd->thn", q, keys[seq, :30])), w)
    want = want.masked_fill(torch.arange(30) >= nv[:, None], NEG_INF)
    _close(s, want, 1e-6)  # (torch.testing.assert_close would import torch.distributed: 2 s)


# Di = 32/64 FP4 rows (17/34 B) and misaligned views (offset) take the byte path; Di = 128 FP4 and bf16 rows words.
@pytest.mark.parametrize(
    "fmt,h,di,qdt,offset",
    [
        ("fp4", 4, 64, torch.float32, 0),
        ("bf16", 20, 32, torch.float32, 0),
        ("fp4", 20, 32, torch.bfloat16, 0),
        ("fp4", 4, 128, torch.float32, 0),
        ("bf16", 4, 32, torch.float32, 2),
    ],
)
def test_index_scores_decode_rows(small_tiles, fmt, h, di, qdt, offset):
    # every row its own sequence and visible count (a decode batch), one sequence read twice
    pool, bt, _ = _paged(fmt, 4, di, 8, 8, seed=3, offset=offset)
    q, w, _ = _qw(5, h, di, seed=4, dtype=qdt)
    seq, nv = torch.tensor([3, 0, 1, 2, 0]), torch.tensor([0, 1, 17, 90, 33], dtype=torch.int32)  # 90 > n_max
    out = torch.full((5, 70), float("nan"))  # n_max > the table's reach (64)
    got = ix.index_scores(q, w, pool, fmt, bt, seq, 8, nv, 70, out=out)
    assert got is out
    _close(out, ix.index_scores_ref(q, w, pool, fmt, bt, seq, 8, nv, 70), 1e-5)
    assert (out[3, :64] > NEG_INF).all() and (out[3, 64:] == NEG_INF).all()
    assert (out[0] == NEG_INF).all() and (out[1, 1:] == NEG_INF).all() and out[1, 0] > NEG_INF


def test_index_scores_mixed_batch(small_tiles):
    # prefill chunks (per-row causal masks inside a tile) next to decode rows, tiles of 4 rows: rows 0-3 and 8-11
    # share a sequence, rows 4-7 straddle a boundary; seq 3 runs past the table's reach (64)
    pool, bt, _ = _paged("fp4", 4, 128, 8, 8, seed=5)
    q, w, g = _qw(13, 4, 128, seed=6)
    seq = torch.tensor([0] * 6 + [1] + [3] * 5 + [2])
    nv = torch.cat((torch.arange(20, 26), torch.tensor([40]), torch.arange(60, 65) + 1, torch.tensor([0])))
    out = torch.full((13, 70), float("nan"))
    ix.index_scores(q, w, pool, "fp4", bt, seq, 8, nv, 70, out=out)
    ref = ix.index_scores_ref(q, w, pool, "fp4", bt, seq, 8, nv, 70)
    _close(out, ref, 1e-5)
    assert torch.equal(ref > NEG_INF, torch.arange(70) < nv.clamp(max=64)[:, None])

    cand = torch.randint(-1, 16, (13, 4), generator=g).int()
    out = torch.full((13, 16), float("nan"))
    ix.index_scores_candidates(q, w, pool, "fp4", bt, seq, 8, cand, 4, nv, out=out)
    _close(out, ix.index_scores_candidates_ref(q, w, pool, "fp4", bt, seq, 8, cand, 4, nv), 1e-5)


def test_long_chunk_kernel(monkeypatch):
    """indexer_prefill (bf16 q and keys, its thresholds and tiles shrunk): a chunk of one sequence beside rows of
    others (programs spanning sequences), rows seeing past the table's reach, n_max not a multiple of the tiles,
    super-tiles past every row's visible entries."""
    import dsserve.kernels.indexer_prefill as IP

    for name, v in (("PREFILL_ROWS", 1), ("ROWS", 4), ("BLOCK_N", 16), ("SUPER", 2)):
        monkeypatch.setattr(IP, name, v)
    calls, real = [], IP.prefill_scores
    monkeypatch.setattr(IP, "prefill_scores", lambda *a: calls.append(1) or real(*a))
    pool, bt, _ = _paged("bf16", 4, 128, 8, 12, seed=11)
    q, w, _ = _qw(13, 4, 128, seed=12)
    q = q.bfloat16()
    seq = torch.tensor([0] * 6 + [1] + [3] * 5 + [2])
    nv = torch.cat((torch.arange(20, 26), torch.tensor([40]), torch.arange(90, 95) + 1, torch.tensor([0])))
    out = torch.full((13, 101), float("nan"))  # reach 96, n_max 101: 4 super-tiles of 32, the last one partial
    ix.index_scores(q, w, pool, "bf16", bt, seq, 8, nv, 101, out=out)
    _close(out, ix.index_scores_ref(q, w, pool, "bf16", bt, seq, 8, nv, 101), 1e-5)
    assert calls and (out[12] == NEG_INF).all() and (out[:, 96:] == NEG_INF).all()


@pytest.mark.parametrize("seq", [[1, 1, 1], [1, 0, 1]])
def test_tile_taller_than_batch(seq):
    # Hi = 2: 16 dot rows need a tile of 8 query rows; 3 rows leave 5 padded (one sequence, then mixed)
    pool, bt, _ = _paged("fp4", 2, 128, 16, 3, seed=7)
    q, w, _ = _qw(3, 2, 128, seed=8)
    seq, nv = torch.tensor(seq), torch.tensor([30, 31, 48])
    out = torch.full((3, 48), float("nan"))
    ix.index_scores(q, w, pool, "fp4", bt, seq, 16, nv, 48, out=out)
    _close(out, ix.index_scores_ref(q, w, pool, "fp4", bt, seq, 16, nv, 48), 1e-5)


def _raw_fp4(di, device, offset=0):
    """Random FP4 rows: every nibble code (-0.0 too) and the smallest scale bytes, 0 (2^-127, fp32 subnormal)
    included; q is scaled up by 2^120 so those keys still dominate the scores."""
    g = torch.Generator().manual_seed(11)
    rb = di // 2 + di // 32
    rows = torch.randint(0, 256, (32, rb), generator=g, dtype=torch.uint8)
    rows[:, di // 2 :] = torch.randint(0, 4, (32, di // 32), generator=g, dtype=torch.uint8)
    pool = torch.zeros(32 * rb + offset, dtype=torch.uint8, device=device)[offset:].view(32, rb)
    pool.copy_(rows)
    bt = torch.randperm(4, generator=g).int()[None]
    q, w, _ = _qw(3, 4, di, seed=12)
    return pool, bt.to(device), q.to(device) * 2.0**120, w.to(device)


@pytest.mark.parametrize("di,offset", [(64, 0), (128, 0), (128, 1)])
def test_index_scores_raw_fp4_bytes(small_tiles, di, offset):
    pool, bt, q, w = _raw_fp4(di, "cpu", offset)
    seq, nv = torch.zeros(3, dtype=torch.int32), torch.tensor([32, 20, 7])
    out = ix.index_scores(q, w, pool, "fp4", bt, seq, 8, nv, 32)
    _close(out, ix.index_scores_ref(q, w, pool, "fp4", bt, seq, 8, nv, 32), 1e-5)


@pytest.mark.parametrize(
    "fmt,di,qdt",
    [("fp4", 32, torch.float32), ("bf16", 32, torch.float32), ("fp4", 32, torch.bfloat16), ("fp4", 128, torch.float32)],
)
def test_index_scores_candidates(small_tiles, fmt, di, qdt):
    pool, bt, _ = _paged(fmt, 3, di, 8, 6, seed=5)
    q, w, g = _qw(4, 4, di, seed=6, dtype=qdt)
    seq, nv = torch.tensor([2, 0, 0, 1]), torch.tensor([0, 5, 30, 48])
    # cbs 4: 12 blocks reachable; ids past n_visible, past the table (20), -1 anywhere, any order
    cand = torch.randint(0, 14, (4, 8), generator=g).int()
    cand[torch.rand(4, 8, generator=g) < 0.3] = -1
    cand[3, :3] = torch.tensor([20, 11, 1])
    out = torch.full((4, 32), float("nan"))
    ix.index_scores_candidates(q, w, pool, fmt, bt, seq, 8, cand, 4, nv, out=out)
    ref = ix.index_scores_candidates_ref(q, w, pool, fmt, bt, seq, 8, cand, 4, nv)
    _close(out, ref, 1e-5)
    ent = ix.candidate_entries(cand, 4, torch.arange(32))
    assert torch.equal(ref > NEG_INF, (ent >= 0) & (ent < nv[:, None]))


@pytest.mark.parametrize("fmt", ["fp4", "bf16"])
def test_consumer_selection_matches_model(small_tiles, fmt):
    # one sequence's chunk of rows; few distinct keys so scores tie; dyadic inputs so the kernel and the ref agree
    # bit for bit and the comparison can be exact
    t, epb, cbs, top_blocks, k = 6, 8, 4, 5, 6
    pool, bt, _ = _paged(fmt, 1, 32, epb, 8, seed=7, distinct=9)
    seq, nv = torch.zeros(t, dtype=torch.int32), torch.tensor([0, 3, 13, 30, 47, 64])
    qs, ws, _ = _qw(t, 4, 32, seed=8, exact=True, dtype=torch.float64)  # fp64 like the tiny models
    qc, wc, _ = _qw(t, 4, 32, seed=9, exact=True, dtype=torch.float64)
    src = ix.index_scores(qs, ws, pool, fmt, bt, seq, epb, nv, 64)
    cand = candidate_blocks(src, nv, cbs, top_blocks)
    full = ix.index_scores_ref(qc, wc, pool, fmt, bt, seq, epb, nv, 64)
    m_idx, m_valid = stable_topk(full.masked_fill(~candidate_pool(src, nv, cbs, top_blocks), NEG_INF), k)
    cs = ix.index_scores_candidates(qc, wc, pool, fmt, bt, seq, epb, cand, cbs, nv)
    c_idx, c_valid = topk(cs, k)
    ent = ix.candidate_entries(cand, cbs, c_idx)
    assert torch.equal(m_valid.sum(1), c_valid.sum(1)) and m_valid[-1].all()
    for r in range(t):
        assert torch.equal(m_idx[r][m_valid[r]], ent[r][c_valid[r]])


def test_input_errors():
    pool, bt, _ = _paged("fp4", 2, 32, 8, 2, seed=0)
    q, w, _ = _qw(2, 4, 32, seed=0)
    seq, nv = torch.tensor([1, 0]), torch.tensor([3, 4])
    with pytest.raises(ValueError, match="format"):
        ix.index_scores(q, w, pool, "fp8", bt, seq, 8, nv, 16)
    with pytest.raises(ValueError, match="pool"):
        ix.index_scores_ref(q, w, pool, "bf16", bt, seq, 8, nv, 16)
    with pytest.raises(ValueError, match="float tensor"):
        ix.index_scores(q.int(), w, pool, "fp4", bt, seq, 8, nv, 16)
    with pytest.raises(ValueError, match="epb"):
        ix.index_scores(q, w, pool, "fp4", bt, seq, 0, nv, 16)
    for bad in (seq.float(), seq[:1], seq[None]):
        with pytest.raises(ValueError, match="row_seq"):
            ix.index_scores_ref(q, w, pool, "fp4", bt, bad, 8, nv, 16)
    with pytest.raises(ValueError, match="block_table"):
        ix.index_scores(q, w, pool, "fp4", bt[0], seq, 8, nv, 16)
    with pytest.raises(ValueError, match="cand_blocks"):
        ix.index_scores_candidates(q, w, pool, "fp4", bt, seq, 8, torch.zeros(3, 2, dtype=torch.int32), 4, nv)


# ------------------------------------------------------------------ GPU: real shapes
def _real(fmt, kind, t, epb, n_max, seed):
    """Random pool bytes (FP4 scale bytes kept in 2^[-9, 0]), per-sequence tables, row_seq and visible counts.
    kind "prefill": one sequence's chunk of t rows ending at n_max; "decode": t rows of t sequences; "mixed": a
    chunk of t - 37 rows of sequence 0 after 21 and before 16 decode rows of other sequences (4-row tiles straddle)."""
    g = torch.Generator().manual_seed(seed)
    mb = -(-n_max // epb)
    s = 1 if kind == "prefill" else (t if kind == "decode" else 38)
    rb = 68 if fmt == "fp4" else 256
    pool = torch.randint(0, 256, (s * mb * epb, rb), generator=g, dtype=torch.uint8)
    if fmt == "fp4":
        pool[:, 64:] = torch.randint(118, 128, (s * mb * epb, 4), generator=g, dtype=torch.uint8)
    else:
        pool = torch.randn(s * mb * epb, 128, generator=g).bfloat16().view(torch.uint8)
    bt = torch.randperm(s * mb, generator=g).view(s, mb)
    if kind == "prefill":
        seq, nv = torch.zeros(t, dtype=torch.int64), n_max - t + 1 + torch.arange(t)
    elif kind == "decode":
        seq, nv = torch.randperm(t, generator=g), torch.randint(0, n_max + 1, (t,), generator=g)
        nv[0] = n_max
    else:
        c = t - 37
        seq = torch.cat((torch.arange(1, 22), torch.zeros(c, dtype=torch.int64), torch.arange(22, 38)))
        nv = torch.randint(0, n_max + 1, (t,), generator=g)
        nv[21 : 21 + c] = n_max - c + 1 + torch.arange(c)
    return pool.cuda(), bt.int().cuda(), seq.int().cuda(), nv.int().cuda(), g


@cuda
@pytest.mark.parametrize(
    "fmt,kind,t,epb,n_max,qdt",
    [
        ("fp4", "prefill", 4096, 64, 32768, torch.bfloat16),
        ("fp4", "decode", 64, 64, 32768, torch.bfloat16),
        ("fp4", "mixed", 1061, 64, 20000, torch.bfloat16),
        ("fp4", "decode", 1, 64, 20000, torch.bfloat16),
        ("fp4", "decode", 16, 32, 20000, torch.bfloat16),
        ("fp4", "mixed", 300, 64, 20000, torch.float32),
        ("bf16", "prefill", 256, 64, 20000, torch.bfloat16),
        ("bf16", "decode", 16, 64, 20000, torch.float32),
        ("bf16", "prefill", 4096, 64, 32768, torch.bfloat16),
        ("bf16", "mixed", 1061, 64, 20000, torch.bfloat16),
    ],
)
def test_index_scores_gpu(fmt, kind, t, epb, n_max, qdt, monkeypatch):
    import dsserve.kernels.indexer_prefill as IP

    monkeypatch.setattr(IP, "PREFILL_ROWS", 1024)  # bf16 q and keys from 1024 rows: the long-chunk kernel
    pool, bt, seq, nv, g = _real(fmt, kind, t, epb, n_max, seed=t + epb)
    q = torch.randn(t, 32, 128, generator=g).to("cuda", qdt)
    w = torch.randn(t, 32, generator=g).cuda() * 128**-0.5 * 32**-0.5
    tol = 1e-5 if qdt == torch.float32 else 1e-2
    out = torch.full((t, n_max), float("nan"), device="cuda")
    ix.index_scores(q, w, pool, fmt, bt, seq, epb, nv, n_max, out=out)
    _close(out, ix.index_scores_ref(q, w, pool, fmt, bt, seq, epb, nv, n_max), tol)

    # consumer: the source's 2048 best blocks of 8 = 16384 columns (-1 padded while the context is short)
    src = ix.index_scores(q, w.flip(1), pool, fmt, bt, seq, epb, nv, n_max)
    cand = candidate_blocks(src, nv, 8, 2048)
    cand[:, ::7] = torch.where(cand[:, ::7] >= 0, cand[:, ::7], 5)  # a few ids in the -1 tail, unsorted
    out = torch.full((t, 2048 * 8), float("nan"), device="cuda")
    ix.index_scores_candidates(q, w, pool, fmt, bt, seq, epb, cand, 8, nv, out=out)
    _close(out, ix.index_scores_candidates_ref(q, w, pool, fmt, bt, seq, epb, cand, 8, nv), tol)


@cuda
@pytest.mark.parametrize("offset", [0, 2])
def test_raw_fp4_bytes_gpu(offset):
    # e2m1 +-0.5 decode through fp32 subnormals and 2^-127 scales: a flush-to-zero anywhere shows here
    pool, bt, q, w = _raw_fp4(128, "cuda", offset)
    seq, nv = torch.zeros(3, dtype=torch.int32, device="cuda"), torch.tensor([32, 20, 7], device="cuda")
    out = torch.full((3, 32), float("nan"), device="cuda")
    ix.index_scores(q, w, pool, "fp4", bt, seq, 8, nv, 32, out=out)
    _close(out, ix.index_scores_ref(q, w, pool, "fp4", bt, seq, 8, nv, 32), 1e-5)
    cand = torch.tensor([[3, -1, 0, 1]] * 3, dtype=torch.int32, device="cuda")
    out = torch.full((3, 32), float("nan"), device="cuda")
    ix.index_scores_candidates(q, w, pool, "fp4", bt, seq, 8, cand, 8, nv, out=out)
    _close(out, ix.index_scores_candidates_ref(q, w, pool, "fp4", bt, seq, 8, cand, 8, nv), 1e-5)
