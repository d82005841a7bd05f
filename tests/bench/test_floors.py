"""The floors behind the published H200 figures (dsserve/bench/floors.py), recomputed by hand on the `tiny` config.

tiny: 12 backbone layers, compress ratios (0, 0, 2, 2, 2, 2, 1, 1, 1, 1, 1, 1), window 32, index_topk 16, candidate
pool 8 blocks x 4 = 32 entries; indexers on layers 2 and 4 (ratio 2), 6 (ratio 1, the pool's source) and 8, 10
(ratio 1, consumers). Packed records at head_dim 64 / index_head_dim 32: window row 64 + 2 = 66 B, main entry
32 + 4 = 36 B, index key 16 + 1 = 17 B.
"""

import pytest

from dsserve.bench import floors
from dsserve.models.accounting import param_counts
from dsserve.models.presets import preset


@pytest.fixture(scope="module")
def cfg():
    c = preset("tiny")
    assert c.compress_ratios[:12] == (0, 0, 2, 2, 2, 2, 1, 1, 1, 1, 1, 1)
    assert (c.sliding_window, c.index_topk, floors.candidate_pool(c)) == (32, 16, 32)
    return c


def test_index_keys_sources_score_every_visible_entry(cfg):
    # position 100: ratio 2 sees 101 // 2 = 50 entries, ratio 1 sees 101; consumers stop at the pool's 32
    assert floors.index_keys_scored(cfg, 100) == 50 + 50 + 101 + 32 + 32
    # far past the pool: the sources keep growing (the stored runs charged every indexer min(ctx, pool))
    assert floors.index_keys_scored(cfg, 1000) == 500 + 500 + 1001 + 32 + 32


def test_decode_row_bytes_by_hand(cfg):
    r = floors.kv_row_bytes(cfg, 100)
    window = 12 * 32  # every layer reads its full window
    selected = 4 * 16 + 6 * 16  # ratio-2 and ratio-1 layers select index_topk; ratio-0 layers none
    keys = 265
    assert r["index_keys"] == keys and r["indexer_layers"] == 5
    assert r["kv_bytes"] == window * 66 + selected * 36 + keys * 17 == 35609
    assert r["indexer_flops"] == keys * cfg.index_n_heads * cfg.index_head_dim * 2


def test_prefill_flops_charge_the_lm_head_to_one_row_a_chunk(cfg):
    head = cfg.vocab_size * cfg.hidden_size + cfg.hidden_size  # head + final norm (V4.1: no hc head)
    body = param_counts(cfg).active_decode - head
    # a 2-row chunk at positions 100 and 101: windows 12 x 32 each; selected 160 each (102 // 2 = 51 > 16);
    # index keys 265 and 51 + 51 + 102 + 32 + 32 = 268
    att = (384 + 160) * 2 * 4 * cfg.num_attention_heads * cfg.head_dim
    idx = (265 + 268) * cfg.index_n_heads * cfg.index_head_dim * 2
    want = 2 * body * 2 + 2 * head * 1 + att + idx
    assert floors.prefill_flops(cfg, 100, 2) == want
    assert floors.prefill_flops(cfg, 100, 2, logit_rows=2) - want == 2 * head


def test_the_share_is_lower_than_charging_the_head_to_every_row(cfg):
    # the stored runs' formula (head on every row) overstates a chunk's FLOPs, hence its share of the matmul rate
    new = 64
    every_row = floors.prefill_flops(cfg, 0, new, logit_rows=new)
    assert every_row > floors.prefill_flops(cfg, 0, new)
