"""Fail fast when the ranks of a group disagree on what they run (the spec's handshake: vLLM PR #26218, a rank with
another config entered an extra collective and hung the rest). One all-gather of a checksum; every rank raises the
same error, naming the ranks that differ, instead of some ranks waiting in a collective the others never enter."""

from __future__ import annotations

import zlib

import torch
import torch.distributed as dist

from .all_gather import all_gather_dim
from .groups import ParallelConfigError


def agree(what: str, value: str, group: dist.ProcessGroup | None) -> None:
    """Raise ParallelConfigError on every rank of ``group`` unless each passed the same ``value`` (a stable text,
    e.g. the repr of a frozen config: Python's own ``hash`` of a str differs between processes)."""
    if group is None:
        return
    row = torch.tensor([[zlib.crc32(value.encode())]], dtype=torch.long)
    if dist.get_backend(group) == "nccl":
        row = row.cuda()
    sums = all_gather_dim(row, 0, group).view(-1).tolist()
    if len(set(sums)) > 1:
        ranks = [r for r, s in enumerate(sums) if s != sums[0]]
        raise ParallelConfigError(f"the ranks disagree on {what}: ranks {ranks} differ from rank 0")
