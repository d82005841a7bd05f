import pytest

from dsserve.models.accounting import kv_bytes, param_counts
from dsserve.models.presets import preset

B = 1e9


def test_v41_flash_params():
    pc = param_counts(preset("v41-flash"))
    assert pc.backbone / B == pytest.approx(551.9, abs=0.05)
    assert pc.engram_tables == (384_006_168 + 384_016_682) * 256
    assert pc.engram_tables / B == pytest.approx(196.6, abs=0.05)
    assert pc.draft / B == pytest.approx(14.2, abs=0.1)
    p = pc.parts
    assert p["routed_experts"] == 40 * 384 * 3 * 5120 * 2304
    assert p["attention"] / B == pytest.approx(5.06, abs=0.01)
    assert p["shared_experts"] / B == pytest.approx(1.42, abs=0.01)
    assert p["embed_head"] / B == pytest.approx(1.32, abs=0.01)
    assert p["engram_projections"] / B == pytest.approx(0.31, abs=0.01)
    assert (p["mhc"] + p["router_compressor_indexer_norms"]) / B == pytest.approx(0.18, abs=0.01)
    # active: ~8 B per prefill token under CED, ~16 B per decode token (+-0.3 B)
    assert pc.active_prefill / B == pytest.approx(8.0, abs=0.3)
    assert pc.active_decode / B == pytest.approx(16.0, abs=0.3)


def test_v4_flash_params():
    pc = param_counts(preset("v4-flash"))
    assert pc.backbone / B == pytest.approx(284, abs=0.5)
    assert pc.parts["routed_experts"] / B == pytest.approx(277.0, abs=0.05)
    assert pc.parts["attention"] / B == pytest.approx(4.60, abs=0.01)
    assert pc.engram_tables == 0
    assert pc.active_decode / B == pytest.approx(13.0, abs=0.3)


def test_tiny_total_exact():
    pc = param_counts(preset("tiny"))
    assert pc.total == 23_608_782
    assert pc.parts == {
        "routed_experts": 9_437_184,
        "shared_experts": 1_179_648,
        "attention": 1_378_224,
        "embed_head": 4_194_560,
        "mhc": 590_472,
        "router_compressor_indexer_norms": 185_824,
        "engram_projections": 987_136,
    }
    assert pc.engram_tables == 3_224_832 and pc.draft == 2_430_902


def test_proxy_h200_total():
    pc = param_counts(preset("proxy-h200"))
    assert pc.total / B == pytest.approx(46.91, abs=0.01)
    assert pc.parts["routed_experts"] / B == pytest.approx(33.97, abs=0.01)
    assert pc.engram_tables / B == pytest.approx(3.22, abs=0.01)
    assert pc.draft / B == pytest.approx(1.48, abs=0.01)


def test_v41_kv_bytes():
    kv = kv_bytes(preset("v41-flash"))
    assert (kv.main_entry, kv.index_entry, kv.swa_row) == (288, 68, 528)
    assert (kv.main_per_token, kv.index_per_token, kv.global_per_token) == (720, 170, 890)
    assert kv.bf16_global_per_token == 3200
    assert kv.swa_per_sequence == 2_703_360 and kv.draft_swa_per_sequence == 202_752
    assert kv.compressor_state_per_sequence == 3 * 4096
    assert kv_bytes(preset("proxy-h200")).global_per_token == 890


def test_v4_kv_bytes():
    kv = kv_bytes(preset("v4-flash"))
    assert kv.main_entry == 584 and kv.index_entry == 68
    assert kv.global_per_token == pytest.approx(21 * (584 + 68) / 4 + 20 * 584 / 128)
    assert round(kv.global_per_token) == 3514


def test_all_presets_count():
    from dsserve.models.presets import PRESETS

    for name in PRESETS:
        pc = param_counts(preset(name))
        assert 0 < pc.active_prefill <= pc.active_decode < pc.total
