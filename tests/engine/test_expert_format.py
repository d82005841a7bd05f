"""--expert-format: the engine with packed routed experts against the reference forward of the same rounded
weights (tiny, CPU, fp64), and its option errors."""

import argparse

import pytest
import torch

from dsserve import LLM, SamplingParams
from dsserve.engine.args import EngineArgs, EngineArgsError
from dsserve.engine.greedy import greedy_generate
from dsserve.models.loader import load_model
from dsserve.models.quantize import EXPERT_FORMATS, quantize_experts

PROMPTS = [[5, 17, 300, 4000, 12], list(range(40, 77)), [8000]]


@pytest.fixture(scope="module")
def oracle():
    """The plain dummy model with its experts rounded to MXFP4 (dense copies kept): the reference weights."""
    lm = load_model("tiny", dtype="float64")
    quantize_experts(lm.model, "mxfp4", keep_dense=True)
    return lm.model


@pytest.mark.parametrize("backend", ["reference", "paged"])
def test_mxfp4_engine_equals_the_oracle_on_the_rounded_weights(oracle, backend):
    """reference: the engine's MoE reads the kept dense (rounded) experts; paged (reference ops on the CPU): the
    grouped-MoE op reads the packed experts. Both give the oracle's greedy tokens."""
    llm = LLM(
        model="tiny",
        dtype="float64",
        expert_format="mxfp4",
        attention_backend=backend,
        reference_ops="all",
        device="cpu",
        swa_bounded_replay=False,
        enable_prefix_caching=False,
        max_num_seqs=4,
        max_num_batched_tokens=64,
    )
    for b, r in zip(llm.engine.model.layers, oracle.layers):
        assert b.ffn.packed.fmt == "mxfp4" and torch.equal(b.ffn.packed.w2, r.ffn.packed.w2)
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True), use_tqdm=False)
    for p, o in zip(PROMPTS, outs):
        assert o.outputs[0].token_ids == greedy_generate(oracle, p, 6, bounded_replay=False)


def test_expert_format_option():
    assert set(EXPERT_FORMATS) == {"fp8", "mxfp4"}  # EngineArgs validates against the same names
    with pytest.raises(EngineArgsError, match=r"expert_format must be mxfp4, fp8 or None, got 'nvfp4'"):
        EngineArgs(expert_format="nvfp4")
    p = argparse.ArgumentParser()
    EngineArgs.add_cli_args(p)
    assert EngineArgs.from_cli(p.parse_args(["--expert-format", "mxfp4"])).expert_format == "mxfp4"
    assert EngineArgs.from_cli(p.parse_args([])).expert_format is None
