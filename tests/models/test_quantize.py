"""--quantization fp8 (models.quantize.quantize_dense_fp8): which tensors become Fp8Linear, and the tiny model's
forward on them equals the same model running the dequantised weights as plain nn.Linear (fp32)."""

import copy

import pytest
import torch
from torch import nn

from dsserve.kernels.fp8_linear import Fp8Linear
from dsserve.models.checkpoint import dummy_weights
from dsserve.models.model import DeepseekForCausalLM
from dsserve.models.presets import preset
from dsserve.models.quantize import quantize_dense_fp8

# The release's dense FP8 tensors per layer (spec 1.7 and the table of 4.2), module names without ".weight"
RELEASE_FP8 = (
    "attn.wq_a",
    "attn.wq_b",
    "attn.wkv",
    "attn.wo_a",
    "attn.wo_b",
    "ffn.shared_experts.w1",
    "ffn.shared_experts.w2",
    "ffn.shared_experts.w3",
)
RELEASE_FP8_INDEXER = ("attn.indexer.wq_b",)  # layers that own an indexer
RELEASE_FP8_ENGRAM = ("engram.wkv",)  # layers with Engram


def release_fp8_names(model):
    names = []
    for i, layer in enumerate(model.layers):
        own = RELEASE_FP8 + (RELEASE_FP8_INDEXER if layer.attn.indexer is not None else ())
        own += RELEASE_FP8_ENGRAM if layer.engram is not None else ()
        names += [f"layers.{i}.{n}" for n in own]
    return names


@pytest.fixture(scope="module")
def models():
    """(quantised, twin): the tiny dummy model (fp32) after quantize_dense_fp8, and its pre-quantisation copy whose
    converted nn.Linear weights hold the dequantised values."""
    torch.manual_seed(0)
    cfg = preset("tiny")
    q = DeepseekForCausalLM(cfg).eval()
    dummy_weights(q, cfg, seed=0)
    twin = copy.deepcopy(q)
    n = quantize_dense_fp8(q, cfg.weight_block_size)
    names = release_fp8_names(q)
    assert n == len(names)
    with torch.no_grad():
        for name in names:
            twin.get_submodule(name).weight.copy_(q.get_submodule(name).dequantized_weight())
    return q, twin, names


def test_every_release_fp8_tensor_is_fp8linear(models):
    q, twin, names = models
    cfg = q.cfg
    assert any(layer.engram is not None for layer in q.layers) and any(layer.attn.indexer for layer in q.layers)
    for name in names:
        mod = q.get_submodule(name)
        assert isinstance(mod, Fp8Linear), name
        assert mod.block == cfg.weight_block_size and mod.out_features == twin.get_submodule(name).out_features
        assert mod.groups == (cfg.o_groups if name.endswith("wo_a") else 1), name
    # nothing else: the compressor, indexer wk / weights_proj, gate and head stay as they are (bf16 in the release)
    fp8 = {n for n, m in q.named_modules() if isinstance(m, Fp8Linear)}
    fused = {f"layers.{i}.ffn.shared_experts.w13" for i in range(len(q.layers))}
    assert fp8 == set(names) | fused
    # the fused gate/up product holds the bytes once: w1 and w3 are views of its rows
    sh = q.layers[0].ffn.shared_experts
    assert sh.w1.weight.data_ptr() == sh.w13.weight.data_ptr()
    assert sh.w3.weight.data_ptr() == sh.w13.weight[sh.w1.out_features :].data_ptr()
    assert isinstance(q.layers[2].attn.compressor.wkv, nn.Linear) and isinstance(q.head, nn.Linear)
    assert quantize_dense_fp8(q, cfg.weight_block_size) == 0  # already converted


@torch.no_grad()
def test_forward_equals_the_dequantised_model(models):
    q, twin, _ = models
    toks = torch.randint(0, q.cfg.vocab_size, (24,), generator=torch.Generator().manual_seed(1))
    ref = twin.reference_logits(toks)
    out = q.reference_logits(toks)
    assert ((out - ref).norm() / ref.norm()).item() < 1e-5
    # the rounding is visible: the unrounded weights give other logits (so the comparison can fail)
    plain = DeepseekForCausalLM(q.cfg).eval()
    dummy_weights(plain, q.cfg, seed=0)
    assert ((plain.reference_logits(toks) - ref).norm() / ref.norm()).item() > 1e-3


def test_wo_a_keeps_its_dtype_when_groups_straddle_blocks():
    """tiny-v4: 64 rows per group on 128x128 blocks, so wo_a stays an nn.Linear; the rest converts."""
    cfg = preset("tiny-v4")
    m = DeepseekForCausalLM(cfg)
    quantize_dense_fp8(m, cfg.weight_block_size)
    attn = m.layers[0].attn
    assert isinstance(attn.wo_a, nn.Linear) and isinstance(attn.wo_b, Fp8Linear)
    assert isinstance(m.layers[0].ffn.shared_experts.w2, Fp8Linear)
