"""Capturing a fixed-shape forward as a CUDA graph: warm-ups, then the capture, on one capture stream; every graph
in one shared memory pool.

Every graph of the engine (decode steps, bounded replay's decoder and encoder rows) captures through one
``GraphCapture``. Graphs that never run at once (the engine's never do) may share a pool provided no graph reads,
at replay, pool memory that no live tensor holds: a later capture may take that memory for its scratch. The warm-up
runs happen on the capture stream, so that what PyTorch and our kernels keep per stream (the cuBLAS workspace, the
split-K counters) is made before any capture and outside the pools. ``DSSERVE_GRAPH_POOL=own``
(``shared_pool=False``) gives every graph its own pool; ``DSSERVE_POISON_GRAPH_SCRATCH=1`` (engine.graph_scratch)
shows a graph reading scratch it did not write.

Graphs of one kind replay one at a time and their callers copy the rows they keep before the next replay, so with
``outputs`` (a ``SharedOutputs`` per kind) each graph ends by copying its result into the first rows of one buffer
sized for the kind's largest bucket, made outside the pool; the result itself is then scratch, and no graph keeps an
output of its own alive in the pool. docs/engine_history.md has the measurements behind the shared pool and outputs.
"""

from __future__ import annotations

import logging
import time
from typing import Callable

import torch

from . import graph_scratch

log = logging.getLogger("dsserve")


Outputs = torch.Tensor | tuple[torch.Tensor, ...]


class SharedOutputs:
    """The output buffers of one kind of graph: ``capacity`` rows (the kind's largest bucket), each graph's result
    in the first rows."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.buffers: tuple[torch.Tensor, ...] | None = None  # made from the first result seen

    def rows_like(self, result: Outputs) -> Outputs:
        """Views of the buffers shaped like ``result`` (a tensor or a tuple of them, rows first)."""
        parts = (result,) if torch.is_tensor(result) else tuple(result)
        if self.buffers is None:
            self.buffers = tuple(t.new_empty((self.capacity,) + tuple(t.shape[1:])) for t in parts)
        if len(parts) != len(self.buffers) or any(
            t.shape[0] > self.capacity or t.shape[1:] != b.shape[1:] or t.dtype != b.dtype
            for t, b in zip(parts, self.buffers)
        ):
            raise ValueError(
                f"graph outputs {[(tuple(t.shape), t.dtype) for t in parts]} do not fit the shared "
                f"buffers {[(tuple(b.shape), b.dtype) for b in self.buffers]}"
            )
        views = tuple(b[: t.shape[0]] for t, b in zip(parts, self.buffers))
        return views[0] if torch.is_tensor(result) else views


def copy_outputs(dst: Outputs, src: Outputs) -> Outputs:
    for d, s in zip(*((x,) if torch.is_tensor(x) else x for x in (dst, src))):
        d.copy_(s)
    return dst


class GraphCapture:
    def __init__(self, warmups: int = 2, shared_pool: bool = True):
        """``shared_pool``: one pool for every graph; False: a pool per graph (see the module docstring)."""
        self.warmups, self.shared_pool = warmups, shared_pool
        self.pool = None
        self.stream = None  # made on first use: the CPU never captures
        self.captured = 0
        self.pool_bytes = 0  # device memory the graphs' pools reserved, all captures together
        self.seconds = 0.0  # wall time of the captures, their warm-ups included: the steps that needed them waited

    def __call__(
        self,
        run: Callable[[], Outputs],
        what: str = "",
        release: Callable[[], None] | None = None,
        outputs: SharedOutputs | None = None,
    ) -> tuple[torch.cuda.CUDAGraph, Outputs]:
        """(graph, its output buffers). ``run`` must mask its writes during this call (warm-ups run it for real:
        Triton compiles and lazily built buffers exist before the capture); the capture itself runs nothing.
        ``what``: the graph's kind and shape, for the log; ``release``: drops the references the run left to what
        it computed and the graph recomputes in every replay (its scratch: freed, later captures reuse it);
        ``outputs``: the kind's shared buffers, which the graph's result is copied into (the module docstring)."""
        if outputs is not None and self.warmups < 1:
            raise ValueError("shared graph outputs take their shapes from a warm-up run: warmups must be >= 1")
        t0 = time.perf_counter()
        if self.stream is None:
            self.stream = torch.cuda.Stream()
        # Warm up on the stream that captures: buffers kept per stream (split-K counters) are then made and sized
        # before the capture, outside any graph's pool.
        self.stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.stream):
            for _ in range(self.warmups):
                result = run()
        torch.cuda.current_stream().wait_stream(self.stream)
        dst = None if outputs is None else outputs.rows_like(result)  # made outside the pool, once per kind
        result = None
        # the capture empties the cache first anyway; done here, the growth of reserved memory is the pool's growth
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        before = torch.cuda.memory_reserved()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(
            graph, pool=self.pool if self.shared_pool else None, stream=self.stream, capture_error_mode="thread_local"
        ):
            out = run() if dst is None else copy_outputs(dst, run())
        if release is not None:
            release()
        if self.shared_pool:
            self.pool = graph.pool()
        grown = torch.cuda.memory_reserved() - before
        took = time.perf_counter() - t0
        self.captured += 1
        self.pool_bytes += grown
        self.seconds += took
        held = ""
        if self.shared_pool and log.isEnabledFor(logging.INFO):
            live, size = graph_scratch.pool_usage(self.pool)
            held = f" ({live / 2**30:.2f} of the shared pool's {size / 2**30:.2f} GiB held by live tensors)"
        log.info(
            "captured CUDA graph %d (%s) in %.2f s: pools grew %.1f MiB, all graphs' %.2f GiB%s",
            self.captured,
            what or "?",
            took,
            grown / 2**20,
            self.pool_bytes / 2**30,
            held,
        )
        if graph_scratch.enabled():
            graph = graph_scratch.PoisonedGraph(graph)
        return graph, out
