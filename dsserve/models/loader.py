"""Build a ready model from a preset name, a built-in checkpoint or a checkpoint directory: config, weights,
tokenizer, Engram map."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from ..distributed.layout import ParallelLayout
from .checkpoint import dummy_weights
from .config import ConfigError, ModelConfig
from .dummy_build import build_dummy_model
from .model import DeepseekForCausalLM
from .presets import CHECKPOINTS, PRESETS, model_dir, preset
from .quantize import EXPERT_FORMATS
from .release_loader import LoadReport, load_release
from .tokenizer import Tokenizer, engram_token_map

LOAD_FORMATS = ("auto", "safetensors", "dummy")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "float64": torch.float64}


@dataclass
class LoadedModel:
    model: DeepseekForCausalLM
    cfg: ModelConfig
    tokenizer: Tokenizer
    load_format: str
    report: LoadReport | None = None  # what a checkpoint load read and where each kind of tensor went


def resolve_config(model: str) -> ModelConfig:
    model = model_dir(model)
    if model in PRESETS:
        return preset(model)
    if os.path.isdir(model):
        return ModelConfig.from_json(model)
    raise ConfigError(
        f"unknown model {model!r}: not a preset ({', '.join(sorted(PRESETS))}), not a built-in "
        f"checkpoint ({', '.join(sorted(CHECKPOINTS))}) and not a checkpoint directory"
    )


def load_model(
    model: str,
    load_format: str = "auto",
    dtype: str = "float32",
    seed: int = 0,
    qat: bool | None = None,
    expert_format: str | None = None,
    device: str | torch.device | None = None,
    quantization: str | None = None,
    engram_tables: str = "device",
    layout: ParallelLayout = ParallelLayout(),
    tp_group=None,
    ep_group=None,
    tokenizer: str | None = None,
    engram_store=None,
) -> LoadedModel:
    """``auto`` reads safetensors from a checkpoint directory; a preset has no weights, so it gets ``dummy``
    (seeded random weights), as vLLM's ``--load-format dummy``.

    ``expert_format`` (fp8 | mxfp4): the routed experts packed in it (models.quantize.quantize_experts); None:
    as loaded. ``device``: where the model will run (default cpu). Dummy weights with an expert format are
    built on that device, each layer's experts packed as they are filled (models.dummy_build), so the 36 GB
    MXFP4 release proxy loads on one H200 without its 270 GB of dense experts; everything else is loaded on the
    host as before and moved by the caller. The dense experts are kept (rounded to the packed values) only
    when the device is the CPU: there the reference backend and the tests' oracle read them on tiny models;
    on a GPU the grouped-MoE ops read the packed experts alone (and the reference path dequantises them).

    A checkpoint streams through ``release_loader.load_release`` straight onto ``device`` in its runtime form:
    ``quantization="fp8"`` keeps the stored FP8 dense weights as Fp8Linear, ``expert_format`` the stored MXFP4
    experts packed, ``engram_tables`` (device | host | host-fp8) places the Engram tables; ``layout`` is this
    rank's share, built as the parallel passes cut it, closing over ``tp_group`` / ``ep_group``
    (``load_release``). ``tokenizer``: a tokenizer directory or model name used instead of the checkpoint's own
    (which then need not exist: vLLM's ``--tokenizer``). ``engram_store``: the node's shared host tables
    (``layers.engram_store``; a checkpoint's, read once per node)."""
    if load_format not in LOAD_FORMATS:
        raise ConfigError(f"load format {load_format!r} is not one of {LOAD_FORMATS}")
    if dtype not in DTYPES:
        raise ConfigError(f"dtype {dtype!r} is not one of {tuple(DTYPES)}")
    model = model_dir(model)
    cfg = resolve_config(model)
    if qat is not None:
        cfg = cfg.with_options(qat=qat)
    is_dir = os.path.isdir(model)
    if load_format == "auto":
        load_format = "safetensors" if is_dir else "dummy"
    if load_format == "safetensors" and not is_dir:
        raise ConfigError(f"{model!r} is a preset with no weights; use --load-format dummy or a checkpoint directory")
    if expert_format is not None and expert_format not in EXPERT_FORMATS:
        raise ConfigError(f"expert format {expert_format!r} is not one of {EXPERT_FORMATS} (or None)")
    if tokenizer is not None:
        tokenizer = Tokenizer.load(tokenizer)
    else:
        tokenizer = Tokenizer.from_dir(model) if is_dir else Tokenizer.for_preset(model)
    device = torch.device(device or "cpu")
    keep_dense = device.type == "cpu"
    report = None
    if load_format == "safetensors":
        net, report = load_release(
            cfg,
            model,
            layout=layout,
            device=device,
            dtype=DTYPES[dtype],
            quantization=quantization,
            expert_format=expert_format,
            engram_tables=engram_tables,
            keep_dense=keep_dense,
            tp_group=tp_group,
            ep_group=ep_group,
            engram_store=engram_store,
        )
    elif expert_format is not None:
        net = build_dummy_model(cfg, seed, expert_format, device, keep_dense)
    else:
        net = DeepseekForCausalLM(cfg).eval()
        dummy_weights(net, cfg, seed)
    net = net.to(DTYPES[dtype])
    if device.type == "cuda":  # the float32 build's blocks back to the driver: the KV budget reads free memory
        torch.cuda.empty_cache()
    token_map = engram_token_map(cfg, tokenizer)
    if token_map is not None:
        net.engram_token_map = torch.as_tensor(token_map, dtype=torch.long)
    return LoadedModel(net, cfg, tokenizer, load_format, report)
