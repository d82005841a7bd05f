"""Release checkpoint layout (spec 4) against the real V4.1-Flash / V4-Flash shapes, and the loader/writer on a
stand-in module built from the tiny layout."""

import json
import math
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from dsserve.layers.quant import dequant_engram, dequant_fp8_block, fake_quant_fp4_pow2, quant_engram, quant_fp8_block
from dsserve.models.checkpoint import (
    CheckpointError,
    dummy_weights,
    load_checkpoint,
    model_name_for,
    model_shapes,
    release_layout,
    save_checkpoint,
)
from dsserve.models.config import ModelConfig
from dsserve.models.presets import preset


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Tiny tensors: intra-op threads only add barrier overhead (10x slower on a loaded 2-core box)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def _primes_above(start: int, count: int) -> list[int]:
    out, n = [], start + 1
    while len(out) < count:
        if all(n % d for d in range(2, int(n**0.5) + 1)):
            out.append(n)
        n += 1
    return out


@pytest.fixture(scope="module")
def v41():
    return release_layout(preset("v41-flash"))


@pytest.fixture(scope="module")
def v4():
    return release_layout(preset("v4-flash"))


def spec(layout, name):
    s = layout[name]
    return list(s.shape), s.dtype


def layers_with(layout, suffix):
    return sorted(int(n.split(".")[1]) for n in layout if n.startswith("layers.") and n.endswith(suffix))


# ---------------------------------------------------------------- layout vs the real release (metadata only)
def test_v41_flash_attention_and_experts(v41):
    assert spec(v41, "layers.0.attn.wq_b.weight") == ([32768, 1280], "F8_E4M3")
    assert spec(v41, "layers.0.attn.wq_b.scale") == ([1024, 40], "F8_E8M0")
    assert spec(v41, "layers.0.attn.wo_a.weight") == ([8192, 4096], "F8_E4M3")
    assert spec(v41, "layers.0.attn.wo_a.scale") == ([256, 128], "F8_E8M0")
    assert spec(v41, "layers.39.attn.attn_sink") == ([64], "F32")
    assert spec(v41, "layers.5.hc_attn_fn") == ([24, 20480], "F32")
    assert spec(v41, "layers.5.hc_ffn_scale") == ([3], "F32")
    for w in ("w1", "w3"):
        assert spec(v41, f"layers.0.ffn.experts.383.{w}.weight") == ([2304, 2560], "I8")
        assert spec(v41, f"layers.0.ffn.experts.383.{w}.scale") == ([2304, 160], "F8_E8M0")
    assert spec(v41, "layers.7.ffn.experts.0.w2.weight") == ([5120, 1152], "I8")
    assert spec(v41, "layers.7.ffn.experts.0.w2.scale") == ([5120, 72], "F8_E8M0")
    assert "layers.0.ffn.experts.384.w1.weight" not in v41
    assert spec(v41, "layers.3.ffn.shared_experts.w2.weight") == ([5120, 2304], "F8_E4M3")
    assert spec(v41, "layers.3.ffn.gate.weight") == ([384, 5120], "BF16")
    assert len(layers_with(v41, "ffn.gate.bias")) == 40 and len(layers_with(v41, "ffn.gate.bias_vl")) == 40


def test_v41_flash_compressors_indexers_globals(v41):
    assert layers_with(v41, "attn.compressor.wkv.weight") == [2, 8, 14, 20]
    assert layers_with(v41, "attn.compressor.wgate.weight") == [2, 8, 14]
    assert layers_with(v41, "attn.indexer.wk.weight") == [2, 8, 14, 20]
    assert layers_with(v41, "attn.indexer.wq_b.weight") == [2, 8, 14, 20, 24, 28, 32, 36]
    assert layers_with(v41, "attn.indexer.weights_proj.weight") == [2, 8, 14, 20, 24, 28, 32, 36]
    assert spec(v41, "layers.20.attn.compressor.wkv.weight") == ([512, 5120], "BF16")
    assert spec(v41, "layers.20.attn.indexer.wk.weight") == ([128, 512], "BF16")
    assert spec(v41, "layers.24.attn.indexer.wq_b.weight") == ([4096, 1280], "F8_E4M3")
    assert spec(v41, "layers.24.attn.indexer.weights_proj.weight") == ([32, 5120], "BF16")
    assert spec(v41, "head.weight") == ([129280, 5120], "BF16")
    assert spec(v41, "embed.weight") == ([129280, 5120], "BF16")
    assert not any("hc_head" in n or "tid2eid" in n or "ape" in n.split(".")[-1] for n in v41)


def test_v41_flash_engram(v41):
    assert layers_with(v41, "engram.embed.weight") == [1, 14]
    assert spec(v41, "layers.1.engram.embed.weight") == ([384_006_168, 256], "F8_E4M3")
    assert spec(v41, "layers.14.engram.embed.weight") == ([384_016_682, 256], "F8_E4M3")
    assert spec(v41, "layers.14.engram.embed.scale") == ([384_016_682, 8], "F8_E8M0")
    assert spec(v41, "layers.1.engram.wkv.weight") == ([25600, 6144], "F8_E4M3")
    assert spec(v41, "layers.1.engram.q_weight") == ([4, 5120], "BF16")
    primes = _primes_above(15_999_999, 48)  # spec 1.5: consecutive primes, layer 1 first
    assert (sum(primes[:24]), sum(primes[24:])) == (384_006_168, 384_016_682)


def test_v41_flash_dspark_and_totals(v41):
    assert spec(v41, "mtp.0.main_proj.weight") == ([5120, 15360], "F8_E4M3")
    assert spec(v41, "mtp.0.main_norm.weight") == ([5120], "BF16")
    assert spec(v41, "mtp.2.norm.weight") == ([5120], "BF16")
    assert spec(v41, "mtp.2.markov_head.embed.weight") == ([129280, 256], "BF16")
    assert spec(v41, "mtp.2.markov_head.head.weight") == ([129280, 256], "BF16")
    assert spec(v41, "mtp.2.confidence_head.proj.weight") == ([1, 5376], "BF16")
    for s in range(3):
        assert spec(v41, f"mtp.{s}.ffn.gate.weight") == ([128, 5120], "BF16")
        assert spec(v41, f"mtp.{s}.ffn.experts.127.w2.weight") == ([5120, 1152], "I8")
        assert f"mtp.{s}.ffn.experts.128.w1.weight" not in v41 and f"mtp.{s}.ffn.gate.bias_vl" in v41
        assert f"mtp.{s}.attn.wq_b.scale" in v41
        assert not any(
            n.startswith(f"mtp.{s}.") and ("compressor" in n or "indexer" in n or "engram" in n) for n in v41
        )
    assert not any(n.startswith("mtp.3.") for n in v41)
    # spec 1.9: 551.9 B backbone + 196.6 B Engram + 14.2 B DSpark; spec 1.7: ~475 GiB on disk
    params = sum(math.prod(s.float_shape) for s in v41.values() if s.quant != "scale")
    assert abs(params / 1e9 - 762.7) < 0.1
    assert 470 < sum(s.nbytes for s in v41.values()) / 2**30 < 480


def test_v4_flash_layout(v4):
    assert spec(v4, "hc_head_fn") == ([4, 16384], "F32")
    assert spec(v4, "hc_head_base") == ([4], "F32") and spec(v4, "hc_head_scale") == ([1], "F32")
    assert layers_with(v4, "ffn.gate.tid2eid") == [0, 1, 2]
    assert spec(v4, "layers.0.ffn.gate.tid2eid") == ([129280, 6], "I32")
    assert layers_with(v4, "ffn.gate.bias") == list(range(3, 43))
    assert not any("bias_vl" in n or "engram" in n or n.startswith("mtp.") for n in v4)
    assert layers_with(v4, "attn.compressor.wkv.weight") == list(range(2, 43))
    assert layers_with(v4, "attn.indexer.wq_b.weight") == list(range(2, 43, 2))
    assert spec(v4, "layers.2.attn.compressor.wkv.weight") == ([1024, 4096], "BF16")
    assert spec(v4, "layers.2.attn.compressor.wgate.weight") == ([1024, 4096], "BF16")
    assert spec(v4, "layers.2.attn.compressor.ape") == ([4, 1024], "F32")
    assert spec(v4, "layers.3.attn.compressor.wkv.weight") == ([512, 4096], "BF16")
    assert spec(v4, "layers.3.attn.compressor.ape") == ([128, 512], "F32")
    assert spec(v4, "layers.3.attn.compressor.norm.weight") == ([512], "BF16")
    assert spec(v4, "layers.42.attn.indexer.compressor.wkv.weight") == ([256, 4096], "BF16")
    assert spec(v4, "layers.42.attn.indexer.compressor.ape") == ([4, 256], "F32")
    assert spec(v4, "layers.42.attn.indexer.compressor.norm.weight") == ([128], "BF16")
    assert spec(v4, "layers.2.attn.indexer.wq_b.weight") == ([8192, 1024], "F8_E4M3")
    assert spec(v4, "layers.2.attn.wq_b.scale") == ([256, 8], "F8_E8M0")  # 128x128 blocks
    assert spec(v4, "layers.2.ffn.experts.255.w1.scale") == ([2048, 128], "F8_E8M0")
    params = sum(math.prod(s.float_shape) for s in v4.values() if s.quant != "scale")
    assert abs(params / 1e9 - 284.3) < 0.1  # spec 1.9 (no MTP)


def test_model_name_for():
    assert model_name_for("layers.3.ffn.experts.17.w2.weight") == ("layers.3.ffn.experts.w2", 17)
    assert model_name_for("mtp.1.ffn.experts.0.w1.scale") == ("mtp.1.ffn.experts.w1", 0)
    assert model_name_for("layers.0.attn.wq_b.weight") == ("layers.0.attn.wq_b.weight", None)
    assert model_name_for("layers.0.attn.wq_b.scale") == ("layers.0.attn.wq_b.weight", None)
    assert model_name_for("layers.0.hc_attn_scale") == ("layers.0.hc_attn_scale", None)
    assert model_name_for("layers.0.ffn.shared_experts.w1.weight") == ("layers.0.ffn.shared_experts.w1.weight", None)


def test_tiny_model_shapes():
    cfg = preset("tiny")
    shapes = model_shapes(cfg)
    assert shapes["layers.0.ffn.experts.w1"] == ((8, 128, 256), torch.bfloat16)
    assert shapes["layers.0.ffn.experts.w2"] == ((8, 256, 128), torch.bfloat16)
    assert shapes["mtp.2.ffn.experts.w3"] == ((4, 128, 256), torch.bfloat16)
    assert shapes["layers.0.hc_attn_fn"] == ((24, 1024), torch.float32)
    assert not any(n.endswith(".scale") for n in shapes)
    rows = {1: sum(_primes_above(4095, 12)), 4: sum(_primes_above(4095, 24)[12:])}
    assert rows == {1: 49_796, 4: 50_980}  # spec 5.1
    assert shapes["layers.1.engram.embed.weight"][0] == (rows[1], 32)
    assert shapes["layers.4.engram.embed.weight"][0] == (rows[4], 32)


# ---------------------------------------------------------------- loader / writer on a stand-in module
def make_model(cfg: ModelConfig, drop: str | None = None) -> torch.nn.Module:
    """A plain module tree holding one float32 parameter (int32 buffer for tid2eid) per model tensor name."""
    root = torch.nn.Module()
    for name, (shape, dt) in model_shapes(cfg).items():
        if name == drop:
            continue
        *path, leaf = name.split(".")
        mod = root
        for part in path:
            if not hasattr(mod, part):
                mod.add_module(part, torch.nn.Module())
            mod = getattr(mod, part)
        if dt == torch.int32:
            mod.register_buffer(leaf, torch.zeros(shape, dtype=torch.int32))
        else:
            mod.register_parameter(leaf, torch.nn.Parameter(torch.zeros(shape), requires_grad=False))
    return root


@pytest.fixture(scope="module")
def tiny():
    cfg = preset("tiny")
    model = make_model(cfg)
    dummy_weights(model, cfg, seed=0)
    return cfg, model


@pytest.fixture(scope="module")
def saved(tiny, tmp_path_factory):
    cfg, model = tiny
    out = str(tmp_path_factory.mktemp("ckpt"))
    tok = tmp_path_factory.mktemp("tok")
    (tok / "tokenizer.json").write_text('{"model": {}}')
    save_checkpoint(model, cfg, out, tokenizer_dir=str(tok))
    return out


def expected_after_roundtrip(cfg, model):
    layout = release_layout(cfg)
    sd = model.state_dict()
    out = {}
    for name, s in layout.items():
        if s.quant == "scale":
            continue
        mname, e = model_name_for(name)
        if e is not None:
            if e == 0:
                out[mname] = fake_quant_fp4_pow2(sd[mname], 32)  # == dequant_mxfp4(pack_mxfp4(.)) per expert
            continue
        w = sd[mname]
        if s.quant == "fp8":
            out[mname] = dequant_fp8_block(*quant_fp8_block(w, cfg.weight_block_size), cfg.weight_block_size)
        elif s.quant == "engram_fp8":
            out[mname] = dequant_engram(*quant_engram(w))
        elif s.quant == "bf16":
            out[mname] = w.to(torch.bfloat16).float()
        else:
            out[mname] = w.clone()
    return out


def assert_state_equal(a, b):
    assert set(a) == set(b)
    for k in a:
        assert torch.equal(a[k], b[k]), k


def test_save_writes_release_files(tiny, saved):
    cfg, _ = tiny
    assert sorted(os.listdir(saved)) == ["config.json", "model.safetensors", "tokenizer.json"]
    assert ModelConfig.from_json(saved).to_hf_dict() == cfg.to_hf_dict()
    tensors = load_file(os.path.join(saved, "model.safetensors"))
    layout = release_layout(cfg)
    assert set(tensors) == set(layout)
    for n, s in layout.items():
        assert tuple(tensors[n].shape) == s.shape, n


def test_roundtrip_equals_quant_dequant(tiny, saved):
    cfg, model = tiny
    fresh = make_model(cfg)
    assert load_checkpoint(fresh, cfg, saved) == []
    expect = expected_after_roundtrip(cfg, model)
    assert_state_equal({k: v for k, v in fresh.state_dict().items()}, expect)
    # the dequantised weights are on the grid: a second save/load changes nothing
    again = make_model(cfg)
    path2 = os.path.join(os.path.dirname(saved), "again")
    save_checkpoint(fresh, cfg, path2)
    load_checkpoint(again, cfg, path2)
    assert_state_equal(again.state_dict(), fresh.state_dict())


def test_sharded_roundtrip(tiny, saved, tmp_path):
    cfg, _ = tiny
    single = make_model(cfg)
    load_checkpoint(single, cfg, saved)
    save_checkpoint(single, cfg, str(tmp_path), max_shard_bytes=4 << 20)
    files = sorted(f for f in os.listdir(tmp_path) if f.endswith(".safetensors"))
    assert len(files) > 3 and files[0] == f"model-00001-of-{len(files):05d}.safetensors"
    index = json.load(open(tmp_path / "model.safetensors.index.json"))
    assert set(index["weight_map"]) == set(release_layout(cfg)) and set(index["weight_map"].values()) == set(files)
    for f in files[:-1]:
        assert os.path.getsize(tmp_path / f) < (4 << 20) + 65536
    sharded = make_model(cfg)
    load_checkpoint(sharded, cfg, str(tmp_path))
    assert_state_equal(sharded.state_dict(), single.state_dict())


def _corrupt(saved, tmp_path, edit):
    tensors = load_file(os.path.join(saved, "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    return str(tmp_path)


def _load_error(cfg, path):
    model = make_model(cfg)
    before = model.state_dict()["layers.0.attn.wq_a.weight"].clone()
    with pytest.raises(CheckpointError) as err:
        load_checkpoint(model, cfg, path)
    assert torch.equal(model.state_dict()["layers.0.attn.wq_a.weight"], before)  # validated before loading
    return str(err.value)


def test_missing_tensor_error(tiny, saved, tmp_path):
    cfg, _ = tiny
    msg = _load_error(cfg, _corrupt(saved, tmp_path, lambda t: t.pop("layers.2.attn.compressor.wgate.weight")))
    assert "'layers.2.attn.compressor.wgate.weight'" in msg and "[64, 256] BF16" in msg and "1 problem" in msg


def test_extra_tensor_error_and_ignored_vision(tiny, saved, tmp_path):
    cfg, _ = tiny

    def edit(t):
        t["layers.0.attn.bogus.weight"] = torch.zeros(3, 5)
        t["vision.patch_embed.proj.weight"] = torch.zeros(2, 2)  # release vision tower: tolerated

    msg = _load_error(cfg, _corrupt(saved, tmp_path, edit))
    assert "'layers.0.attn.bogus.weight'" in msg and "[3, 5] F32" in msg and "1 problem" in msg


def test_misshaped_and_mistyped_errors(tiny, saved, tmp_path):
    cfg, _ = tiny

    def edit(t):
        t["layers.0.attn.wq_a.weight"] = torch.zeros(96, 128).to(torch.float8_e4m3fn)
        t["norm.weight"] = torch.ones(256)

    msg = _load_error(cfg, _corrupt(saved, tmp_path, edit))
    assert "'layers.0.attn.wq_a.weight': expected [96, 256] F8_E4M3, found [96, 128] F8_E4M3" in msg
    assert "'norm.weight': expected [256] BF16, found [256] F32" in msg and "2 problem" in msg


def test_many_problems_are_counted(tiny, saved, tmp_path):
    cfg, _ = tiny
    path = _corrupt(saved, tmp_path, lambda t: [t.pop(k) for k in list(t) if k.startswith("layers.3.")])
    msg = _load_error(cfg, path)
    n = sum(1 for k in release_layout(cfg) if k.startswith("layers.3."))
    assert f"{n} problem(s)" in msg and f"and {n - 8} more" in msg


def test_model_missing_tensor_error(tiny, saved):
    cfg, _ = tiny
    with pytest.raises(CheckpointError, match=r"model has no tensor 'layers.4.engram.q_weight'.*\[4, 256\]"):
        load_checkpoint(make_model(cfg, drop="layers.4.engram.q_weight"), cfg, saved)
    with pytest.raises(CheckpointError, match="no model.safetensors"):
        load_checkpoint(make_model(cfg), cfg, os.path.dirname(saved))


def test_dummy_weights_deterministic_and_sane(tiny):
    cfg, model = tiny
    other = make_model(cfg)
    dummy_weights(other, cfg, seed=0)
    assert_state_equal(other.state_dict(), model.state_dict())
    dummy_weights(other, cfg, seed=1)
    sd = other.state_dict()
    assert not torch.equal(sd["layers.0.attn.wq_a.weight"], model.state_dict()["layers.0.attn.wq_a.weight"])
    assert torch.equal(sd["layers.0.attn_norm.weight"], torch.ones(256))
    assert torch.equal(sd["layers.2.attn.compressor.norm.weight"], torch.ones(64))
    assert torch.equal(sd["layers.1.engram.k_weight"], torch.ones(4, 256))
    assert torch.equal(sd["layers.0.hc_attn_base"], torch.zeros(24))
    assert torch.equal(sd["layers.0.hc_attn_scale"], torch.ones(3))
    for name in ("layers.0.ffn.gate.bias", "layers.0.attn.attn_sink"):  # random, so tests exercise them
        assert 0.2 < sd[name].std().item() < 1.0, name
    assert abs(sd["layers.0.attn.wq_b.weight"].std().item() * 96**0.5 - 1) < 0.05
    assert abs(sd["layers.0.ffn.experts.w2"].std().item() * 128**0.5 - 1) < 0.05
    assert abs(sd["layers.1.engram.embed.weight"].std().item() - 0.1) < 0.01


def test_dummy_weights_v4_tid2eid():
    cfg = preset("tiny-v4")
    model = make_model(cfg)
    dummy_weights(model, cfg, seed=3)
    t = model.state_dict()["layers.0.ffn.gate.tid2eid"]
    assert t.shape == (8192, 2) and t.dtype == torch.int32
    assert (t >= 0).all() and (t < 8).all() and (t[:, 0] != t[:, 1]).all()
    assert torch.equal(model.state_dict()["hc_head_scale"], torch.ones(1))
