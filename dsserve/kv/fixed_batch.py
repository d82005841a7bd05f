"""A ``PagedBatch`` in fixed shapes: the static buffers a CUDA graph of a forward (or part of one) reads.

Every per-step value the kernels read is data in a buffer refilled before each run, never a Python scalar or a
shape: ``capacity`` rows of positions, tokens, window slots and the per-row sequence index (``row_seq``) and first
row (``row_first``); ``seq_capacity`` block tables of ``bound / block_size`` blocks; index sources score
``bound / r`` entries (``num_entries``), where ``bound`` is the context bucket (a position bound over every row),
-inf past each row's own. Padding rows repeat a real row's inputs, so they read only valid rows, and write nothing
(``real`` masks their window stores and ring tags).

Subclasses: ``DecodeBatch`` (one row per sequence, the whole model) and ``ReplayBatch`` (bounded replay's decoder
rows of a prefill step, several rows per sequence).
"""

from __future__ import annotations

import torch

from ..layers.rope import forget_tables
from .paged import PagedKVCache
from .paged_batch import PagedBatch


class FixedBatch(PagedBatch):
    def __init__(self, cache: PagedKVCache, capacity: int, seq_capacity: int, bound: int):
        if bound % cache.layout.block_size:
            raise ValueError(
                f"the context bound {bound} must be a multiple of the block size {cache.layout.block_size}"
            )
        dev, i32, i64 = cache.device, torch.int32, torch.long
        self.cache, self.capacity, self.seq_capacity, self.bound = cache, capacity, seq_capacity, bound
        self.tokens = torch.zeros(capacity, dtype=i64, device=dev)
        self.positions = torch.zeros(capacity, dtype=i64, device=dev)
        self.seq_tables = torch.full((seq_capacity, bound // cache.layout.block_size), -1, dtype=i32, device=dev)
        self.slots = torch.zeros(capacity, dtype=i64, device=dev)
        self.real = torch.zeros(capacity, dtype=torch.bool, device=dev)
        self.row_first = torch.zeros(capacity, dtype=i32, device=dev)
        self.row_seq = torch.zeros(capacity, dtype=i32, device=dev)
        self.seqs = []  # the paged path reads no per-sequence host value
        self.begin()

    def begin(self) -> None:
        """Drop what the previous run derived from the buffers (a graph's capture must record computing it)."""
        self.forget_derived()

    def forget_derived(self) -> None:
        """Drop what a run derived from the buffers. Also after a graph's capture: the graph recomputes all of it in
        every replay, so held here it would only keep the graph's scratch out of the shared pool."""
        self.topk = self.cand_blocks = None
        self._cos_sin, self._visible = {}, {}
        self._store_rows = self._window = self._no_rows = self._tag_rows = None
        self.key_tables = {}
        forget_tables()

    @property
    def block_rows(self) -> torch.Tensor:
        """[capacity, bound / block_size] each row's block table (exact-mode windows), gathered in the run."""
        return self.seq_tables[self.row_seq.long()]

    def tables(self, seqs: list, pad_to: int) -> torch.Tensor:
        """Host int32 [pad_to, bound / block_size]: the sequences' block tables (-1 past each), then copies of the
        first for padding."""
        width = self.seq_tables.shape[1]
        rows = [kv.host_table()[:width] for kv in seqs]
        out = torch.nn.utils.rnn.pad_sequence(
            rows + rows[:1] * (pad_to - len(seqs)), batch_first=True, padding_value=-1
        )
        return torch.nn.functional.pad(out, (0, width - out.shape[1]), value=-1)

    def check_bound(self, last_position: int) -> None:
        if last_position >= self.bound:
            raise ValueError(f"position {last_position} is past the batch's context bound {self.bound}")

    def num_entries(self, source: int) -> int:
        return self.bound // self.cache.layout.sources[source][0]

    def _window_store_rows(self) -> torch.Tensor:
        return torch.where(self.real, super()._window_store_rows(), -1)

    def narrow(self, keep, seqs):
        raise NotImplementedError("a fixed-shape batch keeps every row: bounded replay narrows before it")
