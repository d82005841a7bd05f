"""route (Triton MoE router) against route_ref, and route_ref against Gate.forward itself."""

import pytest
import torch
import torch.nn.functional as F

from dsserve.kernels.router import _plan, route, route_ref
from dsserve.layers.moe import Gate

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

# (T, d, E, k): the brief's tiny grid, every value of each axis at least twice, k = E once
TINY = [(1, 64, 8, 1), (5, 96, 12, 2), (33, 64, 40, 6), (5, 64, 40, 1), (33, 96, 8, 6), (1, 96, 12, 12)]
# the three code paths: default plan, one launch (all E, all d per program), split d + select pass
PATHS = {"default": None, "fused": {"fused": True, "BT": 16}, "split": {"fused": False, "BE": 16, "BK": 16, "SPLIT": 3}}


def _inputs(t, d, e, gen, device="cpu", dtype=torch.float32, alt=True):
    x = torch.randn(t, d, generator=gen).to(device, dtype)
    w = (torch.randn(e, d, generator=gen) * d**-0.5 * 2).to(device, dtype)
    b = (torch.randn(e, generator=gen) * 0.1).to(device)
    ba = (torch.randn(e, generator=gen) * 0.5).to(device) if alt else None
    u = (torch.rand(t, generator=gen) < 0.5).to(device) if alt else None
    return x, w, b, ba, u


def _poisoned(t, k, device="cpu"):
    return (torch.full((t, k), -7, dtype=torch.int64, device=device), torch.full((t, k), float("nan"), device=device))


def _rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def _run_and_compare(args, k, temp, scale, config, wtol=1e-5):
    x = args[0]
    ids, w = route(*args[:3], k, temp, scale, *args[3:], out=_poisoned(x.shape[0], k, x.device), config=config)
    rids, rw = route_ref(*args[:3], k, temp, scale, *args[3:])
    assert torch.equal(ids, rids)
    assert _rel(w, rw) < wtol
    return ids, w


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("t,d,e,k", TINY)
def test_route_interpreted(t, d, e, k, path):
    gen = torch.Generator().manual_seed(t * 1000 + d * 10 + e + k)
    p, _ = _plan(t, e, d, 1, dict(PATHS[path] or {}))
    assert path != "split" or (not p["FUSED"] and p["SPLIT"] > 1)  # the path really is the one named
    assert path != "fused" or p["FUSED"]
    _run_and_compare(_inputs(t, d, e, gen), k, 1.3, 1.5, PATHS[path])


@pytest.mark.parametrize("path", PATHS)
def test_route_exact_ties_take_lower_id(path):
    """Integer x and W: every logit is exact in any summation order, so duplicated expert rows (with equal
    biases) tie exactly in both; k cuts through tied groups, so only the lower-id rule gives the ref's ids."""
    gen = torch.Generator().manual_seed(1)
    t, d = 33, 64
    x = torch.randint(-2, 3, (t, d), generator=gen).float()
    proto = torch.randint(-1, 2, (3, d), generator=gen).float() * 0.25
    w = proto[torch.tensor([2, 0, 1, 0, 2, 1, 1, 0, 2, 0, 1, 2])]
    b = torch.tensor([0.0, 0.5, 0.0, 0.5, 0.0, 0.0, 0.0, 0.5, 0.0, 0.5, 0.0, 0.0])  # equal within each group
    u = torch.rand(t, generator=gen) < 0.5
    for k in (1, 2, 5, 12):
        ids, _ = _run_and_compare((x, w, b, b.flip(0), u), k, 1.0, 1.5, PATHS[path])
        assert (ids[:, :-1] != ids[:, 1:]).all()  # k distinct experts


@pytest.mark.parametrize("path", PATHS)
def test_route_alt_bias_and_extremes(path):
    """bias_alt decides on use_alt rows (a large alt bias flips the choice); bias None; softplus far out on both
    sides (logits beyond +-20, where the threshold and log1p of tiny values matter); bf16 operands."""
    gen = torch.Generator().manual_seed(2)
    t, d, e, k = 5, 64, 12, 2
    x, w, b, _, _ = _inputs(t, d, e, gen)
    ba = torch.zeros(e)
    ba[[3, 9]] = 100.0
    u = torch.tensor([True, False, True, False, False])
    ids, _ = _run_and_compare((x, w, b, ba, u), k, 1.0, 1.5, PATHS[path])
    pair = ids.sort(-1).values == torch.tensor([3, 9])
    assert pair[u].all() and not pair[~u].all(-1).any()
    _run_and_compare((x, w, None, ba, u), k, 1.0, 1.5, PATHS[path])
    _run_and_compare((x, w, None), k, 1.0, 1.5, PATHS[path])
    for shift in (-60.0, 60.0):  # every logit of row 0 beyond the threshold on one side; rows 1.. span both
        xs = x * 15
        xs[0] = 0
        ws = torch.cat([w, torch.zeros(e, 1)], 1)
        xs = torch.cat([xs, torch.full((t, 1), 1.0)], 1)
        ws[:, -1] = shift
        _run_and_compare((xs, ws, b * 0.01), e, 1.0, 1.5, PATHS[path])
    x16, w16, b16, ba16, u16 = _inputs(t, d, e, gen, dtype=torch.bfloat16)
    _run_and_compare((x16, w16, b16, ba16, u16), k, 1.0, 1.5, PATHS[path])
    _run_and_compare((x16, w16.float(), b16, ba16, u16), k, 1.0, 1.5, PATHS[path])


def test_route_ref_is_gate_forward():
    gen = torch.Generator().manual_seed(3)
    for vision, temp in ((True, 1.0), (False, 0.7)):
        gate = Gate(48, 20, 4, hash_routed=False, vision_bias=vision, vocab=1, temp=temp, scale=2.5)
        with torch.no_grad():
            for prm in gate.parameters():
                prm.copy_(torch.randn(prm.shape, generator=gen))
        x = torch.randn(9, 48, generator=gen, dtype=torch.float64)
        img = torch.rand(9, generator=gen) < 0.5
        want = gate(x, None, img)
        got = route_ref(x, gate.weight, gate.bias, 4, temp, 2.5, gate.bias_vl, img)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
        if vision:  # the image bias really changed some image row's choice
            assert not torch.equal(want[0][img], gate(x, None, None)[0][img])


def test_route_rejects_bad_arguments():
    x, w, b, u = torch.randn(3, 16), torch.randn(8, 16), torch.zeros(8), torch.zeros(3, dtype=torch.bool)
    bad = [
        (x, w, b, 0, 1.0, b, u, None),
        (x, w, b, 9, 1.0, b, u, None),
        (x, w[:, 1:], b, 2, 1.0, b, u, None),
        (x, w, b[1:], 2, 1.0, b, u, None),
        (x, w, b, 2, 0.0, b, u, None),
        (x, w, b, 2, 1.0, b, u.float(), None),
        (x.double(), w, b, 2, 1.0, b, u, None),
        (x, w, b, 2, 1.0, b, u, _poisoned(3, 3)),
    ]
    for xx, ww, bb, k, temp, ba, uu, out in bad:
        with pytest.raises(ValueError):
            route(xx, ww, bb, k, temp, 1.5, ba, uu, out=out)
    ids, wt = route(x[:0], w, b, 2, 1.0, 1.5)
    assert ids.shape == (0, 2) and wt.shape == (0, 2)


# ---- GPU: real shapes, bf16 operands ----


def _check_gpu(args, k, ids, w, rids, rw):
    """ids equal wherever the ref's ordering is clear; near-ties (adjacent biased scores among the top k+1 within
    1e-3 relative) may flip between summation orders, but only between near-equal experts."""
    x, wt, b, ba, u = args
    s = torch.sqrt(F.softplus(x.float() @ wt.float().t()))
    biased = torch.where(u[:, None], s + ba, s + b)
    top = biased.sort(-1, descending=True).values[:, : k + 1]
    gap = (top[:, :-1] - top[:, 1:]) / top[:, :1].abs().clamp_min(1e-6)
    clear = (gap > 1e-3).all(-1)
    same = (ids == rids).all(-1)
    assert same[clear].all()
    assert same.float().mean() >= 0.99 or (~same).sum() <= 1
    assert torch.allclose(biased.gather(1, ids), biased.gather(1, rids), rtol=0, atol=1e-3 * top[:, :1].abs().max())
    assert _rel(w[same], rw[same]) < 1e-3


@needs_cuda
@pytest.mark.parametrize("path", ["default", "fused", "split"])
@pytest.mark.parametrize("t", [1, 7, 64, 4096])
@pytest.mark.parametrize("d,e,k", [(5120, 384, 6), (4096, 384, 6), (4096, 128, 3)])
def test_route_gpu(d, e, k, t, path, monkeypatch):
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)  # the ref is the fp32 matmul
    gen = torch.Generator().manual_seed(t + d + e)
    args = _inputs(t, d, e, gen, device="cuda", dtype=torch.bfloat16)
    cfg = {"default": None, "fused": {"fused": True}, "split": {"fused": False}}[path]
    ids, w = route(*args[:3], k, 1.0, 1.5, *args[3:], out=_poisoned(t, k, "cuda"), config=cfg)
    rids, rw = route_ref(*args[:3], k, 1.0, 1.5, *args[3:])
    assert ids.min() >= 0 and ids.max() < e and torch.isfinite(w).all()
    _check_gpu(args, k, ids, w, rids, rw)


@needs_cuda
def test_route_gpu_ties_and_no_bias():
    """Exact ties (integer operands, duplicated experts) on the GPU's bf16 tensor-core path, both forms."""
    gen = torch.Generator().manual_seed(5)
    t, d, e = 64, 5120, 384
    x = torch.randint(-2, 3, (t, d), generator=gen).to("cuda", torch.bfloat16)
    w = (torch.randint(-1, 2, (8, d), generator=gen) * 0.0625)[torch.arange(e) % 8].to("cuda", torch.bfloat16)
    for cfg in ({"fused": True}, {"fused": False}):
        ids, wt = route(x, w, None, 6, 1.0, 1.5, out=_poisoned(t, 6, "cuda"), config=cfg)
        rids, rw = route_ref(x, w, None, 6, 1.0, 1.5)
        assert torch.equal(ids, rids) and _rel(wt, rw) < 1e-4
