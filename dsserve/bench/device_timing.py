"""Device timing shared by the GPU benchmarks: eager calls and CUDA-graph replays.

An eager median includes the host's launch path (argument checks, allocations, Triton's launcher); a decode step
captured as a graph pays only the device time, measured here as a graph of `calls` calls timed by replays.
(triton.testing.do_bench_cudagraph faulted at capture on the H200 with cudaErrorInvalidAddressSpace for the
sparse-attention calls, 2026-11-29; a plain torch.cuda.graph capture after one warm-up call works.)
"""

from __future__ import annotations

from typing import Callable

import torch


def eager_ms(fn: Callable[[int], object], sets: int = 1) -> float:
    """Median ms of one call fn(i), i cycling over `sets` input sets."""
    from triton.testing import do_bench

    it = iter(range(1 << 62))
    return do_bench(lambda: fn(next(it) % sets), warmup=25, rep=200, return_mode="median")


def graph_ms(fn: Callable[[int], object], sets: int = 1, calls: int = 20) -> float:
    """Median device ms per call: one CUDA graph holds `calls` calls fn(i % sets), timed by its replays."""
    from triton.testing import do_bench

    fn(0)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for i in range(calls):
            fn(i % sets)
    ms = do_bench(g.replay, warmup=10, rep=100, return_mode="median") / calls
    del g
    return ms
