"""dsserve.kernels.engram_mix against engram_mix_ref (the lines of Engram.forward) and Engram.forward itself.

CPU: the Triton interpreter on tiny ragged shapes (one chunk, and several chunks with a small chunk bound), fp32 /
bf16 / fp16, dead rows (out == x exactly), a zero key (sign 0) and negative dots. GPU: the release proxy's n = 4,
d = 4096 at T 1 / 32, and a CUDA-graph replay with refilled inputs and a poisoned output."""

import pytest
import torch

import dsserve.kernels.engram_mix as mix_mod
from dsserve.kernels.engram_mix import engram_mix, engram_mix_ref
from dsserve.layers.engram import Engram
from dsserve.layers.engram_hash import DEAD
from dsserve.models.presets import preset

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _inputs(t, n, d, dtype, seed, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, n, d, generator=g) * torch.exp2(torch.randint(-3, 4, (t, n, 1), generator=g).float())
    kv = torch.randn(t, (n + 1) * d, generator=g)
    qw = 1 + 0.5 * torch.randn(n, d, generator=g)
    kw = 1 + 0.5 * torch.randn(n, d, generator=g)
    ids = torch.randint(0, 1000, (t,), generator=g)
    ids[::3] = DEAD
    if t > 1:
        ids[1] = -2  # before-start marks are not dead
        kv[1, :d] = 0  # a zero key: dot 0, sign 0, gate 1/2
    if t > 2:
        kv[2, d : 2 * d] *= -1e3  # a negated key far larger than x: the other sign of dot, rms scales apart
    return [a.to(device) for a in (x.to(dtype), kv.to(dtype), qw, kw, ids)]


def _rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def _check(args, eps, tol):
    x, kv, qw, kw, ids = args
    out = engram_mix(*args, eps)
    ref = engram_mix_ref(*args, eps)
    assert out.shape == x.shape and out.dtype == x.dtype and out.device == x.device
    assert _rel(out, ref) < tol
    dead = ids == DEAD
    assert torch.equal(out[dead], x[dead])
    if (~dead).any():  # the mix moved the live rows (else the test could not fail)
        assert _rel(out[~dead], x[~dead]) > 1e-3
    return out


@pytest.mark.parametrize("t,n,d", [(1, 2, 16), (4, 4, 96), (5, 2, 40), (3, 4, 24)])
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2), (torch.float16, 1e-3)])
def test_matches_ref(t, n, d, dtype, tol):
    _check(_inputs(t, n, d, dtype, 10 * t + d), 1e-6, tol)


def test_chunked_d(monkeypatch):
    """Several constexpr chunks over d, the last one ragged."""
    monkeypatch.setattr(mix_mod, "_MAX_BLOCK_D", 32)
    for d in (96, 40):
        _check(_inputs(4, 2, d, torch.float32, d), 1e-20, 1e-5)
        _check(_inputs(4, 2, d, torch.bfloat16, d + 1), 1e-6, 1e-2)


def test_engram_forward_tail():
    """Equal to Engram.forward (tiny preset, gathered rows given) after its wkv projection."""
    cfg = preset("tiny")
    torch.manual_seed(0)
    eng = Engram(cfg, cfg.engram_layer_ids[0]).float()
    with torch.no_grad():
        eng.q_weight.normal_(1, 0.3)
        eng.k_weight.normal_(1, 0.3)
    t, n, d = 3, cfg.hc_mult, cfg.hidden_size
    x = torch.randn(t, n, d)
    rows = torch.randn(t, cfg.engram_columns, cfg.engram_head_dim)
    ids = torch.tensor([5, DEAD, 7])
    with torch.no_grad():
        want = eng(x, ids, [slice(0, t)], [None], rows)
        kv = eng.wkv(rows.flatten(1))
        out = engram_mix(x, kv, eng.q_weight, eng.k_weight, ids, cfg.rms_norm_eps)
    assert _rel(out, want) < 1e-5 and torch.equal(out[1], x[1])


def test_fp64_runs_ref_and_bad_input_is_named():
    args = _inputs(2, 2, 16, torch.float64, 0)
    assert torch.equal(engram_mix(*args, 1e-6), engram_mix_ref(*args, 1e-6))
    x, kv, qw, kw, ids = _inputs(2, 2, 16, torch.float32, 0)
    with pytest.raises(ValueError, match="x"):
        engram_mix(x[0], kv, qw, kw, ids, 1e-6)
    with pytest.raises(ValueError, match="kv"):
        engram_mix(x, kv[:, :-1], qw, kw, ids, 1e-6)
    with pytest.raises(ValueError, match="kv"):
        engram_mix(x, kv.bfloat16(), qw, kw, ids, 1e-6)
    with pytest.raises(ValueError, match="k_weight"):
        engram_mix_ref(x, kv, qw, kw[:1], ids, 1e-6)
    with pytest.raises(ValueError, match="ids"):
        engram_mix(x, kv, qw, kw, ids.float(), 1e-6)
    with pytest.raises(ValueError, match="x: the kernel"):
        engram_mix(x.to(torch.int32), kv.to(torch.int32), qw, kw, ids, 1e-6)
    assert engram_mix(x[:0], kv[:0], qw, kw, ids[:0], 1e-6).shape == (0, 2, 16)


# ------------------------------------------------------------------ GPU
@needs_cuda
@pytest.mark.parametrize("t", [1, 32])
@pytest.mark.parametrize("dtype,tol", [(torch.bfloat16, 1e-2), (torch.float32, 1e-5)])
def test_cuda_release_shape(t, dtype, tol):
    _check(_inputs(t, 4, 4096, dtype, t, "cuda"), 1e-6, tol)


@needs_cuda
def test_cuda_graph_replays_refilled_inputs():
    args = _inputs(32, 4, 4096, torch.bfloat16, 0, "cuda")
    engram_mix(*args, 1e-6)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = engram_mix(*args, 1e-6)
    for seed in (1, 2):
        for buf, new in zip(args, _inputs(32, 4, 4096, torch.bfloat16, seed, "cuda")):
            buf.copy_(new)
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert _rel(out, engram_mix_ref(*args, 1e-6)) < 1e-2
        dead = args[4] == DEAD
        assert torch.equal(out[dead], args[0][dead])
