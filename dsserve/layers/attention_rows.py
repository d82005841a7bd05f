"""One sequence's CSA2 attention straight from its paged rows, through the sparse attention op (V4 on a GPU).

V4 has no paged batched path yet: its attention runs sequence by sequence (``CSA2Attention.forward``), and there the
torch reference gathers every selected entry of every row into one tensor ([rows, 512, D]: 4 GB a layer for an 8K
chunk) and the window ring into another. When the cache holds raw bf16 rows (V4's layout in a bf16 model) the
sparse attention op reads them in place by physical row instead, as the paged path does for V4.1's packed rows:
the window's ring rows by slot and tag, the selected entries through the block table. The output comes de-rotated,
in the model's dtype.
"""
from __future__ import annotations

import torch
import triton

from .numerics import fp32_param

RAW_BF16 = "raw-bfloat16"  # kv.layout.RawRows' name for bf16 rows: the bytes of formats.BF16_ROWS


def reads_rows_in_place(cache, ops) -> bool:
    """Whether a sequence's attention can read its rows in place: kernel ops, a paged ring of raw bf16 rows."""
    c = getattr(cache, "cache", None)
    if ops is None or c is None or c.layout.window_in_blocks:
        return False
    return c.layout.window_fmt.name == RAW_BF16 and c.layout.main_fmt.name == RAW_BF16


def _old_window_rows(cache, layer: int, p: torch.Tensor) -> torch.Tensor:
    """[n, W] int32: ring rows of positions p-W+1..p written before these rows (before p[0]), -1 if absent."""
    c = cache.cache
    w = c.layout.window
    q = p[:, None] - (w - 1) + torch.arange(w, device=p.device)[None, :]
    ring = q.clamp_min(0) % w
    ok = (q >= 0) & (q < p[:1, None]) & (c.window_pos[layer][cache.slot][ring] == q)
    return torch.where(ok, cache.slot * w + ring, -1).to(torch.int32)


def _entry_rows(cache, source: int, idx: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """[n, K'] int32: physical rows of entry ids ``idx`` (-1 where not valid), K padded to a power of two >= 16
    so the kernel compiles once per bucket as a V4 HCA layer's entry count grows."""
    epb = cache.cache.layout.sources[source][1]
    table = cache.table()
    e = idx.long().clamp_min(0)
    blk = table[(e // epb).clamp(max=table.shape[0] - 1)]
    rows = torch.where(valid, blk * epb + e % epb, -1).to(torch.int32)
    k = max(16, triton.next_power_of_2(rows.shape[1]))
    return torch.nn.functional.pad(rows, (0, k - rows.shape[1]), value=-1)


def attend_rows(attn, q: torch.Tensor, kv: torch.Tensor, p: torch.Tensor, cache, sel, cos_sin, ops,
                dtype: torch.dtype) -> torch.Tensor:
    """One sequence's rows: q [n, H, D] (rotated), kv [n, D] their window entries (not yet in the ring), positions
    p [n], ``sel`` (entry ids [n, K], valid [n, K]) or None, cos_sin their kernel tables. Returns the de-rotated
    output [n, H, D] in ``dtype``; the caller pushes kv to the ring afterwards."""
    c, role = cache.cache, attn.role
    main_pool = sel_rows = None
    if sel is not None and sel[0].shape[1]:
        main_pool = c.main[role.kv_source].flatten(0, 1)
        sel_rows = _entry_rows(cache, role.kv_source, *sel)
    first = torch.zeros(p.shape[0], dtype=torch.int32, device=p.device)  # the sequence's rows start at row 0
    return ops.sparse_attention(q, *cos_sin, c.window[role.index].flatten(0, 1), "bf16",
                                _old_window_rows(cache, role.index, p), kv, first, main_pool, "bf16", sel_rows,
                                fp32_param(attn.attn_sink), attn.cfg.head_dim ** -0.5, out_dtype=dtype)
