"""models.dummy_build: a dummy model whose routed experts are filled and packed one layer at a time equals a plain
build + dummy_weights + quantize_experts, and never holds the dense experts of two layers at once."""

import inspect

import pytest
import torch

from dsserve.layers.moe import MoE, deferred_experts
from dsserve.models import dummy_build
from dsserve.models.checkpoint import dummy_weights
from dsserve.models.config import ConfigError
from dsserve.models.loader import load_model
from dsserve.models.model import DeepseekForCausalLM
from dsserve.models.presets import preset
from dsserve.models.quantize import pack_experts, quantize_experts

PACKED = ("w1", "w3", "w2", "s1", "s3", "s2")


def _plain(fmt, keep_dense):
    cfg = preset("tiny")
    m = DeepseekForCausalLM(cfg).eval()
    dummy_weights(m, cfg, seed=3)
    quantize_experts(m, fmt, keep_dense=keep_dense)
    return m


@pytest.mark.parametrize("fmt,keep_dense", [("mxfp4", True), ("mxfp4", False), ("fp8", False)])
def test_packed_build_equals_plain_build_then_quantize(fmt, keep_dense):
    got = dummy_build.build_dummy_model(preset("tiny"), 3, fmt, "cpu", keep_dense)
    ref = _plain(fmt, keep_dense)
    sg, sr = got.state_dict(), ref.state_dict()
    assert sg.keys() == sr.keys() and ("layers.0.ffn.experts.w1" in sg) == keep_dense
    for name in sg:
        assert torch.equal(sg[name], sr[name]), name
    for a, b in zip(got.layers, ref.layers):
        assert a.ffn.packed.fmt == fmt
        for f in PACKED:
            assert torch.equal(getattr(a.ffn.packed, f), getattr(b.ffn.packed, f)), f
    draft = [m for m in got.mtp.modules() if isinstance(m, MoE)]
    assert draft and all(m.packed is None and not m.experts["w1"].is_meta for m in draft)  # the draft stays dense


def test_one_layer_of_dense_experts_at_a_time(monkeypatch):
    seen = []

    def spy(moe, fmt, keep_dense=True):
        net = inspect.currentframe().f_back.f_locals["net"]
        seen.append(sum(not b.ffn.experts["w1"].is_meta for b in net.layers if "w1" in b.ffn.experts))
        pack_experts(moe, fmt, keep_dense)

    monkeypatch.setattr(dummy_build, "pack_experts", spy)
    net = dummy_build.build_dummy_model(preset("tiny"), 0, "mxfp4", "cpu", keep_dense=False)
    assert seen == [1] * len(net.layers)  # only the layer being packed has its dense experts
    assert all("w1" not in b.ffn.experts and b.ffn.packed is not None for b in net.layers)


def test_deferred_experts_live_on_meta_only_inside():
    cfg = preset("tiny")
    with deferred_experts():
        m = MoE(cfg, 4, 2)
    assert all(p.is_meta for p in m.experts.values()) and not m.gate.weight.is_meta
    assert not MoE(cfg, 4, 2).experts["w1"].is_meta


def test_load_model_with_an_expert_format():
    lm = load_model("tiny", seed=1, expert_format="mxfp4", dtype="float64")
    ref = load_model("tiny", seed=1)
    quantize_experts(ref.model, "mxfp4")
    ref.model.double()
    b, r = lm.model.layers[2].ffn, ref.model.layers[2].ffn
    assert b.packed.fmt == "mxfp4" and torch.equal(b.packed.w1, r.packed.w1)
    assert b.experts["w1"].dtype == torch.float64 and torch.equal(b.experts["w1"], r.experts["w1"])  # kept on CPU
    with pytest.raises(ConfigError, match=r"expert format 'nvfp4' is not one of \('fp8', 'mxfp4'\)"):
        load_model("tiny", expert_format="nvfp4")


def test_pack_experts_is_idempotent_and_keeps_its_format():
    m = _plain("mxfp4", keep_dense=False)
    before = m.layers[0].ffn.packed
    assert quantize_experts(m, "mxfp4") == len(m.layers) and m.layers[0].ffn.packed is before
    with pytest.raises(ValueError, match="already packed as mxfp4, cannot repack as fp8"):
        quantize_experts(m, "fp8")
