"""A local Hugging Face cache with one model in it, for tests that name a model by its Hugging Face id."""

import json
import os

from dsserve.models.presets import CHECKPOINTS


def fake_hf_cache(root, repo="deepseek-ai/tiny-trained", extra: dict | None = None) -> str:
    """A Hugging Face cache holding one snapshot of the built-in checkpoint (files linked, not copied)."""
    folder = os.path.join(root, "models--" + repo.replace("/", "--"))
    commit = "0" * 40
    snap = os.path.join(folder, "snapshots", commit)
    os.makedirs(snap)
    os.makedirs(os.path.join(folder, "refs"))
    with open(os.path.join(folder, "refs", "main"), "w") as f:
        f.write(commit)
    src = CHECKPOINTS["tiny-trained"]
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        os.symlink(os.path.join(src, name), os.path.join(snap, name))
    for name, obj in (extra or {}).items():
        with open(os.path.join(snap, name), "w") as f:
            json.dump(obj, f)
    return snap
