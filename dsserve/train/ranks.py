"""Data-parallel ranks for training: which share of a step is this process's, and the sums across processes."""

from __future__ import annotations

import os

import torch

BACKENDS = ("auto", "gloo", "nccl")


class Ranks:
    """This process's place among the data-parallel ranks (one process: rank 0 of 1, no communication). ``backend``
    auto: NCCL (sums on the GPUs) when every rank has a GPU of its own, else gloo with the sums staged through host
    memory (ranks sharing a GPU, which NCCL refuses, or the CPU)."""

    def __init__(self, device: str = "cpu", backend: str = "auto"):
        import torch.distributed as dist

        if backend not in BACKENDS:
            raise ValueError(f"dist backend {backend!r}: one of {list(BACKENDS)}")
        self.world = int(os.environ.get("WORLD_SIZE", "1"))
        self.rank = int(os.environ.get("RANK", "0"))
        self.dist = dist if self.world > 1 else None
        own_gpus = device == "cuda" and self.world <= torch.cuda.device_count()
        self.backend = ("nccl" if own_gpus else "gloo") if backend == "auto" else backend
        if self.dist is not None and not dist.is_initialized():
            dist.init_process_group(self.backend)

    def device(self, device: str) -> str:
        if device == "cuda" and self.world > 1:  # ranks spread over the GPUs, several to one if need be
            device = f"cuda:{int(os.environ.get('LOCAL_RANK', self.rank)) % torch.cuda.device_count()}"
            torch.cuda.set_device(device)  # Triton launches on the current device, whatever its tensors' device
        return device

    def _where(self, t: torch.Tensor) -> torch.Tensor:
        """Where the sum runs: the GPU for NCCL, host memory for gloo."""
        return t.to(f"cuda:{torch.cuda.current_device()}") if self.backend == "nccl" else t.cpu()

    def sum(self, values: list[float]) -> list[float]:
        if self.dist is None:
            return values
        t = self._where(torch.tensor(values, dtype=torch.float64))
        self.dist.all_reduce(t)
        return t.tolist()

    def sum_grads(self, params: list[torch.nn.Parameter]) -> None:
        if self.dist is None:
            return
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
        # one more slot a parameter: whether any rank gave it a gradient (an expert no rank routed to keeps None,
        # as in one process, so AdamW skips it)
        flat = self._where(
            torch.cat(
                [g.reshape(-1) for g in grads]
                + [torch.tensor([float(p.grad is not None) for p in params], device=grads[0].device)]
            )
        )
        self.dist.all_reduce(flat)
        at, seen = 0, flat[-len(params) :].tolist()
        for p, g, s in zip(params, grads, seen):
            total = flat[at : at + g.numel()].view_as(g)
            if p.grad is not None:  # in place: a captured step's gradients are its graph's outputs (train.step)
                p.grad.copy_(total)
            elif s > 0:
                p.grad = total.to(g.device)
            at += g.numel()
