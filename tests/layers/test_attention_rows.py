"""layers/attention_rows.py: one sequence's attention read in place from a paged ring and pools of raw bf16 rows
(V4 in a bf16 model) equals the per-sequence torch path on the same rows: the window ring (rows of this step and of
earlier ones, a ring that wrapped), an indexer layer's selected entries and an HCA layer's every visible entry."""
import pytest
import torch

from dsserve.kernels.ops import OPS, KernelOps
from dsserve.kv.layout import KVLayout
from dsserve.kv.paged import PagedKVCache
from dsserve.layers.attention import sparse_attention_with_sink
from dsserve.layers.attention_rows import attend_rows, reads_rows_in_place
from dsserve.layers.indexer import visible_entries
from dsserve.models.checkpoint import dummy_weights
from dsserve.models.model import DeepseekForCausalLM
from dsserve.models.presets import preset


def _setup(earlier: int, n: int, gap: bool = False):
    cfg = preset("tiny-v4")
    model = DeepseekForCausalLM(cfg).eval()
    dummy_weights(model, cfg, seed=0)
    model = model.bfloat16()
    lay = KVLayout.build(cfg, None, "auto", torch.bfloat16)
    cache = PagedKVCache(lay, 8, 2, torch.bfloat16)
    seq = cache.new_sequence()
    cache.grow(seq, earlier + n)
    g = torch.Generator().manual_seed(earlier)
    for layer in (2, 3):  # a CSA layer (ratio 4, own indexer) and an HCA layer (ratio 128)
        # gap: positions 40..59 never written, so their ring slots still hold older positions (tags must say so)
        pos = torch.cat((torch.arange(40), torch.arange(60, earlier))) if gap else torch.arange(earlier)
        for part in pos.split(40):
            seq.push_window(layer, torch.randn(part.numel(), cfg.head_dim, generator=g).bfloat16(), part)
        r = cfg.roles[layer].ratio
        seq.push_global(layer, torch.randn(earlier // r, cfg.head_dim, generator=g).bfloat16(),
                        torch.randn(earlier // r, cfg.index_head_dim, generator=g).bfloat16())
    seq.num_tokens = earlier
    return cfg, model, seq, g


def _torch_path(attn, q, kv, p, seq, sel):
    """CSA2Attention.forward's per-sequence torch path on the same rows, de-rotated, in bf16."""
    cfg, role = attn.cfg, attn.role
    old_k, old_p = seq.window_rows(role.index)
    win_k, win_p = torch.cat((old_k.to(kv.dtype), kv)), torch.cat((old_p, p))
    mask = (win_p[None] <= p[:, None]) & (win_p[None] > p[:, None] - cfg.sliding_window) & (win_p[None] >= 0)
    main, _ = seq.global_kv(role.kv_source)
    idx, valid = sel
    o = sparse_attention_with_sink(q, win_k, mask, main.to(kv.dtype)[idx], valid, attn.attn_sink.float(),
                                   cfg.head_dim ** -0.5)
    return attn.rope(o, p, inverse=True).to(torch.bfloat16)


@pytest.mark.parametrize("layer", [2, 3])
@pytest.mark.parametrize("ops", ["references", "triton"])
@pytest.mark.parametrize("earlier,n,gap", [(70, 5, False), (36, 9, False), (70, 5, True)])  # the ring (W = 32)
def test_in_place_read_equals_the_torch_path(layer, ops, earlier, n, gap):  # wrapped; rows straddle a group
    cfg, model, seq, g = _setup(earlier, n, gap)
    attn = model.layers[layer].attn
    ops = KernelOps(frozenset(OPS) if ops == "references" else frozenset())
    assert reads_rows_in_place(seq, ops) and not reads_rows_in_place(seq, None)
    p = torch.arange(earlier, earlier + n)
    q = torch.randn(n, cfg.num_attention_heads, cfg.head_dim, generator=g).bfloat16()
    kv = torch.randn(n, cfg.head_dim, generator=g).bfloat16()
    r = cfg.roles[layer].ratio
    ne = seq.num_entries(layer)
    if attn.indexer is None:  # HCA: every visible entry
        idx = torch.arange(ne).expand(n, ne)
        valid = idx < visible_entries(p, r)[:, None]
    else:  # an indexer's pick: random visible entries, some slots invalid
        idx = torch.randint(0, ne, (n, cfg.index_topk), generator=g)
        valid = (idx < visible_entries(p, r)[:, None]) & (torch.rand(n, cfg.index_topk, generator=g) > 0.2)
    got = attend_rows(attn, q, kv, p, seq, (idx, valid), attn.rope.kernel_tables(p, torch.bfloat16), ops,
                      torch.bfloat16)
    want = _torch_path(attn, q, kv, p, seq, (idx, valid))
    rel = float((got.float() - want.float()).norm() / want.float().norm())
    assert got.dtype == torch.bfloat16 and rel < 1e-2, rel
    if ops.reference:  # (the interpreter truncates the kernel's fp32 -> bf16 stores: most last bits differ there)
        assert (got != want).float().mean() < 0.05  # the same bf16 values but for the sum order's rounding ties
