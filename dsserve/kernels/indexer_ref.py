"""Torch references of the indexer scoring ops (dsserve/kernels/indexer.py has the layouts), and the argument
checks the kernels share. Each ref runs on any device, in acc(q) precision (fp64 stays fp64)."""

from __future__ import annotations

import torch

from dsserve.kv.formats import BF16_ROWS, INDEX_FP4, RowFormat
from dsserve.layers.numerics import acc

_REF_CHUNK = 1 << 19  # ref: rows per chunk * n bounded so gathered keys stay ~0.5 GB at Di = 128


# ------------------------------------------------------------------ checks shared by refs and kernels
def _row_format(fmt: str, di: int) -> RowFormat:
    if fmt == "fp4":
        return INDEX_FP4.with_channels(di)
    if fmt == "bf16":
        return BF16_ROWS.with_channels(di)
    if fmt in ("raw-float32", "raw-float64"):  # V4's fp32 / fp64 rows: the refs read them, the kernels refuse
        from dsserve.kv.layout import RawRows  # here: kv.layout imports the model config

        return RawRows(di, torch.float32 if fmt == "raw-float32" else torch.float64)
    raise ValueError(f"unknown index pool format {fmt!r}; expected 'fp4', 'bf16', 'raw-float32' or 'raw-float64'")


def _check(q, w, pool, fmt, block_table, row_seq, epb, n_visible) -> RowFormat:
    if q.dim() != 3:
        raise ValueError(f"q must be [T, Hi, Di], got {tuple(q.shape)}")
    t, h, di = q.shape
    if tuple(w.shape) != (t, h):
        raise ValueError(f"w must be [T, Hi] = {(t, h)}, got {tuple(w.shape)}")
    rf = _row_format(fmt, di)
    if pool.dtype != torch.uint8 or pool.dim() != 2 or pool.shape[1] != rf.row_bytes:
        raise ValueError(
            f"pool must be uint8 [Nrows, {rf.row_bytes}] for {fmt} with Di={di}, got {pool.dtype} {tuple(pool.shape)}"
        )
    if block_table.dim() != 2 or block_table.is_floating_point():
        raise ValueError(f"block_table must be integer [S, MB], got {block_table.dtype} {tuple(block_table.shape)}")
    if tuple(row_seq.shape) != (t,) or row_seq.is_floating_point():
        raise ValueError(f"row_seq must be integer [T={t}], got {row_seq.dtype} {tuple(row_seq.shape)}")
    if not isinstance(epb, int) or epb <= 0:
        raise ValueError(f"epb (entries per block) must be a positive int, got {epb!r}")
    if tuple(n_visible.shape) != (t,) or n_visible.is_floating_point():
        raise ValueError(f"n_visible must be integer [T={t}], got {n_visible.dtype} {tuple(n_visible.shape)}")
    return rf


def _check_cands(cand_blocks, cbs, t):
    if cand_blocks.dim() != 2 or cand_blocks.shape[0] != t or cand_blocks.is_floating_point():
        raise ValueError(f"cand_blocks must be integer [T={t}, NB], got {cand_blocks.dtype} {tuple(cand_blocks.shape)}")
    if not isinstance(cbs, int) or cbs <= 0:
        raise ValueError(f"cand_block_size must be a positive int, got {cbs!r}")


def _out(out, t, n, dtype, device):
    if out is None:
        return torch.empty(t, n, dtype=dtype, device=device)
    if tuple(out.shape) != (t, n) or out.dtype != dtype or not out.is_contiguous():
        raise ValueError(f"out must be contiguous {dtype} [{t}, {n}], got {out.dtype} {tuple(out.shape)}")
    return out


# ------------------------------------------------------------------ references
def _entry_scores(q, w, pool, rf, block_table, row_seq, epb, n_visible, entries):
    """Scores of entries [T, N] (int64, any value) for each row; -inf where not visible."""
    mb = block_table.shape[1]
    vis = (entries >= 0) & (entries < n_visible.long()[:, None]) & (entries < mb * epb)
    col = torch.where(vis, entries // epb, 0)
    phys = torch.where(vis, block_table[row_seq.long()[:, None], col].long() * epb + entries % epb, 0)
    dt = acc(q).dtype
    out = torch.empty(entries.shape, dtype=dt, device=q.device)
    step = max(1, _REF_CHUNK // max(1, entries.shape[1]))
    for a in range(0, q.shape[0], step):  # chunks bound the gathered [rows, N, Di] keys
        keys = rf.unpack(pool[phys[a : a + step]], dt)
        logits = torch.relu(torch.einsum("thd,tnd->thn", acc(q[a : a + step]), keys))
        out[a : a + step] = torch.einsum("thn,th->tn", logits, acc(w[a : a + step]).to(dt))
    return out.masked_fill(~vis, float("-inf"))


def index_scores_ref(q, w, pool, fmt, block_table, row_seq, epb, n_visible, n_max, out=None):
    rf = _check(q, w, pool, fmt, block_table, row_seq, epb, n_visible)
    entries = torch.arange(n_max, device=q.device).expand(q.shape[0], n_max)
    s = _entry_scores(q, w, pool, rf, block_table, row_seq, epb, n_visible, entries)
    return s if out is None else _out(out, *s.shape, s.dtype, s.device).copy_(s)


def index_scores_candidates_ref(
    q, w, pool, fmt, block_table, row_seq, epb, cand_blocks, cand_block_size, n_visible, out=None
):
    """Dense then mask: every entry the block table reaches, then the candidate columns gathered."""
    _check(q, w, pool, fmt, block_table, row_seq, epb, n_visible)
    _check_cands(cand_blocks, cand_block_size, q.shape[0])
    reach = block_table.shape[1] * epb
    dense = index_scores_ref(q, w, pool, fmt, block_table, row_seq, epb, n_visible, reach)
    ent = candidate_entries(
        cand_blocks, cand_block_size, torch.arange(cand_blocks.shape[1] * cand_block_size, device=q.device)
    )
    ok = (ent >= 0) & (ent < reach)
    s = dense.gather(1, torch.where(ok, ent, 0)).masked_fill(~ok, float("-inf"))
    return s if out is None else _out(out, *s.shape, s.dtype, s.device).copy_(s)


def candidate_entries(cand_blocks: torch.Tensor, cand_block_size: int, idx: torch.Tensor) -> torch.Tensor:
    """Compact column indices idx ([T, k] or [k]) -> entry ids int64 [T, k]; -1 where the block is -1."""
    idx = idx.long().expand(cand_blocks.shape[0], -1) if idx.dim() == 1 else idx.long()
    blk = cand_blocks.long().gather(1, idx // cand_block_size)
    return torch.where(blk >= 0, blk * cand_block_size + idx % cand_block_size, -1)
