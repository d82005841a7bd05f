"""Engine options: one frozen dataclass, named like vLLM's CLI flags, shared by ``LLM(...)`` and the CLI."""
from __future__ import annotations

import argparse
from dataclasses import MISSING, dataclass, fields


class EngineArgsError(ValueError):
    """An engine option that does not exist or has a value it cannot take."""


@dataclass(frozen=True)
class EngineArgs:
    model: str = "tiny"
    load_format: str = "auto"  # auto | safetensors | dummy
    dtype: str = "float32"  # float32 | bfloat16 | float64
    seed: int = 0  # seed of dummy weights
    qat: bool | None = None  # quantisation-aware numerics (None: the model's default, on)
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 64
    max_model_len: int | None = None  # default: the model's max_position_embeddings
    kv_cache_memory: int | None = None  # bytes for the KV cache
    kv_cache_memory_fraction: float | None = None  # or this fraction of the memory free now (default: 256 MiB)
    block_size: int | None = None  # tokens per global KV block (default: 64, or a multiple of V4's 128)
    kv_cache_dtype: str = "auto"  # auto (packed FP4/FP8 records of the release) | bf16
    scheduling_policy: str = "fcfs"  # fcfs | priority
    enable_chunked_prefill: bool = True
    long_prefill_token_threshold: int = 0
    swa_bounded_replay: bool = True  # V4.1 decoder replay; off = exact mode
    replay_window: int | None = None  # default: the model's sliding window
    replay_form: str = "report"  # report: narrow at layer 20 (TRT-LLM); vllm: layer 20 on all rows, 21+ narrowed
    enable_prefix_caching: bool = True
    session_retention: float = 0.0  # seconds a finished session request's blocks stay ahead of LRU (0 = off)

    def __post_init__(self):
        if self.replay_form not in ("report", "vllm"):
            raise EngineArgsError(f"replay_form must be 'report' or 'vllm', got {self.replay_form!r}")
        if self.replay_window is not None and self.replay_window < 1:
            raise EngineArgsError(f"replay_window must be >= 1, got {self.replay_window}")
        if self.session_retention < 0:
            raise EngineArgsError(f"session_retention must be >= 0 seconds, got {self.session_retention}")
        for name in ("max_num_batched_tokens", "max_num_seqs"):
            if getattr(self, name) < 1:
                raise EngineArgsError(f"{name} must be >= 1, got {getattr(self, name)}")
        f = self.kv_cache_memory_fraction
        if f is not None and not 0 < f <= 1:
            raise EngineArgsError(f"kv_cache_memory_fraction must be in (0, 1], got {f}")
        if self.kv_cache_memory is not None and self.kv_cache_memory <= 0:
            raise EngineArgsError(f"kv_cache_memory must be a positive number of bytes, got {self.kv_cache_memory}")

    @classmethod
    def from_kwargs(cls, **kw) -> "EngineArgs":
        names = {f.name for f in fields(cls)}
        unknown = sorted(set(kw) - names)
        if unknown:
            raise EngineArgsError(f"unknown engine option(s) {unknown}; options are {sorted(names)}")
        return cls(**kw)

    @classmethod
    def add_cli_args(cls, p: argparse.ArgumentParser) -> None:
        for f in fields(cls):
            flag = "--" + f.name.replace("_", "-")
            default = f.default if f.default is not MISSING else None
            if f.type in ("bool", "bool | None"):
                p.add_argument(flag, action=argparse.BooleanOptionalAction, default=default)
            else:
                kind = int if f.type.startswith("int") else float if f.type.startswith("float") else str
                p.add_argument(flag, type=kind, default=default)

    @classmethod
    def from_cli(cls, ns: argparse.Namespace) -> "EngineArgs":
        return cls(**{f.name: getattr(ns, f.name) for f in fields(cls)})
