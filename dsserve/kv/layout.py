"""The paged cache's shape before allocation: which pools, which row formats, how many bytes."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..models.config import ModelConfig
from .formats import RowFormat, format_for

KV_CACHE_DTYPES = ("auto", "bf16")


class RawRows:
    """Rows kept as the model computed them (the bytes of a float dtype). V4's release records (FP8 latent
    with a BF16 RoPE tail) are not built yet, so V4 caches use these."""

    def __init__(self, channels: int, dtype: torch.dtype):
        self.name, self.channels, self.dtype = f"raw-{str(dtype).split('.')[-1]}", channels, dtype
        self.row_bytes = channels * torch.finfo(dtype).bits // 8

    def with_channels(self, channels: int) -> "RawRows":
        return RawRows(channels, self.dtype)

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
    window_in_blocks: bool = False  # exact-mode prefix caching: window rows are stored with the blocks
    # rows before a prefix hit the model runs again: V4's overlapping compressors (ratio 4) mix each entry with the
    # previous group's rows, which the cache does not keep
    resume_rows: int = 0
    # V4's compressor rows not yet pooled, per window slot, in fixed-shape decode steps (PagedKVCache.pending_ring)
    pending_ring_bytes: int = 0

    @classmethod
    def build(
        cls,
        cfg: ModelConfig,
        block_size: int | None = None,
        kv_cache_dtype: str = "auto",
        dtype: torch.dtype = torch.float32,
        window_in_blocks: bool = False,
    ) -> "KVLayout":
        if kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype {kv_cache_dtype!r} is not one of {KV_CACHE_DTYPES}")
        sources = sorted({r.kv_source for r in cfg.roles if r.owns_compressor})
        ratios = [cfg.compress_ratios[s] for s in sources]
        lcm = math.lcm(*ratios) if ratios else 1
        block_size = block_size or math.lcm(lcm, 64)
        if block_size % lcm:
            raise ValueError(
                f"block_size {block_size} must be a multiple of every compress ratio {sorted(set(ratios))}"
            )
        index_dim = cfg.index_head_dim if any(r.owns_indexer for r in cfg.roles) else None

        def fmt(kind, channels):
            return format_for(kind, kv_cache_dtype, channels) if cfg.is_v41 else RawRows(channels, dtype)

        return cls(
            block_size=block_size,
            window=cfg.sliding_window,
            window_layers=tuple(range(cfg.num_hidden_layers)),
            sources={s: (r, block_size // r) for s, r in zip(sources, ratios)},
            window_fmt=fmt("swa", cfg.head_dim),
            main_fmt=fmt("main", cfg.head_dim),
            index_fmt=fmt("index", index_dim) if index_dim else None,
            engram_lookback=cfg.engram_max_ngram_size - 1,
            window_in_blocks=window_in_blocks,
            resume_rows=0 if cfg.is_v41 else max((r for r in ratios if r == 4), default=0),
            pending_ring_bytes=0 if cfg.is_v41 else _pending_ring_bytes(cfg, dtype),
        )

    @property
    def global_bytes_per_block(self) -> int:
        per_entry = self.main_fmt.row_bytes + (self.index_fmt.row_bytes if self.index_fmt else 0)
        return sum(epb * per_entry for _, epb in self.sources.values())

    @property
    def window_bytes_per_token(self) -> int:
        return len(self.window_layers) * self.window_fmt.row_bytes

    @property
    def bytes_per_block(self) -> int:
        extra = self.block_size * self.window_bytes_per_token if self.window_in_blocks else 0
        return self.global_bytes_per_block + extra

    @property
    def bytes_per_window_slot(self) -> int:
        return 0 if self.window_in_blocks else len(self.window_layers) * self.window * self.window_fmt.row_bytes

    @property
    def bytes_per_slot(self) -> int:
        """What one running request holds outside the blocks: its window ring and V4's pending compressor rows."""
        return self.bytes_per_window_slot + self.pending_ring_bytes

    def global_bytes_per_token(self) -> float:
        return self.global_bytes_per_block / self.block_size

    def persistent_bytes_per_token(self, with_window: bool) -> float:
        """What the prefix cache keeps per token: the global KV, plus every layer's window row in exact mode."""
        return self.global_bytes_per_token() + (self.window_bytes_per_token if with_window else 0)

    def plan(self, memory_bytes: int, max_num_seqs: int) -> tuple[int, int]:
        """(global blocks, window slots): one window slot per possible running request, the rest blocks."""
        slots = max_num_seqs
        rest = memory_bytes - slots * self.bytes_per_slot
        blocks = rest // self.bytes_per_block if self.bytes_per_block else 0
        if blocks < 1:
            need = slots * self.bytes_per_slot + self.bytes_per_block
            raise ValueError(
                f"kv cache memory {memory_bytes:,} B is too small: {max_num_seqs} window slots and one "
                f"block need {need:,} B"
            )
        return int(blocks), slots


def _pending_ring_bytes(cfg: ModelConfig, dtype: torch.dtype) -> int:
    """V4's rings per slot: r rows (2r overlapping: ratio 4, and every indexer's compressor) of fp32 (fp64) u and z
    projections, head_dim wide (twice that overlapping)."""
    acc = 8 if dtype == torch.float64 else 4
    total = 0
    for role in cfg.roles:
        if role.owns_compressor and role.ratio > 1:
            k = 2 if role.ratio == 4 else 1
            total += role.ratio * k * cfg.head_dim * k * 2 * acc
            if role.owns_indexer:
                total += role.ratio * 2 * cfg.index_head_dim * 2 * 2 * acc
    return total
