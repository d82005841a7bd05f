"""Poisoning a CUDA graph's scratch memory before each replay, to catch kernels that read scratch they never wrote.

A captured graph's temporaries live in its memory pool: blocks the capture freed again ("inactive" in the
allocator's snapshot) that every replay writes and reads. A kernel that reads such a block before writing it reads
whatever the last user left there: its own graph's previous replay (with a pool per graph), or another graph's
(with a shared pool). ``DSSERVE_POISON_GRAPH_SCRATCH=1`` fills those blocks with 0xFF bytes (NaN in fp32, bf16 and
FP8 e4m3; -1 as an index) before every replay, so such a read shows as non-finite logits at once
(``DSSERVE_CHECK_STEPS`` then names the step). A debugging aid: it costs a memset per block per replay.
"""
from __future__ import annotations

import ctypes
import glob
import logging
import os

import torch

log = logging.getLogger("dsserve")
ENV = "DSSERVE_POISON_GRAPH_SCRATCH"


def enabled() -> bool:
    return os.environ.get(ENV, "") not in ("", "0")


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
    """(address, bytes) of the free blocks of the graph's pool: the memory its replays use as scratch."""
    pool = tuple(graph.pool())
    return [(b["address"], b["size"]) for seg in torch.cuda.memory_snapshot()
            if tuple(seg["segment_pool_id"]) == pool for b in seg["blocks"] if b["state"] == "inactive"]


class PoisonedGraph:
    """A captured graph whose every replay first fills its scratch with 0xFF bytes on the current stream."""

    def __init__(self, graph: torch.cuda.CUDAGraph):
        self.graph, self.blocks, self._rt = graph, scratch_blocks(graph), _cudart()
        log.info("%s: %d scratch blocks, %.1f MiB, poisoned before each replay", ENV, len(self.blocks),
                 sum(n for _, n in self.blocks) / 2 ** 20)

    def replay(self) -> None:
        stream = ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)
        for addr, n in self.blocks:
            err = self._rt.cudaMemsetAsync(ctypes.c_void_p(addr), 0xFF, ctypes.c_size_t(n), stream)
            if err:
                raise RuntimeError(f"{ENV}: cudaMemsetAsync failed with CUDA error {err}")
        self.graph.replay()
