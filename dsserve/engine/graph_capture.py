"""Capturing a fixed-shape forward as a CUDA graph: warm-ups on a side stream, then the capture, into one shared
memory pool.

Every graph of the engine (decode steps, bounded replay's decoder rows) captures through one ``GraphCapture``, so
all share one pool: they never run at once, and a later capture reuses the blocks an earlier one freed.
"""
from __future__ import annotations

from typing import Callable

import torch


class GraphCapture:
    def __init__(self, warmups: int = 2):
        self.warmups = warmups
        self.pool = None
        self.captured = 0

    def __call__(self, run: Callable[[], torch.Tensor]) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        """(graph, its output buffer). ``run`` must mask its writes during this call (warm-ups run it for real:
        Triton compiles and lazily built buffers exist before the capture); the capture itself runs nothing."""
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(self.warmups):
                run()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
            out = run()
        self.pool = graph.pool()
        self.captured += 1
        return graph, out
