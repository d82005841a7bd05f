"""The per-forward context that layers read: which rows, at which positions, against which cache."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..kv.sequence_cache import SequenceCache


@dataclass
class ForwardContext:
    tokens: torch.Tensor  # [T] token ids of the rows in flight
    positions: torch.Tensor  # [T] absolute positions
    cache: SequenceCache
    qat: bool = True
    is_image: torch.Tensor | None = None  # [T] bool: rows inside an image span
    # Published within a forward by the latest index source / candidate source, read by later layers.
    topk: tuple[torch.Tensor, torch.Tensor] | None = None  # (entry ids [T, K], valid [T, K])
    candidates: torch.Tensor | None = None  # [T, n_entries] bool
    trace: list | None = field(default=None)  # optional (layer, op) log for tests
    engram_ids: torch.Tensor | None = None  # [T] compressed ids (-1 = dead) for Engram layers
    engram_history: torch.Tensor | None = None  # compressed ids just before the first row

    def log(self, layer: int, op: str) -> None:
        if self.trace is not None:
            self.trace.append((layer, op))

    def narrow(self, keep: torch.Tensor) -> "ForwardContext":
        """The same forward restricted to the rows in ``keep`` (bounded replay's decoder window)."""
        ids, hist = self.engram_ids, self.engram_history
        if ids is not None:  # kept rows are a suffix: the dropped rows become lookback
            first = int(keep.nonzero()[0]) if keep.any() else ids.shape[0]
            hist, ids = torch.cat((hist, ids[:first])), ids[keep]
        return ForwardContext(tokens=self.tokens[keep], positions=self.positions[keep], cache=self.cache,
                              qat=self.qat, is_image=None if self.is_image is None else self.is_image[keep],
                              trace=self.trace, engram_ids=ids, engram_history=hist)
