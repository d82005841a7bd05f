"""ModelConfig: the shapes of one DeepSeek-V4.1-Flash / V4-Flash model, and each layer's role.

A frozen dataclass read from a HF-style ``config.json`` (V4.1: nested ``text_config`` plus a top-level
``quantization_config``; V4: flat). Layer roles are derived once here, from the raw ``compress_ratios``
list, and every other part reads the role instead of comparing ratios to magic numbers.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, fields, replace
from functools import cached_property

V41 = "deepseek_v41"
V4 = "deepseek_v4"


class ConfigError(ValueError):
    """A config.json or preset that cannot describe a valid model."""


@dataclass(frozen=True)
class LayerRole:
    """What one backbone layer does (spec 1.2). Built by ``ModelConfig.roles``."""

    index: int
    side: str  # "encoder" | "decoder" (V4.1 CED split); V4 layers are all "decoder"
    ratio: int  # raw compress ratio: 0 = SWA only; V4.1 1/2; V4 4 (CSA) / 128 (HCA)
    mode: str  # "swa" | "full" | "reindex" | "reuse"
    kv_source: int | None  # layer whose compressed main KV this layer reads
    index_source: int | None  # layer whose top-k selection this layer uses (None: dense, HCA)
    owns_compressor: bool
    owns_indexer: bool  # computes index scores with its own query (Full and Reindex)
    candidate: str | None  # "source" | "consumer" | None (V4.1 hierarchical pool)
    engram: bool
    dspark_tap: bool
    hash_routed: bool  # V4: experts from tid2eid[token]
    yarn: bool  # ratio != 0: compress theta with YaRN, else base theta without

    @property
    def extras(self) -> str:
        out = []
        if self.engram:
            out.append("engram")
        if self.candidate:
            out.append(f"cand. {self.candidate}")
        if self.dspark_tap:
            out.append("dspark tap")
        if self.hash_routed:
            out.append("hash-routed")
        return ", ".join(out)


@dataclass(frozen=True)
class ModelConfig:
    family: str = V41  # V41 or V4
    vocab_size: int = 129280
    hidden_size: int = 5120
    num_hidden_layers: int = 40
    num_attention_heads: int = 64
    head_dim: int = 512
    qk_rope_head_dim: int = 64
    q_lora_rank: int = 1280
    o_groups: int = 8
    o_lora_rank: int = 1024
    sliding_window: int = 128
    # One entry per backbone layer plus one per draft stage (V4.1 DSpark) or MTP slot (V4).
    compress_ratios: tuple[int, ...] = (0, 0) + (2,) * 18 + (1,) * 20 + (0, 0, 0)
    kv_source_layer_ids: tuple[int, ...] = (2, 8, 14, 20)
    index_source_layer_ids: tuple[int, ...] = (2, 8, 14, 20, 24, 28, 32, 36)
    candidate_source_layer_id: int | None = 20
    candidate_topk_blocks: int = 2048
    candidate_block_size: int = 8
    index_n_heads: int = 32
    index_head_dim: int = 128
    index_topk: int = 512
    rope_theta: float = 10000.0
    compress_rope_theta: float = 160000.0
    yarn_factor: float = 16.0
    yarn_original_max_position: int = 65536
    yarn_beta_fast: float = 32.0
    yarn_beta_slow: float = 1.0
    max_position_embeddings: int = 1048576
    rms_norm_eps: float = 1e-20
    hc_mult: int = 4
    hc_sinkhorn_iters: int = 20
    hc_eps: float = 1e-6
    n_routed_experts: int = 384
    num_experts_per_tok: int = 6
    n_shared_experts: int = 1
    moe_intermediate_size: int = 2304
    routed_scaling_factor: float = 1.5
    gate_temp: float = 1.0
    swiglu_limit: float = 10.0
    num_hash_layers: int = 0
    # Engram (V4.1 only)
    engram_layer_ids: tuple[int, ...] = (1, 14)
    engram_max_ngram_size: int = 4
    engram_n_heads: int = 8
    engram_head_dim: int = 256
    engram_vocab_size: int = 16_000_000  # the prime search starts just above this
    engram_compressed_vocab_size: int = 99092
    engram_pad_token_id: int = 2
    # DSpark (V4.1) / MTP (V4)
    num_nextn_predict_layers: int = 3
    dspark_block_size: int = 5
    dspark_markov_rank: int = 256
    dspark_n_routed_experts: int = 128
    dspark_num_experts_per_tok: int = 3
    dspark_target_layer_ids: tuple[int, ...] = (37, 38, 39)
    dspark_noise_token_id: int = 128799
    # Quantisation: block of the dense FP8 weights (32 in V4.1, 128 in V4); experts MXFP4.
    weight_block_size: int = 32
    expert_dtype: str = "fp4"
    # False: a checkpoint with no quantization_config (a BF16 conversion or a fine-tune): every weight plain.
    quantized: bool = True
    # Quantisation-aware numerics of spec 2.12 (fake-quant of SWA KV, main KV, index q/k).
    qat: bool = True
    bos_token_id: int = 0
    eos_token_id: int = 1
    pad_token_id: int = 2
    image_token_id: int = 129264
    name: str = "custom"

    def __post_init__(self):
        self._validate()

    # ---------------------------------------------------------------- derived geometry
    @property
    def is_v41(self) -> bool:
        return self.family == V41

    @property
    def nope_head_dim(self) -> int:
        return self.head_dim - self.qk_rope_head_dim

    @property
    def num_draft_layers(self) -> int:
        return len(self.compress_ratios) - self.num_hidden_layers

    @property
    def encoder_layers(self) -> int:
        """Layers [0, encoder_layers) encode (V4.1 CED); V4 has no encoder."""
        return self.num_hidden_layers // 2 if self.is_v41 else 0

    @property
    def engram_orders(self) -> tuple[int, ...]:
        return tuple(range(2, self.engram_max_ngram_size + 1))

    @property
    def engram_columns(self) -> int:
        return len(self.engram_orders) * self.engram_n_heads

    @cached_property
    def roles(self) -> tuple[LayerRole, ...]:
        return tuple(self._role(i) for i in range(self.num_hidden_layers))

    def _role(self, i: int) -> LayerRole:
        r = self.compress_ratios[i]
        common = dict(
            index=i,
            ratio=r,
            engram=i in self.engram_layer_ids,
            dspark_tap=self.is_v41 and i in self.dspark_target_layer_ids,
            hash_routed=i < self.num_hash_layers,
            yarn=r != 0,
        )
        if self.is_v41:
            side = "encoder" if i < self.encoder_layers else "decoder"
            if r == 0:
                return LayerRole(
                    side=side,
                    mode="swa",
                    kv_source=None,
                    index_source=None,
                    owns_compressor=False,
                    owns_indexer=False,
                    candidate=None,
                    **common,
                )
            kv = max(s for s in self.kv_source_layer_ids if s <= i)
            ix = max(s for s in self.index_source_layer_ids if s <= i)
            full, reindex = i in self.kv_source_layer_ids, i in self.index_source_layer_ids
            mode = "full" if full else ("reindex" if reindex else "reuse")
            cand = None
            if self.candidate_source_layer_id is not None and reindex:
                if i == self.candidate_source_layer_id:
                    cand = "source"
                elif i > self.candidate_source_layer_id:
                    cand = "consumer"
            return LayerRole(
                side=side,
                mode=mode,
                kv_source=kv,
                index_source=ix,
                owns_compressor=full,
                owns_indexer=reindex,
                candidate=cand,
                **common,
            )
        # V4: every compressed layer owns its cache; CSA (ratio 4) has an indexer, HCA attends densely.
        if r == 0:
            return LayerRole(
                side="decoder",
                mode="swa",
                kv_source=None,
                index_source=None,
                owns_compressor=False,
                owns_indexer=False,
                candidate=None,
                **common,
            )
        csa = r == 4
        return LayerRole(
            side="decoder",
            mode="full",
            kv_source=i,
            index_source=i if csa else None,
            owns_compressor=True,
            owns_indexer=csa,
            candidate=None,
            **common,
        )

    # ---------------------------------------------------------------- validation
    def _validate(self):
        def bad(msg):
            raise ConfigError(f"config {self.name!r}: {msg}")

        if self.family not in (V41, V4):
            bad(f"family must be {V41!r} or {V4!r}, got {self.family!r}")
        if len(self.compress_ratios) < self.num_hidden_layers:
            bad(
                f"compress_ratios has {len(self.compress_ratios)} entries, need at least "
                f"num_hidden_layers={self.num_hidden_layers}"
            )
        if self.head_dim <= self.qk_rope_head_dim or self.qk_rope_head_dim % 2:
            bad(f"qk_rope_head_dim={self.qk_rope_head_dim} must be even and < head_dim={self.head_dim}")
        if self.num_attention_heads % self.o_groups:
            bad(f"num_attention_heads={self.num_attention_heads} not divisible by o_groups={self.o_groups}")
        if self.num_experts_per_tok > self.n_routed_experts:
            bad(f"num_experts_per_tok={self.num_experts_per_tok} > n_routed_experts={self.n_routed_experts}")
        allowed = {0, 1, 2} if self.is_v41 else {0, 4, 128}
        wrong = sorted({r for r in self.compress_ratios[: self.num_hidden_layers]} - allowed)
        if wrong:
            bad(f"compress_ratios has {wrong}; {self.family} allows {sorted(allowed)}")
        if self.is_v41:
            for s in set(self.kv_source_layer_ids) | set(self.index_source_layer_ids):
                if not 0 <= s < self.num_hidden_layers or self.compress_ratios[s] == 0:
                    bad(f"source layer {s} must be a backbone layer with a nonzero compress ratio")
            if not set(self.kv_source_layer_ids) <= set(self.index_source_layer_ids):
                bad("every kv source layer must also be an index source layer")
            for i in range(self.num_hidden_layers):
                r = self.compress_ratios[i]
                if r and not any(s <= i for s in self.kv_source_layer_ids):
                    bad(f"layer {i} has ratio {r} but no kv source at or before it")
                if r and i > 0 and self.compress_ratios[i - 1] == 0 and i not in self.kv_source_layer_ids:
                    bad(f"layer {i} starts a compressed band but is not a kv source")
            if self.candidate_source_layer_id is not None:
                c = self.candidate_source_layer_id
                if c not in self.index_source_layer_ids:
                    bad(f"candidate_source_layer_id={c} is not an index source")
                pool = self.candidate_topk_blocks * self.candidate_block_size
                if pool - (self.candidate_block_size - 1) < self.index_topk:
                    bad(f"candidate pool {pool} too small for index_topk={self.index_topk}")
        for e in self.engram_layer_ids:
            if not 0 <= e < self.num_hidden_layers:
                bad(f"engram layer {e} outside [0, {self.num_hidden_layers})")

    # ---------------------------------------------------------------- HF config.json
    @classmethod
    def from_hf_dict(cls, raw: dict, name: str = "checkpoint") -> "ModelConfig":
        """Read the release's keys. Unknown keys are ignored (the release ships many runtime ones)."""
        top = raw
        text = raw.get("text_config", raw)
        arch = (top.get("architectures") or [""])[0]
        model_type = text.get("model_type", top.get("model_type", ""))
        family = V41 if ("V41" in arch or "v41" in model_type) else V4
        q = top.get("quantization_config") or text.get("quantization_config") or {}
        rs = text.get("rope_scaling") or text.get("rope_parameters") or {}
        if "compress" in rs:  # transformers' V4 nesting {"main": ..., "compress": ...}
            rs = rs["compress"]
        kw: dict = {"family": family, "name": name}
        names = {f.name for f in fields(cls)}
        for k, v in text.items():
            if k in names and k not in ("family", "name"):
                kw[k] = tuple(v) if isinstance(v, list) else v
        if "n_hash_layers" in text:
            kw["num_hash_layers"] = text["n_hash_layers"]
        if family == V4 and "num_hash_layers" not in kw and "n_hash_layers" not in text:
            kw["num_hash_layers"] = 3
        if rs:
            kw.update(
                yarn_factor=float(rs.get("factor", 16.0)),
                yarn_original_max_position=int(rs.get("original_max_position_embeddings", 65536)),
                yarn_beta_fast=float(rs.get("beta_fast", 32.0)),
                yarn_beta_slow=float(rs.get("beta_slow", 1.0)),
            )
        if "engram_pad_token_id" not in text and family == V41:
            kw.setdefault("engram_pad_token_id", 2)
        if family == V4:
            kw.setdefault("engram_layer_ids", ())
            kw.setdefault("kv_source_layer_ids", ())
            kw.setdefault("index_source_layer_ids", ())
            kw.setdefault("candidate_source_layer_id", None)
            kw.setdefault("dspark_target_layer_ids", ())
            kw.setdefault("weight_block_size", 128)
        kw["quantized"] = bool(q)
        if q.get("weight_block_size"):
            kw["weight_block_size"] = int(q["weight_block_size"][0])
        if q.get("expert_dtype"):
            kw["expert_dtype"] = q["expert_dtype"]
        if isinstance(kw.get("eos_token_id"), tuple):
            kw["eos_token_id"] = kw["eos_token_id"][0]
        cfg = cls(**kw)
        declared = text.get("engram_num_embeddings")
        if declared:  # the release states its table sizes; a different prime rule would rehash every row
            from ..layers.engram_hash import engram_rows_per_layer

            derived = list(engram_rows_per_layer(cfg).values())
            if list(declared) != derived:
                raise ConfigError(
                    f"config {name!r}: engram_num_embeddings {list(declared)} disagrees with the "
                    f"rows derived from engram_vocab_size={cfg.engram_vocab_size}: {derived}"
                )
        return cfg

    @classmethod
    def from_json(cls, path: str) -> "ModelConfig":
        if os.path.isdir(path):
            path = os.path.join(path, "config.json")
        try:
            with open(path) as f:
                raw = json.load(f)
        except FileNotFoundError:
            raise ConfigError(f"no config.json at {path}") from None
        except json.JSONDecodeError as e:
            raise ConfigError(f"{path} is not valid JSON: {e}") from None
        return cls.from_hf_dict(raw, name=os.path.basename(os.path.dirname(os.path.abspath(path))))

    def to_hf_dict(self) -> dict:
        """The release's config.json shape: V4.1 nests text_config; V4 is flat."""
        text = {}
        for f in fields(self):
            if f.name in (
                "family",
                "name",
                "yarn_factor",
                "yarn_original_max_position",
                "yarn_beta_fast",
                "yarn_beta_slow",
                "weight_block_size",
                "expert_dtype",
                "qat",
                "quantized",
            ):
                continue
            v = getattr(self, f.name)
            text[f.name] = list(v) if isinstance(v, tuple) else v
        text["num_key_value_heads"] = 1
        if self.engram_layer_ids:
            from ..layers.engram_hash import engram_rows_per_layer

            text["engram_num_embeddings"] = list(engram_rows_per_layer(self).values())
        text["rope_scaling"] = {
            "type": "yarn",
            "factor": self.yarn_factor,
            "original_max_position_embeddings": self.yarn_original_max_position,
            "beta_fast": self.yarn_beta_fast,
            "beta_slow": self.yarn_beta_slow,
        }
        quant = {
            "quant_method": "fp8",
            "fmt": "e4m3",
            "scale_fmt": "ue8m0",
            "weight_block_size": [self.weight_block_size] * 2,
            "expert_dtype": self.expert_dtype,
        }
        q = {"quantization_config": quant} if self.quantized else {}
        if self.is_v41:
            text["model_type"] = "deepseek_v41_text"
            return {"architectures": ["DeepseekV41ForCausalLM"], "model_type": V41, "text_config": text, **q}
        text["n_hash_layers"] = text.pop("num_hash_layers")
        return {"architectures": ["DeepseekV4ForCausalLM"], "model_type": V4, **text, **q}

    def with_options(self, **kw) -> "ModelConfig":
        return replace(self, **kw)
