"""Built-in model shapes: the tiny test models, the H200 proxy and the real releases (spec 5)."""

from __future__ import annotations

import os

from .config import V4, V41, ConfigError, ModelConfig

_TINY_COMMON = dict(
    vocab_size=8192,
    hidden_size=256,
    num_attention_heads=4,
    head_dim=64,
    qk_rope_head_dim=16,
    q_lora_rank=96,
    o_groups=2,
    o_lora_rank=64,
    sliding_window=32,
    index_n_heads=4,
    index_head_dim=32,
    index_topk=16,
    n_routed_experts=8,
    num_experts_per_tok=2,
    n_shared_experts=1,
    moe_intermediate_size=128,
    max_position_embeddings=4096,
)


def _tiny() -> ModelConfig:
    return ModelConfig(
        name="tiny",
        family=V41,
        num_hidden_layers=12,
        rms_norm_eps=1e-20,
        compress_ratios=(0, 0, 2, 2, 2, 2, 1, 1, 1, 1, 1, 1, 0, 0, 0),
        kv_source_layer_ids=(2, 4, 6),
        index_source_layer_ids=(2, 4, 6, 8, 10),
        candidate_source_layer_id=6,
        candidate_topk_blocks=8,
        candidate_block_size=4,
        engram_layer_ids=(1, 4),
        engram_n_heads=4,
        engram_head_dim=32,
        engram_vocab_size=4096,
        engram_compressed_vocab_size=8192,
        num_nextn_predict_layers=3,
        dspark_block_size=5,
        dspark_markov_rank=16,
        dspark_n_routed_experts=4,
        dspark_num_experts_per_tok=2,
        dspark_target_layer_ids=(9, 10, 11),
        dspark_noise_token_id=8191,
        image_token_id=8190,
        **_TINY_COMMON,
    )


def _tiny_v4() -> ModelConfig:
    return ModelConfig(
        name="tiny-v4",
        family=V4,
        num_hidden_layers=12,
        rms_norm_eps=1e-6,
        compress_ratios=(0, 0) + (4, 128) * 5 + (0,),
        kv_source_layer_ids=(),
        index_source_layer_ids=(),
        candidate_source_layer_id=None,
        engram_layer_ids=(),
        num_hash_layers=3,
        num_nextn_predict_layers=1,
        dspark_target_layer_ids=(),
        dspark_noise_token_id=8191,
        weight_block_size=128,
        image_token_id=8190,
        **_TINY_COMMON,
    )


def _proxy_h200() -> ModelConfig:
    return ModelConfig(name="proxy-h200", n_routed_experts=24, engram_vocab_size=262_144, dspark_n_routed_experts=8)


def _proxy_h200_release() -> ModelConfig:
    """proxy-h200 (spec 5.2: every per-layer width, the full schedule) with the routed experts of one rank of an
    8-way expert-parallel deployment (384 / 8 = 48, top-6 kept) and the Engram buckets cut 4x further than
    proxy-h200's (65,536: about 1/245 of real), so the tables stay small. The construction is plain bf16/fp32
    like every preset; the release's storage formats come after construction, from `--quantization fp8` /
    models.quantize.quantize_dense_fp8 (the release's FP8 e4m3 dense projections: attention incl. the
    grouped wo_a, indexer wq_b, shared experts, Engram wkv; 32x32 ue8m0 blocks) and
    quantize_experts(model, "mxfp4", keep_dense=False) (MXFP4 experts, the dense copies dropped; `--expert-format
    mxfp4` builds it so, layer by layer on the device: models.dummy_build): about 36 GB of experts + 15 GB of the
    rest, one H200. Dummy weights only."""
    return ModelConfig(
        name="proxy-h200-release", n_routed_experts=48, engram_vocab_size=65_536, dspark_n_routed_experts=8
    )


def _v41_flash() -> ModelConfig:
    return ModelConfig(name="v41-flash")


def _v4_flash() -> ModelConfig:
    return ModelConfig(
        name="v4-flash",
        family=V4,
        hidden_size=4096,
        num_hidden_layers=43,
        q_lora_rank=1024,
        compress_ratios=(0, 0) + (4, 128) * 20 + (4, 0),
        kv_source_layer_ids=(),
        index_source_layer_ids=(),
        candidate_source_layer_id=None,
        index_n_heads=64,
        rms_norm_eps=1e-6,
        n_routed_experts=256,
        moe_intermediate_size=2048,
        num_hash_layers=3,
        engram_layer_ids=(),
        num_nextn_predict_layers=1,
        dspark_target_layer_ids=(),
        weight_block_size=128,
    )


PRESETS = {
    "tiny": _tiny,
    "tiny-v4": _tiny_v4,
    "proxy-h200": _proxy_h200,
    "proxy-h200-release": _proxy_h200_release,
    "v41-flash": _v41_flash,
    "v4-flash": _v4_flash,
}
# Trained weights that ship in the package, by name (issue 10: the tiny shape trained on the synthetic tasks).
CHECKPOINTS = {
    "tiny-trained": os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "data", "tiny-trained")
}
DEFAULT_MODEL = "tiny-trained"


def model_dir(model: str) -> str:
    """A built-in checkpoint's directory for its name; a preset name or a directory as given."""
    return CHECKPOINTS.get(model, model)


def preset(name: str) -> ModelConfig:
    if name not in PRESETS:
        raise ConfigError(f"unknown preset {name!r}; presets are {sorted(PRESETS)} (or pass a checkpoint directory)")
    return PRESETS[name]()
