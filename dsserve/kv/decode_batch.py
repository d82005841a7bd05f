"""A decode step's ``PagedBatch`` in fixed shapes: the static buffers a CUDA graph of the step reads.

One row per sequence, padded to ``capacity`` rows; every per-step value the kernels read is data in a buffer
refilled before each run (``fill``), never a Python scalar or a shape: block tables are [capacity, bound / block]
and the index sources score ``bound / r`` entries (``num_entries``), where ``bound`` is the context bucket (a
position bound over every row). Padding rows repeat row 0's inputs, so they read only valid rows, and write
nothing: their window and entry stores go to row -1 and their compressor carry to the spare slot (``real``).
"""
from __future__ import annotations

import torch

from ..layers.context import SeqRows
from ..layers.rope import forget_tables
from .paged import PagedKVCache, SequenceKV
from .paged_batch import PagedBatch


class DecodeBatch(PagedBatch):
    is_decode = True

    def __init__(self, cache: PagedKVCache, capacity: int, bound: int):
        if bound % cache.layout.block_size:
            raise ValueError(f"the context bound {bound} must be a multiple of the block size "
                             f"{cache.layout.block_size}")
        dev, i32, i64 = cache.device, torch.int32, torch.long
        self.cache, self.capacity, self.bound = cache, capacity, bound
        self.tokens = torch.zeros(capacity, dtype=i64, device=dev)
        self.positions = torch.zeros(capacity, dtype=i64, device=dev)
        self.seq_tables = torch.full((capacity, bound // cache.layout.block_size), -1, dtype=i32, device=dev)
        self.slots = torch.zeros(capacity, dtype=i64, device=dev)
        self.carry_slots = torch.zeros(capacity, dtype=i64, device=dev)  # the spare slot for padding rows
        self.real = torch.zeros(capacity, dtype=torch.bool, device=dev)
        self.row_first = self.row_seq = torch.arange(capacity, dtype=i32, device=dev)  # each row its own sequence
        self.block_rows = self.seq_tables
        self.seqs = [SeqRows(slice(t, t + 1), None) for t in range(capacity)]
        # Engram (filled by the model's fill_decode): compressed ids [capacity], per layer row ids or rows
        self.engram_ids: torch.Tensor | None = None
        self.engram_rows: dict[int, torch.Tensor] = {}
        self.begin()

    def begin(self) -> None:
        """Drop what the previous run derived from the buffers (a graph's capture must record computing it)."""
        self.topk = self.cand_blocks = None
        self._cos_sin, self._visible, self._entry_stores = {}, {}, {}
        self._store_rows = self._window = self._no_rows = self._tag_rows = None
        forget_tables()

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
        if max(pos) >= self.bound:
            raise ValueError(f"position {max(pos)} is past the batch's context bound {self.bound}")
        spare = self.cache.slots.num_blocks
        width = self.seq_tables.shape[1]
        rows = [kv.host_table()[:width] for kv in seqs]
        tables = torch.nn.utils.rnn.pad_sequence(rows + rows[:1] * (cap - b), batch_first=True, padding_value=-1)
        tables = torch.nn.functional.pad(tables, (0, width - tables.shape[1]), value=-1)
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

    def num_entries(self, source: int) -> int:
        return self.bound // self.cache.layout.sources[source][0]

    def _window_store_rows(self) -> torch.Tensor:
        return torch.where(self.real, super()._window_store_rows(), -1)

    def narrow(self, keep, seqs):
        raise NotImplementedError("a decode step keeps every row: bounded replay never narrows it")
