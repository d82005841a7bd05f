"""A decode step's fixed-shape batch (``FixedBatch``): one row per sequence, padded to ``capacity`` rows.

The whole model runs on it (``DeepseekForCausalLM.forward_decode``), the compressors included: padding rows repeat
row 0's inputs and write nothing, their window and entry stores going to row -1 and their compressor carry to the
spare slot (``carry_slots``).
"""
from __future__ import annotations

import torch

from ..layers.context import SeqRows
from .fixed_batch import FixedBatch
from .paged import PagedKVCache, SequenceKV


class DecodeBatch(FixedBatch):
    is_decode = True

    def __init__(self, cache: PagedKVCache, capacity: int, bound: int):
        super().__init__(cache, capacity, capacity, bound)
        self.carry_slots = torch.zeros(capacity, dtype=torch.long, device=cache.device)  # spare slot: padding
        self.row_first.copy_(torch.arange(capacity))  # each row its own sequence
        self.row_seq.copy_(torch.arange(capacity))
        self.seqs = [SeqRows(slice(t, t + 1), None) for t in range(capacity)]
        # Engram (filled by the model's fill_decode): compressed ids [capacity], per layer row ids or rows
        self.engram_ids: torch.Tensor | None = None
        self.engram_rows: dict[int, torch.Tensor] = {}

    def begin(self) -> None:
        super().begin()
        self._entry_stores = {}

    @property
    def block_rows(self) -> torch.Tensor:
        return self.seq_tables  # row t is sequence t

    @staticmethod
    def fits(seqs: list[SequenceKV]) -> str | None:
        """Why these sequences cannot take a fixed-shape decode step at their next positions (None: they can):
        the host's compressor counts must be those of a sequence that ran every earlier position."""
        for kv in seqs:
            p = kv.num_tokens
            if p < kv.published_until:
                return "a row is inside its sequence's cached prefix"
            for src, (r, _) in kv.cache.layout.sources.items():
                if kv.num_entries(src) != p // r or (r > 1 and kv.carried.get(src, 0) != p % r):
                    return f"source {src}'s entries or carried rows are not those of position {p}"
        return None

    def fill(self, seqs: list[SequenceKV], tokens: list[int]) -> None:
        """This step's rows (sequence i decodes token i at its next position) into the buffers; padding repeats
        row 0. Host tensors copied without waiting."""
        b, cap = len(seqs), self.capacity
        if not 0 < b <= cap:
            raise ValueError(f"a decode batch of {b} rows does not fit capacity {cap}")
        pad = [0] * (cap - b)
        pos = [kv.num_tokens for kv in seqs]
        self.check_bound(max(pos))
        spare = self.cache.slots.num_blocks
        tables = self.tables(seqs, cap)
        slots = [kv.slot for kv in seqs]
        put = lambda dst, src: dst.copy_(src, non_blocking=True)  # noqa: E731
        put(self.tokens, torch.tensor(tokens + [tokens[0] for _ in pad]))
        put(self.positions, torch.tensor(pos + [pos[0] for _ in pad]))
        put(self.seq_tables, tables)
        put(self.slots, torch.tensor(slots + [slots[0] for _ in pad]))
        put(self.carry_slots, torch.tensor(slots + [spare for _ in pad]))
        put(self.real, torch.tensor([True] * b + [False for _ in pad]))

    def mask_writes(self) -> None:
        """Every row a padding row (stores nothing): for the warm-up runs before a capture."""
        self.real.fill_(False)
        self.carry_slots.fill_(self.cache.slots.num_blocks)

    def entry_stores(self, ratio: int, rope, dtype: torch.dtype):
        """Per row, where a ratio-r source stores the entry the row completes (-1: none completes, or padding) and
        the RoPE tables at that entry's position; the same for every source of the ratio (the pools share block
        tables), so computed once per ratio per step."""
        key = (ratio, rope.spec, dtype == torch.float64)
        if key not in self._entry_stores:
            bs, p = self.cache.layout.block_size, self.positions
            epb = bs // ratio
            e = torch.div(p, ratio, rounding_mode="floor")  # the entry whose group holds p
            done = ((p + 1) % ratio == 0) & self.real
            rows = torch.where(done, self.seq_tables.long().gather(1, (p // bs)[:, None])[:, 0] * epb + e % epb, -1)
            self._entry_stores[key] = rows, rope.kernel_tables(e * ratio, dtype)
        return self._entry_stores[key]
