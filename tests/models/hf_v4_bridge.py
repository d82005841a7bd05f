"""Bridge between DeepSeek-V4 *release* tensor names and transformers' ``DeepseekV4ForCausalLM``.

Test-only helpers (nothing here is imported by ``dsserve``):

* ``hf_config_from(cfg)``            -- a ``DeepseekV4Config`` describing the same model as our ``ModelConfig``
                                        (V4 family only), with YaRN's attention factor pinned to 1.0 so HF
                                        matches the reference / spec (no mscale on cos/sin).
* ``release_tensor_shapes(cfg)``     -- the contract: every release-named tensor (spec 4 / 4.5 V4 variants)
                                        with its shape and dtype, dequantised (no ``.scale`` siblings).
* ``random_release_state_dict(cfg)`` -- random tensors with those names and shapes, scaled so a forward is
                                        well-conditioned (finite logits, non-degenerate routing / top-k).
* ``release_to_hf_state_dict(sd, cfg)`` -- rename / restack to HF parameter names (experts fused into
                                        ``gate_up_proj`` = cat(w1, w3) and ``down_proj`` = w2, stacked over
                                        experts; ``tid2eid`` cast to int64; ``mtp.*`` dropped).
* ``load_hf_model(cfg, sd)``         -- build the HF model in fp32 on CPU and load ``sd`` strictly.

The mapping mirrors transformers' own ``conversion_mapping.py`` entry for ``deepseek_v4`` (WeightRenaming list
plus MergeModulelist/Concatenate for the experts), written out explicitly per tensor.
"""

from __future__ import annotations

import math
import re

import torch

from dsserve.models.config import V4, ModelConfig

_LAYER_TYPE = {0: "sliding_attention", 4: "compressed_sparse_attention", 128: "heavily_compressed_attention"}


# ----------------------------------------------------------------------------------------------- config
def hf_config_from(cfg: ModelConfig, **overrides):
    """A transformers ``DeepseekV4Config`` for the V4 model described by ``cfg``.

    ``overrides`` are passed to the config constructor last (e.g. ``attention_factor`` experiments are done by
    editing ``rope_parameters`` instead).
    """
    from transformers import DeepseekV4Config

    if cfg.family != V4:
        raise ValueError(f"hf_config_from needs a V4 config, got family {cfg.family!r}")
    n = cfg.num_hidden_layers
    ratios = list(cfg.compress_ratios[:n])
    bad = sorted(set(ratios) - set(_LAYER_TYPE))
    if bad:
        raise ValueError(f"compress ratios {bad} have no transformers layer type")
    if cfg.n_shared_experts != 1:
        raise ValueError("transformers' DeepseekV4 has exactly one shared expert")
    if cfg.gate_temp != 1.0:
        raise ValueError("transformers' DeepseekV4 router has no temperature")
    prf = cfg.qk_rope_head_dim / cfg.head_dim
    rope_parameters = {
        "main": {"rope_type": "default", "rope_theta": cfg.rope_theta, "partial_rotary_factor": prf},
        "compress": {
            "rope_type": "yarn",
            "rope_theta": cfg.compress_rope_theta,
            "partial_rotary_factor": prf,
            "factor": cfg.yarn_factor,
            "original_max_position_embeddings": cfg.yarn_original_max_position,
            "beta_fast": cfg.yarn_beta_fast,
            "beta_slow": cfg.yarn_beta_slow,
            # The reference multiplies cos/sin by nothing. Without this key HF derives 0.1*ln(16)+1 = 1.2773
            # and scales cos/sin (hence q.k on the rope channels by 1.63x and the de-rotated output).
            "attention_factor": 1.0,
        },
    }
    kw = dict(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size,
        moe_intermediate_size=cfg.moe_intermediate_size,
        num_hidden_layers=n,
        num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=1,
        head_dim=cfg.head_dim,
        q_lora_rank=cfg.q_lora_rank,
        num_experts_per_tok=cfg.num_experts_per_tok,
        n_routed_experts=cfg.n_routed_experts,
        n_shared_experts=cfg.n_shared_experts,
        scoring_func="sqrtsoftplus",
        norm_topk_prob=True,
        routed_scaling_factor=cfg.routed_scaling_factor,
        max_position_embeddings=cfg.max_position_embeddings,
        rope_theta=cfg.rope_theta,
        compress_rope_theta=cfg.compress_rope_theta,
        partial_rotary_factor=prf,
        rope_parameters=rope_parameters,
        layer_types=[_LAYER_TYPE[r] for r in ratios],
        compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 128},
        mlp_layer_types=["hash_moe" if i < cfg.num_hash_layers else "moe" for i in range(n)],
        hc_mult=cfg.hc_mult,
        hc_sinkhorn_iters=cfg.hc_sinkhorn_iters,
        hc_eps=cfg.hc_eps,
        swiglu_limit=cfg.swiglu_limit,
        sliding_window=cfg.sliding_window,
        o_groups=cfg.o_groups,
        o_lora_rank=cfg.o_lora_rank,
        index_n_heads=cfg.index_n_heads,
        index_head_dim=cfg.index_head_dim,
        index_topk=cfg.index_topk,
        num_nextn_predict_layers=cfg.num_nextn_predict_layers,
        rms_norm_eps=cfg.rms_norm_eps,
        hidden_act="silu",
        tie_word_embeddings=False,
        attention_bias=False,
        mlp_bias=False,
        pad_token_id=None,  # only affects nn.Embedding init; weights are loaded anyway
        bos_token_id=cfg.bos_token_id,
        eos_token_id=cfg.eos_token_id,
    )
    kw.update(overrides)
    hf = DeepseekV4Config(**kw)
    hf._attn_implementation = "eager"  # the only backend V4 supports
    return hf


# ----------------------------------------------------------------------------------------------- names
def release_tensor_shapes(cfg: ModelConfig) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Every release tensor (dequantised) the bridge expects, in release order, with shape and dtype.

    Layer roles: ratio 0 = SWA only (no compressor); ratio 4 = CSA (overlapping compressor with 2*head_dim
    projections, ape [4, 2*head_dim], plus an indexer with its own overlapping compressor at index_head_dim);
    ratio 128 = HCA (plain compressor, ape [128, head_dim], no indexer). Layers < num_hash_layers carry
    ``ffn.gate.tid2eid`` [vocab, top_k] int32 and no ``ffn.gate.bias``; the others carry ``ffn.gate.bias``.
    MTP tensors are not listed (HF does not instantiate MTP).
    """
    f32, i32 = torch.float32, torch.int32
    d, V, hc = cfg.hidden_size, cfg.vocab_size, cfg.hc_mult
    H, D = cfg.num_attention_heads, cfg.head_dim
    mix = (2 + hc) * hc
    I, E, k = cfg.moe_intermediate_size, cfg.n_routed_experts, cfg.num_experts_per_tok
    ih, idim = cfg.index_n_heads, cfg.index_head_dim
    out: dict[str, tuple[tuple[int, ...], torch.dtype]] = {
        "embed.weight": ((V, d), f32),
        "head.weight": ((V, d), f32),
        "norm.weight": ((d,), f32),
        "hc_head_fn": ((hc, hc * d), f32),
        "hc_head_base": ((hc,), f32),
        "hc_head_scale": ((1,), f32),
    }
    for L in range(cfg.num_hidden_layers):
        r = cfg.compress_ratios[L]
        p = f"layers.{L}."
        out.update(
            {
                p + "attn_norm.weight": ((d,), f32),
                p + "ffn_norm.weight": ((d,), f32),
                p + "hc_attn_fn": ((mix, hc * d), f32),
                p + "hc_attn_base": ((mix,), f32),
                p + "hc_attn_scale": ((3,), f32),
                p + "hc_ffn_fn": ((mix, hc * d), f32),
                p + "hc_ffn_base": ((mix,), f32),
                p + "hc_ffn_scale": ((3,), f32),
                p + "attn.wq_a.weight": ((cfg.q_lora_rank, d), f32),
                p + "attn.q_norm.weight": ((cfg.q_lora_rank,), f32),
                p + "attn.wq_b.weight": ((H * D, cfg.q_lora_rank), f32),
                p + "attn.wkv.weight": ((D, d), f32),
                p + "attn.kv_norm.weight": ((D,), f32),
                p + "attn.wo_a.weight": ((cfg.o_groups * cfg.o_lora_rank, H * D // cfg.o_groups), f32),
                p + "attn.wo_b.weight": ((d, cfg.o_groups * cfg.o_lora_rank), f32),
                p + "attn.attn_sink": ((H,), f32),
            }
        )
        if r:
            coff = 2 if r == 4 else 1  # overlap doubles the CSA projections (Ca | Cb)
            out.update(
                {
                    p + "attn.compressor.wkv.weight": ((coff * D, d), f32),
                    p + "attn.compressor.wgate.weight": ((coff * D, d), f32),
                    p + "attn.compressor.ape": ((r, coff * D), f32),
                    p + "attn.compressor.norm.weight": ((D,), f32),
                }
            )
        if r == 4:
            out.update(
                {
                    p + "attn.indexer.wq_b.weight": ((ih * idim, cfg.q_lora_rank), f32),
                    p + "attn.indexer.weights_proj.weight": ((ih, d), f32),
                    p + "attn.indexer.compressor.wkv.weight": ((2 * idim, d), f32),
                    p + "attn.indexer.compressor.wgate.weight": ((2 * idim, d), f32),
                    p + "attn.indexer.compressor.ape": ((4, 2 * idim), f32),
                    p + "attn.indexer.compressor.norm.weight": ((idim,), f32),
                }
            )
        out[p + "ffn.gate.weight"] = ((E, d), f32)
        if L < cfg.num_hash_layers:
            out[p + "ffn.gate.tid2eid"] = ((V, k), i32)
        else:
            out[p + "ffn.gate.bias"] = ((E,), f32)
        out.update(
            {
                p + "ffn.shared_experts.w1.weight": ((I, d), f32),
                p + "ffn.shared_experts.w2.weight": ((d, I), f32),
                p + "ffn.shared_experts.w3.weight": ((I, d), f32),
            }
        )
        for e in range(E):
            out.update(
                {
                    p + f"ffn.experts.{e}.w1.weight": ((I, d), f32),
                    p + f"ffn.experts.{e}.w2.weight": ((d, I), f32),
                    p + f"ffn.experts.{e}.w3.weight": ((I, d), f32),
                }
            )
    return out


def random_release_state_dict(cfg: ModelConfig, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random fp32 release-named tensors (int32 ``tid2eid``), scaled for a well-conditioned forward."""
    g = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=g)

    sd: dict[str, torch.Tensor] = {}
    for name, (shape, dtype) in release_tensor_shapes(cfg).items():
        if name.endswith("tid2eid"):
            V, k = shape
            # k distinct experts per token, like the release table
            t = torch.stack([torch.randperm(cfg.n_routed_experts, generator=g)[:k] for _ in range(V)])
            sd[name] = t.to(dtype)
        elif name.endswith("norm.weight"):  # RMSNorm gains (attn/ffn/q/kv/compressor/final norms)
            sd[name] = 1.0 + 0.1 * randn(*shape)
        elif name.endswith("_fn"):  # mHC projections act on an RMS-normalised 4d vector
            sd[name] = randn(*shape) / math.sqrt(shape[1])
        elif name.endswith("_base"):
            sd[name] = 0.5 * randn(*shape)
        elif name.endswith("_scale"):
            sd[name] = 1.0 + 0.2 * randn(*shape)
        elif name.endswith("attn_sink"):
            sd[name] = randn(*shape)
        elif name.endswith(".ape"):
            sd[name] = 0.5 * randn(*shape)
        elif name.endswith("gate.bias"):
            sd[name] = 0.1 * randn(*shape)
        elif name in ("embed.weight",):
            sd[name] = randn(*shape)
        else:  # linear weights [out, in]
            sd[name] = randn(*shape) / math.sqrt(shape[-1])
        assert tuple(sd[name].shape) == tuple(shape), name
    return sd


# ----------------------------------------------------------------------------------------------- mapping
# Per-layer leaf renames, release suffix -> HF suffix (after "layers.{L}." -> "model.layers.{L}.").
_LAYER_RENAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "hc_attn_fn": "attn_hc.fn",
    "hc_attn_base": "attn_hc.base",
    "hc_attn_scale": "attn_hc.scale",
    "hc_ffn_fn": "ffn_hc.fn",
    "hc_ffn_base": "ffn_hc.base",
    "hc_ffn_scale": "ffn_hc.scale",
    "attn.wq_a.weight": "self_attn.q_a_proj.weight",
    "attn.q_norm.weight": "self_attn.q_a_norm.weight",
    "attn.wq_b.weight": "self_attn.q_b_proj.weight",
    "attn.wkv.weight": "self_attn.kv_proj.weight",
    "attn.kv_norm.weight": "self_attn.kv_norm.weight",
    "attn.wo_a.weight": "self_attn.o_a_proj.weight",  # [g*o_lora, H*D/g]; HF views it as [g, o_lora, H*D/g]
    "attn.wo_b.weight": "self_attn.o_b_proj.weight",
    "attn.attn_sink": "self_attn.sinks",
    "attn.compressor.wkv.weight": "self_attn.compressor.kv_proj.weight",
    "attn.compressor.wgate.weight": "self_attn.compressor.gate_proj.weight",
    "attn.compressor.ape": "self_attn.compressor.position_bias",
    "attn.compressor.norm.weight": "self_attn.compressor.kv_norm.weight",
    # HF nests the indexer inside the CSA compressor
    "attn.indexer.wq_b.weight": "self_attn.compressor.indexer.q_b_proj.weight",
    "attn.indexer.weights_proj.weight": "self_attn.compressor.indexer.scorer.weights_proj.weight",
    "attn.indexer.compressor.wkv.weight": "self_attn.compressor.indexer.kv_proj.weight",
    "attn.indexer.compressor.wgate.weight": "self_attn.compressor.indexer.gate_proj.weight",
    "attn.indexer.compressor.ape": "self_attn.compressor.indexer.position_bias",
    "attn.indexer.compressor.norm.weight": "self_attn.compressor.indexer.kv_norm.weight",
    "ffn.gate.weight": "mlp.gate.weight",
    "ffn.gate.bias": "mlp.gate.e_score_correction_bias",
    "ffn.gate.tid2eid": "mlp.gate.tid2eid",
    "ffn.shared_experts.w1.weight": "mlp.shared_experts.gate_proj.weight",
    "ffn.shared_experts.w2.weight": "mlp.shared_experts.down_proj.weight",
    "ffn.shared_experts.w3.weight": "mlp.shared_experts.up_proj.weight",
}
_GLOBAL_RENAMES = {
    "embed.weight": "model.embed_tokens.weight",
    "head.weight": "lm_head.weight",
    "norm.weight": "model.norm.weight",
    "hc_head_fn": "model.hc_head.hc_fn",
    "hc_head_base": "model.hc_head.hc_base",
    "hc_head_scale": "model.hc_head.hc_scale",
}
_LAYER_KEY = re.compile(r"^layers\.(\d+)\.(.+)$")
_EXPERT_KEY = re.compile(r"^ffn\.experts\.(\d+)\.(w[123])\.weight$")


def release_to_hf_state_dict(
    release_sd: dict[str, torch.Tensor], cfg: ModelConfig, drop_mtp: bool = True
) -> dict[str, torch.Tensor]:
    """Map dequantised release-named tensors to ``DeepseekV4ForCausalLM`` state-dict names and layouts.

    Raises ``KeyError`` on any name it does not know (including FP8/FP4 ``.scale`` siblings: dequantise first)
    and on incomplete expert sets. ``mtp.*`` tensors are dropped (HF ignores them on load too).
    """
    out: dict[str, torch.Tensor] = {}
    experts: dict[int, dict[str, dict[int, torch.Tensor]]] = {}
    unknown = []
    for name, t in release_sd.items():
        if name.startswith("mtp."):
            if drop_mtp:
                continue
            unknown.append(name)
            continue
        if name in _GLOBAL_RENAMES:
            out[_GLOBAL_RENAMES[name]] = t
            continue
        m = _LAYER_KEY.match(name)
        if not m:
            unknown.append(name)
            continue
        L, rest = int(m.group(1)), m.group(2)
        if L >= cfg.num_hidden_layers:
            unknown.append(name)
            continue
        em = _EXPERT_KEY.match(rest)
        if em:
            experts.setdefault(L, {}).setdefault(em.group(2), {})[int(em.group(1))] = t
            continue
        if rest not in _LAYER_RENAMES:
            unknown.append(name)
            continue
        if rest == "ffn.gate.tid2eid":
            t = t.to(torch.int64)  # HF buffer is int64 (release int32)
        out[f"model.layers.{L}.{_LAYER_RENAMES[rest]}"] = t
    if unknown:
        raise KeyError(
            f"release tensors with no transformers counterpart: {sorted(unknown)[:20]}"
            f"{' ...' if len(unknown) > 20 else ''}"
        )
    E = cfg.n_routed_experts
    for L, ws in sorted(experts.items()):
        for w in ("w1", "w2", "w3"):
            have = ws.get(w, {})
            if sorted(have) != list(range(E)):
                raise KeyError(f"layer {L}: experts {w} incomplete, have {sorted(have)} of {E}")

        def stack(w, ws=ws):
            return torch.stack([ws[w][e] for e in range(E)], dim=0)

        # gate_up_proj[e] = cat(w1[e], w3[e]) along the output dim: [E, 2I, d]; HF chunks it gate-first.
        out[f"model.layers.{L}.mlp.experts.gate_up_proj"] = torch.cat([stack("w1"), stack("w3")], dim=1)
        out[f"model.layers.{L}.mlp.experts.down_proj"] = stack("w2")  # [E, d, I]
    return out


def load_hf_model(cfg: ModelConfig, release_sd: dict[str, torch.Tensor], dtype=torch.float32, **config_overrides):
    """``DeepseekV4ForCausalLM`` (CPU, ``dtype``, eval) with ``release_sd`` loaded strictly."""
    from transformers import DeepseekV4ForCausalLM

    hf_cfg = hf_config_from(cfg, **config_overrides)
    model = DeepseekV4ForCausalLM(hf_cfg).to(dtype).eval()
    hf_sd = release_to_hf_state_dict(release_sd, cfg)
    ref = model.state_dict()
    missing = sorted(set(ref) - set(hf_sd))
    extra = sorted(set(hf_sd) - set(ref))
    if missing or extra:
        raise KeyError(
            f"state-dict mismatch: missing {missing[:10]} ({len(missing)}), unexpected {extra[:10]} ({len(extra)})"
        )
    bad = [(k, tuple(hf_sd[k].shape), tuple(ref[k].shape)) for k in ref if hf_sd[k].shape != ref[k].shape]
    if bad:
        raise ValueError(f"shape mismatch (name, given, expected): {bad[:10]}")
    model.load_state_dict({k: v.to(ref[k].dtype) for k, v in hf_sd.items()}, strict=True)
    return model
