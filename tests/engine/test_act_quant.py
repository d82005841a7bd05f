"""--act-quant: the release's activation rounding (spec 2.12, act_quant) through the engine, against the reference
forward applying the same rounding to the same rounded weights (tiny, CPU, fp32: the kernels take no fp64)."""

import argparse
import os

import pytest
import torch

from dsserve import LLM, SamplingParams
from dsserve.engine.args import EngineArgs
from dsserve.engine.greedy import greedy_generate
from dsserve.kernels.ops import OPS
from dsserve.models.loader import load_model
from dsserve.models.quantize import quantize_dense_fp8, quantize_experts, use_act_quant

PROMPTS = [[5, 17, 300, 4000, 12], list(range(40, 77))]


@pytest.fixture(scope="module")
def oracle():
    """The dummy tiny model in the release's forms (MXFP4 experts, FP8 projections; dense copies of the experts
    kept, rounded) with the activation rounding on: the reference forward the engine must reproduce."""
    lm = load_model("tiny", dtype="float32")
    quantize_experts(lm.model, "mxfp4", keep_dense=True)
    quantize_dense_fp8(lm.model, lm.model.cfg.weight_block_size)
    assert use_act_quant(lm.model, True) > 0
    return lm.model


def engine(backend: str, reference_ops: str) -> LLM:
    return LLM(
        model="tiny",
        dtype="float32",
        expert_format="mxfp4",
        quantization="fp8",
        act_quant=True,
        attention_backend=backend,
        reference_ops=reference_ops,
        device="cpu",
        swa_bounded_replay=False,
        enable_prefix_caching=False,
        max_num_seqs=4,
        max_num_batched_tokens=64,
    )


def greedy(llm: LLM, prompts, n: int):
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True), use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def test_the_rounding_changes_the_reference_forward(oracle):
    ids = torch.tensor(PROMPTS[1])
    with torch.no_grad():
        on = oracle(ids)
        use_act_quant(oracle, False)
        try:
            off = oracle(ids)
        finally:
            use_act_quant(oracle, True)
    assert (on.hidden - off.hidden).abs().max() > 1e-3 * off.hidden.abs().max()


@pytest.mark.parametrize("backend", ["reference", "paged"])
def test_engine_with_reference_ops_equals_the_oracle(oracle, backend):
    llm = engine(backend, "all")
    for layer in llm.engine.model.layers:
        assert layer.ffn.act_quant and layer.attn.wq_a.act_quant_min_m == 0
    for p, got in zip(PROMPTS, greedy(llm, PROMPTS, 6)):
        assert got == greedy_generate(oracle, p, 6, bounded_replay=False)


def test_engine_with_w4a8_kernels_interpreted_equals_the_oracle(oracle):
    """The routed experts as grouped_moe_a8's Triton kernels (the interpreter on the CPU), every other op its
    reference (the W8A8 projections' kernels are checked against their reference in tests/kernels, and with
    these on the GPU below): a prefill step and a decode step, as the interpreter is slow (~45 s here)."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("needs the Triton interpreter on the CPU")
    llm = engine("paged", ",".join(sorted(set(OPS) - {"moe"})))
    got = greedy(llm, PROMPTS[:1], 2)[0]
    assert got == greedy_generate(oracle, PROMPTS[0], 2, bounded_replay=False)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_w4a8_w8a8_kernels_on_gpu(monkeypatch):
    """MXFP4 experts and FP8 projections with --act-quant through the W4A8 / W8A8 kernels against the oracle
    running the same weights and rounding through the torch references (fp32; every choice whose top-2 margin
    clears rounding agrees, as in test_paged_attention). The kernels' tiles on the FP16 MMA, which sums the e4m3
    products exactly: Hopper's FP8 wgmma sums them to ~2^-13, enough to flip act_quant roundings all through this
    random fp32 model (median logit error 0.8 on an H100); tests/kernels bound that MMA kernel by kernel."""
    from test_paged_attention import _greedy_agrees_with_oracle, _tiny

    from dsserve.kernels import fp8_linear
    from dsserve.kernels.ops import KernelOps
    from dsserve.models.quantize import use_fp8_kernels

    monkeypatch.setattr(fp8_linear, "MMA", "fp16")

    m = _tiny(torch.float32, "cuda")
    quantize_experts(m, "mxfp4", keep_dense=True)
    assert quantize_dense_fp8(m, m.cfg.weight_block_size) > 0
    use_fp8_kernels(m, True)
    use_act_quant(m, True)
    _greedy_agrees_with_oracle(
        "cuda", range(8), 8, 7, KernelOps(frozenset()), model=m, before_oracle=lambda mod: use_fp8_kernels(mod, False)
    )


def test_act_quant_option():
    p = argparse.ArgumentParser()
    EngineArgs.add_cli_args(p)
    assert EngineArgs.from_cli(p.parse_args(["--act-quant"])).act_quant is True
    assert EngineArgs.from_cli(p.parse_args([])).act_quant is False
    assert any("act_quant: no effect" in n for n in EngineArgs(act_quant=True).notes())
    assert not EngineArgs(act_quant=True, quantization="fp8", expert_format="mxfp4").notes()
