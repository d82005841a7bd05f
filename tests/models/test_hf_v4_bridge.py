"""Self-check of the release-name -> transformers DeepseekV4 bridge on the tiny-v4 preset."""

from __future__ import annotations

import os
import sys

import pytest
import torch

pytest.importorskip("transformers")
sys.path.insert(0, os.path.dirname(__file__))

from hf_v4_bridge import (  # noqa: E402
    hf_config_from,
    load_hf_model,
    random_release_state_dict,
    release_tensor_shapes,
    release_to_hf_state_dict,
)

from dsserve.models.presets import preset  # noqa: E402


@pytest.fixture(scope="module")
def cfg():
    return preset("tiny-v4")


def test_hf_config_matches_roles(cfg):
    hf = hf_config_from(cfg)
    assert hf.num_hidden_layers == cfg.num_hidden_layers
    assert hf.layer_types[:4] == [
        "sliding_attention",
        "sliding_attention",
        "compressed_sparse_attention",
        "heavily_compressed_attention",
    ]
    assert hf.mlp_layer_types == ["hash_moe"] * 3 + ["moe"] * (cfg.num_hidden_layers - 3)
    assert hf.qk_rope_head_dim == cfg.qk_rope_head_dim
    comp = hf.rope_parameters["compress"]
    assert comp["rope_type"] == "yarn" and comp["attention_factor"] == 1.0
    assert hf.rope_parameters["main"]["rope_type"] == "default"


def test_strict_load_and_forward(cfg):
    torch.manual_seed(0)
    sd = random_release_state_dict(cfg, seed=0)
    shapes = release_tensor_shapes(cfg)
    assert set(sd) == set(shapes)
    model = load_hf_model(cfg, sd)  # raises on any missing / unexpected / mis-shaped tensor

    # every HF parameter and persistent buffer came from the release dict
    hf_sd = release_to_hf_state_dict(sd, cfg)
    assert set(hf_sd) == set(model.state_dict())
    # YaRN attention factor is neutralised on every rotary module
    for m in model.modules():
        if type(m).__name__ == "DeepseekV4RotaryEmbedding":
            assert m.compress_attention_scaling == 1.0 and m.main_attention_scaling == 1.0
    # a couple of layout spot checks
    L = cfg.num_hash_layers  # first learned-router layer
    gu = model.model.layers[L].mlp.experts.gate_up_proj
    I = cfg.moe_intermediate_size
    assert torch.equal(gu[3, :I], sd[f"layers.{L}.ffn.experts.3.w1.weight"])
    assert torch.equal(gu[3, I:], sd[f"layers.{L}.ffn.experts.3.w3.weight"])
    assert torch.equal(model.model.layers[0].mlp.gate.tid2eid, sd["layers.0.ffn.gate.tid2eid"].long())

    ids = torch.randint(0, cfg.vocab_size, (1, 300), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        logits = model(input_ids=ids, use_cache=False).logits
    assert logits.shape == (1, 300, cfg.vocab_size)
    assert torch.isfinite(logits).all()
    assert logits.std() > 0


def test_unknown_names_rejected(cfg):
    sd = random_release_state_dict(cfg, seed=0)
    sd["layers.0.attn.wq_b.scale"] = torch.ones(1)
    with pytest.raises(KeyError):
        release_to_hf_state_dict(sd, cfg)
    sd = random_release_state_dict(cfg, seed=0)
    del sd["layers.4.ffn.experts.5.w2.weight"]
    with pytest.raises(KeyError):
        release_to_hf_state_dict(sd, cfg)
