"""dsserve.kernels.grouped_moe_a8: W4A8 / W8A8 routed experts against routed_experts_ref(act_quant=True).

Interpreter tests use tiny shapes and fp32 x (rel err < 1e-5: the e4m3 products are exact, only the fp32 sums'
order differs); the GPU tests one EP rank of the release proxy (d = 5120, inter = 2304, E = 48, k = 6, bf16 x:
rel err < 1e-2, bf16 outputs). Scratch and outputs start as NaN, and experts that no token picks hold NaN weights
(FP8 byte 0x7F) or NaN scales (e8m0 byte 255), so a row left unwritten or a tile read from the wrong expert shows.
"""

import pytest
import torch
import triton
import triton.language as tl
from test_grouped_moe import dense, poison, rel, routing

from dsserve.kernels import grouped_moe as G
from dsserve.kernels import grouped_moe_a8 as A
from dsserve.layers.quant import E2M1_VALUES, fake_quant_fp8_pow2

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
LIMIT = 3.0


def _nan_empty(shape, dtype, device):
    return torch.full(shape, float("nan") if dtype.is_floating_point else 0xFF, dtype=dtype, device=device)


@pytest.fixture(autouse=True)
def _poisoned_scratch(monkeypatch):
    monkeypatch.setattr(A, "_empty", _nan_empty)


@pytest.fixture(scope="module")
def tiny():
    """{(fmt, d, inter): experts} for 8 experts: (64, 64) runs two 32-wide K groups a step, (96, 32) three K steps
    of one group (96 has no power-of-two divisor above 32)."""
    return {
        (fmt, d, i): G.ExpertWeights.from_dense(*dense(8, d, i, seed=d + i), fmt)
        for fmt in ("mxfp4", "fp8")
        for d, i in ((64, 64), (96, 32))
    }


@pytest.mark.parametrize("fmt", ["mxfp4", "fp8"])
@pytest.mark.parametrize("t,k,d,inter", [(1, 3, 64, 64), (5, 2, 96, 32), (17, 2, 64, 64)])
def test_matches_ref_with_the_same_rounding(tiny, fmt, t, k, d, inter):
    ex = tiny[(fmt, d, inter)]
    ids, w = routing(t, k, 8, seed=t + k)
    x = torch.randn(t, d, generator=torch.Generator().manual_seed(t)) * 3
    out = G.routed_experts(x, ids, w, ex, LIMIT, act_quant=True)
    ref = G.routed_experts_ref(x, ids, w, ex, LIMIT, act_quant=True)
    assert out.dtype == x.dtype and out.shape == (t, d) and out.isfinite().all()
    assert rel(out, ref) < 1e-5
    # the tiles on the FP16 MMA (e4m3 is exact in fp16; exact sums on every GPU tile, as here)
    assert rel(G.routed_experts(x, ids, w, ex, LIMIT, act_quant=True, config={"mma": "fp16"}), ref) < 1e-5
    # the activation rounding is visible: this is not the weight-only result
    assert rel(ref, G.routed_experts_ref(x, ids, w, ex, LIMIT)) > 1e-3


def test_uneven_routing_empty_experts_and_1_to_32_rows_an_expert(tiny):
    """Expert 2 takes all 33 tokens (three 16-row tiles, the last with one row), experts 5 and 6 the rest; five
    experts are empty and poisoned."""
    t, k = 33, 3
    ids, w = routing(t, k, 8, seed=5, hot=2, pool=[5, 6])
    x = torch.randn(t, 64, generator=torch.Generator().manual_seed(6))
    for fmt in ("mxfp4", "fp8"):
        ex = poison(tiny[(fmt, 64, 64)], torch.tensor([0, 1, 3, 4, 7]))
        out = G.routed_experts(x, ids, w, ex, LIMIT, act_quant=True)
        assert out.isfinite().all()
        assert rel(out, G.routed_experts_ref(x, ids, w, ex, LIMIT, act_quant=True)) < 1e-5


def test_bf16_rows_swap_and_accumulate_into(tiny):
    """bf16 x (bf16 matmul outputs and h, as the reference rounds them), both MMA orientations, and the shared
    expert's output taking the routed sum in place."""
    ex = tiny[("mxfp4", 64, 64)]
    ids, w = routing(9, 3, 8, seed=7)
    x = torch.randn(9, 64, generator=torch.Generator().manual_seed(7)).bfloat16()
    ref = G.routed_experts_ref(x, ids, w, ex, LIMIT, act_quant=True)
    for swap in (True, False):
        out = G.routed_experts(x, ids, w, ex, LIMIT, act_quant=True, config={"SWAP": swap})
        assert out.dtype == torch.bfloat16 and rel(out, ref) < 5e-3
    shared = torch.randn(9, 64, generator=torch.Generator().manual_seed(8)).bfloat16()
    want = G.routed_experts_ref(x, ids, w, ex, LIMIT, act_quant=True, accumulate_into=shared.clone())
    got = G.routed_experts(x, ids, w, ex, LIMIT, act_quant=True, accumulate_into=shared.clone())
    assert rel(got, want) < 5e-3


@pytest.mark.parametrize("fmt", ["mxfp4", "fp8"])
def test_prefill_sized_calls_run_bf16_tiles_with_the_same_rounding(tiny, monkeypatch, fmt):
    """From grouped_moe's prefill threshold (bf16 rows; forced here by config dequant, fp32 rows) x is fake-quantised
    in its dtype, the experts dequantised, and h fake-quantised in the up kernel's epilogue: the reference's numbers
    on grouped_moe's bf16 tiles."""
    calls, real = [], G._up_kernel
    ex = tiny[(fmt, 64, 64)]
    ids, w = routing(17, 2, 8, seed=9)
    x = torch.randn(17, 64, generator=torch.Generator().manual_seed(9)) * 3
    ref = G.routed_experts_ref(x, ids, w, ex, LIMIT, act_quant=True)
    monkeypatch.setattr(G, "_up_kernel", type("Spy", (), {"__getitem__": lambda _, g: calls.append(g) or real[g]})())
    out = G.routed_experts(x, ids, w, ex, LIMIT, act_quant=True, config={"dequant": True})
    assert calls and out.isfinite().all() and rel(out, ref) < 1e-5
    # the tiles' MMA choice means nothing to bf16 tiles (they sum exactly): accepted, and the same numbers
    same = G.routed_experts(x, ids, w, ex, LIMIT, act_quant=True, config={"dequant": True, "mma": "fp16"})
    assert torch.equal(same, out)
    assert rel(ref, G.routed_experts_ref(x, ids, w, ex, LIMIT)) > 1e-3


@triton.jit
def _convert_kernel(b_ptr, o_ptr, N: tl.constexpr, H: tl.constexpr, SPLIT: tl.constexpr):
    r = tl.arange(0, N)[:, None]
    b = tl.load(b_ptr + r * H + tl.arange(0, H)[None, :])
    w = A.e2m1x2_to_e4m3(b, N, H, False, SPLIT)
    tl.store(o_ptr + r * 2 * H + tl.arange(0, 2 * H)[None, :], w.to(tl.float32))


@pytest.mark.parametrize("split", [False, True])
def test_every_e2m1_pair_becomes_exact_e4m3(split):
    """All 256 bytes: each nibble's e4m3 is its e2m1 value times 2^-6; SPLIT puts the low nibbles first."""
    b = torch.arange(256, dtype=torch.uint8).view(16, 16)
    out = torch.empty(16, 32)
    _convert_kernel[(1,)](b, out, N=16, H=16, SPLIT=split)
    lo, hi = E2M1_VALUES[(b & 15).long()], E2M1_VALUES[(b >> 4).long()]
    want = torch.cat([lo, hi], 1) if split else torch.stack([lo, hi], -1).view(16, 32)
    assert torch.equal(out, want * 2.0**-6)


@triton.jit
def _quant_kernel(x_ptr, q_ptr, s_ptr, R: tl.constexpr):
    at = tl.arange(0, R)[:, None] * 32 + tl.arange(0, 32)[None, :]
    q, s = A.quant_e4m3_pow2(tl.load(x_ptr + at))
    tl.store(q_ptr + at, q)
    tl.store(s_ptr + tl.arange(0, R), s)


def test_epilogue_quant_is_the_fake_quant_exactly():
    x = torch.randn(16, 32, generator=torch.Generator().manual_seed(2)) * torch.logspace(-6, 6, 16)[:, None]
    x[1] = 0.0  # amax floor 1e-4
    x[2, 0] = 448.0 * 2.0**-3  # amax exactly 448 * 2^k: scale 2^k
    x[3, 5] = 7.99 * 2.0**-3  # a rounding carry into the exponent
    q, s = torch.empty(16, 32, dtype=torch.uint8), torch.empty(16)
    _quant_kernel[(1,)](x, q, s, R=16)
    assert torch.equal(q.view(torch.float8_e4m3fn).float() * s[:, None], fake_quant_fp8_pow2(x, 32))


def test_rejects_what_it_cannot_run(tiny):
    ids, w = routing(2, 2, 8)
    x = torch.randn(2, 64)
    bf = G.ExpertWeights.from_dense(*dense(8, 64, 64), "bf16")
    with pytest.raises(ValueError, match="fmt mxfp4 or fp8"):
        G.routed_experts(x, ids, w, bf, LIMIT, act_quant=True)
    with pytest.raises(ValueError, match="asm"):
        G.routed_experts(x, ids, w, tiny[("mxfp4", 64, 64)], LIMIT, act_quant=True, config={"asm": True})
    with pytest.raises(ValueError, match="BN"):
        G.routed_experts(x, ids, w, tiny[("mxfp4", 64, 64)], LIMIT, act_quant=True, config={"BN": 16})
    with pytest.raises(ValueError, match="mma='bf16'.*'fp8' or 'fp16'"):
        G.routed_experts(x, ids, w, tiny[("mxfp4", 64, 64)], LIMIT, act_quant=True, config={"mma": "bf16"})
    empty = G.routed_experts(x[:0], ids[:0], w[:0], tiny[("mxfp4", 64, 64)], LIMIT, act_quant=True)
    assert empty.shape == (0, 64)


# ------------------------------------------------------------------ GPU: one EP rank of the release proxy
GD, GINTER, GE, GK = 5120, 2304, 48, 6


@pytest.fixture(scope="module")
def gpu_experts():
    if not torch.cuda.is_available():
        return None
    return {f: G.ExpertWeights.from_dense(*dense(GE, GD, GINTER, "cuda", seed=9), f) for f in ("mxfp4", "fp8")}


# Hopper's FP8 wgmma (tiles of 32 or more rows) sums the e4m3 products to about 2^-13 of their magnitudes
# (benchmarks/results/fp8-mma-h100), which flips some of h's e4m3 roundings between the two projections: 1.2e-3 to
# 2.5e-3 of the output at 256 tokens on an H100 (a wrong scale or row moves it by ~1).
FP8_MMA_REL = 5e-3
# The FP16 MMA (config mma) forms each product exactly and sums in fp32, in another order than the reference's
# matmul: a last-bit difference still flips an h rounding now and then, and a flip moves its row by one e4m3 step.
# Over 8 inputs an H100 gave up to 7e-6 (mxfp4) and 2.4e-4 (fp8 experts) at 256 tokens, 1.3e-7 at 1-8 tokens.
FP16_MMA_REL = 1e-3


@cuda
@pytest.mark.parametrize("fmt", ["mxfp4", "fp8"])
@pytest.mark.parametrize("t", [1, 8, 64, 256])  # 1-32 tokens an expert at decode; BM 64 tiles at 256
def test_gpu_model_shapes(gpu_experts, fmt, t):
    ex = gpu_experts[fmt]
    ids, w = routing(t, GK, GE, "cuda", seed=t)
    x = torch.randn(t, GD, generator=torch.Generator().manual_seed(t)).to("cuda", torch.bfloat16)
    out = G.routed_experts(x, ids, w, ex, 10.0, act_quant=True)
    assert out.isfinite().all()
    # the reference with the same bf16 roundings (of the matmul outputs and h, before h's act_quant)
    assert rel(out, G.routed_experts_ref(x, ids, w, ex, 10.0, act_quant=True)) < 1e-2
    ref = G.routed_experts_ref(x.float(), ids, w, ex, 10.0, act_quant=True)
    assert rel(G.routed_experts(x.float(), ids, w, ex, 10.0, act_quant=True), ref) < FP8_MMA_REL
    assert (
        rel(G.routed_experts(x.float(), ids, w, ex, 10.0, act_quant=True, config={"mma": "fp16"}), ref) < FP16_MMA_REL
    )
    if fmt == "mxfp4":  # the PTX conversion gives the byte-wise Triton ops' numbers, bit for bit
        assert torch.equal(out, G.routed_experts(x, ids, w, ex, 10.0, act_quant=True, config={"asm": False}))


@cuda
@pytest.mark.parametrize("fmt", ["mxfp4", "fp8"])
@pytest.mark.parametrize("t", [1, 7, 64, 256])
def test_gpu_tiny_model_widths(fmt, t):
    """The tiny model's experts (d 256, inter 128: BK 128 on the down projection, 8 experts, top-2), which the
    engine's GPU test with --act-quant runs, in fp32 on CUDA, PTX conversion and byte-wise ops alike."""
    ex = G.ExpertWeights.from_dense(*dense(8, 256, 128, "cuda", seed=t), fmt)
    ids, w = routing(t, 2, 8, "cuda", seed=t)
    x = torch.randn(t, 256, generator=torch.Generator().manual_seed(t)).to("cuda")
    ref = G.routed_experts_ref(x, ids, w, ex, 10.0, act_quant=True)
    assert rel(G.routed_experts(x, ids, w, ex, 10.0, act_quant=True), ref) < FP8_MMA_REL
    assert rel(G.routed_experts(x, ids, w, ex, 10.0, act_quant=True, config={"asm": False}), ref) < FP8_MMA_REL
    for asm in (True, False):  # the FP16 MMA sums exactly: only a last-bit flip of an h rounding is left
        assert (
            rel(G.routed_experts(x, ids, w, ex, 10.0, act_quant=True, config={"asm": asm, "mma": "fp16"}), ref) < 1e-4
        )


@cuda
def test_gpu_uneven_routing_and_empty_experts(gpu_experts):
    ids, w = routing(40, GK, GE, "cuda", seed=11, hot=3, pool=list(range(10, 20)))
    unused = torch.tensor([e for e in range(GE) if e != 3 and not 10 <= e < 20], device="cuda")
    x = torch.randn(40, GD, device="cuda", dtype=torch.bfloat16)
    for fmt in ("mxfp4", "fp8"):
        ex = poison(gpu_experts[fmt], unused)
        out = G.routed_experts(x, ids, w, ex, 10.0, act_quant=True)
        assert out.isfinite().all()
        assert rel(out, G.routed_experts_ref(x, ids, w, ex, 10.0, act_quant=True)) < 1e-2


@cuda
def test_gpu_graph_capture_follows_new_routing(gpu_experts):
    """No host sync: the W4A8 call captures into a CUDA graph, and a replay on new routing and rows (same buffers)
    gives the eager result."""
    ex = gpu_experts["mxfp4"]
    ids, w = routing(8, GK, GE, "cuda", seed=12)
    x = torch.randn(8, GD, device="cuda", dtype=torch.bfloat16)
    G.routed_experts(x, ids, w, ex, 10.0, act_quant=True)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = G.routed_experts(x, ids, w, ex, 10.0, act_quant=True)
    ids.copy_(routing(8, GK, GE, "cuda", seed=13)[0])
    x.copy_(torch.randn(8, GD, device="cuda", dtype=torch.bfloat16))
    graph.replay()
    assert torch.equal(out, G.routed_experts(x, ids, w, ex, 10.0, act_quant=True))
