"""Warm-in: the model's mHC and MoE brought in gradually, after the attention has formed its lookups.

Measured on multi-query associative recall (``benchmarks/results/train-tiny-brakes``): the tiny model with every
mechanism on did not form a keyed in-context lookup in 3192 steps; with mHC fixed at a plain residual and the MoE off
it formed one at steps ~500-900 (with Engram on or off alike); with mHC or the MoE left on, not by 1100-1800. A quieter
random start (mHC's token-dependent part x 0.01, the branches' outputs x 1 / sqrt(2 x layers)) did not help, so the
brake is in the training, not in the first step. So a run can start without them and blend them in: at level r each
block's mixes are (1 - r) x the plain residual's (pre 1/n, post 1, comb the identity) + r x its own, and its MoE's
output is scaled by r (``Block.warm_in``). At r = 1 the block computes exactly its own function; after the run it is
detached, so what is saved and served is the model itself. Every parameter trains throughout (the MoE's and the mixes'
get no gradient while r = 0).
"""

from __future__ import annotations

import torch


def warm_in_level(at: float, start: float, end: float) -> float:
    """r at ``at`` (a step, or a share of the run) for a ramp from 0 at ``start`` to 1 at ``end``; end <= 0: off (1)."""
    if end <= 0:
        return 1.0
    if end <= start:
        return 0.0 if at < start else 1.0
    return min(1.0, max(0.0, (at - start) / (end - start)))


class WarmIn:
    """One device scalar shared by every block of ``model`` (a CUDA graph captured with it reads each new level)."""

    def __init__(self, model, start: float, end: float):
        if start < 0 or end < 0 or (end > 0 and end < start):
            raise ValueError(f"warm-in wants 0 <= start <= end (or end 0: off), got start {start}, end {end}")
        if getattr(model, "kernel_ops", None) is not None:
            raise ValueError("warm-in blends the torch forward's mixes; the model has kernel ops enabled")
        self.model, self.start, self.end = model, start, end
        self.level = torch.ones((), dtype=torch.float32, device=model.embed.weight.device)
        self.on = end > 0
        for block in model.layers:
            block.warm_in = self.level if self.on else None

    def set(self, at: float) -> float:
        r = warm_in_level(at, self.start, self.end)
        if self.on:
            self.level.fill_(r)
        return r

    def detach(self) -> None:
        for block in self.model.layers:
            block.warm_in = None
