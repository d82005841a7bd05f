import pytest
import torch

from dsserve.kv.block_pool import BlockPool, InvariantError, OutOfBlocks
from dsserve.kv.paged import KVLayout, PagedKVCache
from dsserve.models.presets import preset


def test_real_config_stores_890_bytes_per_token_in_its_pools():
    lay = KVLayout.build(preset("v41-flash"))  # nothing allocated: byte arithmetic of the real pools
    assert lay.block_size == 64 and lay.sources == {2: (2, 32), 8: (2, 32), 14: (2, 32), 20: (1, 64)}
    assert (lay.main_fmt.row_bytes, lay.index_fmt.row_bytes, lay.window_fmt.row_bytes) == (288, 68, 528)
    assert lay.global_bytes_per_token() == 890
    assert lay.bytes_per_window_slot == 40 * 128 * 528  # 2.58 MiB per running request
    bf16 = KVLayout.build(preset("v41-flash"), kv_cache_dtype="bf16")
    assert bf16.global_bytes_per_token() == 3200


def test_pools_hold_real_bytes():
    cfg = preset("tiny")
    lay = KVLayout.build(cfg)
    kv = PagedKVCache(lay, num_blocks=4, num_window_slots=2)
    assert all(t.dtype == torch.uint8 for t in kv.main.values())
    assert (
        sum(t.numel() for t in kv.main.values()) + sum(t.numel() for t in kv.index.values()) == 4 * lay.bytes_per_block
    )
    assert sum(t.numel() for t in kv.window.values()) == 2 * lay.bytes_per_window_slot


def test_plan_and_its_errors():
    lay = KVLayout.build(preset("tiny"))
    blocks, slots = lay.plan(64 << 20, max_num_seqs=8)
    assert slots == 8 and blocks == ((64 << 20) - 8 * lay.bytes_per_window_slot) // lay.bytes_per_block
    with pytest.raises(ValueError, match="too small"):
        lay.plan(1000, max_num_seqs=8)
    with pytest.raises(ValueError, match="multiple of every compress ratio"):
        KVLayout.build(preset("tiny-v4"), block_size=64)
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        KVLayout.build(preset("tiny"), kv_cache_dtype="fp8")


def test_window_ring_stays_bounded_and_ordered():
    cfg = preset("tiny")
    kv = PagedKVCache(KVLayout.build(cfg, kv_cache_dtype="bf16"), 2, 1)
    seq = kv.new_sequence()
    w = cfg.sliding_window
    for start in range(0, 3 * w, 10):
        pos = torch.arange(start, start + 10)
        seq.push_window(0, torch.randn(10, cfg.head_dim), pos)
        _, p = seq.window_rows(0)  # the whole ring, live rows in position order, empty rows (-1) last
        live = list(range(max(0, start + 10 - w), start + 10))
        assert p.tolist() == live + [-1] * (w - len(live))


def test_block_pool_catches_double_free_and_leaks():
    pool = BlockPool(4)
    ids = pool.allocate(3)
    with pytest.raises(OutOfBlocks):
        pool.allocate(2)
    pool.free(ids[:1])
    with pytest.raises(RuntimeError, match="freed twice"):
        pool.free(ids[:1])
    with pytest.raises(InvariantError, match="owners"):
        pool.check(owned=ids[1:2])
    pool.check(owned=ids[1:])
