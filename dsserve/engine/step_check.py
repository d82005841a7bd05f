"""Checking every step on the device, to name the step behind a live server's device-side failure (off by default).

On a GPU the engine never waits for the device inside a step, so a device-side assert (an index out of bounds in
some kernel) surfaces at a later host read, often a step after the one that launched it, and the process dies with
every request. ``CUDA_LAUNCH_BLOCKING=1`` names the op only outside CUDA graphs, and changes the timing. With
``DSSERVE_CHECK_STEPS=<file>`` in the server's environment, the engine instead waits for the device after each
step's forward and after each step launched ahead, checks that the logits are finite, and keeps the last steps'
shapes: per sequence its first position and row count, and which fixed-shape runner (decode, encoder rows, decoder
rows) took the step. On a failure it writes them, newest last, as JSON to the file and raises. Costs a host wait per
step: a diagnostic, not a serving mode.
"""
from __future__ import annotations

import json
import os
from collections import deque

import torch

ENV = "DSSERVE_CHECK_STEPS"


class StepCheckError(RuntimeError):
    pass


class StepCheck:
    def __init__(self, path: str, device: torch.device, keep: int = 64):
        self.path, self.device, self.steps, self.checked = path, device, deque(maxlen=keep), 0

    @classmethod
    def from_env(cls, device: torch.device) -> "StepCheck | None":
        path = os.environ.get(ENV)
        return cls(path, device) if path else None

    def after(self, label: str, logits: torch.Tensor, seqs: list[tuple[int, int]], **runners) -> None:
        """``label``'s step has been launched: wait for it, then check ``logits`` [B, V]. ``seqs``: (first position,
        rows) per sequence; ``runners``: what ran it (e.g. decode=(batch bucket, context bucket))."""
        self.steps.append({"step": label, "seqs": seqs, **runners})
        try:
            if self.device.type == "cuda":  # also a step that samples nothing (logits [0, V]) ran on it
                torch.cuda.synchronize(self.device)
            bad = (~torch.isfinite(logits.float())).any(1).nonzero().flatten().tolist() if logits.numel() else []
        except Exception as e:  # the device's error, raised by the wait
            self._write(label, f"{type(e).__name__}: {e}")
            raise
        if bad:
            self._write(label, f"non-finite logits in rows {bad}")
            raise StepCheckError(f"step check: non-finite logits in rows {bad} of a {label} step (see {self.path})")
        self.checked += 1

    def _write(self, label: str, error: str) -> None:
        with open(self.path, "w") as f:
            json.dump({"failed": label, "error": error, "steps_checked": self.checked, "last_steps": list(self.steps)},
                      f, default=str, indent=1)
