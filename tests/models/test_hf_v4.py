"""V4-Flash mode against transformers' DeepseekV4ForCausalLM, both fed the weights of one saved checkpoint.

Differences by design (docs/v4_transformers_notes.md): transformers has no quantisation-aware numerics, so
QAT is off; its YaRN helper multiplies cos/sin by 1.277, which the bridge neutralises (attention_factor 1)
to match the release; its top-k is not stable, so the config uses 16 index heads, where ReLU scores have no
exact ties at the top-k boundary.
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

pytest.importorskip("transformers")
sys.path.insert(0, os.path.dirname(__file__))

from hf_v4_bridge import load_hf_model  # noqa: E402

from dsserve.models.checkpoint import dummy_weights, model_name_for, release_layout, save_checkpoint  # noqa: E402
from dsserve.models.loader import load_model  # noqa: E402
from dsserve.models.model import DeepseekForCausalLM  # noqa: E402
from dsserve.models.presets import preset  # noqa: E402
from dsserve.models.tokenizer import TINY_DIR  # noqa: E402


def release_tensors_of(model, cfg):
    """The loaded model's weights under release names (dequantised), one entry per release tensor."""
    sd = model.state_dict()
    out = {}
    for name, spec in release_layout(cfg).items():
        if spec.quant == "scale":
            continue
        mname, e = model_name_for(name)
        out[name] = (sd[mname] if e is None else sd[mname][e]).clone()
    return out


@pytest.fixture(scope="module")
def both(tmp_path_factory):
    cfg = preset("tiny-v4").with_options(index_n_heads=16, qat=False)
    src = DeepseekForCausalLM(cfg)
    dummy_weights(src, cfg, seed=3)
    ckpt = tmp_path_factory.mktemp("tiny-v4-ckpt")
    save_checkpoint(src, cfg, str(ckpt), tokenizer_dir=TINY_DIR)
    ours = load_model(str(ckpt), qat=False)  # through the real loader: FP8 blocks and MXFP4 experts
    hf = load_hf_model(ours.cfg, release_tensors_of(ours.model, ours.cfg))
    return ours, hf


@torch.no_grad()
def test_v4_logits_match_transformers(both):
    ours, hf = both
    toks = torch.randint(0, ours.cfg.vocab_size, (300,), generator=torch.Generator().manual_seed(7))
    mine = ours.model.reference_logits(toks)
    theirs = hf(input_ids=toks[None]).logits[0].float()
    rel = (mine - theirs).norm() / theirs.norm()
    assert rel < 1e-5, rel
    assert (mine.argmax(-1) == theirs.argmax(-1)).float().mean() > 0.999
