"""FP8 block-scaled linear: Triton kernels (W8A16, W8A8, activation quant) against their torch references."""

import pytest
import torch
from torch import nn

from dsserve.kernels import fp8_linear as F
from dsserve.layers.quant import dequant_fp8_block, fake_quant_fp8_pow2, quant_fp8_block

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def rel(out, ref):
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


def make(n, k, block, device="cpu", seed=0):
    g = torch.Generator(device=device).manual_seed(seed)
    # rows and columns of very different magnitude so that the block scales differ (a wrong scale index shows)
    w = torch.randn(n, k, generator=g, device=device) * torch.logspace(-3, 0, n, device=device)[:, None]
    w *= torch.logspace(0, 2, k, device=device).flip(0)[None, :]
    w_q, w_s = quant_fp8_block(w, block)
    return w_q, w_s.view(torch.uint8)


@pytest.mark.parametrize(
    "m,n,k,block,dtype,config",
    [
        (1, 96, 64, 32, torch.float32, None),  # BK 128 > K: masked K tail, 4 scale rows per tile
        (5, 80, 72, 32, torch.bfloat16, None),  # ragged N and K (partial edge blocks)
        (33, 64, 192, 128, torch.float32, {"BK": 64}),  # BK < block: one scale per tile, ragged K block
        (5, 96, 96, 32, torch.float32, {"BK": 32, "SPLIT_K": 2, "BN": 32}),  # split K, 3 K tiles over 2 programs
    ],
)
def test_w8a16_matches_ref(m, n, k, block, dtype, config):
    w_q, w_s = make(n, k, block)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(1)).to(dtype)
    out = F.fp8_linear(x, w_q, w_s, block, config=config)
    ref = F.fp8_linear_ref(x, w_q, w_s, block)
    assert out.dtype == dtype and out.shape == (m, n)
    assert rel(out, ref) < (1e-5 if dtype == torch.float32 else 1e-2)


def test_wide_weights_sum_split_k_in_the_kernel_up_to_64_rows(monkeypatch):
    """Split-K partials of 17-64 rows: summed by the tile's last program for wide weights (N >= WIDE_N, here
    lowered to 96), by torch for narrow ones; both the reference's numbers."""
    monkeypatch.setattr(F, "WIDE_N", 96)
    calls, real = [], F.tile_counters
    monkeypatch.setattr(F, "tile_counters", lambda *a: calls.append(a) or real(*a))
    for n, in_kernel in ((96, True), (80, False)):
        calls.clear()
        w_q, w_s = make(n, 96, 32)
        x = torch.randn(33, 96, generator=torch.Generator().manual_seed(2))
        out = F.fp8_linear(x, w_q, w_s, 32, config={"BK": 32, "SPLIT_K": 3})
        assert bool(calls) == in_kernel
        assert rel(out, F.fp8_linear_ref(x, w_q, w_s, 32)) < 1e-5


@pytest.mark.parametrize("groups", [1, 2])
def test_many_rows_take_dequant_then_matmul_the_reference_exactly(monkeypatch, groups):
    calls, real = [], F.dequant_fp8
    monkeypatch.setattr(F, "dequant_fp8", lambda *a: calls.append(a) or real(*a))
    monkeypatch.setattr(F, "DEQUANT_MIN_ROWS", 8)
    w_q, w_s = make(groups * 64, 96, 32)
    g = torch.Generator().manual_seed(2)
    for m, config, taken in (
        (7, None, False),
        (8, None, True),
        (7, {"dequant": True}, True),
        (8, {"dequant": False}, False),
    ):
        calls.clear()
        x = torch.randn(m, groups * 96, generator=g).bfloat16()
        out = F.fp8_linear(x, w_q, w_s, 32, groups=groups, config=config)
        ref = F.fp8_linear_ref(x, w_q, w_s, 32, groups=groups)
        assert bool(calls) == taken, (m, config)
        if taken:
            assert torch.equal(out, ref)
        assert rel(out, ref) < 1e-2


def test_act_quant_is_the_fake_quant_exactly():
    x = torch.randn(5, 96, generator=torch.Generator().manual_seed(2))
    x[1] = 0.0  # amax floor 1e-4
    x[2, :32] = 448.0 * 2.0**-3  # amax exactly 448 * 2^k: scale 2^k, not 2^(k+1)
    x[3, 32:64] *= 1e6
    q, s = F.act_quant_rows(x, 32)
    deq = q.view(torch.float8_e4m3fn).float() * s.repeat_interleave(32, 1)
    assert torch.equal(deq, fake_quant_fp8_pow2(x, 32))
    assert s[2, 0] == 2.0**-3
    qs, ss = F.act_quant_rows(x, 32, split=True)  # each group's even channels first, then its odd ones
    assert torch.equal(ss, s)
    assert torch.equal(qs.view(5, 3, 2, 16), q.view(5, 3, 16, 2).transpose(2, 3))


@pytest.mark.parametrize(
    "m,n,k,block,group,dtype",
    [
        (5, 96, 64, 32, 32, torch.float32),
        (33, 80, 256, 128, 128, torch.float32),
        (1, 64, 96, 32, 32, torch.bfloat16),
    ],
)
def test_w8a8_matches_its_ref(m, n, k, block, group, dtype):
    w_q, w_s = make(n, k, block)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(3)).to(dtype)
    out = F.fp8_linear(x, w_q, w_s, block, act_quant=True, act_group=group)
    ref = F.fp8_linear_w8a8_ref(x, w_q, w_s, block, act_group=group)
    assert rel(out, ref) < (1e-5 if dtype == torch.float32 else 1e-2)
    # the activation rounding is visible: W8A8 is not the W8A16 result
    assert rel(ref, F.fp8_linear_ref(x, w_q, w_s, block)) > 1e-4


@pytest.mark.parametrize(
    "m,n,k,groups,config",
    [
        (1, 96, 256, 1, {"SPLIT_K": 2, "BK": 64}),  # decode: swapped, 4 K tiles over 2 programs, summed in-kernel
        (3, 80, 96, 1, {"SPLIT_K": 3, "BK": 32, "SWAP": False}),  # unswapped, ragged N, 3 splits
        (20, 64, 128, 1, {"SPLIT_K": 2, "BK": 32}),  # 17-64 rows, narrow: torch sums the stored splits
        (2, 128, 64, 2, {"SPLIT_K": 2, "BK": 32}),  # grouped, swapped, split
        (4, 64, 160, 1, {"SPLIT_K": 2, "BK": 64}),  # K tiles 2 + 1, the last one partial (K masks)
        (70, 96, 64, 1, {"BK": 64}),  # > 64 rows: 128-row tiles, no split
        (70, 64, 256, 1, {"SPLIT_K": 2, "BK": 64}),  # > 64 rows, split: torch sums the stored splits
    ],
)
def test_w8a8_split_k_and_swap_match_ref(monkeypatch, m, n, k, groups, config):
    # scratch, quantised rows and outputs start as NaN (bytes 0xFF: e4m3 NaN), so anything left unwritten shows
    nan = lambda shape, dtype, device: torch.full(  # noqa: E731
        shape, float("nan") if dtype.is_floating_point else 0xFF, dtype=dtype, device=device
    )
    monkeypatch.setattr(F, "_empty", nan)
    w_q, w_s = make(n, k, 32, seed=m)
    x = torch.randn(m, groups * k, generator=torch.Generator().manual_seed(m))
    out = F.fp8_linear(x, w_q, w_s, 32, act_quant=True, groups=groups, config=config)
    assert out.shape == (m, n) and out.isfinite().all()
    assert rel(out, F.fp8_linear_w8a8_ref(x, w_q, w_s, 32, groups=groups)) < 1e-5
    # the quantisation inside the product kernel (<= 8 rows) or by its own launch: the same bytes, the same sums
    for fuse in (True, False):
        cfg = dict(config or {}, fuse_quant=fuse)
        assert torch.equal(F.fp8_linear(x, w_q, w_s, 32, act_quant=True, groups=groups, config=cfg), out)
    # the tiles on the FP16 MMA (e4m3 is exact in fp16; exact sums on every GPU tile, as here)
    cfg = dict(config or {}, mma="fp16")
    assert rel(F.fp8_linear(x, w_q, w_s, 32, act_quant=True, groups=groups, config=cfg), out) < 1e-6


@pytest.mark.parametrize("groups", [1, 2])
def test_w8a8_many_rows_fake_quantise_then_matmul_the_reference_exactly(monkeypatch, groups):
    monkeypatch.setattr(F, "DEQUANT_MIN_ROWS", 8)
    w_q, w_s = make(groups * 64, 96, 32)
    x = torch.randn(9, groups * 96, generator=torch.Generator().manual_seed(3)).bfloat16()
    ref = F.fp8_linear_w8a8_ref(x, w_q, w_s, 32, groups=groups)
    assert torch.equal(F.fp8_linear(x, w_q, w_s, 32, act_quant=True, groups=groups), ref)
    out = F.fp8_linear(x.float(), w_q, w_s, 32, act_quant=True, groups=groups, config={"dequant": False})
    assert rel(out, F.fp8_linear_w8a8_ref(x.float(), w_q, w_s, 32, groups=groups)) < 1e-5


def test_module_round_trip_and_dispatch():
    lin = nn.Linear(96, 80, bias=False)
    torch.nn.init.normal_(lin.weight, std=0.05, generator=torch.Generator().manual_seed(4))
    mod = F.Fp8Linear.from_linear(lin, 32)
    q, s = quant_fp8_block(lin.weight.detach(), 32)
    assert torch.equal(mod.dequantized_weight(), dequant_fp8_block(q, s, 32))
    assert mod.weight.dtype == torch.float8_e4m3fn and mod.weight_scale.dtype == torch.uint8
    x = torch.randn(2, 3, 96, generator=torch.Generator().manual_seed(5))
    ref = x @ mod.dequantized_weight().t()
    assert rel(mod(x), ref) < 1e-6
    mod.use_kernel = True
    assert mod(x).shape == (2, 3, 80) and rel(mod(x), ref) < 1e-5
    mod.act_quant_min_m = 6  # 6 rows: W8A8 numerics in the kernel and in the reference alike
    assert rel(mod(x), F.fp8_linear_w8a8_ref(x.view(6, 96), q, s, 32).view(2, 3, 80)) < 1e-5
    mod.double()  # fp8 bytes survive a model-wide dtype cast
    assert mod.weight.dtype == torch.float8_e4m3fn
    assert torch.equal(mod.dequantized_weight(), dequant_fp8_block(q, s, 32))


def test_rejects_bad_operands():
    w_q, w_s = make(64, 64, 32)
    x = torch.randn(2, 64)
    with pytest.raises(ValueError, match="block"):
        F.fp8_linear(x, w_q, w_s, 16)
    with pytest.raises(ValueError, match="w_s"):
        F.fp8_linear(x, w_q, w_s[:1], 32)
    with pytest.raises(ValueError, match="x must be"):
        F.fp8_linear(torch.randn(2, 32), w_q, w_s, 32)
    with pytest.raises(ValueError, match="act_group"):
        F.fp8_linear(x, w_q, w_s, 32, act_quant=True, act_group=128)
    with pytest.raises(ValueError, match="mma='tf32'.*'fp8' or 'fp16'"):
        F.fp8_linear(x, w_q, w_s, 32, act_quant=True, config={"mma": "tf32"})
    with pytest.raises(ValueError, match="bias"):
        F.Fp8Linear.from_linear(nn.Linear(64, 64), 32)


def grouped_loop(x, w_q, w_s, block, groups):
    """The block-diagonal product group by group: each group's own rows and scale rows, a plain matmul."""
    n, k = w_q.shape
    o, ob = n // groups, n // groups // block
    outs = [
        x[:, g * k : (g + 1) * k]
        @ dequant_fp8_block(w_q[g * o : (g + 1) * o], w_s[g * ob : (g + 1) * ob], block).to(x.dtype).t()
        for g in range(groups)
    ]
    return torch.cat(outs, 1)


@pytest.mark.parametrize("groups,m,o,k", [(2, 5, 64, 96), (4, 3, 32, 64), (8, 1, 32, 32)])
def test_grouped_ref_is_the_per_group_loop(groups, m, o, k):
    w_q, w_s = make(groups * o, k, 32, seed=groups)
    x = torch.randn(m, groups * k, generator=torch.Generator().manual_seed(6))
    ref = F.fp8_linear_ref(x, w_q, w_s, 32, groups=groups)
    assert ref.shape == (m, groups * o)
    assert rel(ref, grouped_loop(x, w_q, w_s, 32, groups)) < 1e-6
    # not the dense product: the off-diagonal blocks are zero, not W's other groups
    dense = x[:, :k] @ dequant_fp8_block(w_q, w_s, 32).t()
    assert rel(ref[:, :o], dense[:, :o]) < 1e-6 and rel(ref[:, o:], dense[:, o:]) > 0.1
    aq = F.fp8_linear_w8a8_ref(x, w_q, w_s, 32, groups=groups)
    assert rel(aq, grouped_loop(fake_quant_fp8_pow2(x, 32), w_q, w_s, 32, groups)) < 1e-6


@pytest.mark.parametrize(
    "groups,m,o,k,dtype,config",
    [
        (2, 1, 64, 256, torch.float32, {"SPLIT_K": 2}),  # decode: BN 64 = O, 2 K tiles over 2 programs
        (4, 5, 32, 64, torch.bfloat16, None),  # default tiles, BN 32 = O: one program per group
        (2, 5, 64, 128, torch.float32, {"BN": 32, "BK": 32, "SPLIT_K": 3}),  # 2 programs a group, 4 K tiles over 2
        (4, 70, 32, 64, torch.float32, None),  # M > 64: BM 128, BK 64
    ],
)
def test_grouped_w8a16_matches_ref(groups, m, o, k, dtype, config):
    w_q, w_s = make(groups * o, k, 32, seed=m)
    x = torch.randn(m, groups * k, generator=torch.Generator().manual_seed(7)).to(dtype)
    out = F.fp8_linear(x, w_q, w_s, 32, groups=groups, config=config)
    ref = F.fp8_linear_ref(x, w_q, w_s, 32, groups=groups)
    assert out.dtype == dtype and out.shape == (m, groups * o)
    assert rel(out, ref) < (1e-5 if dtype == torch.float32 else 1e-2)


@pytest.mark.parametrize(
    "m,n,k,groups,config",
    [
        (1, 80, 96, 1, {"BK": 32, "SPLIT_K": 2}),  # N tail past the weight (zero-filled tile), split summed in-kernel
        (5, 128, 128, 2, {"BK": 32}),  # grouped: the descriptor spans every group's rows
        (70, 96, 64, 1, None),  # many rows: 128-row tiles
    ],
)
def test_w8a16_tma_weight_tiles_equal_pointer_loads(m, n, k, groups, config):
    """config tma: the weight tiles by TMA from a host descriptor give the pointer loads' numbers, bit for bit."""
    w_q, w_s = make(n, k, 32)
    x = torch.randn(m, groups * k, generator=torch.Generator().manual_seed(4))
    out = F.fp8_linear(x, w_q, w_s, 32, groups=groups, config=dict(config or {}, tma=True))
    assert torch.equal(out, F.fp8_linear(x, w_q, w_s, 32, groups=groups, config=config))
    assert rel(out, F.fp8_linear_ref(x, w_q, w_s, 32, groups=groups)) < 1e-5


def test_grouped_w8a8_and_module():
    w_q, w_s = make(4 * 32, 64, 32, seed=8)
    x = torch.randn(5, 4 * 64, generator=torch.Generator().manual_seed(9))
    out = F.fp8_linear(x, w_q, w_s, 32, act_quant=True, groups=4)
    assert rel(out, F.fp8_linear_w8a8_ref(x, w_q, w_s, 32, groups=4)) < 1e-5
    mod = F.Fp8Linear.from_quantized(w_q, w_s, 32, groups=4)
    assert (mod.in_features, mod.out_features) == (64, 128) and "groups=4" in repr(mod)
    ref = F.fp8_linear_ref(x, w_q, w_s, 32, groups=4)
    assert rel(mod(x.view(5, 1, 256)).view(5, 128), ref) < 1e-6
    mod.use_kernel = True
    assert rel(mod(x), ref) < 1e-5
    lin = nn.Linear(64, 128, bias=False)
    assert F.Fp8Linear.from_linear(lin, 32, groups=4).groups == 4


def test_grouped_rejects_bad_operands():
    w_q, w_s = make(96, 64, 32)
    x = torch.randn(2, 128)
    with pytest.raises(ValueError, match="groups"):
        F.fp8_linear_ref(x, w_q, w_s, 32, groups=5)  # 96 rows do not split into 5
    with pytest.raises(ValueError, match="multiple of block"):
        F.fp8_linear(torch.randn(2, 256), w_q, w_s, 32, groups=4)  # O = 24: a scale block straddles groups
    with pytest.raises(ValueError, match="x must be"):
        F.fp8_linear(torch.randn(2, 64), w_q, w_s, 32, groups=3)  # x must be [M, groups * K]
    with pytest.raises(ValueError, match="BN"):
        F.fp8_linear(torch.randn(2, 192), w_q, w_s, 32, groups=3, config={"BN": 64})  # O = 32
    with pytest.raises(ValueError, match="multiple of block"):
        F.Fp8Linear.from_linear(nn.Linear(64, 96, bias=False), 32, groups=2)  # O = 48


def _poisoned_call(fn, m, n):
    # fill the allocator's next block of this size with NaN so that an unwritten output element shows
    torch.full((m, n), float("nan"), device="cuda", dtype=torch.float32)
    torch.full((m, n), float("nan"), device="cuda", dtype=torch.bfloat16)
    return fn()


@cuda
@pytest.mark.parametrize("name", list(F.BENCH_SHAPES))
@pytest.mark.parametrize("m", [1, 64, 4096])
@pytest.mark.parametrize("block", [32, 128])
def test_gpu_model_shapes(name, m, block):
    n, k = F.BENCH_SHAPES[name]
    w_q, w_s = make(n, k, block, "cuda", seed=m)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    out = _poisoned_call(lambda: F.fp8_linear(x, w_q, w_s, block), m, n)
    assert not out.isnan().any()
    assert rel(out, F.fp8_linear_ref(x, w_q, w_s, block)) < 1e-2
    assert rel(out, F.fp8_linear_ref(x.float(), w_q, w_s, block)) < 1e-2
    for group in {32, block}:
        out = _poisoned_call(lambda: F.fp8_linear(x, w_q, w_s, block, act_quant=True, act_group=group), m, n)
        assert not out.isnan().any()
        assert rel(out, F.fp8_linear_w8a8_ref(x.float(), w_q, w_s, block, act_group=group)) < 1e-2


@cuda
@pytest.mark.parametrize("name", list(F.BENCH_SHAPES))
def test_gpu_prefill_rows_both_paths(name):
    n, k = F.BENCH_SHAPES[name]
    w_q, w_s = make(n, k, 32, "cuda", seed=7)
    x = torch.randn(F.DEQUANT_MIN_ROWS + 3, k, device="cuda", dtype=torch.bfloat16)
    ref = F.fp8_linear_ref(x, w_q, w_s, 32)
    assert torch.equal(_poisoned_call(lambda: F.fp8_linear(x, w_q, w_s, 32), x.shape[0], n), ref)
    out = _poisoned_call(lambda: F.fp8_linear(x, w_q, w_s, 32, config={"dequant": False}), x.shape[0], n)
    assert rel(out, ref) < 1e-2


@cuda
def test_gpu_fp32_split_k_and_bk_fallback():
    w_q, w_s = make(1280, 5120, 32, "cuda")
    x = torch.randn(3, 5120, device="cuda")
    ref = F.fp8_linear_ref(x, w_q, w_s, 32)
    for cfg in (None, {"SPLIT_K": 1}, {"SPLIT_K": 7, "BK": 32}):
        assert rel(F.fp8_linear(x, w_q, w_s, 32, config=cfg), ref) < 1e-5
    out = F.fp8_linear(x, w_q, w_s, 32, act_quant=True)
    assert rel(out, F.fp8_linear_w8a8_ref(x, w_q, w_s, 32)) < 1e-5


# The tiny model's projections (N, K of the weight, groups; x has groups x K columns): K not a multiple of BK (96,
# 384), narrow N (64), wo_a's 2 groups.
TINY_SHAPES = [(96, 256, 1), (256, 96, 1), (64, 256, 1), (128, 128, 2), (256, 128, 1), (1280, 384, 1), (256, 256, 1)]


@cuda
@pytest.mark.parametrize("n,k,groups", TINY_SHAPES)
@pytest.mark.parametrize("m", [1, 7, 64])
def test_gpu_tiny_model_widths(n, k, groups, m):
    """The widths of the tiny model, which the engine's GPU test with --act-quant runs (fp32, block 32): W8A16 and
    W8A8 against their references on CUDA (the interpreter tests cover these widths on the CPU)."""
    w_q, w_s = make(n, k, 32, "cuda", seed=n + k + m)
    x = torch.randn(m, groups * k, device="cuda")
    out = _poisoned_call(lambda: F.fp8_linear(x, w_q, w_s, 32, groups=groups), m, n)
    assert rel(out, F.fp8_linear_ref(x, w_q, w_s, 32, groups=groups)) < 1e-5
    ref = F.fp8_linear_w8a8_ref(x, w_q, w_s, 32, groups=groups)
    out = _poisoned_call(lambda: F.fp8_linear(x, w_q, w_s, 32, act_quant=True, groups=groups), m, n)
    assert_within_fp8_mma_sums(out, ref, x, w_q, w_s, groups)
    exact = {"mma": "fp16"}
    out = _poisoned_call(lambda: F.fp8_linear(x, w_q, w_s, 32, act_quant=True, groups=groups, config=exact), m, n)
    assert rel(out, ref) < 1e-5


def assert_within_fp8_mma_sums(out, ref, x, w_q, w_s, groups):
    """Hopper's FP8 wgmma (tiles of 32 or more rows) sums a tile's e4m3 products to about 2^-13 of their
    magnitudes: up to 2^-12.7 of an output's sum of |products| on an H100 (benchmarks/results/fp8-mma-h100). Each
    output is held to 2^-10 of its own sum of |products| (the reference on |x|, |w|); a wrong scale or row moves an
    output by a share of its value, far more."""
    w_abs = (w_q.view(torch.uint8) & 0x7F).view(w_q.dtype)  # the e4m3 sign bit cleared
    mag = F.fp8_linear_w8a8_ref(x.abs(), w_abs, w_s, 32, groups=groups)
    assert ((out - ref).abs() <= 2**-10 * mag).all()


@cuda
@pytest.mark.parametrize("m", [1, 16, 300])
def test_gpu_grouped_wo_a(m):
    n, k, groups = 8192, 4096, 8  # attn.wo_a: 8 groups x 1024 rows, each on its own 4096 columns
    w_q, w_s = make(n, k, 32, "cuda", seed=m)
    x = torch.randn(m, groups * k, device="cuda", dtype=torch.bfloat16)
    out = _poisoned_call(lambda: F.fp8_linear(x, w_q, w_s, 32, groups=groups), m, n)
    assert not out.isnan().any()
    ref = F.fp8_linear_ref(x.float(), w_q, w_s, 32, groups=groups)
    assert rel(out, ref) < 1e-2
    assert rel(F.fp8_linear(x.float(), w_q, w_s, 32, groups=groups), ref) < 1e-5
    assert rel(ref.cpu(), grouped_loop(x.float().cpu(), w_q.cpu(), w_s.cpu(), 32, groups)) < 1e-5
    out = _poisoned_call(lambda: F.fp8_linear(x, w_q, w_s, 32, act_quant=True, groups=groups), m, n)
    assert rel(out, F.fp8_linear_w8a8_ref(x.float(), w_q, w_s, 32, groups=groups)) < 1e-2
