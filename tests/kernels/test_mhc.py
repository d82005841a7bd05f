"""mhc_site / mhc_expand (Triton) == their references, and the references == Block.forward's own pieces."""

import pytest
import torch

from dsserve.kernels import mhc as K
from dsserve.kernels.mhc import example_inputs, mhc_expand, mhc_expand_ref, mhc_site, mhc_site_ref

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _rel(out, ref):
    assert out.shape == ref.shape and out.dtype == ref.dtype
    out, ref = out.double(), ref.double()
    return ((out - ref).norm() / ref.norm()).item()  # NaN (a poisoned, unwritten entry) fails every `<`


@pytest.fixture
def poison(monkeypatch):
    """Every buffer the kernels allocate (outputs and scratch) starts as NaN."""

    def alloc(*shape, dtype, device):
        return torch.full(shape, float("nan"), dtype=dtype, device=device)

    monkeypatch.setattr(K, "_alloc", alloc)


def _few_differ(out, ref):
    """bf16 results are rounded like the reference's: only summation-order ties may flip (truncation flips ~half)."""
    return out.dtype != torch.bfloat16 or (out != ref).double().mean().item() < 0.01


def _check_site(args, h_tol):
    got, want = mhc_site(*args), mhc_site_ref(*args)
    assert got[0].dtype == args[0].dtype and all(g.dtype == torch.float32 for g in got[1:])
    errs = [_rel(g, w) for g, w in zip(got, want)]
    assert errs[0] < h_tol and max(errs[1:]) < 1e-5 and _few_differ(got[0], want[0]), errs
    return got


def _check_expand(t, d, dtype, tol, device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed)
    x, y = torch.randn(t, 4, d, generator=g).to(dtype), torch.randn(t, d, generator=g).to(dtype)
    post, comb = 2 * torch.rand(t, 4, generator=g), torch.rand(t, 4, 4, generator=g)
    args = [a.to(device) for a in (y, x, post, comb)]
    out, ref = mhc_expand(*args), mhc_expand_ref(*args)
    assert out.dtype == dtype and _rel(out, ref) < tol and _few_differ(out, ref)


@pytest.mark.parametrize("d", [32, 96])
def test_site_interpreted(poison, d):
    for t in (1, 5, 17):
        for dtype, h_tol in ((torch.float32, 1e-5), (torch.bfloat16, 1e-2)):
            args = example_inputs(t, 4, d, dtype, seed=t + d)
            h, pre, post, comb = _check_site(args, h_tol)
            # Sinkhorn's last step normalises columns: they sum to ~1 (a sanity check on the reference too)
            assert (comb.sum(1) - 1).abs().max() < 1e-4 and (post > 0).all() and (pre > 1e-6).all()


def test_site_bf16x3_interpreted(poison, monkeypatch):
    """Long bf16 batches take fn in three bf16 parts (threshold lowered): mixes as close to the fp32 reference as
    tf32x3's; the parts are cached per weight, and a changed weight is split again."""
    monkeypatch.setattr(K, "BF16X3_MIN_ROWS", 1)
    calls, real = [], K._fn_parts
    monkeypatch.setattr(K, "_fn_parts", lambda fn: calls.append(1) or real(fn))
    for t in (1, 17):
        args = example_inputs(t, 4, 96, torch.bfloat16, seed=t + 3)
        _check_site(args, 1e-2)
        parts = real(args[1])
        assert parts.dtype == torch.bfloat16 and torch.equal(parts.float().sum(0), args[1].float())
        assert real(args[1]) is parts
        args[1].mul_(2)  # a new version: split again
        assert real(args[1]) is not parts
        _check_site(args, 1e-2)
    assert calls


def test_site_edge_cases_interpreted(poison):
    args = example_inputs(3, 4, 32, seed=7)
    args[0], args[-1] = args[0] * 1e3, 1  # the mixes are scale-free, h renormalises any scale; one Sinkhorn step
    _check_site(args, 1e-5)
    args[0] = args[0].transpose(0, 1).contiguous().transpose(0, 1)  # a strided x is copied, not misread
    _check_site(args, 1e-5)
    _check_site(example_inputs(3, 4, 32, torch.float16, seed=8), 1e-3)
    got = mhc_site(*example_inputs(0, 4, 32))
    assert [tuple(g.shape) for g in got] == [(0, 32), (0, 4), (0, 4), (0, 4, 4)]
    empty = mhc_expand(torch.zeros(0, 32), torch.zeros(0, 4, 32), torch.zeros(0, 4), torch.zeros(0, 4, 4))
    assert empty.shape == (0, 4, 32)


@pytest.mark.parametrize("d", [32, 96])
def test_expand_interpreted(poison, d):
    for t in (1, 5, 17):
        for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 1e-2)):
            _check_expand(t, d, dtype, tol, seed=t + d)


def test_references_are_block_forward(tiny_models, poison):
    """Hooks on a real V4.1 forward: each site's (h, mixes) and each expand equal the references on the same inputs;
    the kernels match them on those inputs (the tiny model's weights) in fp32."""
    m = tiny_models["tiny"]
    block = m.layers[2]  # no Engram here: the stream entering the block is what its attention site mixes
    c, seen = m.cfg, {}
    mix = block.mix

    def spy_mix(site, x):
        seen["mix_" + site] = (x, *mix(site, x))
        return seen["mix_" + site][1:]

    hooks = [
        block.register_forward_pre_hook(lambda mod, a: seen.__setitem__("in", a[:2])),
        block.register_forward_hook(lambda mod, a, out: seen.__setitem__("out", out[:2])),
    ]
    hooks += [
        getattr(block, name).register_forward_hook(lambda mod, a, out, name=name: seen.__setitem__(name, out))
        for name in ("attn_norm", "ffn_norm", "attn", "ffn")
    ]
    block.mix = spy_mix
    try:
        with torch.no_grad():
            m(torch.tensor([5, 17, 300, 2, 99]))
    finally:
        del block.mix
        for h in hooks:
            h.remove()
    (x_in, pre_in), (x_a, a_pre, a_post, a_comb), (x_mid, f_pre, f_post, f_comb) = (
        seen["in"],
        seen["mix_attn"],
        seen["mix_ffn"],
    )
    assert torch.equal(x_a, x_in) and x_in.shape == (5, c.hc_mult, c.hidden_size)
    eps = (c.rms_norm_eps, c.rms_norm_eps, c.hc_eps, c.hc_sinkhorn_iters)
    # V4.1: attention collapses with the pre handed in, the FFN with the attention site's pre
    for site, x, pre in (("attn", x_in, pre_in), ("ffn", x_mid, a_pre)):
        args = [
            x,
            getattr(block, f"hc_{site}_fn"),
            getattr(block, f"hc_{site}_base"),
            getattr(block, f"hc_{site}_scale"),
            pre,
            getattr(block, f"{site}_norm").weight,
        ]
        for g, w in zip(mhc_site_ref(*args, *eps), (seen[f"{site}_norm"], *seen["mix_" + site][1:])):
            assert torch.equal(g, w), site
        _check_site([a.detach().float() for a in args] + list(eps), 1e-5)
    assert torch.equal(mhc_expand_ref(seen["attn"], x_in, a_post, a_comb), x_mid)
    assert torch.equal(mhc_expand_ref(seen["ffn"], x_mid, f_post, f_comb), seen["out"][0])
    assert torch.equal(seen["out"][1], f_pre)  # the FFN site's pre is handed to the next layer


def test_input_errors():
    args = example_inputs(2, 4, 32)
    with pytest.raises(ValueError, match="x must"):
        mhc_site(args[0][0], *args[1:])
    with pytest.raises(ValueError, match="pre_in"):
        mhc_site(*args[:4], args[4][:, :3], *args[5:])
    with pytest.raises(ValueError, match="sinkhorn_iters"):
        mhc_site(*args[:-1], 0)
    with pytest.raises(ValueError, match="kernel needs"):
        mhc_site(args[0].double(), *args[1:])
    with pytest.raises(ValueError, match="comb"):
        mhc_expand(args[0][:, 0], args[0], args[4], args[4])


# ------------------------------------------------------------------ GPU: the model's shapes (d = 5120, n = 4)
@cuda
@pytest.mark.parametrize("t", [1, 64, 129, 4096])  # 129: the 64-row tiles with a ragged last block
def test_site_gpu(poison, monkeypatch, t):
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)  # the ref is the fp32 matmul
    _check_site(example_inputs(t, 4, 5120, torch.bfloat16, "cuda", seed=t), 1e-2)
    if t == 64:
        _check_site(example_inputs(t, 4, 5120, torch.float32, "cuda", seed=t + 1), 1e-5)


@cuda
@pytest.mark.parametrize("t", [64, 4096])
def test_site_gpu_bf16x3(poison, monkeypatch, t):
    """The bf16x3 partials (switched on) at the model's shapes: as close to the fp32 reference as tf32x3's."""
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)
    monkeypatch.setattr(K, "BF16X3_MIN_ROWS", 1)
    _check_site(example_inputs(t, 4, 5120, torch.bfloat16, "cuda", seed=t + 2), 1e-2)


@cuda
def test_site_gpu_edge_cases(poison, monkeypatch):
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)
    args = example_inputs(3, 4, 5120, torch.bfloat16, "cuda", seed=5)
    args[0], args[-1] = args[0] * 1e3, 1  # scale-free mixes, one Sinkhorn step
    _check_site(args, 1e-2)
    h, pre, post, comb = mhc_site(*example_inputs(0, 4, 5120, torch.bfloat16, "cuda"))
    assert h.shape == (0, 5120) and comb.shape == (0, 4, 4)


@cuda
@pytest.mark.parametrize("t", [1, 64, 4096])
def test_expand_gpu(poison, t):
    _check_expand(t, 5120, torch.bfloat16, 1e-2, "cuda", seed=t)
    if t == 64:
        _check_expand(t, 5120, torch.float32, 1e-5, "cuda", seed=t + 1)
