"""Poisoning a CUDA graph's pool memory that no live tensor holds, before each replay: a kernel that reads memory it
did not write in that replay shows at once.

A graph may read at replay only memory it writes in that replay first, or that a live tensor holds (its inputs,
outputs and persistent buffers). Everything else in its memory pool ("inactive" blocks in the allocator's
snapshot) is scratch: its own temporaries, and in a shared pool also other graphs' temporaries and tensors freed
since its capture. ``DSSERVE_POISON_GRAPH_SCRATCH=1`` fills those blocks with 0xFF bytes (NaN in fp32, bf16 and
FP8 e4m3; -1 as an index) right before every replay, so a read of stale memory gives non-finite logits
(``dsserve:nonfinite_logit_rows_total``; ``DSSERVE_CHECK_STEPS`` names the step). A debugging aid: it takes an
allocator snapshot and a memset per block per replay. ``DSSERVE_GRAPH_POOL=own`` gives every graph a pool of its own
(the default is one shared pool).
"""

from __future__ import annotations

import ctypes
import glob
import logging
import os

import torch

log = logging.getLogger("dsserve")
ENV = "DSSERVE_POISON_GRAPH_SCRATCH"
POOL_ENV = "DSSERVE_GRAPH_POOL"


def enabled() -> bool:
    return os.environ.get(ENV, "") not in ("", "0")


def shared_pool() -> bool:
    """``DSSERVE_GRAPH_POOL``: "shared" (default, one pool for all graphs) or "own" (a pool per graph)."""
    v = os.environ.get(POOL_ENV, "shared")
    if v not in ("own", "shared"):
        raise ValueError(f"{POOL_ENV} must be 'own' or 'shared', got {v!r}")
    return v == "shared"


def _cudart() -> ctypes.CDLL:
    """The CUDA runtime PyTorch loaded (its wheels ship it under nvidia/*/lib; a system one works too)."""
    roots = [os.path.dirname(os.path.dirname(torch.__file__))]
    names = [p for r in roots for p in glob.glob(os.path.join(r, "nvidia", "**", "libcudart.so*"), recursive=True)]
    for name in names + ["libcudart.so", "libcudart.so.13", "libcudart.so.12"]:
        try:
            lib = ctypes.CDLL(name)
        except OSError:
            continue
        lib.cudaMemsetAsync.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t, ctypes.c_void_p]
        return lib
    raise RuntimeError(f"{ENV}: no libcudart found (looked for {names or 'nvidia/*/lib/libcudart.so*'})")


def scratch_blocks(graph: torch.cuda.CUDAGraph) -> list[tuple[int, int]]:
    """(address, bytes) of the free blocks of the graph's pool now."""
    pool = tuple(graph.pool())
    return [
        (b["address"], b["size"])
        for seg in torch.cuda.memory_snapshot()
        if tuple(seg["segment_pool_id"]) == pool
        for b in seg["blocks"]
        if b["state"] == "inactive"
    ]


def pool_usage(pool) -> tuple[int, int]:
    """(bytes of a graph memory pool (``graph.pool()``) that live tensors hold, bytes it reserved)."""
    pool = tuple(pool)
    segs = [seg for seg in torch.cuda.memory_snapshot() if tuple(seg["segment_pool_id"]) == pool]
    return sum(seg["active_size"] for seg in segs), sum(seg["total_size"] for seg in segs)


class PoisonedGraph:
    """A captured graph whose every replay first fills its pool's free blocks with 0xFF bytes (current stream)."""

    def __init__(self, graph: torch.cuda.CUDAGraph):
        self.graph, self._rt = graph, _cudart()
        self.blocks = scratch_blocks(graph)  # at capture; replays take them anew (a shared pool's change)
        self.poisoned_bytes = 0
        log.info(
            "%s: %d free blocks, %.1f MiB, poisoned before each replay",
            ENV,
            len(self.blocks),
            sum(n for _, n in self.blocks) / 2**20,
        )

    def replay(self) -> None:
        stream = ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)
        self.blocks = scratch_blocks(self.graph)
        for addr, n in self.blocks:
            err = self._rt.cudaMemsetAsync(ctypes.c_void_p(addr), 0xFF, ctypes.c_size_t(n), stream)
            if err:
                raise RuntimeError(f"{ENV}: cudaMemsetAsync failed with CUDA error {err}")
            self.poisoned_bytes += n
        self.graph.replay()
