"""Rows to their ranks over a group, with counts: the expert-parallel dispatch and combine.

Two steps, as vLLM's and DeepEP's normal mode: ``all_to_all_counts`` tells every rank how many rows (per bucket:
per local expert, in the dispatcher) it will receive from each source, then ``all_to_all_rows`` moves the rows with
those split sizes. The counts come back to the host (split sizes are host lists): one sync per exchange, fine for
prefill; a fixed-shape variant for CUDA graphs is later work (docs/parallel.md). ``group`` None is a group of one
rank: no communication.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def _world(group: dist.ProcessGroup | None) -> int:
    return 1 if group is None else dist.get_world_size(group)


def all_to_all_counts(counts: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """``counts`` [world, m] int64: row r is what this rank sends to rank r (m buckets). Returns [world, m]: row s
    is what rank s sends to this rank."""
    world = _world(group)
    if counts.dim() != 2 or counts.shape[0] != world:
        raise ValueError(f"counts must be [{world}, m] (one row per rank of the group), got {tuple(counts.shape)}")
    if world == 1:
        return counts.clone()
    out = torch.empty_like(counts)
    dist.all_to_all_single(out.view(-1), counts.contiguous().view(-1), group=group)
    return out


def all_to_all_counts_ref(counts: list[torch.Tensor]) -> list[torch.Tensor]:
    """The same in one process: ``counts[s]`` is rank s's argument; returns each rank's result."""
    return [torch.stack([c[r] for c in counts]) for r in range(len(counts))]


def all_to_all_rows(x: torch.Tensor, send: list[int], recv: list[int], group: dist.ProcessGroup | None) -> torch.Tensor:
    """``x``'s rows in blocks, ``send[r]`` rows for rank r in rank order; returns the rows received, ``recv[s]``
    from rank s in rank order (``recv`` from ``all_to_all_counts``, or known: a combine returns a dispatch's rows).
    Any dtype with the same trailing shape on every rank; zero counts are fine (an idle rank still joins)."""
    world = _world(group)
    if len(send) != world or len(recv) != world or sum(send) != x.shape[0]:
        raise ValueError(f"send {send} must split x's {x.shape[0]} rows over {world} ranks; recv {recv} likewise")
    if world == 1:
        return x.clone()
    out = x.new_empty(sum(recv), *x.shape[1:])
    dist.all_to_all_single(out, x.contiguous(), output_split_sizes=recv, input_split_sizes=send, group=group)
    return out


def all_to_all_rows_ref(xs: list[torch.Tensor], sends: list[list[int]]) -> list[torch.Tensor]:
    """The same in one process: rank s holds ``xs[s]`` split by ``sends[s]``; returns each rank's received rows."""
    blocks = [x.split(send) for x, send in zip(xs, sends)]
    return [torch.cat([b[r] for b in blocks]) for r in range(len(xs))]
