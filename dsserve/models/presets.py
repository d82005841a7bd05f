"""Built-in model shapes: the tiny test models, the H200 proxy and the real releases (spec 5)."""
from __future__ import annotations

from .config import V4, V41, ConfigError, ModelConfig

_TINY_COMMON = dict(
    vocab_size=8192, hidden_size=256, num_attention_heads=4, head_dim=64, qk_rope_head_dim=16,
    q_lora_rank=96, o_groups=2, o_lora_rank=64, sliding_window=32, index_n_heads=4, index_head_dim=32,
    index_topk=16, n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1, moe_intermediate_size=128,
    max_position_embeddings=4096,
)


def _tiny() -> ModelConfig:
    return ModelConfig(
        name="tiny", family=V41, num_hidden_layers=12, rms_norm_eps=1e-20,
        compress_ratios=(0, 0, 2, 2, 2, 2, 1, 1, 1, 1, 1, 1, 0, 0, 0),
        kv_source_layer_ids=(2, 4, 6), index_source_layer_ids=(2, 4, 6, 8, 10),
        candidate_source_layer_id=6, candidate_topk_blocks=8, candidate_block_size=4,
        engram_layer_ids=(1, 4), engram_n_heads=4, engram_head_dim=32, engram_vocab_size=4096,
        engram_compressed_vocab_size=8192, num_nextn_predict_layers=3, dspark_block_size=5,
        dspark_markov_rank=16, dspark_n_routed_experts=4, dspark_num_experts_per_tok=2,
        dspark_target_layer_ids=(9, 10, 11), dspark_noise_token_id=8191, image_token_id=8190,
        **_TINY_COMMON)


def _tiny_v4() -> ModelConfig:
    return ModelConfig(
        name="tiny-v4", family=V4, num_hidden_layers=12, rms_norm_eps=1e-6,
        compress_ratios=(0, 0) + (4, 128) * 5 + (0,), kv_source_layer_ids=(), index_source_layer_ids=(),
        candidate_source_layer_id=None, engram_layer_ids=(), num_hash_layers=3, num_nextn_predict_layers=1,
        dspark_target_layer_ids=(), dspark_noise_token_id=8191, weight_block_size=128, image_token_id=8190,
        **_TINY_COMMON)


def _proxy_h200() -> ModelConfig:
    return ModelConfig(name="proxy-h200", n_routed_experts=24, engram_vocab_size=262_144,
                       dspark_n_routed_experts=8)


def _v41_flash() -> ModelConfig:
    return ModelConfig(name="v41-flash")


def _v4_flash() -> ModelConfig:
    return ModelConfig(
        name="v4-flash", family=V4, hidden_size=4096, num_hidden_layers=43, q_lora_rank=1024,
        compress_ratios=(0, 0) + (4, 128) * 20 + (4, 0), kv_source_layer_ids=(), index_source_layer_ids=(),
        candidate_source_layer_id=None, index_n_heads=64, rms_norm_eps=1e-6, n_routed_experts=256,
        moe_intermediate_size=2048, num_hash_layers=3, engram_layer_ids=(), num_nextn_predict_layers=1,
        dspark_target_layer_ids=(), weight_block_size=128)


PRESETS = {"tiny": _tiny, "tiny-v4": _tiny_v4, "proxy-h200": _proxy_h200, "v41-flash": _v41_flash,
           "v4-flash": _v4_flash}
DEFAULT_MODEL = "tiny"


def preset(name: str) -> ModelConfig:
    if name not in PRESETS:
        raise ConfigError(f"unknown preset {name!r}; presets are {sorted(PRESETS)} (or pass a checkpoint directory)")
    return PRESETS[name]()
