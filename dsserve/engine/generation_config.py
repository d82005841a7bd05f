"""Default sampling parameters from a checkpoint's ``generation_config.json``, as vLLM's ``--generation-config``.

``auto`` reads the model directory's file, ``vllm`` reads none (``SamplingParams``' own defaults), anything else is
a directory holding the file (or the file itself). Only the fields vLLM takes are read: temperature, top_p, top_k,
min_p, repetition_penalty, and max_new_tokens as max_tokens; a request's own value always wins.
"""

from __future__ import annotations

import json
import os

from ..models.config import ConfigError

FILE = "generation_config.json"
FIELDS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
    "max_new_tokens": "max_tokens",
}


def default_sampling(source: str, model_dir: str | None) -> dict:
    """SamplingParams keyword arguments: what the generation config sets, nothing else."""
    if source == "vllm":
        return {}
    if source == "auto":
        if model_dir is None or not os.path.isfile(os.path.join(model_dir, FILE)):
            return {}
        path = os.path.join(model_dir, FILE)
    else:
        path = os.path.join(source, FILE) if os.path.isdir(source) else source
        if not os.path.isfile(path):
            raise ConfigError(f"generation_config {source!r}: no {FILE} there (auto, vllm, or a directory holding one)")
    try:
        with open(path, encoding="utf-8") as f:
            cfg = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise ConfigError(f"generation config {path}: {e}") from None
    if not isinstance(cfg, dict):
        raise ConfigError(f"generation config {path}: not a JSON object")
    return {ours: cfg[theirs] for theirs, ours in FIELDS.items() if cfg.get(theirs) is not None}
