"""Build a ready model from a preset name or a checkpoint directory: config, weights, tokenizer, Engram map."""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from .checkpoint import dummy_weights, load_checkpoint
from .config import ConfigError, ModelConfig
from .model import DeepseekForCausalLM
from .presets import PRESETS, preset
from .tokenizer import Tokenizer, engram_token_map

LOAD_FORMATS = ("auto", "safetensors", "dummy")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float64": torch.float64}


@dataclass
class LoadedModel:
    model: DeepseekForCausalLM
    cfg: ModelConfig
    tokenizer: Tokenizer
    load_format: str


def resolve_config(model: str) -> ModelConfig:
    if model in PRESETS:
        return preset(model)
    if os.path.isdir(model):
        return ModelConfig.from_json(model)
    raise ConfigError(f"unknown model {model!r}: not a preset ({', '.join(sorted(PRESETS))}) "
                      f"and not a checkpoint directory")


def load_model(model: str, load_format: str = "auto", dtype: str = "float32", seed: int = 0,
               qat: bool | None = None) -> LoadedModel:
    """``auto`` reads safetensors from a checkpoint directory; a preset has no weights, so it gets ``dummy``
    (seeded random weights), as vLLM's ``--load-format dummy``."""
    if load_format not in LOAD_FORMATS:
        raise ConfigError(f"load format {load_format!r} is not one of {LOAD_FORMATS}")
    if dtype not in DTYPES:
        raise ConfigError(f"dtype {dtype!r} is not one of {tuple(DTYPES)}")
    cfg = resolve_config(model)
    if qat is not None:
        cfg = cfg.with_options(qat=qat)
    is_dir = os.path.isdir(model)
    if load_format == "auto":
        load_format = "safetensors" if is_dir else "dummy"
    if load_format == "safetensors" and not is_dir:
        raise ConfigError(f"{model!r} is a preset with no weights; use --load-format dummy or a checkpoint directory")
    tokenizer = Tokenizer.from_dir(model) if is_dir else Tokenizer.for_preset(model)
    net = DeepseekForCausalLM(cfg).eval()
    if load_format == "dummy":
        dummy_weights(net, cfg, seed)
    else:
        load_checkpoint(net, cfg, model)
    net = net.to(DTYPES[dtype])
    token_map = engram_token_map(cfg, tokenizer)
    if token_map is not None:
        net.engram_token_map = torch.as_tensor(token_map, dtype=torch.long)
    return LoadedModel(net, cfg, tokenizer, load_format)
