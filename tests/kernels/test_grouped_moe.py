"""dsserve.kernels.grouped_moe: the routed-expert grouped GEMMs against routed_experts_ref, and the ref against MoE.

Interpreter tests use tiny shapes (d = 64, inter = 32, E = 8, fp32 x, so fp32 dots: rel err < 1e-5); GPU tests one
EP rank of the model (d = 5120, inter = 512, E = 48, k = 6, bf16 x: rel err < 1e-2). Every scratch and output tensor
starts as NaN, and experts that no token picks hold NaN / Inf weights, so a row left unwritten or a tile read from
the wrong expert shows.
"""

from dataclasses import replace

import pytest
import torch

from dsserve.kernels import grouped_moe as G
from dsserve.kernels.moe_permute import expert_tiles, tile_count
from dsserve.layers.moe import MoE
from dsserve.models.presets import preset

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
D, INTER, E, LIMIT = 64, 32, 8, 3.0


@pytest.fixture(autouse=True)
def _poisoned_scratch(monkeypatch):
    monkeypatch.setattr(
        G, "_empty", lambda shape, dtype, device: torch.full(shape, float("nan"), dtype=dtype, device=device)
    )


def rel(out, ref):
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


def dense(n_exp, d, inter, device="cpu", seed=0):
    """(W1, W3, W2) [E, out, in] fp32, scaled so that the SwiGLU inputs reach past LIMIT (both clamps engage),
    with rows of different magnitude so that a wrong scale block shows."""
    g = torch.Generator(device=device).manual_seed(seed)
    mag = torch.logspace(-1, 0.5, inter, device=device)[:, None]
    w1 = torch.randn(n_exp, inter, d, generator=g, device=device) * mag * 2 * d**-0.5
    w3 = torch.randn(n_exp, inter, d, generator=g, device=device) * mag * 2 * d**-0.5
    w2 = torch.randn(n_exp, d, inter, generator=g, device=device) * inter**-0.5
    return w1, w3, w2


def routing(t, k, n_exp, device="cpu", seed=1, hot=None, pool=None):
    """Distinct experts per token; `hot` takes slot 0 of every token, the other slots come from `pool`."""
    g = torch.Generator(device=device).manual_seed(seed)
    pool = torch.arange(n_exp, device=device) if pool is None else torch.tensor(pool, device=device)
    pool = pool[pool != hot] if hot is not None else pool
    m = k - (hot is not None)
    ids = pool[torch.rand(t, pool.numel(), generator=g, device=device).argsort(1)[:, :m]]
    if hot is not None:
        ids = torch.cat([torch.full((t, 1), hot, device=device), ids], 1)
    return ids, torch.rand(t, k, generator=g, device=device) + 0.1


def poison(ex, unused):
    """NaN weights (bf16, fp8 byte 0x7F) or an Inf scale (MXFP4 e8m0 byte 255) for the experts no token picks."""
    if ex.fmt == "bf16":
        return replace(ex, **{n: getattr(ex, n).index_fill(0, unused, float("nan")) for n in ("w1", "w3", "w2")})
    names = ("w1", "w3", "w2") if ex.fmt == "fp8" else ("s1", "s3", "s2")
    fill = 0x7F if ex.fmt == "fp8" else 255
    return replace(ex, **{n: getattr(ex, n).index_fill(0, unused, fill) for n in names})


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float64])
def test_from_dense_packs_expert_by_expert_as_the_whole_stack(dtype):
    """from_dense quantises one expert at a time (bounded temporaries): the bytes and scales are those of packing
    the whole fp32 stack at once, MXFP4 (pack_mxfp4 takes [..., k]) and FP8 (quant_fp8_block, per expert)."""
    from dsserve.layers.quant import pack_mxfp4, quant_fp8_block

    w1, w3, w2 = (w.to(dtype) for w in dense(3, 64, 96, seed=4))
    ex = G.ExpertWeights.from_dense(w1, w3, w2, "mxfp4")
    for got, scales, w in ((ex.w1, ex.s1, w1), (ex.w3, ex.s3, w3), (ex.w2, ex.s2, w2)):
        q, sc = pack_mxfp4(w if dtype == torch.float64 else w.float())
        assert torch.equal(got.view(torch.uint8), q.view(torch.uint8))
        assert torch.equal(scales.view(torch.uint8), sc.view(torch.uint8))
    ex = G.ExpertWeights.from_dense(w1, w3, w2, "fp8")
    for e in range(3):
        q, sc = quant_fp8_block(w2[e].float(), G.FP8_BLOCK)
        assert torch.equal(ex.w2[e].view(torch.uint8), q.view(torch.uint8))
        assert torch.equal(ex.s2[e].view(torch.uint8), sc.view(torch.uint8))


@pytest.fixture(scope="module")
def tiny_experts():
    return {fmt: G.ExpertWeights.from_dense(*dense(E, D, INTER), fmt) for fmt in G.FMTS}


@pytest.mark.parametrize("fmt", G.FMTS)
@pytest.mark.parametrize("t,k", [(1, 3), (3, 1), (17, 2)])
def test_matches_ref(tiny_experts, fmt, t, k):
    ex = tiny_experts[fmt]
    ids, w = routing(t, k, E, seed=t * 10 + k)
    x = torch.randn(t, D, generator=torch.Generator().manual_seed(t))
    out = G.routed_experts(x, ids, w, ex, LIMIT)
    ref = G.routed_experts_ref(x, ids, w, ex, LIMIT)
    assert out.dtype == x.dtype and out.shape == (t, D)
    assert rel(out, ref) < 1e-5
    assert rel(ref, G.routed_experts_ref(x, ids, w, ex, 1e9)) > 1e-3  # the clamps are exercised


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_accumulate_into_adds_in_fp32_and_rounds_once(tiny_experts, dtype):
    """The shared expert's output takes the routed sum in place: (fp32 sum + fp32 shared) rounded once, kernel and
    reference alike (where a bf16 routed output added afterwards rounds twice)."""
    ex = tiny_experts["mxfp4"]
    ids, w = routing(9, 3, E, seed=4)
    x = torch.randn(9, D, generator=torch.Generator().manual_seed(4)).to(dtype)
    shared = torch.randn(9, D, generator=torch.Generator().manual_seed(5)).to(dtype)
    routed = G.routed_experts_ref(x, ids, w, ex, LIMIT)  # rounded to dtype: adding it rounds a second time
    want = (routed.float() + shared.float()).to(dtype)
    into = shared.clone()
    got = G.routed_experts_ref(x, ids, w, ex, LIMIT, accumulate_into=into)
    assert got is into and got.dtype == dtype
    if dtype == torch.float32:
        assert torch.equal(got, want)  # nothing to round away in fp32
    else:
        assert rel(got.float(), want.float()) < 1e-2 and not torch.equal(got, want)  # one rounding fewer
    zero = G.routed_experts_ref(x, ids, w, ex, LIMIT, accumulate_into=torch.zeros_like(x))
    assert torch.equal(zero, routed)
    kern = G.routed_experts(x, ids, w, ex, LIMIT, accumulate_into=shared.clone())
    kern_twice = (G.routed_experts(x, ids, w, ex, LIMIT).float() + shared.float()).to(dtype)
    assert rel(kern.float(), kern_twice.float()) < (1e-6 if dtype == torch.float32 else 1e-2)
    if dtype == torch.float32:
        assert rel(kern, got) < 1e-5
    with pytest.raises(ValueError, match="accumulate_into"):
        G.routed_experts(x, ids, w, ex, LIMIT, accumulate_into=shared[:, :-1].clone())


@pytest.mark.parametrize("fmt", G.FMTS)
def test_uneven_routing_and_empty_experts(tiny_experts, fmt):
    t, k = 17, 3  # all 17 tokens on expert 2 (two tiles of 16), the rest on 5 and 6; five experts stay empty
    ids, w = routing(t, k, E, seed=5, hot=2, pool=[5, 6])
    ex = poison(tiny_experts[fmt], torch.tensor([0, 1, 3, 4, 7]))
    x = torch.randn(t, D, generator=torch.Generator().manual_seed(6))
    out, ref = G.routed_experts(x, ids, w, ex, LIMIT), G.routed_experts_ref(x, ids, w, ex, LIMIT)
    assert out.isfinite().all() and rel(out, ref) < 1e-5


@pytest.mark.parametrize("t,k,bk", [(1, 3, 32), (17, 2, 64), (9, 3, 128)])
def test_mxfp4_dot_scaled_matches_default(tiny_experts, t, k, bk):
    """bf16 rows take tl.dot_scaled (it upcasts the nibbles) by default: against the kernel's own nibble decode on
    the same rows (same epilogue and roundings: equal up to fp32 summation order) and the reference (loose: the
    interpreter truncates fp32 -> bf16 where the reference rounds); one and several K steps (BK 32, 64; 128 is cut
    to the dims), unused experts poisoned."""
    ids, w = routing(t, k, E, seed=50 + t)
    unused = [e for e in range(E) if e not in set(ids.flatten().tolist())]
    ex = poison(tiny_experts["mxfp4"], torch.tensor(unused, dtype=torch.long))
    x = torch.randn(t, D, generator=torch.Generator().manual_seed(51 + t)).bfloat16()
    out = G.routed_experts(x, ids, w, ex, LIMIT, config={"BK": bk})
    assert out.isfinite().all() and out.dtype == torch.bfloat16
    assert rel(out, G.routed_experts(x, ids, w, ex, LIMIT, config={"decode": "own", "BK": bk})) < 1e-5
    assert rel(out, G.routed_experts_ref(x, ids, w, ex, LIMIT)) < 5e-2  # bf16 h: 8 mantissa bits, truncated


@pytest.mark.parametrize("d,inter,cfg", [(D, INTER, {"BK": 64}), (96, 96, {"BN": 64, "BK": 32})])
def test_mxfp4_tma_weight_tiles_equal_pointer_loads(d, inter, cfg):
    """config tma: the packed weight tiles come by TMA (host descriptors over [E * N, K / 2] rows); the same
    numbers as the pointer loads, bit for bit, including tiles that run past an expert's rows (96 rows in 64-row
    tiles: the next expert's rows, or zeros past the last one, reach only unstored columns)."""
    ex = G.ExpertWeights.from_dense(*dense(E, d, inter, seed=9), "mxfp4")
    ids, w = routing(9, 3, E, seed=10)
    ids[0, 0] = E - 1  # the last expert: its spill-over tile reads past the array (zero-filled)
    x = torch.randn(9, d, generator=torch.Generator().manual_seed(11)).bfloat16()
    out = G.routed_experts(x, ids, w, ex, LIMIT, config=dict(cfg, tma=True))
    assert out.isfinite().all()
    assert torch.equal(out, G.routed_experts(x, ids, w, ex, LIMIT, config=cfg))


def test_ragged_fp8_small_tiles_and_half_x():
    # d, inter off the tile sizes: partial 32x32 scale blocks, masked K tails, several N tiles, a GROUP_M split
    ex = G.ExpertWeights.from_dense(*dense(E, 96, 48, seed=2), "fp8")
    ids, w = routing(9, 3, E, seed=7)
    x = torch.randn(9, 96, generator=torch.Generator().manual_seed(8))
    out = G.routed_experts(x, ids, w, ex, LIMIT, config={"BM": 16, "BN": 32, "BK": 32, "GROUP_M": 2})
    assert rel(out, G.routed_experts_ref(x, ids, w, ex, LIMIT)) < 1e-5
    ex = G.ExpertWeights.from_dense(*dense(E, D, INTER, seed=3), "mxfp4")
    # fp16, not bf16: the Triton 3.9 interpreter truncates fp32 -> bf16 (the GPU rounds to nearest even)
    xh = x[:, :D].half()
    out = G.routed_experts(xh, ids, w, ex, LIMIT)
    assert out.dtype == torch.float16 and rel(out, G.routed_experts_ref(xh, ids, w, ex, LIMIT)) < 1e-2


def test_mxfp4_ptx_decode_is_cuda_only_and_bounded(tiny_experts):
    ex = tiny_experts["mxfp4"]
    ids, w = routing(3, 2, E)
    x = torch.randn(3, D).bfloat16()
    assert ex.max_scale <= 128 and tiny_experts["bf16"].max_scale == 0
    with pytest.raises(ValueError, match="asm"):  # the interpreter runs no PTX
        G.routed_experts(x, ids, w, ex, LIMIT, config={"decode": "asm"})
    big = replace(ex, s1=ex.s1.index_fill(0, torch.tensor([1]), 129))
    assert big.max_scale == 129  # a scale byte past the PTX decode's range: dot_scaled serves the layer
    with pytest.raises(ValueError, match="decode"):
        G.routed_experts(x, ids, w, ex, LIMIT, config={"decode": "fast"})


@pytest.mark.parametrize("fmt", ["fp8", "mxfp4"])
def test_many_rows_run_dequantised_experts_on_bf16_tiles(tiny_experts, monkeypatch, fmt):
    ex = tiny_experts[fmt]
    bf = G.ExpertWeights("bf16", *(ex.dequantized(n, torch.bfloat16) for n in ("w1", "w3", "w2")))
    assert all(torch.equal(a.bfloat16(), b) for a, b in zip(ex.dequant(5), bf.dequant(5)))  # the exact decode
    calls, real = [], G.ExpertWeights.dequantized
    monkeypatch.setattr(G.ExpertWeights, "dequantized", lambda self, *a: calls.append(a[0]) or real(self, *a))
    monkeypatch.setattr(G, "DEQUANT_MIN_ROWS_PER_EXPERT", 2)  # 2 rows an expert: 16 pairs on E = 8
    g = torch.Generator().manual_seed(4)
    for t, k, taken in ((17, 2, True), (5, 3, False)):
        calls.clear()
        ids, w = routing(t, k, E, seed=t)
        x = torch.randn(t, D, generator=g).bfloat16()
        out = G.routed_experts(x, ids, w, ex, LIMIT)
        assert calls == (["w1", "w3", "w2"] if taken else [])
        if taken:  # the same kernels on the same bf16 weights
            assert torch.equal(out, G.routed_experts(x, ids, w, bf, LIMIT, config=G.DEQUANT_TILES))
        # the interpreter truncates fp32 -> bf16 stores (the GPU rounds): near the in-kernel decode, looser to the ref
        assert rel(out, G.routed_experts(x, ids, w, ex, LIMIT, config={"dequant": False})) < 1e-2
        assert rel(out, G.routed_experts_ref(x, ids, w, ex, LIMIT)) < 5e-2


def test_dequantized_fp8_experts_with_ragged_scale_rows():
    ex = G.ExpertWeights.from_dense(*dense(3, 96, 40, seed=5), "fp8")  # inter 40: w1's last scale row is partial
    for name, i in (("w1", 0), ("w3", 1), ("w2", 2)):
        want = torch.stack([ex.dequant(e)[i] for e in range(3)]).bfloat16()
        assert torch.equal(ex.dequantized(name, torch.bfloat16), want)


@pytest.mark.parametrize("fmt", G.FMTS)
def test_ref_plus_shared_expert_is_moe_forward(fmt):
    """The reference is MoE.forward's routed part: add the shared expert and the module's output comes back."""
    torch.manual_seed(0)
    cfg = preset("tiny")
    moe = MoE(cfg, n_experts=8, topk=3)
    for p in moe.parameters():
        torch.nn.init.normal_(p, std=cfg.hidden_size**-0.5)
    moe = moe.double()
    ex = G.ExpertWeights.from_dense(*(moe.experts[n].detach().float() for n in ("w1", "w3", "w2")), fmt)
    with torch.no_grad():  # the module holds what the loader makes of the stored format
        for i, n in enumerate(("w1", "w3", "w2")):
            moe.experts[n].copy_(torch.stack([ex.dequant(e)[i] for e in range(8)]).double())
    x = torch.randn(5, cfg.hidden_size, dtype=torch.float64)
    tokens = torch.arange(5)
    with torch.no_grad():
        ids, w = moe.gate(x, tokens, None)
        y = G.routed_experts_ref(x, ids, w, ex, moe.limit) + moe.shared_experts(x)
        ref = moe(x, tokens)
    assert rel(y, ref) < 1e-12


@pytest.mark.parametrize(
    "ids",
    [
        torch.arange(8)[:, None],  # one pair per expert: the bound is reached
        torch.full((37, 1), 3),  # one expert, three tiles
        torch.tensor([[0, 7], [7, 0], [-1, 8], [2, 7], [7, 7]]),  # out-of-range ids land in no tile
    ],
)
def test_expert_tiles_cover_every_pair_once(ids):
    order, tiles = expert_tiles(ids, E, 16)
    flat = ids.reshape(-1)
    assert tiles.shape == (3, tile_count(flat.numel(), E, 16))
    seen = []
    for e, lo, hi in tiles.t().tolist():
        if e < E:
            rows = order[lo : min(lo + 16, hi)]
            assert rows.numel() > 0 and (flat[rows] == e).all()
            seen += rows.tolist()
    valid = ((flat >= 0) & (flat < E)).nonzero().flatten().tolist()
    assert sorted(seen) == valid
    if ids.shape == (8, 1):
        assert (tiles[0] < E).all()


def test_empty_and_bad_operands(tiny_experts):
    ex, x = tiny_experts["mxfp4"], torch.randn(2, D)
    ids, w = routing(2, 2, E)
    assert G.routed_experts(x[:0], ids[:0], w[:0], ex, LIMIT).shape == (0, D)
    with pytest.raises(ValueError, match="fmt"):
        G.ExpertWeights.from_dense(*dense(E, D, INTER), "fp4")
    with pytest.raises(ValueError, match="w2 must be"):
        G.ExpertWeights("bf16", *dense(E, D, INTER)[:2], torch.zeros(E, D, 16))
    with pytest.raises(ValueError, match="s1 must be"):
        G.ExpertWeights("mxfp4", ex.w1, ex.w3, ex.w2, ex.s1[:, :, :1], ex.s3, ex.s2)
    with pytest.raises(ValueError, match="x must be"):
        G.routed_experts(torch.randn(2, 32), ids, w, ex, LIMIT)
    with pytest.raises(ValueError, match="ids must be"):
        G.routed_experts(x, ids.float(), w, ex, LIMIT)
    with pytest.raises(ValueError, match="weights must be"):
        G.routed_experts(x, ids, w[:, :1], ex, LIMIT)
    with pytest.raises(ValueError, match="not supported by the kernel"):
        G.routed_experts(x.double(), ids, w, ex, LIMIT)
    with pytest.raises(ValueError, match="lie in"):
        G.routed_experts_ref(x, ids + E, w, ex, LIMIT)
    with pytest.raises(ValueError, match="BK"):
        G.routed_experts(x, ids, w, ex, LIMIT, config={"BK": 16})


# ------------------------------------------------------------------ GPU: one EP rank of the model
GD, GINTER, GE, GK = 5120, 512, 48, 6


@pytest.fixture(scope="module")
def gpu_experts():
    if not torch.cuda.is_available():
        return None
    return {fmt: G.ExpertWeights.from_dense(*dense(GE, GD, GINTER, "cuda", seed=9), fmt) for fmt in G.FMTS}


@cuda
@pytest.mark.parametrize("fmt,decode", [(f, None) for f in G.FMTS] + [("mxfp4", d) for d in G.MXFP4_DECODES])
@pytest.mark.parametrize("t", [1, 16, 256, 1024])  # BM 16, 16, 32, 128 (64 unscaled): decode and prefill tiles
def test_gpu_model_shapes(gpu_experts, fmt, decode, t):
    """Every format, and every MXFP4 decode (None: the default, the PTX decode up to 32 pairs an expert)."""
    ex = gpu_experts[fmt]
    ids, w = routing(t, GK, GE, "cuda", seed=t)
    x = torch.randn(t, GD, device="cuda", dtype=torch.bfloat16)
    out = G.routed_experts(x, ids, w, ex, 10.0, config={"decode": decode} if decode else None)
    assert out.isfinite().all()
    assert rel(out, G.routed_experts_ref(x, ids, w, ex, 10.0)) < 1e-2
    assert rel(out, G.routed_experts_ref(x.float(), ids, w, ex, 10.0)) < 1e-2


@cuda
@pytest.mark.parametrize("fmt", G.FMTS)
@pytest.mark.parametrize("t", [40, 256])  # MXFP4: the PTX decode (240 pairs), tl.dot_scaled (1536)
def test_gpu_uneven_routing_and_empty_experts(gpu_experts, fmt, t):
    # every token on expert 3 (up to 16 tiles of 16 rows), the rest on experts 10..19; 37 experts stay empty
    ids, w = routing(t, GK, GE, "cuda", seed=11, hot=3, pool=list(range(10, 20)))
    unused = torch.tensor([e for e in range(GE) if e != 3 and not 10 <= e < 20], device="cuda")
    ex = poison(gpu_experts[fmt], unused)
    x = torch.randn(t, GD, device="cuda", dtype=torch.bfloat16)
    out = G.routed_experts(x, ids, w, ex, 10.0)
    assert out.isfinite().all() and rel(out, G.routed_experts_ref(x, ids, w, ex, 10.0)) < 1e-2
    if fmt == "mxfp4":  # poisoned scales (255) are past the PTX decode's range: the unpoisoned experts take it
        ex = gpu_experts[fmt]
        out = G.routed_experts(x, ids, w, ex, 10.0, config={"decode": "asm"})
        assert rel(out, G.routed_experts_ref(x, ids, w, ex, 10.0)) < 1e-2


@cuda
@pytest.mark.parametrize("fmt", ["fp8", "mxfp4"])
def test_gpu_prefill_dequant_path(gpu_experts, fmt):
    ex = gpu_experts[fmt]
    t = G.DEQUANT_MIN_ROWS_PER_EXPERT * GE // GK + 5  # just past the threshold: the dequant path by default
    ids, w = routing(t, GK, GE, "cuda", seed=14)
    x = torch.randn(t, GD, device="cuda", dtype=torch.bfloat16)
    out = G.routed_experts(x, ids, w, ex, 10.0)
    bf = G.ExpertWeights("bf16", *(ex.dequantized(n, torch.bfloat16) for n in ("w1", "w3", "w2")))
    assert torch.equal(out, G.routed_experts(x, ids, w, bf, 10.0, config=G.DEQUANT_TILES))
    assert rel(out, G.routed_experts_ref(x, ids, w, ex, 10.0)) < 1e-2
    assert rel(out, G.routed_experts(x, ids, w, ex, 10.0, config={"dequant": False})) < 1e-2


@cuda
@pytest.mark.parametrize("decode", G.MXFP4_DECODES)
def test_gpu_graph_capture_has_no_host_sync(gpu_experts, decode):
    ex = gpu_experts["mxfp4"]
    ids, w = routing(8, GK, GE, "cuda", seed=12)
    x = torch.randn(8, GD, device="cuda", dtype=torch.bfloat16)
    cfg = {"decode": decode}
    ref = G.routed_experts(x, ids, w, ex, 10.0, config=cfg)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = G.routed_experts(x, ids, w, ex, 10.0, config=cfg)
    ids.copy_(routing(8, GK, GE, "cuda", seed=13)[0])  # new routing, same buffers: the graph follows it
    graph.replay()
    assert rel(out, G.routed_experts(x, ids, w, ex, 10.0, config=cfg)) < 1e-6 and rel(out, ref) > 1e-2
