import json

import pytest

from dsserve.models.config import ConfigError, ModelConfig
from dsserve.models.presets import PRESETS, preset


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_hf_dict_round_trip(name, tmp_path):
    cfg = preset(name)
    (tmp_path / "config.json").write_text(json.dumps(cfg.to_hf_dict()))
    back = ModelConfig.from_json(str(tmp_path))
    assert back.with_options(name=cfg.name) == cfg


def test_release_shaped_configs():
    v41 = preset("v41-flash").to_hf_dict()
    assert v41["architectures"] == ["DeepseekV41ForCausalLM"] and "text_config" in v41
    assert v41["quantization_config"]["weight_block_size"] == [32, 32]
    v4 = preset("v4-flash").to_hf_dict()
    assert "text_config" not in v4 and v4["n_hash_layers"] == 3 and v4["hidden_size"] == 4096


def test_v41_roles_match_the_spec_schedule():
    roles = preset("v41-flash").roles
    assert [r.index for r in roles if r.mode == "full"] == [2, 8, 14, 20]
    assert [r.index for r in roles if r.mode == "reindex"] == [24, 28, 32, 36]
    assert [r.index for r in roles if r.candidate == "consumer"] == [24, 28, 32, 36]
    assert roles[20].candidate == "source" and roles[20].side == "decoder" and roles[19].side == "encoder"
    assert [r.index for r in roles if r.engram] == [1, 14]
    assert [r.index for r in roles if r.dspark_tap] == [37, 38, 39]
    assert roles[25].kv_source == 20 and roles[25].index_source == 24 and roles[13].kv_source == 8
    assert not roles[0].yarn and roles[2].yarn and roles[21].yarn


def test_v4_roles():
    roles = preset("v4-flash").roles
    assert [r.index for r in roles if r.hash_routed] == [0, 1, 2]
    csa = [r for r in roles if r.ratio == 4]
    hca = [r for r in roles if r.ratio == 128]
    assert len(csa) == 21 and len(hca) == 20
    assert all(r.owns_indexer and r.kv_source == r.index for r in csa)
    assert all(not r.owns_indexer and r.index_source is None for r in hca)


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(compress_ratios=(0, 0, 3) + (1,) * 12), "allows"),
        (dict(kv_source_layer_ids=(0,)), "nonzero compress ratio"),
        (dict(num_experts_per_tok=9), "num_experts_per_tok"),
        (dict(candidate_topk_blocks=2), "candidate pool"),
        (dict(family="llama"), "family"),
    ],
)
def test_invalid_configs_are_named_errors(change, message):
    with pytest.raises(ConfigError, match=message):
        preset("tiny").with_options(**change)


def test_missing_and_broken_config_json(tmp_path):
    with pytest.raises(ConfigError, match="no config.json"):
        ModelConfig.from_json(str(tmp_path))
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        ModelConfig.from_json(str(tmp_path))


def test_declared_engram_table_sizes_are_checked(tmp_path):
    raw = preset("v41-flash").to_hf_dict()
    assert raw["text_config"]["engram_num_embeddings"] == [384_006_168, 384_016_682]
    raw["text_config"]["engram_num_embeddings"] = [384_006_168, 1]
    (tmp_path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ConfigError, match="engram_num_embeddings"):
        ModelConfig.from_json(str(tmp_path))
