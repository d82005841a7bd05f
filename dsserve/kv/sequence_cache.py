"""The per-sequence cache of the reference path: every kind of state one sequence carries between forwards.

Kinds (spec 3.1): a sliding window of post-RoPE K=V rows per layer, the global compressed main KV and index
keys per KV source layer, the compressor's not-yet-pooled rows per source, and the Engram token lookback.
The paged engine implements the same methods over its block pools.
"""

from __future__ import annotations

import torch

# made once: a cache made inside a captured training step (train.step) must not make host tensors
_NO_HISTORY = torch.empty(0, dtype=torch.long)


class SequenceCache:
    def __init__(self, window: int, engram_lookback: int = 3):
        self.window = window
        self.engram_lookback = engram_lookback
        self.num_tokens = 0  # positions [0, num_tokens) have been through the encoder
        self.published_until = 0  # global entries below this position are given (a prefix hit), not computed
        self._swa: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._main: dict[int, torch.Tensor] = {}
        self._index_k: dict[int, torch.Tensor] = {}
        self._pending: dict[int, tuple[torch.Tensor, torch.Tensor, int]] = {}
        self.engram_history = _NO_HISTORY  # compressed ids (-1 = dead), oldest first

    # sliding window ------------------------------------------------------------------
    def window_rows(self, layer: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """(keys [n, D], positions [n]) of the layer's window, n <= window; (None, None) when empty."""
        return self._swa.get(layer, (None, None))

    def push_window(self, layer: int, keys: torch.Tensor, positions: torch.Tensor) -> None:
        old_k, old_p = self._swa.get(layer, (None, None))
        if old_k is not None:
            keys, positions = torch.cat((old_k, keys)), torch.cat((old_p, positions))
        self._swa[layer] = (keys[-self.window :].clone(), positions[-self.window :].clone())

    # global compressed KV ------------------------------------------------------------
    def global_kv(self, source: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        return self._main.get(source), self._index_k.get(source)

    def push_global(self, source: int, main: torch.Tensor, index_k: torch.Tensor | None) -> None:
        if source in self._main:
            main = torch.cat((self._main[source], main))
            if index_k is not None:
                index_k = torch.cat((self._index_k[source], index_k))
        self._main[source] = main
        if index_k is not None:
            self._index_k[source] = index_k

    # compressor rows not yet pooled (a dangling half-group; for V4's overlap also the last group)
    def pending(self, source: int):
        return self._pending.get(source)

    def set_pending(self, source: int, state: tuple[torch.Tensor, torch.Tensor, int] | None) -> None:
        """state = (u [n, C], z [n, C], position of its first row), or None when nothing is pending."""
        if state is None:
            self._pending.pop(source, None)
        else:
            self._pending[source] = state

    # Engram lookback -------------------------------------------------------------------
    def push_engram_history(self, compressed_ids: torch.Tensor) -> None:
        hist = self.engram_history
        joined = torch.cat((hist.to(compressed_ids.device), compressed_ids)) if hist.numel() else compressed_ids
        self.engram_history = joined[-self.engram_lookback :]

    def num_entries(self, source: int) -> int:
        m = self._main.get(source)
        return 0 if m is None else m.shape[0]
