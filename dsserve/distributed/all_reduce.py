"""Sum over a group: where a row-parallel split closes (attention's wo_b, the MoE's down projections, the
vocabulary-parallel embedding). ``group`` None is a group of one rank: no communication."""

from __future__ import annotations

import torch
import torch.distributed as dist


def all_reduce_sum(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """The elementwise sum of every rank's ``x`` (same shape and dtype on every rank), on every rank. In place when
    ``x`` is contiguous (a fresh product, as the callers hand), else on a contiguous copy; returns the sum."""
    if group is None or dist.get_world_size(group) == 1:
        return x
    x = x.contiguous()
    dist.all_reduce(x, op=dist.ReduceOp.SUM, group=group)
    return x


def all_reduce_sum_ref(parts: list[torch.Tensor]) -> torch.Tensor:
    """The same sum in one process, ``parts[r]`` being rank r's tensor, added in rank order. With two ranks the
    collective's sum is the same number (addition commutes); with more, it may differ by the order's rounding."""
    out = parts[0].clone()
    for p in parts[1:]:
        out += p
    return out
