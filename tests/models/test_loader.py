"""Checkpoint directories through the real loader: preset -> save -> load_model -> same forward."""

import os

import pytest
import torch

from dsserve.engine.greedy import greedy_generate
from dsserve.models.checkpoint import CheckpointError, save_checkpoint
from dsserve.models.config import ConfigError
from dsserve.models.loader import load_model
from dsserve.models.presets import DEFAULT_MODEL, model_dir
from dsserve.models.tokenizer import TINY_DIR


@pytest.fixture(scope="module")
def saved_tiny(tmp_path_factory):
    src = load_model("tiny", seed=5)
    out = tmp_path_factory.mktemp("tiny-ckpt")
    save_checkpoint(src.model, src.cfg, str(out), tokenizer_dir=TINY_DIR, max_shard_bytes=8 << 20)
    return src, str(out)


def test_saved_checkpoint_reloads_to_the_same_quantised_weights(saved_tiny, tmp_path):
    src, path = saved_tiny
    a = load_model(path)
    assert a.load_format == "safetensors" and a.tokenizer.vocab_size == 8192
    save_checkpoint(a.model, a.cfg, str(tmp_path), tokenizer_dir=path)  # FP8/MXFP4 values re-quantise exactly
    b = load_model(str(tmp_path))
    for (name, x), (_, y) in zip(a.model.state_dict().items(), b.model.state_dict().items()):
        assert torch.equal(x, y), name
    toks = torch.arange(40) * 7 % 8192
    with torch.no_grad():
        assert torch.equal(a.model.reference_logits(toks), b.model.reference_logits(toks))
    # Against the float source only the release formats' rounding differs: FP8 blocks, MXFP4 experts, BF16.
    sa, ss = a.model.state_dict(), src.model.state_dict()
    for name, bound in (
        ("layers.3.attn.wq_b.weight", 0.07),
        ("layers.3.ffn.experts.w1", 0.2),
        ("embed.weight", 0.01),
        ("layers.3.hc_attn_fn", 0.0),
    ):
        rel = ((sa[name] - ss[name]).norm() / ss[name].norm()).item()
        assert rel <= bound, (name, rel)


def test_greedy_generate_from_a_checkpoint(saved_tiny):
    lm = load_model(saved_tiny[1])
    prompt = lm.tokenizer.encode("Hello, world", add_bos=True)
    out = greedy_generate(lm.model, prompt, 8)
    assert len(out) == 8 and all(0 <= t < 8192 for t in out)
    assert out == greedy_generate(lm.model, prompt, 8)


def test_the_built_in_checkpoint_loads_by_name_and_is_the_default():
    assert DEFAULT_MODEL == "tiny-trained" and os.path.isdir(model_dir(DEFAULT_MODEL))
    by_name, by_dir = load_model("tiny-trained"), load_model(model_dir("tiny-trained"))
    assert by_name.load_format == "safetensors" and by_name.cfg == by_dir.cfg
    for (name, x), (_, y) in zip(by_name.model.state_dict().items(), by_dir.model.state_dict().items()):
        assert torch.equal(x, y), name
    # trained, not the seeded random weights of the tiny preset of the same shape
    untrained = load_model("tiny")
    assert not torch.equal(by_name.model.state_dict()["embed.weight"], untrained.model.state_dict()["embed.weight"])
    assert by_name.tokenizer.encode("Hello", add_bos=True) == untrained.tokenizer.encode("Hello", add_bos=True)


def test_load_errors():
    with pytest.raises(ConfigError, match=r"unknown model.*built-in checkpoint \(tiny-trained\)"):
        load_model("no-such-model")
    with pytest.raises(ConfigError, match="no weights"):
        load_model("tiny", load_format="safetensors")
    with pytest.raises(ConfigError, match="load format"):
        load_model("tiny", load_format="pt")


def test_bfloat16_model_runs(saved_tiny):
    lm = load_model(saved_tiny[1], dtype="bfloat16")
    with torch.no_grad():
        logits = lm.model.reference_logits(torch.arange(1, 50))
    assert logits.isfinite().all()


def test_checkpoint_for_another_config_is_a_named_error(saved_tiny, tmp_path):
    import json
    import shutil

    path = tmp_path / "ckpt"
    shutil.copytree(saved_tiny[1], path)
    cfg = json.loads((path / "config.json").read_text())
    cfg["text_config"]["q_lora_rank"] = 64
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=r"layers\.\d+\.attn\.wq_a\.weight.*expected \[64, 256\]"):
        load_model(str(path))


def test_an_unquantised_bf16_checkpoint_loads_and_generates_as_its_release_format(saved_tiny, tmp_path):
    """Issue 52.5: the release names with plain BF16 weights and no quantization_config (a BF16 conversion)."""
    import json

    from safetensors import safe_open

    release = load_model(saved_tiny[1])  # FP8/MXFP4/Engram-FP8, dequantised; QAT on
    save_checkpoint(release.model, release.cfg, str(tmp_path), tokenizer_dir=saved_tiny[1], quantize=False)
    assert "quantization_config" not in json.loads((tmp_path / "config.json").read_text())
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        dtypes = {f.get_slice(k).get_dtype() for k in f.keys()}
        assert not any(k.endswith(".scale") for k in f.keys())
    assert dtypes == {"BF16", "F32", "I32"} or dtypes == {"BF16", "F32"}
    plain = load_model(str(tmp_path))
    assert not plain.cfg.quantized and plain.cfg.qat
    # every release value is exact in BF16 (e4m3/e2m1 times a power of two), so the weights are the same bits
    for (name, x), (_, y) in zip(release.model.state_dict().items(), plain.model.state_dict().items()):
        assert torch.equal(x, y), name
    prompt = release.tokenizer.encode("Hello, world", add_bos=True)
    assert greedy_generate(plain.model, prompt, 6) == greedy_generate(release.model, prompt, 6)
    # --expert-format quantises on load where the user asks
    packed = load_model(str(tmp_path), expert_format="mxfp4")
    ref = load_model(saved_tiny[1], expert_format="mxfp4")
    p, q = packed.model.layers[0].ffn.packed, ref.model.layers[0].ffn.packed
    # the same values (bytes may differ: a block whose top value is half the grid's max re-packs one scale lower)
    for e in range(p.shape[0]):
        assert all(torch.equal(x, y) for x, y in zip(p.dequant(e), q.dequant(e)))


def test_a_fp32_fine_tune_loads_without_quantization_config(saved_tiny, tmp_path):
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    release = load_model(saved_tiny[1])
    save_checkpoint(release.model, release.cfg, str(tmp_path / "bf16"), tokenizer_dir=saved_tiny[1], quantize=False)
    tensors = {
        k: (v.float() if v.dtype == torch.bfloat16 else v)
        for k, v in load_file(str(tmp_path / "bf16" / "model.safetensors")).items()
    }
    os.makedirs(tmp_path / "f32")
    save_file(tensors, str(tmp_path / "f32" / "model.safetensors"))
    for fn in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(tmp_path / "bf16" / fn, tmp_path / "f32" / fn)
    assert "quantization_config" not in json.loads((tmp_path / "f32" / "config.json").read_text())
    f32 = load_model(str(tmp_path / "f32"))
    assert torch.equal(
        f32.model.state_dict()["layers.1.attn.wq_b.weight"], release.model.state_dict()["layers.1.attn.wq_b.weight"]
    )
