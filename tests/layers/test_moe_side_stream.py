"""The shared expert on a side stream (a decode step's few rows, on a GPU): the same output, bit for bit, as on
one stream, eagerly and replayed from a CUDA graph. Skipped without CUDA (on the CPU there is one stream)."""

import pytest
import torch

from dsserve.kernels.grouped_moe import ExpertWeights
from dsserve.kernels.ops import KernelOps
from dsserve.layers import moe as M
from dsserve.models.presets import preset


def test_no_side_stream_on_the_cpu_or_for_many_rows():
    assert M._side_stream(torch.zeros(4, 8)) is None
    if torch.cuda.is_available():
        assert M._side_stream(torch.zeros(M.SHARED_EXPERT_STREAM_MAX_ROWS + 1, 8, device="cuda")) is None
        assert M._side_stream(torch.zeros(1, 8, device="cuda")) is not None


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("t", [1, 9])
def test_side_stream_shared_expert_equals_one_stream(monkeypatch, t):
    torch.manual_seed(0)
    cfg = preset("tiny")
    moe = M.MoE(cfg, n_experts=8, topk=3)
    for p in moe.parameters():
        torch.nn.init.normal_(p, std=cfg.hidden_size**-0.5)
    moe = moe.to("cuda", torch.bfloat16)
    moe.packed = ExpertWeights.from_dense(*(moe.experts[n].detach().float() for n in ("w1", "w3", "w2")), "mxfp4")
    ops = KernelOps()
    x = torch.randn(t, cfg.hidden_size, device="cuda", dtype=torch.bfloat16)
    tokens = torch.arange(t, device="cuda")
    with torch.no_grad():
        monkeypatch.setattr(M, "SHARED_EXPERT_STREAM_MAX_ROWS", 0)
        one = moe(x, tokens, ops=ops)
        monkeypatch.setattr(M, "SHARED_EXPERT_STREAM_MAX_ROWS", 64)
        two = moe(x, tokens, ops=ops)
        assert torch.equal(one, two)
        static_x = x.clone()
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):  # warm-up off the default stream, as torch.cuda.graph wants
            moe(static_x, tokens, ops=ops)
        torch.cuda.current_stream().wait_stream(s)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            out = moe(static_x, tokens, ops=ops)
        static_x.copy_(torch.randn_like(x))
        g.replay()
        torch.cuda.synchronize()
        monkeypatch.setattr(M, "SHARED_EXPERT_STREAM_MAX_ROWS", 0)
        assert torch.equal(out, moe(static_x, tokens, ops=ops))
