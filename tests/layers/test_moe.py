"""The MoE's routed loop (``MoE.forward`` without kernel ops, the oracle) against the textbook sum written row by row
here: for every row, each chosen expert's clamped SwiGLU, times its routing weight, down-projected, plus the shared
expert. Rows sorted by expert inside the loop must land back on their own rows, each pair counted once (twice when a
hash-routed row names an expert twice)."""

import pytest
import torch

from dsserve.layers import moe as M
from dsserve.layers.quant import fake_quant_fp8_pow2
from dsserve.models.presets import preset


def _moe(n_experts: int, topk: int, hash_routed: bool = False) -> M.MoE:
    torch.manual_seed(0)
    cfg = preset("tiny")
    moe = M.MoE(cfg, n_experts=n_experts, topk=topk, hash_routed=hash_routed).double()
    for p in moe.parameters():
        torch.nn.init.normal_(p, std=cfg.hidden_size**-0.5)
    if hash_routed:
        moe.gate.tid2eid.copy_(torch.randint(0, n_experts, moe.gate.tid2eid.shape, dtype=torch.int32))
    return moe


def _row_by_row(moe: M.MoE, x, tokens, act_quant: bool = False) -> torch.Tensor:
    aq = fake_quant_fp8_pow2 if act_quant else (lambda t: t)
    ids, w = moe.gate(x, tokens, None)
    ex = moe.experts
    out = []
    for t in range(x.shape[0]):
        y = moe.shared_experts(x[t : t + 1])[0]
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            xt = aq(x[t : t + 1])
            h = M.clamped_swiglu(xt @ ex["w1"][e].t(), xt @ ex["w3"][e].t(), moe.limit) * w[t, j]
            y = y + (aq(h) @ ex["w2"][e].t())[0]
        out.append(y)
    return torch.stack(out)


@pytest.mark.parametrize("rows", [1, 2, 7, 40])
def test_routed_loop_equals_the_row_by_row_sum(rows):
    moe = _moe(8, 3)
    x = torch.randn(rows, moe.gate.weight.shape[1], dtype=torch.float64)
    tokens = torch.randint(0, 100, (rows,))
    with torch.no_grad():
        assert torch.allclose(moe(x, tokens), _row_by_row(moe, x, tokens), rtol=0, atol=1e-12)


def test_a_hash_routed_row_naming_an_expert_twice_counts_it_twice():
    moe = _moe(4, 3, hash_routed=True)
    moe.gate.tid2eid[5] = torch.tensor([2, 2, 0], dtype=torch.int32)
    tokens = torch.tensor([5, 1, 5, 3])
    x = torch.randn(4, moe.gate.weight.shape[1], dtype=torch.float64)
    with torch.no_grad():
        assert torch.allclose(moe(x, tokens), _row_by_row(moe, x, tokens), rtol=0, atol=1e-12)


def test_routed_loop_with_act_quant_and_gradients():
    """The release's act_quant rounds x and h per row (the loop applies it once to all pairs), and training's
    backward reaches every chosen expert's weights and only those."""
    moe = _moe(8, 2)
    moe.act_quant, moe.packed = True, object()  # dense weights kept: the loop, with the packed form's numerics
    x = torch.randn(6, moe.gate.weight.shape[1], dtype=torch.float64)
    tokens = torch.arange(6)
    y = moe(x, tokens)
    with torch.no_grad():
        assert torch.allclose(y, _row_by_row(moe, x, tokens, act_quant=True), rtol=0, atol=1e-12)
    y.square().sum().backward()
    chosen = set(moe.gate(x, tokens, None)[0].flatten().tolist())
    grads = moe.experts["w2"].grad.flatten(1).abs().sum(1)
    assert {e for e in range(8) if grads[e] > 0} == chosen


def test_no_rows():
    moe = _moe(8, 2)
    x = torch.zeros(0, moe.gate.weight.shape[1], dtype=torch.float64)
    assert moe(x, torch.zeros(0, dtype=torch.long)).shape == (0, x.shape[1])
