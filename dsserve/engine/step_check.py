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
import logging
import os
from collections import deque

import torch

ENV = "DSSERVE_CHECK_STEPS"
log = logging.getLogger("dsserve")
_NONE = torch.iinfo(torch.int64).max


class ScoreProbe:
    """Per indexer layer: [NaN scores, +inf scores, rows with either, first such row, first such column], added to
    by every forward that scores (graph-safe: in-place device ops, no host reads) and read by StepCheck."""

    def __init__(self, num_layers: int, device: torch.device):
        self.stats = torch.zeros(num_layers, 5, dtype=torch.int64, device=device)
        self.reset()

    def reset(self) -> None:
        self.stats.zero_()
        self.stats[:, 3:] = _NONE

    def add(self, layer: int, scores: torch.Tensor) -> None:
        if not scores.numel():
            return
        nan = scores.isnan()
        bad = nan | (scores == float("inf"))
        rows = bad.any(1)
        t, n = scores.shape
        first_row = torch.where(rows, torch.arange(t, device=scores.device), _NONE).amin()
        first_col = torch.where(bad.any(0), torch.arange(n, device=scores.device), _NONE).amin()
        st = self.stats[layer]
        st[:3] += torch.stack((nan.sum(), (bad & ~nan).sum(), rows.sum()))
        st[3:] = torch.minimum(st[3:], torch.stack((first_row, first_col)))

    def take(self) -> dict:
        """{layer: {nan, posinf, rows, first_row, first_col}} of the layers with a non-finite score since the last
        take (after a device wait); then zeroes the counters."""
        st = self.stats.tolist()
        self.reset()
        keys = ("nan", "posinf", "rows", "first_row", "first_col")
        return {i: dict(zip(keys, r)) for i, r in enumerate(st) if r[0] or r[1]}


class StepCheckError(RuntimeError):
    pass


class StepCheck:
    def __init__(self, path: str, device: torch.device, keep: int = 64):
        self.path, self.device, self.steps, self.checked = path, device, deque(maxlen=keep), 0
        self.probe: ScoreProbe | None = None
        self.steps_with_bad_scores = 0

    def attach(self, model) -> None:
        """Count the model's non-finite index scores; before any graph is captured (they capture the adds)."""
        self.probe = model.score_probe = ScoreProbe(len(model.layers), self.device)

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
        scores = self.probe.take() if self.probe is not None else {}
        if scores:
            self.steps[-1]["bad_index_scores"] = scores
            self.steps_with_bad_scores += 1
            if self.steps_with_bad_scores <= 20:
                log.warning(
                    "step check: non-finite index scores in a %s step (%d so far): %s; the step: %s",
                    label,
                    self.steps_with_bad_scores,
                    scores,
                    self.steps[-1],
                )
        if bad:
            self._write(label, f"non-finite logits in rows {bad}")
            raise StepCheckError(f"step check: non-finite logits in rows {bad} of a {label} step (see {self.path})")
        self.checked += 1

    def _write(self, label: str, error: str) -> None:
        with open(self.path, "w") as f:
            json.dump(
                {"failed": label, "error": error, "steps_checked": self.checked, "last_steps": list(self.steps)},
                f,
                default=str,
                indent=1,
            )
