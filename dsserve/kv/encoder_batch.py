"""The encoder rows of a prefill step in fixed shapes (``ReplayBatch`` plus the compressors' state): what a CUDA
graph of the encoder layers reads.

With bounded replay a prefix hit's step runs the encoder on the replayed window rows plus the new tokens (a few
hundred rows through 20 layers: host-bound when eager). Unlike the decoder, the encoder layers own compressors
(V4.1's ratio-2 sources), so on top of ``ReplayBatch`` each row carries where its sequence may start storing global
entries (``store_from``: entries below a prefix hit's ``published_until`` are the cache's, read-only) and its
compressor carry slot (``carry_slots``: the spare slot for padding). A row completes its group's entry when
(p + 1) % r == 0; the group's earlier rows are this step's rows of its sequence, or, before the step's first row,
the carried rows of the previous step (``layers.compress_paged.compress_rows``). The host's entry and carried-row
counts follow in ``commit``.
"""

from __future__ import annotations

import torch

from ..layers.context import SeqRows
from .replay_batch import ReplayBatch


class EncoderBatch(ReplayBatch):
    is_fixed_rows = True  # layers.compress_paged: several rows a sequence, in fixed shapes

    def __init__(self, cache, capacity: int, seq_capacity: int, bound: int):
        dev = cache.device
        self.store_from = torch.zeros(capacity, dtype=torch.long, device=dev)
        self.carry_slots = torch.zeros(capacity, dtype=torch.long, device=dev)
        super().__init__(cache, capacity, seq_capacity, bound)

    def forget_derived(self) -> None:
        super().forget_derived()
        self._entry_stores, self._seq_last = {}, None

    @staticmethod
    def fits(seqs: list[SeqRows], sources: dict[int, int]) -> str | None:
        """Why these sequences' rows cannot run the encoder in fixed shapes (None: they can). ``sources``: the
        encoder's KV sources, layer -> ratio. The host counts must be those of a sequence that ran every position
        before its first row, or of a prefix hit (entries up to ``published_until``, nothing carried)."""
        for s in seqs:
            kv, n = s.cache, s.rows.stop - s.rows.start
            pub = kv.published_until
            if s.first + n <= pub:
                return "every row of a sequence is inside its cached prefix"
            for src, r in sources.items():
                restart = pub - pub % r > s.first  # a hit: the rows from the boundary group on are pooled again
                carried = 0 if restart or r == 1 else s.first % r
                if kv.num_entries(src) != max(s.first, pub) // r or (r > 1 and kv.carried.get(src, 0) != carried):
                    return f"source {src}'s entries or carried rows do not match the rows' first position"
        return None

    def fill(self, seqs: list[SeqRows], tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        index = super().fill(seqs, tokens, positions)
        live = [s for s in seqs if s.rows.stop > s.rows.start]
        store_from, carry = [], []
        for s in live:
            k = s.rows.stop - s.rows.start
            store_from += [max(s.first, s.cache.published_until)] * k
            carry += [s.cache.slot] * k
        pad = self.capacity - len(carry)
        spare = self.cache.slots.num_blocks
        self.store_from.copy_(torch.tensor(store_from + store_from[-1:] * pad), non_blocking=True)
        self.carry_slots.copy_(torch.tensor(carry + [spare] * pad), non_blocking=True)
        return index

    def mask_writes(self) -> None:
        super().mask_writes()
        self.carry_slots.fill_(self.cache.slots.num_blocks)

    def seq_last(self) -> torch.Tensor:
        """[capacity] the last position of each row's sequence in this step (once a run)."""
        if self._seq_last is None:
            p = self.positions
            last = torch.full((self.seq_tables.shape[0],), -1, dtype=p.dtype, device=p.device)
            last.scatter_reduce_(0, self.row_seq.long(), p, reduce="amax")
            self._seq_last = last[self.row_seq.long()]
        return self._seq_last

    def first_positions(self) -> torch.Tensor:
        return self._first_positions()

    def entry_stores(self, ratio: int, rope, dtype: torch.dtype):
        """Per row, where a ratio-r source stores the entry the row completes (-1: none completes, a cached entry,
        or padding) and the RoPE tables at that entry's position; computed once per ratio per run."""
        key = (ratio, rope.spec, dtype == torch.float64)
        if key not in self._entry_stores:
            bs, p = self.cache.layout.block_size, self.positions
            epb = bs // ratio
            e = torch.div(p, ratio, rounding_mode="floor")
            done = ((p + 1) % ratio == 0) & self.real & (e >= torch.div(self.store_from, ratio, rounding_mode="floor"))
            rows = torch.where(done, self.block_rows.long().gather(1, (p // bs)[:, None])[:, 0] * epb + e % epb, -1)
            self._entry_stores[key] = rows, rope.kernel_tables(e * ratio, dtype)
        return self._entry_stores[key]

    @staticmethod
    def commit(seqs: list[SeqRows], sources: dict[int, int]) -> None:
        """The host's side of the run: each sequence's entry and carried-row counts after its rows."""
        for s in seqs:
            kv, end = s.cache, s.first + s.rows.stop - s.rows.start
            for src, r in sources.items():
                kv._entries[src] = max(kv.num_entries(src), end // r)
                if r > 1:
                    kv.carried[src] = end % r
