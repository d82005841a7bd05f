"""Concatenation over a group along one dimension: where a column-parallel split closes without a sum (the
vocabulary-parallel head's logits). ``group`` None is a group of one rank: no communication."""

from __future__ import annotations

import torch
import torch.distributed as dist


def all_gather_dim(
    x: torch.Tensor, dim: int, group: dist.ProcessGroup | None, sizes: list[int] | None = None
) -> torch.Tensor:
    """Every rank's ``x`` concatenated along ``dim`` in rank order, on every rank. ``sizes``: each rank's extent
    along ``dim`` when they differ (a vocabulary that does not divide evenly); the shards are padded to the largest
    for the collective and trimmed after. Other dimensions must agree across ranks."""
    if group is None or dist.get_world_size(group) == 1:
        return x
    world = dist.get_world_size(group)
    dim = dim % x.dim()
    if sizes is not None and len(sizes) != world:
        raise ValueError(f"sizes has {len(sizes)} entries for a group of {world} ranks")
    if sizes is not None and x.shape[dim] != sizes[dist.get_rank(group)]:
        raise ValueError(f"this rank's extent {x.shape[dim]} along dim {dim} is not sizes[rank] = {sizes}")
    top = x.shape[dim] if sizes is None else max(sizes)
    if x.shape[dim] < top:
        pad = list(x.shape)
        pad[dim] = top - x.shape[dim]
        x = torch.cat((x, x.new_zeros(pad)), dim)
    parts = [torch.empty_like(x) for _ in range(world)]
    dist.all_gather(parts, x.contiguous(), group=group)
    if sizes is not None:
        parts = [p.narrow(dim, 0, n) for p, n in zip(parts, sizes)]
    return torch.cat(parts, dim)


def all_gather_dim_ref(parts: list[torch.Tensor], dim: int) -> torch.Tensor:
    """The same in one process, ``parts[r]`` being rank r's tensor."""
    return torch.cat(parts, dim)
