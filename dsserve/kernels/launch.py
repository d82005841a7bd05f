"""Launching a Triton kernel on the GPU that holds its tensors.

Triton launches on the current CUDA device, so a kernel whose tensors live on another GPU of the process must be
launched under that device; on the CPU (the interpreter) there is none to select.
"""

from __future__ import annotations

import torch


def launch(kernel, grid, device: torch.device, *args, **meta) -> None:
    """``kernel[grid](*args, **meta)`` with ``device`` current (a CUDA device), or plainly (the interpreter)."""
    if device.type == "cuda":
        with torch.cuda.device(device):
            kernel[grid](*args, **meta)
    else:
        kernel[grid](*args, **meta)
