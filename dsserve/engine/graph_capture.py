"""Capturing a fixed-shape forward as a CUDA graph: warm-ups on a side stream, then the capture, into a memory pool
of its own.

Every graph of the engine (decode steps, bounded replay's decoder and encoder rows) captures through one
``GraphCapture``. Each capture gets a pool of its own, which costs memory: a shared pool would let a later capture
reuse the blocks an earlier one freed, and by PyTorch's rules that is safe for graphs that never run at once. The
engine's graphs never do, yet with one shared pool a live server at 32 concurrent agent sessions failed in a decode
graph replayed right after a decoder-rows graph (NaN logits; before top-k wrote every slot, a device-side assert),
in every run past 175 s (six). With a pool per graph it did not (one run of the same sweep, 409 s:
benchmarks/results/agentx-small-h200-c32/diagnosis-2026-12-03). The cause inside the shared pool is not found yet
(docs/decode_graphs.md).
"""
from __future__ import annotations

import logging
from typing import Callable

import torch

log = logging.getLogger("dsserve")


class GraphCapture:
    def __init__(self, warmups: int = 2):
        self.warmups = warmups
        self.captured = 0
        self.pool_bytes = 0  # device memory the graphs' pools reserved, all captures together

    def __call__(self, run: Callable[[], torch.Tensor]) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        """(graph, its output buffer). ``run`` must mask its writes during this call (warm-ups run it for real:
        Triton compiles and lazily built buffers exist before the capture); the capture itself runs nothing."""
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(self.warmups):
                run()
        torch.cuda.current_stream().wait_stream(side)
        # the capture empties the cache first anyway; done here, the growth of reserved memory is the new pool
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        before = torch.cuda.memory_reserved()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, capture_error_mode="thread_local"):
            out = run()
        grown = torch.cuda.memory_reserved() - before
        self.captured += 1
        self.pool_bytes += grown
        log.info("captured CUDA graph %d: its pool %.1f MiB, all graphs' %.2f GiB", self.captured, grown / 2 ** 20,
                 self.pool_bytes / 2 ** 30)
        return graph, out
