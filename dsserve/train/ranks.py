"""Data-parallel ranks for training: which share of a step is this process's, and the sums across processes."""
from __future__ import annotations

import os

import torch


class Ranks:
    """This process's place among the data-parallel ranks (one process: rank 0 of 1, no communication)."""

    def __init__(self):
        import torch.distributed as dist
        self.world = int(os.environ.get("WORLD_SIZE", "1"))
        self.rank = int(os.environ.get("RANK", "0"))
        self.dist = dist if self.world > 1 else None
        if self.dist is not None and not dist.is_initialized():
            dist.init_process_group("gloo")

    def device(self, device: str) -> str:
        if device == "cuda" and self.world > 1:  # ranks spread over the GPUs, several to one if need be
            return f"cuda:{int(os.environ.get('LOCAL_RANK', self.rank)) % torch.cuda.device_count()}"
        return device

    def sum(self, values: list[float]) -> list[float]:
        if self.dist is None:
            return values
        t = torch.tensor(values, dtype=torch.float64)
        self.dist.all_reduce(t)
        return t.tolist()

    def sum_grads(self, params: list[torch.nn.Parameter]) -> None:
        if self.dist is None:
            return
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
        # one more slot a parameter: whether any rank gave it a gradient (an expert no rank routed to keeps None,
        # as in one process, so AdamW skips it)
        flat = torch.cat([g.reshape(-1) for g in grads]
                         + [torch.tensor([float(p.grad is not None) for p in params], device=grads[0].device)]).cpu()
        self.dist.all_reduce(flat)
        at, seen = 0, flat[-len(params):]
        for p, g, s in zip(params, grads, seen):
            p.grad = flat[at:at + g.numel()].view_as(g).to(g.device) if s > 0 else None
            at += g.numel()
