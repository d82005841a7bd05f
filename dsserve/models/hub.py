"""A Hugging Face model id (``deepseek-ai/DeepSeek-V4.1-Flash``) as a local checkpoint directory, as vLLM's
``--model`` takes it: the snapshot in the local Hugging Face cache, downloaded first where a network allows."""

from __future__ import annotations

import os

from .config import ConfigError
from .presets import CHECKPOINTS, PRESETS

# what a checkpoint directory needs: config, weights and their index, tokenizer, generation defaults
CHECKPOINT_FILES = ["*.json", "*.safetensors", "*.model", "*.txt"]
TOKENIZER_FILES = ["tokenizer.json", "tokenizer_config.json", "config.json"]


def is_repo_id(name: str) -> bool:
    """``owner/name``, and nothing on this machine by that path."""
    parts = name.split("/")
    return len(parts) == 2 and all(parts) and not name.startswith((".", "~")) and not os.path.exists(name)


def resolve_model(name: str, files: list[str] = CHECKPOINT_FILES) -> str:
    """A preset, a built-in checkpoint or an existing path as given; a Hugging Face id as its snapshot directory
    (the cache's copy; with ``HF_HUB_OFFLINE=1`` only that; else ``files`` of it are downloaded: a tokenizer needs
    ``TOKENIZER_FILES``, not the weights). Anything else as given: the loader names it."""
    if name in PRESETS or name in CHECKPOINTS or not is_repo_id(name):
        return name
    try:
        from huggingface_hub import snapshot_download
        from huggingface_hub.errors import LocalEntryNotFoundError
    except ImportError:
        raise ConfigError(
            f"{name!r} looks like a Hugging Face model id; resolving it needs `pip install huggingface_hub` "
            "(or pass the checkpoint directory)"
        ) from None
    # huggingface_hub reads HF_HUB_CACHE once, when first imported; read it at each call, as a launch would
    cache_dir = os.environ.get("HF_HUB_CACHE") or None
    try:
        return snapshot_download(name, local_files_only=True, cache_dir=cache_dir)
    except LocalEntryNotFoundError:
        pass
    offline = os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on")
    if offline:
        raise ConfigError(f"{name!r} is not in the local Hugging Face cache and HF_HUB_OFFLINE is set")
    try:
        return snapshot_download(name, allow_patterns=files, cache_dir=cache_dir)
    except Exception as e:  # network, auth, missing repo: one clear line, not a traceback
        raise ConfigError(
            f"{name!r} is not a preset, a built-in checkpoint, a directory or a Hugging Face model in the local "
            f"cache, and downloading it failed: {type(e).__name__}: {e}"
        ) from None
