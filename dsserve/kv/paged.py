"""The paged KV cache: every kind of state a running request carries, in fixed-size pools.

Kinds (spec 3.1), each with its own allocation rule:
- global main KV and index keys, one pool per KV source layer, paged in blocks of ``block_size`` tokens
  (``block_size / ratio`` entries per block); stored packed as the release does (FP4 main 288 B, FP4 index
  68 B per entry) or bf16 for debugging; read by every consumer layer of that source;
- the sliding window, one ring of ``W`` rows per layer per running request (FP8, 528 B per row), in window
  slots that are reused, never grown with context;
- the compressor's not-yet-pooled rows and the Engram lookback, small per-request tensors.

With prefix caching, full blocks are registered in a ``PrefixCache`` and shared by later requests. In exact
mode (no bounded replay) the window rows live in the blocks too, so a hit restores the window exactly.

A ``SequenceKV`` is one request's view; it has the methods of ``SequenceCache`` so the model runs on it
unchanged.
"""

from __future__ import annotations

import math

import torch

from .block_pool import BlockPool, InvariantError
from .layout import KV_CACHE_DTYPES, KVLayout, RawRows  # noqa: F401 - re-exported: the pools' shape
from .prefix_cache import PrefixCache, block_hashes


class PagedKVCache:
    def __init__(
        self,
        layout: KVLayout,
        num_blocks: int,
        num_window_slots: int,
        dtype: torch.dtype = torch.float32,
        prefix_caching: bool = False,
        engram_token_map: torch.Tensor | None = None,
        device: torch.device | str = "cpu",
    ):
        self.layout, self.dtype, self.device = layout, dtype, torch.device(device)
        self.prefix = PrefixCache() if prefix_caching else None
        # Engram histories live on the host (a few ids a sequence): the host-table prefetch hashes them there,
        # and the device path uploads them without a wait
        self.engram_token_map = None if engram_token_map is None else engram_token_map.cpu()
        self.blocks = BlockPool(
            num_blocks, "global KV block", on_evict=self.prefix.evict if self.prefix is not None else None
        )
        self.slots = BlockPool(num_window_slots, "window slot")
        u8, dev = torch.uint8, self.device
        self.main = {
            s: torch.zeros(num_blocks, epb, layout.main_fmt.row_bytes, dtype=u8, device=dev)
            for s, (_, epb) in layout.sources.items()
        }
        self.index = (
            {
                s: torch.zeros(num_blocks, epb, layout.index_fmt.row_bytes, dtype=u8, device=dev)
                for s, (_, epb) in layout.sources.items()
            }
            if layout.index_fmt
            else {}
        )
        # The window: a ring per running request (slots), or, in exact-mode prefix caching, rows in the blocks.
        # Every layer's window is a view of one buffer [layers, n, rows, bytes], so that a speculative step saves and
        # restores a sequence's ring rows of all layers in one copy each (SequenceKV.save_rows, rollback).
        rows, n = (layout.block_size, num_blocks) if layout.window_in_blocks else (layout.window, num_window_slots)
        layers = layout.window_layers
        self.window_all = torch.zeros(len(layers), n, rows, layout.window_fmt.row_bytes, dtype=u8, device=dev)
        self.window = {i: self.window_all[j] for j, i in enumerate(layers)}
        # The ring's position tags [slots, W] per layer, over a flat buffer with one spare element at the end: a
        # step's rows that store nothing scatter their tags there (no mask, so no count read back from the device)
        self.window_tags_all = None
        if not layout.window_in_blocks:
            self.window_tags_all = torch.full((len(layers), n * rows + 1), -1, dtype=torch.long, device=dev)
        self.window_tags = {} if self.window_tags_all is None else dict(zip(layers, self.window_tags_all))
        self.window_pos = {i: t[:-1].view(n, rows) for i, t in self.window_tags.items()}
        self._carry: dict = {}  # see carry()
        self._rings: dict = {}  # see pending_ring()

    def carry(self, source: int, width: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """The compressor's not-yet-pooled rows of a ratio-r source on the batched path: (u, z) projections
        [window slots + 1, r - 1, width] indexed by window slot (a sequence carries at most r - 1 rows; which of them
        are live is host state, ``SequenceKV.carried``). The spare last slot takes the writes of a decode batch's
        padding rows. On the device, so a captured decode step reads and writes them in place."""
        if source not in self._carry:
            r = self.layout.sources[source][0]
            shape = (self.slots.num_blocks + 1, r - 1, width)
            self._carry[source] = tuple(torch.zeros(shape, dtype=dtype, device=self.device) for _ in range(2))
        return self._carry[source]

    def pending_ring(self, key: int, rows: int, width: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """V4's compressor rows not yet pooled, for fixed-shape decode steps: (u, z) [window slots + 1, rows, width]
        by window slot, position p at row p % rows (rows: r, or 2r for an overlapping compressor, whose entries also
        pool the group before). ``key``: a source layer, or -1 - layer for its indexer's compressor (as
        ``SequenceKV.pending``). The spare last slot takes a decode batch's padding rows. Which rows are live is
        host state (``RingPending``)."""
        if key not in self._rings:
            shape = (self.slots.num_blocks + 1, rows, width)
            self._rings[key] = tuple(torch.zeros(shape, dtype=dtype, device=self.device) for _ in range(2))
        ring = self._rings[key]
        if ring[0].shape[1:] != (rows, width) or ring[0].dtype != dtype:
            raise InvariantError(
                f"compressor ring {key} is {tuple(ring[0].shape[1:])} {ring[0].dtype}, "
                f"asked for {(rows, width)} {dtype}"
            )
        return ring

    # -------------------------------------------------------------------------- per request
    def new_sequence(self) -> "SequenceKV":
        slot = self.slots.allocate(1)[0]
        for pos in self.window_pos.values():
            pos[slot] = -1
        return SequenceKV(self, slot)

    # -------------------------------------------------------------------------- prefix cache
    def match(self, tokens: list[int], salt: str | None = None) -> tuple[list[int], list[bytes]]:
        """The cached blocks of the longest prefix of ``tokens`` that leaves at least one token to compute
        (the last row must run to give logits), and the chain of full-block hashes of ``tokens``."""
        if self.prefix is None:
            return [], []
        hashes = block_hashes(tokens, self.layout.block_size, salt)
        usable = (len(tokens) - 1) // self.layout.block_size
        return self.prefix.lookup(hashes[:usable]), hashes

    def attach_prefix(self, seq: "SequenceKV", blocks: list[int], tokens: list[int], replay_floor: int | None) -> int:
        """Start ``seq`` on cached ``blocks``; returns the first position the model must run.

        The global entries of the hit are read, never rewritten (``published_until``). With bounded replay
        the model resumes at ``replay_floor`` (rows from there to the hit rebuild the window); in exact mode
        the window comes with the blocks and the model resumes at the hit.
        """
        self.blocks.touch(blocks)
        seq.block_table, seq._table, seq._host_table = list(blocks), None, None
        hit = len(blocks) * self.layout.block_size
        for source, (ratio, _) in self.layout.sources.items():
            seq._entries[source] = hit // ratio
        seq.published_until = hit
        start = hit if replay_floor is None else min(hit, replay_floor)
        start = max(0, min(start, hit - self.layout.resume_rows))
        seq.num_tokens = start
        if self.engram_token_map is not None and start:
            lb = self.layout.engram_lookback
            seq.engram_history = self.engram_token_map[torch.tensor(tokens[max(0, start - lb) : start])]
        return start

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix and end the session holds; False (nothing done) while any block is in use,
        since a live sequence would go on registering the blocks it holds."""
        if self.blocks.num_used:
            return False
        if self.prefix is not None:
            self.prefix.clear()
        self.blocks.expire_holds(float("inf"))
        return True

    def register_full_blocks(self, seq: "SequenceKV", hashes: list[bytes]) -> None:
        """Blocks whose every row has been through the model become shareable at once."""
        if self.prefix is None:
            return
        full = min(seq.num_tokens // self.layout.block_size, len(hashes), len(seq.block_table))
        for b in range(seq.num_registered, full):
            self.prefix.register(seq.block_table[b], hashes[b])
        seq.num_registered = max(seq.num_registered, full)

    @property
    def rollback_multiple(self) -> int:
        """A speculative step's rows are kept up to a multiple of this (every source ratio divides it): there no
        compressor carries a part group, so a rollback rebuilds no carried rows (``SequenceKV.rollback``)."""
        return math.lcm(1, *(r for r, _ in self.layout.sources.values()))

    def blocks_needed(self, seq: "SequenceKV", total_tokens: int) -> int:
        return max(0, -(-total_tokens // self.layout.block_size) - len(seq.block_table))

    def grow(self, seq: "SequenceKV", total_tokens: int) -> None:
        """Make room for the request's first ``total_tokens`` tokens (the scheduler checked it fits)."""
        seq.block_table.extend(self.blocks.allocate(self.blocks_needed(seq, total_tokens)))

    def release(self, seq: "SequenceKV", hold_until: float | None = None) -> None:
        self.blocks.free(seq.block_table, hold_until)
        self.slots.free([seq.slot])
        seq.block_table, seq.slot, seq._table, seq._host_table = [], None, None, None

    def check(self, live: list["SequenceKV"], held: list[int] = ()) -> None:
        """After every step: each live request's blocks and slot are owned once, nothing else is used. ``held``:
        block references taken outside any sequence (a P/D load's blocks before admission)."""
        self.blocks.check([b for s in live for b in s.block_table] + list(held))
        self.slots.check([s.slot for s in live])
        for s in live:
            if len(s.block_table) * self.layout.block_size < s.num_tokens:
                raise InvariantError(f"a request holds {len(s.block_table)} blocks for {s.num_tokens} tokens")

    def report(self) -> dict[str, int]:
        lay = self.layout
        return {
            "global_blocks": self.blocks.num_blocks,
            "block_size": lay.block_size,
            "global_bytes": self.blocks.num_blocks * lay.bytes_per_block,
            "window_in_blocks": lay.window_in_blocks,
            "global_bytes_per_token": lay.global_bytes_per_token(),
            "window_slots": self.slots.num_blocks,
            "window_bytes": self.slots.num_blocks * lay.bytes_per_window_slot,
            "window_row_bytes": lay.window_fmt.row_bytes,
        }


class RingPending:
    """A sequence's pending compressor rows held in ``PagedKVCache.pending_ring`` since position ``first``: those the
    eager pooling would still keep at its token count (from the last complete group when ``overlap``, else from the
    first incomplete one; groups of ``ratio``), which need no host update per step. ``ring``: (rows, width, dtype)."""

    __slots__ = ("first", "ring", "ratio", "overlap")

    def __init__(self, first: int, ring: tuple[int, int, torch.dtype], ratio: int, overlap: bool):
        self.first, self.ring, self.ratio, self.overlap = first, ring, ratio, overlap

    def live_from(self, end: int) -> int:
        done = end // self.ratio
        keep = max(0, (done - 1) * self.ratio) if self.overlap else done * self.ratio
        return max(keep, self.first)


class SequenceKV:
    """One request's slice of the paged cache, with ``SequenceCache``'s methods."""

    def __init__(self, cache: PagedKVCache, slot: int):
        self.cache, self.slot = cache, slot
        self.block_table: list[int] = []
        self._table: torch.Tensor | None = None
        self._host_table: torch.Tensor | None = None
        self.num_tokens = 0
        self.published_until = 0  # global entries of positions below this came from the prefix cache
        self._unpacked = None  # (source, entries, main, index) of the last global_kv read
        self.num_registered = 0  # leading blocks already in the prefix cache
        self._entries: dict[int, int] = {}
        self._pending: dict = {}  # the per-sequence reference path's carried rows (tensors)
        self.carried: dict[int, int] = {}  # batched path: source -> carried rows in PagedKVCache.carry (0: none)
        self.rings_live = False  # every V4 compressor's pending rows are in the rings (see pending_to_ring)
        self.engram_history = torch.empty(0, dtype=torch.long)  # host, see PagedKVCache
        self._saved = None  # a speculative step's window rows, see save_rows

    def table(self) -> torch.Tensor:
        """The block table as a LongTensor on the cache's device, rebuilt only when it grew (tables only
        grow, or are replaced whole by attach_prefix / release, which drop this copy)."""
        if self._table is None or self._table.shape[0] != len(self.block_table):
            self._table = torch.tensor(self.block_table, dtype=torch.long).to(self.cache.device, non_blocking=True)
        return self._table

    def host_table(self) -> torch.Tensor:
        """The block table as a host int32 tensor, rebuilt only when it grew (see ``table``)."""
        if self._host_table is None or self._host_table.shape[0] != len(self.block_table):
            self._host_table = torch.tensor(self.block_table, dtype=torch.int32)
        return self._host_table

    # window ---------------------------------------------------------------------------
    def window_rows(self, layer: int):
        c = self.cache
        if c.layout.window_in_blocks:
            pos = torch.arange(max(0, self.num_tokens - c.layout.window), self.num_tokens, device=c.device)
            if pos.numel() == 0:
                return None, None
            bs = c.layout.block_size
            phys = self.table()[pos // bs]
            return c.layout.window_fmt.unpack(c.window[layer][phys, pos % bs], c.dtype), pos
        # The whole ring, oldest position first, empty rows (position -1) last: the reader masks them. Counting the
        # live rows on the host would wait for the device twice a layer and sequence (V4's eager GPU steps did).
        pos = c.window_pos[layer][self.slot]
        order = torch.argsort(torch.where(pos >= 0, pos, torch.iinfo(pos.dtype).max))
        return c.layout.window_fmt.unpack(c.window[layer][self.slot, order], c.dtype), pos[order]

    def push_window(self, layer: int, keys: torch.Tensor, positions: torch.Tensor) -> None:
        c, w = self.cache, self.cache.layout.window
        if c.layout.window_in_blocks:
            # rows run again before a prefix hit (layout.resume_rows) are in the shared cached blocks already
            skip = max(0, self.published_until - self.num_tokens)
            keys, positions = keys[skip:], positions[skip:]
            bs = c.layout.block_size
            phys = self.table()[positions // bs]
            c.window[layer][phys, positions % bs] = c.layout.window_fmt.pack(keys)
            return
        keys, positions = keys[-w:], positions[-w:]
        ring = positions % w
        c.window[layer][self.slot, ring] = c.layout.window_fmt.pack(keys)
        c.window_pos[layer][self.slot, ring] = positions

    # global KV ------------------------------------------------------------------------
    def num_entries(self, source: int) -> int:
        return self._entries.get(source, 0)

    def global_kv(self, source: int):
        c = self.cache
        n = self.num_entries(source)
        # A source's consumers are consecutive layers (20..39 read 20): unpack once per step, not per layer.
        # Entries only ever append, so (source, count) names the content; one entry bounds the memory.
        if self._unpacked is not None and self._unpacked[:2] == (source, n):
            return self._unpacked[2:]
        _, epb = c.layout.sources[source]
        table = self.table()[: -(-n // epb)]
        main = c.layout.main_fmt.unpack(c.main[source][table].flatten(0, 1)[:n], c.dtype)
        index = (
            c.layout.index_fmt.unpack(c.index[source][table].flatten(0, 1)[:n], c.dtype) if source in c.index else None
        )
        self._unpacked = (source, n, main, index)
        return main, index

    def push_global(self, source: int, main: torch.Tensor, index_k: torch.Tensor | None) -> None:
        c = self.cache
        n0, n = self.num_entries(source), main.shape[0]
        if n == 0:
            return
        rows = self.entry_rows(source, n0, n)
        # The model already fake-quantised these rows: store them exactly (see formats.pack_main_fp4).
        c.main[source].view(-1, c.main[source].shape[-1])[rows] = c.layout.main_fmt.pack(main, prequantized=True)
        if index_k is not None and source in c.index:
            c.index[source].view(-1, c.index[source].shape[-1])[rows] = c.layout.index_fmt.pack(index_k)
        self._entries[source] = n0 + n

    def entry_rows(self, source: int, first: int, n: int) -> torch.Tensor:
        """Physical rows (in the source's pools seen as [blocks * epb, bytes]) of entries first..first+n-1."""
        _, epb = self.cache.layout.sources[source]
        last = first + n - 1
        if last // epb >= len(self.block_table):
            raise InvariantError(f"entry {last} of source {source} has no block: the scheduler under-allocated")
        e = torch.arange(first, first + n, device=self.cache.device)
        return self.table()[e // epb] * epb + e % epb

    # compressor rows and Engram lookback ---------------------------------------------------
    def pending(self, source: int):
        """(u, z, position of the first row) of the compressor rows not yet pooled, or None. Rows a fixed-shape decode
        step left in the cache's ring are gathered from it here (device indexing, no wait)."""
        state = self._pending.get(source)
        if isinstance(state, RingPending):
            u, z = self.cache.pending_ring(source, *state.ring)
            first = state.live_from(self.num_tokens)
            at = torch.arange(first, self.num_tokens).remainder(state.ring[0]).to(u.device, non_blocking=True)
            state = (u[self.slot, at], z[self.slot, at], first)
            self._pending[source] = state
            self.rings_live = False
        return state

    def pending_to_ring(self, source: int, ring: tuple[int, int, torch.dtype], ratio: int, overlap: bool) -> None:
        """Before a fixed-shape decode step: the pending rows (if still tensors) into the ring, which then holds
        positions from theirs (none pending: from this step's) on; the step reads the groups it completes there."""
        state, first = self._pending.get(source), self.num_tokens
        if isinstance(state, RingPending):
            return
        if state is not None:
            u, z = self.cache.pending_ring(source, *ring)
            n = state[0].shape[0]
            at = torch.arange(state[2], state[2] + n).remainder(ring[0]).to(u.device, non_blocking=True)
            u[self.slot, at] = state[0]
            z[self.slot, at] = state[1]
            first = state[2]
        self._pending[source] = RingPending(first, ring, ratio, overlap)

    def set_pending(self, source: int, state) -> None:
        self.rings_live = False
        if state is None:
            self._pending.pop(source, None)
        else:
            self._pending[source] = state

    # speculative steps -------------------------------------------------------------------
    def save_rows(self, first: int, n: int) -> None:
        """Before a step whose rows at positions first..first+n-1 may be rolled back: the window ring rows they will
        overwrite (positions W before them) are copied aside, with their tags, for ``rollback``."""
        c, w = self.cache, self.cache.layout.window
        saved = None
        if not c.layout.window_in_blocks:
            if n > w:
                raise InvariantError(f"a speculative step of {n} rows overwrites more than the window's {w}")
            ring = torch.arange(first, first + n, device=c.device) % w
            # every layer's rows and tags in one copy each (advanced indexing copies: the saved rows are their own)
            tags = c.window_tags_all[:, :-1].view(len(c.window), -1, w)
            saved = (c.window_all[:, self.slot, ring], tags[:, self.slot, ring])
        self._saved = (first, n, saved)

    def rollback(self, keep: int, token_ids: list[int]) -> None:
        """After the step ``save_rows`` announced: forget every row at or after position ``keep`` (a multiple of
        ``PagedKVCache.rollback_multiple``, not before the step's first row). The window ring gets its overwritten
        rows back; global entries past ``keep`` are dropped from the counts (their pool rows are written again before
        they are read); no compressor carries rows; the Engram lookback is rebuilt from ``token_ids`` (the sequence's
        tokens, at least ``keep`` of them); blocks past ``keep`` go back to the pool (never registered: registration
        follows this)."""
        c, (first, n, saved) = self.cache, self._saved
        self._saved = None
        if not first <= keep <= first + n or keep % c.rollback_multiple:
            raise InvariantError(f"rollback to {keep}: the step ran rows {first}..{first + n - 1}")
        if keep == first + n:
            return
        if saved is not None:
            back, w = slice(keep - first, n), c.layout.window
            ring = torch.arange(keep, first + n, device=c.device) % w
            c.window_all[:, self.slot, ring] = saved[0][:, back]
            c.window_tags_all[:, :-1].view(len(c.window), -1, w)[:, self.slot, ring] = saved[1][:, back]
        for source, (ratio, _) in c.layout.sources.items():
            self._entries[source] = min(self._entries.get(source, 0), keep // ratio)
        self.carried = dict.fromkeys(self.carried, 0)
        self._pending.clear()
        self.rings_live = False
        self._unpacked = None
        self.num_tokens = keep
        if c.engram_token_map is not None:
            lb = c.layout.engram_lookback
            self.engram_history = c.engram_token_map[
                torch.tensor(token_ids[max(0, keep - lb) : keep], dtype=torch.long)
            ]
        need = -(-keep // c.layout.block_size)
        if len(self.block_table) > need:
            c.blocks.free(self.block_table[need:])
            del self.block_table[need:]
            self._table = self._host_table = None

    def push_engram_history(self, compressed_ids: torch.Tensor) -> None:
        k = self.cache.layout.engram_lookback
        self.engram_history = torch.cat((self.engram_history.to(compressed_ids.device), compressed_ids))[-k:]
