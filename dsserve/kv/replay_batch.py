"""Bounded replay's decoder rows of a step in fixed shapes (``FixedBatch``): what a CUDA graph of the decoder reads.

After bounded replay narrows a step at the decoder's KV source (each prefill keeps its last ``replay_window``
prompt rows; decode rows keep their one row), the decoder layers run on a few hundred rows at most, however long
the prompts: little work, many launches. ``ReplayBatch`` holds those rows padded to ``capacity`` (several rows per
sequence, consecutive positions, sequences in order) with up to ``seq_capacity`` sequences. Padding rows repeat
the last real row (same sequence, same position), so they read what it reads and, masked by ``real``, write
nothing. The decoder layers own no compressor and no Engram, so nothing here counts entries.
"""

from __future__ import annotations

import torch

from ..layers.context import SeqRows
from .fixed_batch import FixedBatch


class ReplayBatch(FixedBatch):
    def fill(self, seqs: list[SeqRows], tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """The kept rows of ``seqs`` (narrowed ``SeqRows``: host ``first`` positions, rows in order; ``tokens``
        and ``positions`` their device tensors [R]) into the buffers. Returns the device row index [capacity]
        that pads any per-row tensor of the R rows to the buffers' rows (callers copy their stream inputs
        with it). Nothing reads the device back."""
        live = [s for s in seqs if s.rows.stop > s.rows.start]
        n = sum(s.rows.stop - s.rows.start for s in live)
        cap = self.capacity
        if not 0 < n <= cap or len(live) > self.seq_capacity:
            raise ValueError(f"{n} rows of {len(live)} sequences do not fit {cap} rows of {self.seq_capacity}")
        self.check_bound(max(s.first + s.rows.stop - s.rows.start - 1 for s in live))
        first, seq, slots = [], [], []
        for i, s in enumerate(live):
            k = s.rows.stop - s.rows.start
            first += [s.rows.start] * k  # narrowed rows count from 0 (the kept rows only)
            seq += [i] * k
            slots += [s.cache.slot] * k
        pad = cap - n
        src = torch.arange(cap).clamp_(max=n - 1)  # padding rows repeat the last real row
        put = lambda dst, t: dst.copy_(t, non_blocking=True)  # noqa: E731
        put(self.row_first, torch.tensor(first + first[-1:] * pad, dtype=torch.int32))
        put(self.row_seq, torch.tensor(seq + seq[-1:] * pad, dtype=torch.int32))
        put(self.slots, torch.tensor(slots + slots[-1:] * pad))
        put(self.real, torch.arange(cap) < n)
        put(self.seq_tables, self.tables([s.cache for s in live], self.seq_capacity))
        index = src.to(self.tokens.device, non_blocking=True)
        self.tokens.copy_(tokens.index_select(0, index))
        self.positions.copy_(positions.index_select(0, index))
        return index

    def mask_writes(self) -> None:
        """Every row a padding row (stores nothing): for the warm-up runs before a capture."""
        self.real.fill_(False)
