"""The paged cache as one forward's kernels see it: per-row tables of physical rows, built once per step.

The per-sequence reference path unpacks each sequence's rows into dense tensors. The batched path instead
hands the kernels flat pools ([rows, bytes]) plus, per query row t of the step:
- ``block_rows`` [T, MB] int32: the row's sequence's block table (-1 padded), for the exact-mode window;
- ``row_first`` [T] int32: the first row of t's sequence in this step, for the step's own window rows;
- per layer, ``old_window_rows`` [T, W] int32: the window rows written by earlier steps (-1 absent);
- ``seq_tables`` [S, MB] int32 and ``row_seq`` [T] int32: kernels.entry_rows maps a selected entry e of a source
  to pool row seq_tables[row_seq[t], e // epb] * epb + e % epb;
- ``window_store_rows`` [T] int64: where this step's window rows go (-1: overwritten within the step).
It also carries what index sources publish to later layers of the same forward (top-k, candidate blocks).
"""

from __future__ import annotations

import torch

from ..layers.indexer import visible_entries
from .paged import PagedKVCache

# layout row format -> the kernels' format name. V4's raw rows: bf16 ones are formats.BF16_ROWS byte for byte;
# fp32 / fp64 ones only the torch references read (their kinds name the dtype).
FORMAT_KIND = {
    "swa_fp8": "fp8",
    "main_fp4": "fp4",
    "index_fp4": "fp4",
    "bf16": "bf16",
    "raw-bfloat16": "bf16",
    "raw-float32": "raw-float32",
    "raw-float64": "raw-float64",
}
_REFERENCE_ONLY = ("attention", "indexer")  # the ops that read pool rows in a raw fp32 / fp64 format


def _upload(t: torch.Tensor, device) -> torch.Tensor:
    """A host tensor on ``device`` without a stream sync (the copy from pageable memory is staged first, so ``t``
    may be dropped at once)."""
    return t.to(device, non_blocking=True)


class PagedBatch:
    def __init__(self, cache: PagedKVCache, seqs, positions: torch.Tensor):
        self.cache, self.seqs, self.positions = cache, list(seqs), positions
        dev = positions.device
        counts = [s.rows.stop - s.rows.start for s in seqs]
        firsts, row = [], 0
        for n in counts:
            firsts += [row] * n
            row += n
        # built on the host and copied without waiting: nothing here reads the device back (CUDA-graph ready)
        self.row_first = _upload(torch.tensor(firsts, dtype=torch.int32), dev)
        # int32: the indexer kernels take it as is (no per-layer conversion)
        row_seq = torch.repeat_interleave(torch.arange(len(seqs), dtype=torch.int32), torch.tensor(counts))
        self.row_seq = _upload(row_seq, dev)
        mb = max(1, max(len(s.cache.block_table) for s in seqs))
        tables = torch.full((len(seqs), mb), -1, dtype=torch.int32)
        for i, s in enumerate(seqs):
            tables[i, : len(s.cache.block_table)] = torch.tensor(s.cache.block_table, dtype=torch.int32)
        self.seq_tables = _upload(tables, dev)
        self.block_rows = self.seq_tables[self.row_seq]
        self.slots = _upload(torch.tensor([s.cache.slot for s in seqs], dtype=torch.long)[row_seq.long()], dev)
        self.topk: tuple[torch.Tensor, torch.Tensor] | None = None  # (entry ids [T, K], valid [T, K])
        self.cand_blocks: torch.Tensor | None = None  # [T, top_blocks] int32, -1 none
        self._cos_sin: dict = {}
        self._store_rows: torch.Tensor | None = None
        self._window = None  # old_window_rows' layer-independent part, built on first use
        self._visible: dict = {}
        self._no_rows: torch.Tensor | None = None
        self._tag_rows = None  # (window_store_rows, their tag indices), see record_window
        # (kind, source) -> a long chunk's bf16 entry table (layers.attention_paged), built by the first layer that
        # reads it after the source's compressor published this step's entries, reused by the layers after it
        self.key_tables: dict = {}

    @classmethod
    def supports(cls, seqs, ops) -> bool:
        """One paged cache whose row formats the ops read: V4.1's packed rows, V4's raw bf16 rows; V4's raw fp32 /
        fp64 rows when the ops reading them run their torch references (``ops``: kernels.ops.KernelOps)."""
        caches = {id(getattr(s.cache, "cache", None)) for s in seqs}
        c = getattr(seqs[0].cache, "cache", None) if seqs else None
        if len(caches) != 1 or not isinstance(c, PagedKVCache):
            return False
        return cls.layout_supported(c.layout, ops)

    @staticmethod
    def layout_supported(layout, ops) -> bool:
        """Whether the ops read this layout's row formats (see ``supports``)."""
        kinds = [
            FORMAT_KIND.get(getattr(f, "name", None))
            for f in (layout.window_fmt, layout.main_fmt, layout.index_fmt)
            if f is not None
        ]
        if None in kinds:
            return False
        return all(not k.startswith("raw-") for k in kinds) or all(op in ops.reference for op in _REFERENCE_ONLY)

    # -------------------------------------------------------------------------- per rope
    def cos_sin(self, rope, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """[T, R/2] at the rows' positions, once per rope per step: fp32 (what the kernels take), or fp64
        for an fp64 model, whose reference path rotates in fp64."""
        key = (rope.spec, dtype == torch.float64)
        if key not in self._cos_sin:
            self._cos_sin[key] = rope.kernel_tables(self.positions, dtype)
        return self._cos_sin[key]

    def visible(self, ratio: int) -> torch.Tensor:
        """[T] int32: entries of a ratio-r source each row may read, once per ratio per step."""
        if ratio not in self._visible:
            self._visible[ratio] = visible_entries(self.positions, ratio).to(torch.int32)
        return self._visible[ratio]

    def no_rows(self) -> torch.Tensor:
        """[T] int64 of -1: store nothing (the window entry computed before the attention, stored after)."""
        if self._no_rows is None:
            self._no_rows = torch.full(self.positions.shape, -1, dtype=torch.long, device=self.positions.device)
        return self._no_rows

    # -------------------------------------------------------------------------- window
    def _first_positions(self) -> torch.Tensor:
        return self.positions[self.row_first.long()]

    def old_window_rows(self, layer: int, ops=None) -> torch.Tensor:
        """[T, W] int32: physical rows of positions p-W+1..p written before this step, -1 if absent. ``ops``
        (kernels.ops.KernelOps): the per-layer tag check in one kernel."""
        if self._window is None:
            self._window = self._window_candidates()
        q, tag_at, rows = self._window
        if tag_at is None:  # exact mode: the rows come from the block tables, the same for every layer
            return rows
        # the ring's slot holds position q only if this layer's tag says so (the slot may hold an older one)
        if ops is not None:
            return ops.window_rows(self.cache.window_tags[layer], tag_at, q, rows)
        return torch.where(self.cache.window_tags[layer][tag_at] == q, rows, -1)

    def _window_candidates(self):
        """The layer-independent part of old_window_rows, once per step: positions q [T, W], the ring rows whose
        tags to compare (flat indices into window_tags) and the physical rows (int32, -1 where q is negative or
        not before this step); exact mode: (q, None, the final rows)."""
        lay = self.cache.layout
        w = lay.window
        q = self.positions[:, None] - (w - 1) + torch.arange(w, device=self.positions.device)[None, :]
        ok = (q >= 0) & (q < self._first_positions()[:, None])
        qc = q.clamp_min(0)
        if lay.window_in_blocks:
            bs = lay.block_size
            blk = self.block_rows.long().gather(1, (qc // bs).clamp(max=self.block_rows.shape[1] - 1))
            return q, None, torch.where(ok, blk * bs + qc % bs, -1).to(torch.int32)
        at = self.slots[:, None] * w + qc % w
        return q, at, torch.where(ok, at, -1).to(torch.int32)

    def window_store_rows(self) -> torch.Tensor:
        """[T] int64: this step's window row destinations, the same for every layer (computed once). A ring
        keeps only each sequence's last W rows (an earlier row would share a slot with a later one)."""
        if self._store_rows is None:
            self._store_rows = self._window_store_rows()
        return self._store_rows

    def _window_store_rows(self) -> torch.Tensor:
        lay = self.cache.layout
        p = self.positions
        if lay.window_in_blocks:
            bs = lay.block_size
            return self.block_rows.long().gather(1, (p // bs)[:, None])[:, 0] * bs + p % bs
        last = torch.full((self.seq_tables.shape[0],), -1, dtype=p.dtype, device=p.device)  # per sequence
        last.scatter_reduce_(0, self.row_seq.long(), p, reduce="amax")
        keep = p > last[self.row_seq] - lay.window
        return torch.where(keep, self.slots * lay.window + p % lay.window, -1)

    def window_store_pairs(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(step rows [M], their window rows [M]) int64: the rows ``window_store_rows`` stores, listed (M = each
        sequence's last W rows, or all of them in exact mode), from the host's positions: V4's raw rows are
        stored by one index_copy, which must see no -1 and no repeated destination."""
        if getattr(self, "_store_pairs", None) is None:
            lay, src, dst, row = self.cache.layout, [], [], 0
            w, bs = lay.window, lay.block_size
            for s in self.seqs:
                n = s.rows.stop - s.rows.start
                first = s.first if s.first is not None else s.cache.num_tokens
                # exact mode: not the rows run again before a prefix hit (already in the shared cached blocks)
                keep = (
                    range(max(0, s.cache.published_until - first), n)
                    if lay.window_in_blocks
                    else range(max(0, n - w), n)
                )
                for i in keep:
                    p = first + i
                    src.append(row + i)
                    dst.append(
                        s.cache.block_table[p // bs] * bs + p % bs if lay.window_in_blocks else s.cache.slot * w + p % w
                    )
                row += n
            dev = self.positions.device
            self._store_pairs = (
                _upload(torch.tensor(src, dtype=torch.long), dev),
                _upload(torch.tensor(dst, dtype=torch.long), dev),
            )
        return self._store_pairs

    def record_window(self, layer: int, rows: torch.Tensor) -> None:
        """The ring's position tags for the rows just stored (exact mode stores by position: no tags)."""
        if not self.cache.layout.window_in_blocks:
            # one scatter, no mask: the stored rows' slots are distinct, rows that store nothing write the spare
            # element at the end (boolean indexing would read the count back from the device)
            tags = self.cache.window_tags[layer]
            if self._tag_rows is None or self._tag_rows[0] is not rows:
                self._tag_rows = (rows, torch.where(rows >= 0, rows, tags.numel() - 1))
            tags.scatter_(0, self._tag_rows[1], self.positions)

    # -------------------------------------------------------------------------- global entries
    def num_entries(self, source: int) -> int:
        return max(s.cache.num_entries(source) for s in self.seqs)

    # -------------------------------------------------------------------------- bounded replay
    def narrow(self, keep: torch.Tensor, seqs) -> "PagedBatch":
        """The same step restricted to the kept rows (a suffix of each sequence's rows)."""
        out = object.__new__(PagedBatch)
        out.cache, out.seqs, out.positions = self.cache, list(seqs), self.positions[keep]
        counts = [s.rows.stop - s.rows.start for s in seqs]
        firsts, row = [], 0
        for n in counts:
            firsts += [row] * n
            row += n
        out.row_first = _upload(torch.tensor(firsts, dtype=torch.int32), self.positions.device)
        out.row_seq, out.seq_tables = self.row_seq[keep], self.seq_tables
        out.block_rows, out.slots = self.block_rows[keep], self.slots[keep]
        out.topk = None if self.topk is None else (self.topk[0][keep], self.topk[1][keep])
        out.cand_blocks = None if self.cand_blocks is None else self.cand_blocks[keep]
        out._cos_sin = {k: (c[keep], s[keep]) for k, (c, s) in self._cos_sin.items()}
        out._store_rows = None  # the kept rows' last W per sequence differ from the full step's
        out._window, out._visible, out._no_rows, out._tag_rows = None, {}, None, None
        out.key_tables = self.key_tables  # the same sequences, in the same order
        return out
