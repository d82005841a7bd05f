"""Selected global entries -> physical pool rows for the sparse attention, in one launch (torch takes ~10).

* entries [T, K] int32 / int64: entry ids in row t's sequence (any value where not valid); valid [T, K] bool;
* seq_tables [S, MB] int32: each sequence's block table, -1 padded; row_seq [T] int32: row t's sequence;
* epb: entries per block of the source.
-> rows [T, K] int32: seq_tables[row_seq[t], min(e // epb, MB - 1)] * epb + e % epb with e = max(entry, 0),
   -1 where not valid or the block is absent (-1). Ids are not range-checked (that would need a sync).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_ROWS = 16


def _check(entries, valid, seq_tables, row_seq, epb):
    if entries.dim() != 2 or entries.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"entries: expected int32/int64 [T, K], got {entries.dtype} {tuple(entries.shape)}")
    if tuple(valid.shape) != tuple(entries.shape) or valid.dtype != torch.bool:
        raise ValueError(f"valid: expected bool {tuple(entries.shape)}, got {valid.dtype} {tuple(valid.shape)}")
    if seq_tables.dim() != 2 or seq_tables.shape[1] == 0 or seq_tables.is_floating_point():
        raise ValueError(f"seq_tables: expected int [S, MB >= 1], got {seq_tables.dtype} {tuple(seq_tables.shape)}")
    if tuple(row_seq.shape) != (entries.shape[0],) or row_seq.is_floating_point():
        raise ValueError(f"row_seq: expected int [{entries.shape[0]}], got {row_seq.dtype} {tuple(row_seq.shape)}")
    if not isinstance(epb, int) or epb < 1:
        raise ValueError(f"epb: expected an int >= 1, got {epb!r}")


def entry_rows_ref(entries, valid, seq_tables, row_seq, epb: int) -> torch.Tensor:
    _check(entries, valid, seq_tables, row_seq, epb)
    e = entries.long().clamp_min(0)
    tables = seq_tables.long()[row_seq.long()]
    blk = tables.gather(1, (e // epb).clamp(max=tables.shape[1] - 1))
    return torch.where(valid & (blk >= 0), blk * epb + e % epb, -1).to(torch.int32)


# The entry count K and the tables' width MB are runtime ints, not constexprs: MB follows the step's longest context
# and K its entries, so as constexprs each new pair compiled a kernel (0.5-0.9 s on the H200) in the step that met it:
# 70 compiles in two minutes of a live replay-off server, the warm-up's 94 besides (benchmarks/results/
# agentx-replay-off-compiles-h200). Only the power-of-two tile BLOCK_K remains; t and MB, bounds only, are not
# specialised on their value's alignment either.
@triton.jit(do_not_specialize=["t", "MB"])
def _entry_rows_kernel(
    e_ptr, v_ptr, tab_ptr, seq_ptr, out_ptr, t, K, MB, EPB: tl.constexpr, BLOCK_K: tl.constexpr, ROWS: tl.constexpr
):
    r = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    j = tl.arange(0, BLOCK_K)
    m = (r[:, None] < t) & (j[None, :] < K)
    at = r.to(tl.int64)[:, None] * K + j[None, :]
    e = tl.maximum(tl.load(e_ptr + at, mask=m, other=0).to(tl.int64), 0)
    ok = tl.load(v_ptr + at, mask=m, other=0) != 0
    s = tl.load(seq_ptr + r, mask=r < t, other=0).to(tl.int64)
    blk = tl.load(tab_ptr + s[:, None] * MB + tl.minimum(e // EPB, MB - 1), mask=m, other=-1).to(tl.int64)
    tl.store(out_ptr + at, tl.where(ok & (blk >= 0), blk * EPB + e % EPB, -1).to(tl.int32), mask=m)


def entry_rows(entries, valid, seq_tables, row_seq, epb: int) -> torch.Tensor:
    _check(entries, valid, seq_tables, row_seq, epb)
    t, k = entries.shape
    out = torch.empty(t, k, dtype=torch.int32, device=entries.device)
    if t and k:
        _entry_rows_kernel[(triton.cdiv(t, _ROWS),)](
            entries.contiguous(),
            valid.contiguous(),
            seq_tables.contiguous(),
            row_seq.contiguous(),
            out,
            t,
            k,
            seq_tables.shape[1],
            EPB=epb,
            BLOCK_K=triton.next_power_of_2(k),
            ROWS=_ROWS,
        )
    return out
