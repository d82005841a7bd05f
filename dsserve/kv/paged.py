"""The paged KV cache: every kind of state a running request carries, in fixed-size pools.

Kinds (spec 3.1), each with its own allocation rule:
- global main KV and index keys, one pool per KV source layer, paged in blocks of ``block_size`` tokens
  (``block_size / ratio`` entries per block); stored packed as the release does (FP4 main 288 B, FP4 index
  68 B per entry) or bf16 for debugging; read by every consumer layer of that source;
- the sliding window, one ring of ``W`` rows per layer per running request (FP8, 528 B per row), in window
  slots that are reused, never grown with context;
- the compressor's not-yet-pooled rows and the Engram lookback, small per-request tensors.

A ``SequenceKV`` is one request's view; it has the methods of ``SequenceCache`` so the model runs on it
unchanged.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..models.config import ModelConfig
from .block_pool import BlockPool, InvariantError
from .formats import RowFormat, format_for

KV_CACHE_DTYPES = ("auto", "bf16")


class RawRows:
    """Rows kept as the model computed them (the bytes of a float dtype). V4's release records (FP8 latent
    with a BF16 RoPE tail) are not built yet, so V4 caches use these."""

    def __init__(self, channels: int, dtype: torch.dtype):
        self.name, self.channels, self.dtype = f"raw-{str(dtype).split('.')[-1]}", channels, dtype
        self.row_bytes = channels * torch.finfo(dtype).bits // 8

    def pack(self, x: torch.Tensor, prequantized: bool = False) -> torch.Tensor:
        return x.to(self.dtype).contiguous().view(torch.uint8)

    def unpack(self, b: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return b.contiguous().view(self.dtype).to(dtype)


@dataclass(frozen=True)
class KVLayout:
    """Pools, row formats and bytes, derived from the model and the cache options, before any allocation."""
    block_size: int
    window: int
    window_layers: tuple[int, ...]
    sources: dict  # kv source layer -> (ratio, entries per block)
    window_fmt: RowFormat
    main_fmt: RowFormat
    index_fmt: RowFormat | None
    engram_lookback: int

    @classmethod
    def build(cls, cfg: ModelConfig, block_size: int | None = None, kv_cache_dtype: str = "auto",
              dtype: torch.dtype = torch.float32) -> "KVLayout":
        if kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype {kv_cache_dtype!r} is not one of {KV_CACHE_DTYPES}")
        sources = sorted({r.kv_source for r in cfg.roles if r.owns_compressor})
        ratios = [cfg.compress_ratios[s] for s in sources]
        lcm = math.lcm(*ratios) if ratios else 1
        block_size = block_size or math.lcm(lcm, 64)
        if block_size % lcm:
            raise ValueError(f"block_size {block_size} must be a multiple of every compress ratio {sorted(set(ratios))}")
        index_dim = cfg.index_head_dim if any(r.owns_indexer for r in cfg.roles) else None

        def fmt(kind, channels):
            return format_for(kind, kv_cache_dtype, channels) if cfg.is_v41 else RawRows(channels, dtype)

        return cls(block_size=block_size, window=cfg.sliding_window,
                   window_layers=tuple(range(cfg.num_hidden_layers)),
                   sources={s: (r, block_size // r) for s, r in zip(sources, ratios)},
                   window_fmt=fmt("swa", cfg.head_dim), main_fmt=fmt("main", cfg.head_dim),
                   index_fmt=fmt("index", index_dim) if index_dim else None,
                   engram_lookback=cfg.engram_max_ngram_size - 1)

    @property
    def bytes_per_block(self) -> int:
        per_entry = self.main_fmt.row_bytes + (self.index_fmt.row_bytes if self.index_fmt else 0)
        return sum(epb * per_entry for _, epb in self.sources.values())

    @property
    def bytes_per_window_slot(self) -> int:
        return len(self.window_layers) * self.window * self.window_fmt.row_bytes

    def global_bytes_per_token(self) -> float:
        return self.bytes_per_block / self.block_size

    def plan(self, memory_bytes: int, max_num_seqs: int) -> tuple[int, int]:
        """(global blocks, window slots): one window slot per possible running request, the rest blocks."""
        slots = max_num_seqs
        rest = memory_bytes - slots * self.bytes_per_window_slot
        blocks = rest // self.bytes_per_block if self.bytes_per_block else 0
        if blocks < 1:
            need = slots * self.bytes_per_window_slot + self.bytes_per_block
            raise ValueError(f"kv cache memory {memory_bytes:,} B is too small: {max_num_seqs} window slots and one "
                             f"block need {need:,} B")
        return int(blocks), slots


class PagedKVCache:
    def __init__(self, layout: KVLayout, num_blocks: int, num_window_slots: int, dtype: torch.dtype = torch.float32):
        self.layout, self.dtype = layout, dtype
        self.blocks = BlockPool(num_blocks, "global KV block")
        self.slots = BlockPool(num_window_slots, "window slot")
        u8 = torch.uint8
        self.main = {s: torch.zeros(num_blocks, epb, layout.main_fmt.row_bytes, dtype=u8)
                     for s, (_, epb) in layout.sources.items()}
        self.index = ({s: torch.zeros(num_blocks, epb, layout.index_fmt.row_bytes, dtype=u8)
                       for s, (_, epb) in layout.sources.items()} if layout.index_fmt else {})
        w = layout.window
        self.window = {i: torch.zeros(num_window_slots, w, layout.window_fmt.row_bytes, dtype=u8)
                       for i in layout.window_layers}
        self.window_pos = {i: torch.full((num_window_slots, w), -1, dtype=torch.long) for i in layout.window_layers}

    # -------------------------------------------------------------------------- per request
    def new_sequence(self) -> "SequenceKV":
        slot = self.slots.allocate(1)[0]
        for i in self.layout.window_layers:
            self.window_pos[i][slot] = -1
        return SequenceKV(self, slot)

    def blocks_needed(self, seq: "SequenceKV", total_tokens: int) -> int:
        return max(0, -(-total_tokens // self.layout.block_size) - len(seq.block_table))

    def grow(self, seq: "SequenceKV", total_tokens: int) -> None:
        """Make room for the request's first ``total_tokens`` tokens (the scheduler checked it fits)."""
        seq.block_table.extend(self.blocks.allocate(self.blocks_needed(seq, total_tokens)))

    def release(self, seq: "SequenceKV") -> None:
        self.blocks.free(seq.block_table)
        self.slots.free([seq.slot])
        seq.block_table, seq.slot = [], None

    def check(self, live: list["SequenceKV"]) -> None:
        """After every step: each live request's blocks and slot are owned once, nothing else is used."""
        self.blocks.check([b for s in live for b in s.block_table])
        self.slots.check([s.slot for s in live])
        for s in live:
            if len(s.block_table) * self.layout.block_size < s.num_tokens:
                raise InvariantError(f"a request holds {len(s.block_table)} blocks for {s.num_tokens} tokens")

    def report(self) -> dict[str, int]:
        lay = self.layout
        return {"global_blocks": self.blocks.num_blocks, "block_size": lay.block_size,
                "global_bytes": self.blocks.num_blocks * lay.bytes_per_block,
                "global_bytes_per_token": lay.global_bytes_per_token(),
                "window_slots": self.slots.num_blocks,
                "window_bytes": self.slots.num_blocks * lay.bytes_per_window_slot,
                "window_row_bytes": lay.window_fmt.row_bytes}


class SequenceKV:
    """One request's slice of the paged cache, with ``SequenceCache``'s methods."""

    def __init__(self, cache: PagedKVCache, slot: int):
        self.cache, self.slot = cache, slot
        self.block_table: list[int] = []
        self.num_tokens = 0
        self._entries: dict[int, int] = {}
        self._pending: dict = {}
        self.engram_history = torch.empty(0, dtype=torch.long)

    # window ---------------------------------------------------------------------------
    def window_rows(self, layer: int):
        c = self.cache
        pos = c.window_pos[layer][self.slot]
        valid = pos >= 0
        if not bool(valid.any()):
            return None, None
        order = torch.argsort(torch.where(valid, pos, pos.max() + 1))[: int(valid.sum())]
        return c.layout.window_fmt.unpack(c.window[layer][self.slot, order], c.dtype), pos[order]

    def push_window(self, layer: int, keys: torch.Tensor, positions: torch.Tensor) -> None:
        c, w = self.cache, self.cache.layout.window
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
        _, epb = c.layout.sources[source]
        table = torch.tensor(self.block_table[: -(-n // epb)], dtype=torch.long)
        main = c.layout.main_fmt.unpack(c.main[source][table].flatten(0, 1)[:n], c.dtype)
        index = (c.layout.index_fmt.unpack(c.index[source][table].flatten(0, 1)[:n], c.dtype)
                 if source in c.index else None)
        return main, index

    def push_global(self, source: int, main: torch.Tensor, index_k: torch.Tensor | None) -> None:
        c = self.cache
        n0, n = self.num_entries(source), main.shape[0]
        if n == 0:
            return
        _, epb = c.layout.sources[source]
        e = torch.arange(n0, n0 + n)
        if int(e[-1]) // epb >= len(self.block_table):
            raise InvariantError(f"entry {int(e[-1])} of source {source} has no block: the scheduler under-allocated")
        phys = torch.tensor(self.block_table, dtype=torch.long)[e // epb]
        # The model already fake-quantised these rows: store them exactly (see formats.pack_main_fp4).
        c.main[source][phys, e % epb] = c.layout.main_fmt.pack(main, prequantized=True)
        if index_k is not None and source in c.index:
            c.index[source][phys, e % epb] = c.layout.index_fmt.pack(index_k)
        self._entries[source] = n0 + n

    # compressor rows and Engram lookback ---------------------------------------------------
    def pending(self, source: int):
        return self._pending.get(source)

    def set_pending(self, source: int, state) -> None:
        if state is None:
            self._pending.pop(source, None)
        else:
            self._pending[source] = state

    def push_engram_history(self, compressed_ids: torch.Tensor) -> None:
        k = self.cache.layout.engram_lookback
        self.engram_history = torch.cat((self.engram_history, compressed_ids))[-k:]
