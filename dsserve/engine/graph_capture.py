"""Capturing a fixed-shape forward as a CUDA graph: warm-ups, then the capture, on one capture stream; every graph
in a memory pool of its own.

Every graph of the engine (decode steps, bounded replay's decoder and encoder rows) captures through one
``GraphCapture``. A pool per graph costs memory (each graph's scratch kept apart: 24-620 MiB a graph on the
release proxy, `dsserve:graph_pool_bytes_total`). A shared pool would be safe for graphs that never run at once
(the engine's never do) provided no graph reads, at replay, pool memory that no live tensor holds, since a later
capture may take that memory for its scratch. Yet with one shared pool a live server at 32 concurrent agent
sessions got NaN logits from a decode graph replayed after a decoder-rows graph, in every run past 175 s (six);
with a pool per graph it did not (benchmarks/results/agentx-small-h200-c32/diagnosis-2026-12-03). The cause is
not found (docs/decode_graphs.md); ``DSSERVE_GRAPH_POOL=shared`` (``shared_pool=True``) and
``DSSERVE_POISON_GRAPH_SCRATCH=1`` (engine.graph_scratch) are there to find it.
"""
from __future__ import annotations

import logging
from typing import Callable

import torch

from . import graph_scratch

log = logging.getLogger("dsserve")


class GraphCapture:
    def __init__(self, warmups: int = 2, shared_pool: bool = False):
        """``shared_pool``: one pool for every graph (less memory; see the module docstring)."""
        self.warmups, self.shared_pool = warmups, shared_pool
        self.pool = None
        self.stream = None  # made on first use: the CPU never captures
        self.captured = 0
        self.pool_bytes = 0  # device memory the graphs' pools reserved, all captures together

    def __call__(self, run: Callable[[], torch.Tensor]) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        """(graph, its output buffer). ``run`` must mask its writes during this call (warm-ups run it for real:
        Triton compiles and lazily built buffers exist before the capture); the capture itself runs nothing."""
        if self.stream is None:
            self.stream = torch.cuda.Stream()
        # Warm up on the stream that captures: buffers kept per stream (split-K counters) are then made and sized
        # before the capture, outside any graph's pool.
        self.stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.stream):
            for _ in range(self.warmups):
                run()
        torch.cuda.current_stream().wait_stream(self.stream)
        # the capture empties the cache first anyway; done here, the growth of reserved memory is the pool's growth
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        before = torch.cuda.memory_reserved()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool if self.shared_pool else None, stream=self.stream,
                              capture_error_mode="thread_local"):
            out = run()
        if self.shared_pool:
            self.pool = graph.pool()
        grown = torch.cuda.memory_reserved() - before
        self.captured += 1
        self.pool_bytes += grown
        log.info("captured CUDA graph %d: pools grew %.1f MiB, all graphs' %.2f GiB", self.captured,
                 grown / 2 ** 20, self.pool_bytes / 2 ** 30)
        if graph_scratch.enabled():
            graph = graph_scratch.PoisonedGraph(graph)
        return graph, out
