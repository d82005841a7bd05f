"""What a P/D hand-off moves, in bytes, for a cache layout (``kv.layout.KVLayout``) and a prompt length.

A hand-off moves the prompt's full blocks (all but the rows of a last, partial block, which the decode side runs
anyway): in replay mode their global KV only (main and index entries of every KV source), in exact mode the window
rows of every token too (the prefix cache's exact-mode block format). Two window-carrying alternatives are counted
against it:

- ``with_window_rows``: every layer's window row of every prompt token beside the global KV, what a connector that
  moves every layer's paged KV per token moves (and what exact mode moves here);
- ``with_window_ring``: only each layer's last W rows (the ring D needs) plus the compressors' carried rows, the
  leanest way to skip the replay.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class HandoffBytes:
    prompt_tokens: int
    blocks: int  # full blocks moved
    global_bytes: int  # main + index entries of the moved blocks
    window_bytes: int  # window rows moved with them (exact mode), else 0
    window_rows_bytes: int  # every layer's window row of every moved token
    window_ring_bytes: int  # every layer's W-row window ring
    carry_bytes: int  # compressor rows not yet pooled at the prompt's end (at most ratio - 1 per source), upper bound

    @property
    def moved(self) -> int:
        return self.global_bytes + self.window_bytes

    @property
    def with_window_rows(self) -> int:
        return self.global_bytes + self.window_rows_bytes

    @property
    def with_window_ring(self) -> int:
        return self.global_bytes + self.window_ring_bytes + self.carry_bytes


def handoff_bytes(layout, prompt_tokens: int, head_dim: int = 512, index_head_dim: int = 128) -> HandoffBytes:
    """Bytes of one hand-off of a ``prompt_tokens`` prompt under ``layout``; ``head_dim`` / ``index_head_dim``
    size the compressor carry (fp32 u and z projections, as the batched path keeps them)."""
    blocks = max(0, (prompt_tokens - 1) // layout.block_size)
    rows = blocks * layout.block_size * layout.window_bytes_per_token
    ring = len(layout.window_layers) * min(layout.window, prompt_tokens) * layout.window_fmt.row_bytes
    carry = 0
    for ratio, _ in layout.sources.values():
        width = head_dim + (index_head_dim if layout.index_fmt else 0)
        carry += (ratio - 1) * width * 2 * 4
    moved_rows = rows if layout.window_in_blocks else 0
    return HandoffBytes(prompt_tokens, blocks, blocks * layout.global_bytes_per_block, moved_rows, rows, ring, carry)
