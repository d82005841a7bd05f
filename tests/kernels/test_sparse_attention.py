"""sparse_attention (Triton) vs sparse_attention_ref, and the reference vs a direct per-sequence construction.

Cases are built like the engine builds them: each sequence has earlier rows (its last W sit in the window pool at
scattered physical rows, listed per query row in any order with -1 holes), a chunk of fresh rows this step, and
visible global entries scattered in the main pool; pools also hold junk rows (NaN bytes) nobody may read.
"""

import pytest
import torch

import dsserve.kernels.sparse_attention as sparse_attention_mod
import dsserve.kernels.sparse_attention_prefill as prefill
from dsserve.kernels.sparse_attention import sparse_attention, sparse_attention_ref
from dsserve.kv import formats
from dsserve.layers.attention import sparse_attention_with_sink
from dsserve.layers.rope import Rope, RopeSpec

TINY = dict(h=4, d=64, r=16, w=32, k=16)
REAL = dict(h=64, d=512, r=64, w=128, k=512)
WFMT = {"fp8": formats.SWA_FP8, "bf16": formats.BF16_ROWS}
MFMT = {"fp4": formats.MAIN_FP4, "fp8": formats.SWA_FP8, "bf16": formats.BF16_ROWS}
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _pool(fmt, vals, junk, g):
    """Rows of vals packed at random physical ids among `junk` extra rows of 0xFF bytes (NaN in e4m3/bf16)."""
    n = vals.shape[0] + junk
    pool = torch.full((n, fmt.row_bytes), 0xFF, dtype=torch.uint8)
    phys = torch.randperm(n, generator=g)[: vals.shape[0]]
    pool[phys] = fmt.pack(vals)
    return pool, phys


def make_case(seqs, h, d, r, w, k, wfmt, mfmt, dtype=torch.float32, seed=0):
    """seqs: (n_old, n_new, n_vis) per sequence. Returns (args, direct) where args are sparse_attention's positional
    arguments and direct() recomputes the output per sequence with sparse_attention_with_sink + Rope (inverse)."""
    g = torch.Generator().manual_seed(seed)
    wf, mf = WFMT[wfmt].with_channels(d), MFMT[mfmt].with_channels(d) if mfmt else None
    ring = [min(n_old, w) for n_old, _, _ in seqs]
    wvals = torch.randn(sum(ring), d, generator=g, dtype=torch.float64)
    wpool, wphys = _pool(wf, wvals, 5, g)
    mvals = torch.randn(max(1, sum(s[2] for s in seqs)), d, generator=g, dtype=torch.float64)
    mvals[::3, :16] *= 0.003  # tiny groups: subnormal e4m3 scales in the FP4 rows
    mpool, mphys = _pool(mf, mvals, 5, g) if mf else (None, None)
    t = sum(s[1] for s in seqs)
    rope = Rope(RopeSpec(r, 10000.0))
    q = torch.randn(t, h, d, generator=g, dtype=torch.float64)
    fresh = formats.SWA_FP8.with_channels(d).reference(torch.randn(t, d, generator=g, dtype=torch.float64))
    sink = torch.randn(h, generator=g, dtype=torch.float64).float()
    old_rows = torch.full((t, w), -1, dtype=torch.int32)
    sel_rows = torch.full((t, k), -1, dtype=torch.int32)
    row_first, pos, parts = torch.zeros(t, dtype=torch.int32), torch.zeros(t, dtype=torch.long), []
    row = wbase = mbase = 0
    for (n_old, n_new, n_vis), nr in zip(seqs, ring):
        rows = slice(row, row + n_new)
        row_first[rows], pos[rows] = row, torch.arange(n_old, n_old + n_new)
        old_p = torch.arange(n_old - nr, n_old)
        for i in range(n_new):
            vis = torch.nonzero(old_p > n_old + i - w).flatten()
            slots = torch.randperm(w, generator=g)[: vis.numel()]
            old_rows[row + i, slots] = wphys[wbase + vis].int()
            if mf is None:
                continue
            take = torch.randperm(n_vis, generator=g)[: min(n_vis, k)]
            take = take[: int(torch.randint(0, take.numel() + 1, (), generator=g))] if i % 2 else take
            sel_rows[row + i, torch.randperm(k, generator=g)[: take.numel()]] = mphys[mbase + take].int()
        parts.append((rows, wbase, nr, old_p, mbase, n_vis))
        row, wbase, mbase = row + n_new, wbase + nr, mbase + n_vis
    cos, sin = rope._cos_sin(pos)
    cast = lambda x: x.to(dtype)  # noqa: E731
    cos, sin = (x.to(torch.float64 if dtype == torch.float64 else torch.float32) for x in (cos, sin))
    args = (
        cast(q),
        cos,
        sin,
        wpool,
        wfmt,
        old_rows,
        cast(fresh),
        row_first,
        mpool,
        mfmt if mf else None,
        sel_rows if mf else None,
        sink,
        d**-0.5,
    )

    def direct():
        out = torch.empty(t, h, d, dtype=torch.float64)
        wk = wf.unpack(wpool, torch.float64)
        for rows, wb, nr, old_p, mb, n_vis in parts:
            p = pos[rows]
            win_k = torch.cat((wk[wphys[wb : wb + nr]], fresh[rows]))
            win_p = torch.cat((old_p, p))
            win_mask = (win_p[None, :] <= p[:, None]) & (win_p[None, :] > p[:, None] - w)
            sel_k = sel_mask = None
            if mf is not None:
                sel = sel_rows[rows].long()
                sel_k, sel_mask = mf.unpack(mpool[sel.clamp(min=0)], torch.float64), sel >= 0
            o = sparse_attention_with_sink(q[rows], win_k, win_mask, sel_k, sel_mask, sink, d**-0.5)
            out[rows] = rope(o, p, inverse=True)
        return out

    return args, direct


def _rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def _check_kernel(args, tol, out_dtype=torch.float32, device="cpu", splits=None):
    args = tuple(x.to(device) if isinstance(x, torch.Tensor) else x for x in args)
    q = args[0]
    out = torch.full(q.shape, float("nan"), dtype=out_dtype, device=device)
    sparse_attention(*args, out_dtype=out_dtype, out=out, splits=splits)
    ref = sparse_attention_ref(*args, out_dtype=torch.float32)
    assert not out.isnan().any()
    assert _rel(out, ref) < tol
    return out


# A decode row, a prefill chunk longer than W over earlier rows, a first row (no old rows, nothing visible), a pair.
RAGGED = [(5, 1, 20), (10, 34, 12), (0, 1, 0), (3, 2, 5)]


@pytest.mark.parametrize("splits", [1, 2, 3])
def test_kernel_ragged_fp8_window_fp4_main(splits):
    # splits = 1 is the single pass (prefill), which writes o directly. TINY, BLOCK_N = 16: virtual key blocks
    # [old 0, old 1, fresh 0, fresh 1, selected 0]; 2 splits take 3 + 2 blocks, 3 splits 2 + 2 + 1, so the prefill
    # rows' fresh blocks and most rows' keys straddle splits.
    args, _ = make_case(RAGGED, **TINY, wfmt="fp8", mfmt="fp4")
    old_rows, row_first, sel_rows = args[5], args[7], args[10]
    first = RAGGED[0][1] + RAGGED[1][1]  # (0, 1, 0): its only key, its own fresh row, sits in one split
    assert (old_rows[first] == -1).all() and (sel_rows[first] == -1).all()
    # Row 0 (a one-row sequence) made keyless: no old rows, no selected entries, its fresh window starts past it.
    assert (old_rows[0] >= 0).any() and (sel_rows[0] >= 0).any()
    old_rows[0], sel_rows[0], row_first[0] = -1, -1, 1
    out = _check_kernel(args, 1e-5, splits=splits)
    assert (out[0] == 0).all()


# K = 48: blocks [old 0, old 1, fresh 0, fresh 1, sel 0, sel 1, sel 2]. splits: None is the automatic choice (7 here,
# one block each); 3 splits take 3 + 3 + 1 blocks, so a split ends inside the selected range; SWA-only (4 blocks)
# with 2 splits takes the old, then the fresh window blocks.
@pytest.mark.parametrize(
    "wfmt,mfmt,dtype,splits",
    [
        ("fp8", "fp8", torch.float32, 1),
        ("bf16", "bf16", torch.float32, None),
        ("fp8", None, torch.float32, 2),
        ("fp8", "fp4", torch.bfloat16, 3),
    ],
)
def test_kernel_formats(wfmt, mfmt, dtype, splits):
    args, _ = make_case([(40, 3, 30), (0, 1, 2)], **dict(TINY, k=48), wfmt=wfmt, mfmt=mfmt, dtype=dtype, seed=1)
    _check_kernel(args, 1e-5 if dtype == torch.float32 else 1e-2, splits=splits)


@pytest.mark.parametrize("wfmt,mfmt", [("fp8", "fp4"), ("bf16", "fp8"), ("fp8", None)])
def test_ref_matches_direct_construction_fp64(wfmt, mfmt, monkeypatch):
    monkeypatch.setattr(sparse_attention_mod, "_REF_CHUNK", 16)  # row chunks that split sequences and windows
    args, direct = make_case(
        [(40, 1, 30), (10, 36, 12), (0, 2, 0)], **TINY, wfmt=wfmt, mfmt=mfmt, dtype=torch.float64, seed=2
    )
    got = sparse_attention_ref(*args, out_dtype=torch.float64)
    assert got.dtype == torch.float64
    assert _rel(got, direct()) < 1e-12
    assert torch.equal(sparse_attention(*args, out_dtype=torch.float64), got)  # fp64 runs the reference


@pytest.mark.parametrize("wfmt,mfmt", [("fp8", "fp4"), ("bf16", "bf16"), ("fp8", None), ("bf16", "fp8")])
def test_prefill_kernel(wfmt, mfmt, monkeypatch):
    """The many-row kernel (sparse_attention_prefill: bf16 q, its rows' threshold lowered, 16-key blocks so that
    the window takes two blocks and the selected entries three): ragged rows, a keyless row, every format."""
    monkeypatch.setattr(prefill, "PREFILL_MIN_ROWS", 1)
    monkeypatch.setattr(prefill, "BLOCK_N", 16)
    calls, real = [], prefill.sparse_attention_prefill
    monkeypatch.setattr(prefill, "sparse_attention_prefill", lambda *a, **k: calls.append(1) or real(*a, **k))
    args, _ = make_case(RAGGED, **dict(TINY, k=48), wfmt=wfmt, mfmt=mfmt, dtype=torch.bfloat16, seed=4)
    old_rows, row_first = args[5], args[7]
    old_rows[0], row_first[0] = -1, 1
    if mfmt:
        args[10][0] = -1
    out = _check_kernel(args, 1e-2)
    assert calls and (out[0] == 0).all()


def test_num_splits_rule():
    assert sparse_attention_mod.num_splits(2 * 132, 24) == 1  # enough programs already (prefill)
    assert sparse_attention_mod.num_splits(4, 24) == 24  # B = 1, H = 64, BLOCK_H = 16: one block per split
    assert sparse_attention_mod.num_splits(64, 24) == 5  # B = 16
    assert sparse_attention_mod.num_splits(256, 24) == 2  # B = 64
    assert sparse_attention_mod.num_splits(1, 3) == 3  # never more splits than key blocks


def test_rejects_bad_input():
    args, _ = make_case([(3, 2, 4)], **TINY, wfmt="fp8", mfmt="fp4")
    bad = {4: "fp4", 9: "fp16", 3: args[3][:, :-1], 8: None}  # window fmt, main fmt, row width, main without sel
    for i, v in bad.items():
        with pytest.raises(ValueError):
            sparse_attention_ref(*args[:i], v, *args[i + 1 :])
    with pytest.raises(ValueError):
        sparse_attention(args[0].half(), *args[1:])
    with pytest.raises(ValueError):
        sparse_attention(*args, splits=0)


# ------------------------------------------------------------------ GPU: real shapes
@cuda
@pytest.mark.parametrize("b", [1, 16, 64])
@pytest.mark.parametrize("wfmt,mfmt", [("fp8", "fp4"), ("fp8", "fp8"), ("bf16", "bf16")])
def test_gpu_decode(b, wfmt, mfmt):
    g = torch.Generator().manual_seed(b)
    seqs = [
        (int(torch.randint(0, 400, (), generator=g)), 1, int(torch.randint(0, 900, (), generator=g))) for _ in range(b)
    ]
    args, _ = make_case(seqs, **REAL, wfmt=wfmt, mfmt=mfmt, seed=b)
    _check_kernel(args, 1e-5, device="cuda")


@cuda
@pytest.mark.parametrize(
    "wfmt,mfmt,dtype",
    [
        ("fp8", "fp4", torch.float32),
        ("fp8", "fp4", torch.bfloat16),
        ("bf16", "fp8", torch.float32),
        ("fp8", None, torch.float32),
    ],
)
def test_gpu_prefill_chunk(wfmt, mfmt, dtype):
    # A 300-row chunk over 200 earlier rows, next to decode rows of other sequences; fewer visible than top-k.
    args, _ = make_case(
        [(7, 1, 3), (200, 300, 400), (0, 1, 0), (150, 1, 700)], **REAL, wfmt=wfmt, mfmt=mfmt, dtype=dtype, seed=3
    )
    if dtype == torch.float32:
        _check_kernel(args, 1e-5, device="cuda")
    else:
        _check_kernel(args, 1e-2, out_dtype=torch.bfloat16, device="cuda")


@cuda
@pytest.mark.parametrize("wfmt,mfmt", [("fp8", "fp4"), ("bf16", "bf16"), ("fp8", None)])
def test_gpu_prefill_kernel(wfmt, mfmt, monkeypatch):
    # The chunk of test_gpu_prefill_chunk through the many-row kernel at its real tiles (64 keys, 2 stages).
    monkeypatch.setattr(prefill, "PREFILL_MIN_ROWS", 1)
    args, _ = make_case(
        [(7, 1, 3), (200, 300, 400), (0, 1, 0), (150, 1, 700)],
        **REAL,
        wfmt=wfmt,
        mfmt=mfmt,
        dtype=torch.bfloat16,
        seed=6,
    )
    _check_kernel(args, 1e-2, out_dtype=torch.bfloat16, device="cuda")


@cuda
def test_gpu_bf16_decode_fp4():
    args, _ = make_case([(300, 1, 800)] * 64, **REAL, wfmt="fp8", mfmt="fp4", dtype=torch.bfloat16, seed=5)
    _check_kernel(args, 1e-2, out_dtype=torch.bfloat16, device="cuda")


@cuda
@pytest.mark.parametrize("b", [1, 16])
@pytest.mark.parametrize("splits", [None, 1, 5, 24])  # 24 virtual blocks of 32 keys: 5 -> 5 per split, 24 -> 1
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_decode_split_k(b, splits, dtype):
    g = torch.Generator().manual_seed(100 + b)
    seqs = [
        (int(torch.randint(0, 400, (), generator=g)), 1, int(torch.randint(0, 900, (), generator=g))) for _ in range(b)
    ]
    if b > 1:
        seqs[-1] = (0, 1, 0)  # a first row: its only key (its fresh row) sits in one split
    args, _ = make_case(seqs, **REAL, wfmt="fp8", mfmt="fp4", dtype=dtype, seed=100 + b)
    if splits is None:  # the automatic rule really splits these decode batches
        assert sparse_attention_mod.num_splits(b, 24) > 1  # one 64-head block per row
    if b > 1:  # a keyless row: no old rows, no selected entries, no fresh window
        args[5][0], args[10][0], args[7][0] = -1, -1, 1
    tol, out_dtype = (1e-5, torch.float32) if dtype == torch.float32 else (1e-2, torch.bfloat16)
    out = _check_kernel(args, tol, out_dtype=out_dtype, device="cuda", splits=splits)
    if b > 1:
        assert (out[0] == 0).all()
