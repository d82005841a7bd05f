"""dsserve.kernels.kv_write: the fused cache writes against their torch references and the model's own modules.

Interpreter tests use tiny shapes (D = 64, R = 16, Di = 32, 1 to 37 rows); GPU tests the real ones (512, 64, 128).
The quantiser is checked bit-exactly (bytes and values); the fused ops allow a rare element one grid step apart,
since the kernel's norm sums in another order and an fp32 ulp can cross a rounding boundary.
"""

from types import SimpleNamespace

import pytest
import torch

from dsserve.kernels import kv_write as kw
from dsserve.layers import quant
from dsserve.layers.attention import CSA2Attention
from dsserve.layers.compressor import Compressor
from dsserve.layers.indexer import Indexer
from dsserve.layers.norm import RMSNorm
from dsserve.layers.rope import Rope, RopeSpec

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
POISON, EPS = 0xA5, 1e-6
OWN = {"store_window": "swa_fp8", "store_main": "main_fp4", "store_index": "index_fp4"}
ROPE = Rope(RopeSpec(16, 10000.0))


@pytest.fixture(autouse=True)
def _poisoned_outputs(monkeypatch):
    """The kernels' returned tensors start as NaN, so a row the kernel fails to write shows up."""
    monkeypatch.setattr(
        kw, "_empty", lambda n, d, dtype, device: torch.full((n, d), float("nan"), dtype=dtype, device=device)
    )


def _angles(n, half, dev, seed):
    pos = torch.randperm(4 * n + 8, generator=torch.Generator().manual_seed(seed))[:n]
    ang = pos.double()[:, None] * 10000.0 ** (-torch.arange(half, dtype=torch.float64) / half)
    return ang.cos().to(dev), ang.sin().to(dev)


def _rows(n, n_pool, dev, seed):
    """A random injective map into a larger pool, with one row (the second) marked -1: not stored. On the CPU it is
    a view whose storage goes on with the pool rows left free, so a kernel reading rows past T stores there."""
    rows = torch.randperm(n_pool, generator=torch.Generator().manual_seed(seed))[:n]
    if n > 1:
        rows[1] = -1
    return rows.to(dev)


def _case(op, n, d, half, dtype, dev, seed, ratio=2):
    g = torch.Generator().manual_seed(seed)
    mag = 10.0 ** torch.empty(n * (ratio if op == "store_main" else 1), 1).uniform_(-3, 3, generator=g)
    x = (torch.randn(mag.shape[0], d, generator=g) * mag).to(dtype).to(dev)
    w = (torch.rand(d, generator=g) + 0.5).to(dtype).to(dev)
    cos, sin = _angles(n, half, dev, seed)
    if op != "store_main":
        return (x, w, EPS, cos, sin)
    z = (torch.randn(x.shape, generator=g) * 3).to(dev) if ratio == 2 else None
    return (x.float(), z, ratio, w, EPS, cos, sin)


def _run(op, args, fmt, qat, n_pool, rows, out_dtype=None):
    """(kernel returned, kernel pool, ref returned, ref pool) from poisoned pools; main returns (latent, main)."""
    f = kw._resolve(op, fmt, args[0].shape[1])
    pools = [torch.full((n_pool, f.row_bytes), POISON, dtype=torch.uint8, device=args[0].device) for _ in range(2)]
    extra = {"out_dtype": out_dtype} if op == "store_main" else {}
    got = getattr(kw, op)(*args, pools[0], rows, fmt, qat, **extra)
    ref = getattr(kw, op + "_ref")(*args, pools[1], rows, fmt, qat, **extra)
    return f, got, pools[0], ref, pools[1]


def _same(a, b):  # bitwise, signed zeros included
    return a.dtype == b.dtype and torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


def _assert_near(out, ref, pre, kind, qat, frac):
    """out == ref except on <= frac of the elements, each within one grid step (two where the group's scale moved)."""
    if not qat:
        tol = 1e-2 if out.dtype != torch.float32 else 1e-5
        assert ((out.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-30)).item() < tol
        return
    bad = ~((out == ref) & (torch.signbit(out) == torch.signbit(ref)))
    assert bad.sum().item() <= max(1, frac * out.numel()), f"{bad.sum().item()} of {out.numel()} differ"
    grp, floor = kw._GROUP[kind], {"swa_fp8": 1e-4, "main_fp4": 6 * 2.0**-9, "index_fp4": 6 * 2.0**-126}[kind]
    amax = pre.float().abs().unflatten(-1, (-1, grp)).amax(-1, keepdim=True).clamp_min(floor)
    top, steps = (448.0, 32.0) if kind == "swa_fp8" else (6.0, 2.0)  # largest grid step, in units of the scale
    step = (2 * amax / top * steps).expand(-1, -1, grp).flatten(-2)
    assert ((out.float() - ref.float()).abs() <= step + 1e-30)[bad].all()


def _check_op(op, args, fmt, qat, frac=0.0, out_dtype=None):
    n = args[-2].shape[0]  # cos: one row per output row
    rows = _rows(n, 2 * n + 3, args[0].device, n)
    f, got, pool, ref, ref_pool = _run(op, args, fmt, qat, 2 * n + 3, rows, out_dtype)
    if op == "store_main":
        (lat, got), (ref_lat, ref) = got, ref
        _assert_near(lat, ref_lat, None, None, False, frac)  # the gate's exp/softmax differ from torch's by ulps
    own = f.name == OWN[op]
    pre = getattr(kw, op + "_ref")(
        *args, ref_pool.clone(), rows, fmt, False, **({"out_dtype": out_dtype} if op == "store_main" else {})
    )
    pre = pre[1] if op == "store_main" else pre
    _assert_near(got, ref, pre, OWN[op], qat, frac)
    keep = rows >= 0
    # Self-consistency: the stored row decodes to what was returned (own format under QAT), else to its re-quant.
    want = got if (qat and own) else f.reference(got)
    assert _same(f.unpack(pool[rows[keep]], got.dtype), want[keep])
    untouched = torch.ones(pool.shape[0], dtype=torch.bool, device=pool.device)
    untouched[rows[keep]] = False
    assert (pool[untouched] == POISON).all() and (ref_pool[untouched] == POISON).all()
    # The kernel's quantiser on the reference's own input to the store reproduces the reference's bytes.
    src = pre if own else ref
    again = torch.full_like(pool, POISON)
    kw.quantize_rows(src, again, rows, f)
    assert torch.equal(again, ref_pool)


# ------------------------------------------------------------------ interpreter (tiny shapes)
@pytest.mark.parametrize("name", ["swa_fp8", "main_fp4", "index_fp4", "bf16"])
def test_quantize_rows_exact(name):
    d = 64
    # Rows: every binade from the amax floors (e4m3 subnormal scales) up; row 2 holds exact ties of e2m1 (scale 1),
    # e4m3 (normal and subnormal, scale 1) and bf16; amax exactly on scale boundaries; signed zeros.
    g = torch.Generator().manual_seed(1)
    x = torch.randn(5, d, generator=g) * (10.0 ** torch.tensor([-7.0, -2.0, 0.0, 2.0, 5.0]))[:, None]
    t4 = torch.tensor([6.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.0, 0.0, 1.0, 3.0, 0.5, 1.5, 4.0, 2.0])
    t8 = torch.tensor(
        [
            448.0,
            1.0625,
            1.1875,
            17.0,
            19.0,
            232.0,
            248.0,
            4.5 / 512,
            3.5 / 512,
            0.5 / 512,
            1.5 / 512,
            -0.0,
            0.0,
            1 + 2**-8,
            1 + 3 * 2**-8,
            -1.0625,
        ]
    )
    x[2] = torch.cat((t4, -t4, t8, -t8))
    x[0, 0] = 6.375  # main scale 6.375 / 6 = 1.0625: an e4m3 tie
    x[1, 0], x[1, 32] = 12.0, 56.0  # pow2 scales exactly 2 (index) and 2^-3 (fp8)
    x[3, 16:32] = 0.0
    f = kw._BASE[name].with_channels(d)
    rows = torch.tensor([6, -1, 0, 3, 1])
    pools = [torch.full((8, f.row_bytes), POISON, dtype=torch.uint8) for _ in range(2)]
    got, ref = kw.quantize_rows(x, pools[0], rows, f), kw.quantize_rows_ref(x, pools[1], rows, f)
    assert _same(got, ref) and torch.equal(pools[0], pools[1])
    assert _same(f.unpack(pools[0][rows[rows >= 0]]), ref[rows >= 0])


@pytest.mark.parametrize(
    "op,fmt,dtype,qat",
    [
        ("store_window", "fp8", torch.float32, True),
        ("store_window", "fp8", torch.bfloat16, True),
        ("store_window", "bf16", torch.float32, True),
        ("store_window", "fp8", torch.float32, False),
        ("store_index", "fp4", torch.float32, True),
        ("store_index", "bf16", torch.bfloat16, True),
    ],
)
def test_store_tiny(op, fmt, dtype, qat):
    d, half = (64, 8) if op == "store_window" else (32, 8)
    _check_op(op, _case(op, 4, d, half, dtype, "cpu", 3), fmt, qat)


@pytest.mark.parametrize(
    "ratio,fmt,out_dtype", [(2, "fp4", None), (1, "fp4", None), (2, "fp8", None), (2, "bf16", torch.bfloat16)]
)
def test_store_main_tiny(ratio, fmt, out_dtype):
    _check_op(
        "store_main",
        _case("store_main", 4, 64, 8, torch.float32, "cpu", 5, ratio),
        fmt,
        True,
        frac=0.01,
        out_dtype=out_dtype,
    )


@pytest.mark.parametrize("n", [1, 37])
def test_partial_last_program(monkeypatch, n):
    """T not a multiple of the rows per program (forced to 16: programs of 16, 16, 5 rows, or 1 of 16): every row
    up to T written, nothing past it read or stored."""
    monkeypatch.setattr(kw, "_rows_per_program", lambda d: 16)
    for op, fmt, d in (("store_window", "fp8", 64), ("store_index", "fp4", 32), ("store_main", "fp4", 64)):
        _check_op(op, _case(op, n, d, 8, torch.float32, "cpu", n), fmt, True, frac=0.01 if op == "store_main" else 0)
    _check_op("store_window", _case("store_window", n, 64, 8, torch.bfloat16, "cpu", n), "bf16", True)


def test_refs_follow_the_model():
    """The references equal CSA2Attention.window_entry, the Compressor and Indexer.index_keys (tiny V4.1, fp32)."""
    torch.manual_seed(0)
    d, hd, di, n = 96, 64, 32, 6
    x, pos = torch.randn(2 * n, d), torch.arange(2 * n)
    layer = SimpleNamespace(
        wkv=torch.nn.Linear(d, hd, bias=False), kv_norm=RMSNorm(hd, EPS), rope=ROPE, cfg=SimpleNamespace(is_v41=True)
    )
    layer._kv_qat = lambda kv, qat: CSA2Attention._kv_qat(layer, kv, qat)
    torch.nn.init.uniform_(layer.kv_norm.weight, 0.5, 1.5)
    cos, sin = ROPE._cos_sin(pos)
    pool = torch.zeros(2 * n, 66, dtype=torch.uint8)
    win = kw.store_window_ref(layer.wkv(x), layer.kv_norm.weight, EPS, cos, sin, pool, pos, "fp8", True)
    assert _same(win, CSA2Attention.window_entry(layer, x, pos, True))
    for ratio in (2, 1):
        comp, idx = Compressor(d, hd, ratio, EPS), Indexer(d, 8, hd, 2, di, 16, EPS, owns_keys=True, owns_query=False)
        torch.nn.init.uniform_(comp.norm.weight, 0.5, 1.5)
        torch.nn.init.uniform_(idx.k_norm.weight, 0.5, 1.5)
        latent, _ = comp(x, 0, None, 0)
        epos = torch.arange(latent.shape[0]) * ratio
        u = x @ comp.wkv.weight.t() if ratio == 2 else comp.wkv(x)  # as Compressor.forward computes it
        z = x @ comp.wgate.weight.t() if ratio == 2 else None
        c, s = ROPE._cos_sin(epos)
        rows = torch.arange(latent.shape[0])
        lat, main = kw.store_main_ref(
            u, z, ratio, comp.norm.weight, EPS, c, s, torch.zeros(len(rows), 36, dtype=torch.uint8), rows, "fp4", True
        )
        assert _same(lat, latent)
        assert _same(main, quant.fake_quant_fp4_e4m3scale(ROPE(latent, epos), 16))
        k = kw.store_index_ref(
            idx.wk(latent),
            idx.k_norm.weight,
            EPS,
            c,
            s,
            torch.zeros(len(rows), 17, dtype=torch.uint8),
            rows,
            "fp4",
            True,
        )
        assert _same(k, idx.index_keys(latent, epos, ROPE, True))


def test_bad_arguments():
    x, w, cos, sin = torch.randn(2, 64), torch.ones(64), torch.ones(2, 8), torch.zeros(2, 8)
    pool, rows = torch.zeros(4, 66, dtype=torch.uint8), torch.tensor([0, 1])
    for fn in (kw.store_window, kw.store_window_ref):
        with pytest.raises(ValueError, match="fmt"):
            fn(x, w, EPS, cos, sin, pool, rows, "fp4")
        with pytest.raises(ValueError, match="pool"):
            fn(x, w, EPS, cos, sin, pool[:, :60], rows, "fp8")
        with pytest.raises(ValueError, match="cos"):
            fn(x, w, EPS, cos[:1], sin, pool, rows, "fp8")
    with pytest.raises(ValueError, match="ratio"):
        kw.store_main(x, None, 3, w, EPS, cos, sin, pool, rows, "fp8")
    with pytest.raises(ValueError, match="z must"):
        kw.store_main_ref(torch.randn(4, 64), None, 2, w, EPS, cos, sin, pool, rows, "fp8")
    with pytest.raises(ValueError, match="power-of-two"):
        kw.store_window(
            torch.randn(2, 96), torch.ones(96), EPS, cos, sin, torch.zeros(4, 99, dtype=torch.uint8), rows, "fp8"
        )


# ------------------------------------------------------------------ GPU (real shapes)
@needs_cuda
@pytest.mark.parametrize("n", [1, 37, 4096])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_store_real_shapes(n, dtype):
    for op, d, fmts in (("store_window", 512, ("fp8", "bf16")), ("store_index", 128, ("fp4", "bf16"))):
        for fmt in fmts:
            _check_op(op, _case(op, n, d, 32, dtype, "cuda", n), fmt, True, frac=2e-3)
    for ratio in (1, 2):
        for fmt in ("fp4", "fp8"):
            args = _case("store_main", n, 512, 32, torch.float32, "cuda", n + ratio, ratio)
            _check_op("store_main", args, fmt, True, frac=2e-3, out_dtype=dtype)
    _check_op("store_window", _case("store_window", n, 512, 32, dtype, "cuda", 7), "fp8", False, frac=2e-3)


@needs_cuda
@pytest.mark.parametrize("name", ["swa_fp8", "main_fp4", "index_fp4", "bf16"])
def test_quantize_rows_exact_gpu(name):
    g = torch.Generator().manual_seed(2)
    x = torch.randn(4096, 512, generator=g) * 10.0 ** torch.empty(4096, 1).uniform_(-9, 9, generator=g)
    x[::7, ::3] = 0.0
    f = kw._BASE[name].with_channels(512)
    rows = _rows(4096, 5000, "cuda", 3)
    pools = [torch.full((5000, f.row_bytes), POISON, dtype=torch.uint8, device="cuda") for _ in range(2)]
    got = kw.quantize_rows(x.cuda(), pools[0], rows, f)
    ref = kw.quantize_rows_ref(x.cuda(), pools[1], rows, f)
    assert _same(got, ref) and torch.equal(pools[0], pools[1])
