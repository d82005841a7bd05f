"""The model's row-wise work through KernelOps (fused router, grouped routed experts, fused mHC sites) against
the oracle (the torch forward with no ops): exact in fp64 with the references, within fp32 rounding with the
Triton kernels (the interpreter on the CPU)."""

import pytest
import torch

from dsserve.kernels.ops import OPS, KernelOps
from dsserve.models.checkpoint import dummy_weights
from dsserve.models.model import DeepseekForCausalLM
from dsserve.models.presets import preset
from dsserve.models.quantize import quantize_experts

ROW_WISE = frozenset({"router", "moe", "mhc"})


def _tiny(dtype, seed=0):
    cfg = preset("tiny")
    m = DeepseekForCausalLM(cfg).eval()
    dummy_weights(m, cfg, seed=seed)
    return m.to(dtype)


def _logits(m, toks, ops, **kw):
    m.kernel_ops = ops
    try:
        with torch.no_grad():
            return m.reference_logits(toks, **kw)
    finally:
        m.kernel_ops = None


def test_reference_ops_equal_the_oracle_fp64():
    m = _tiny(torch.float64)
    toks = torch.randint(0, m.cfg.vocab_size, (9,), generator=torch.Generator().manual_seed(1))
    got, ref = _logits(m, toks, KernelOps(frozenset(OPS))), _logits(m, toks, None)
    assert (got - ref).abs().max() < 1e-10


@pytest.mark.interpreter  # CPU tensors through the kernels
def test_triton_row_wise_ops_match_the_oracle_fp32():
    # QAT off: with it, a last-bit difference can cross an FP4/FP8 rounding boundary and move logits by 1e-3
    # (seen here: 7e-3 on 12 tokens), which says nothing about the kernels.
    m = _tiny(torch.float32)
    toks = torch.randint(0, m.cfg.vocab_size, (6,), generator=torch.Generator().manual_seed(2))
    ref = _logits(m, toks, None, qat=False)
    got = _logits(m, toks, KernelOps(frozenset(OPS) - ROW_WISE), qat=False)
    assert (got - ref).abs().max() < 1e-4 * ref.abs().max()


@pytest.mark.parametrize("fmt", ["fp8", "mxfp4"])
def test_quantized_experts_keep_the_oracle_on_the_rounded_weights(fmt):
    """quantize_experts rounds the routed experts to the release format: the dense oracle then runs the
    dequantised weights, and the packed experts (reference ops) give the same logits in fp64."""
    m = _tiny(torch.float64)
    n = quantize_experts(m, fmt)
    assert n == len(m.layers) and all(b.ffn.packed.fmt == fmt for b in m.layers)
    toks = torch.randint(0, m.cfg.vocab_size, (7,), generator=torch.Generator().manual_seed(3))
    got, ref = _logits(m, toks, KernelOps(frozenset(OPS))), _logits(m, toks, None)
    assert (got - ref).abs().max() < 1e-10
    ffn = m.layers[0].ffn
    for name, w in zip(("w1", "w3", "w2"), ffn.packed.dequant(1)):  # the oracle's weights are the packed ones
        assert torch.equal(ffn.experts[name][1], w.to(torch.float64))


def test_packed_experts_follow_device_and_dtype_moves():
    m = _tiny(torch.float32)
    quantize_experts(m, "mxfp4", keep_dense=False)
    assert "w1" not in m.layers[0].ffn.experts
    packed = m.layers[0].ffn.packed
    m.double()
    assert m.layers[0].ffn.packed.w1.dtype == torch.uint8 and torch.equal(m.layers[0].ffn.packed.w1, packed.w1)
    toks = torch.tensor([3, 1, 4, 1, 5])
    ref = _logits(m, toks, None)  # packed only: the reference path dequantises expert by expert
    got = _logits(m, toks, KernelOps(frozenset(OPS)))
    assert (got - ref).abs().max() < 1e-10
