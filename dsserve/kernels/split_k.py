"""Split-K partial sums reduced inside the kernel that made them: the last program of an output tile adds them.

A decode GEMM (few rows, many weight bytes) splits K over programs so that every SM streams weights; summing
the fp32 partials afterwards took two more launches (a reduce, a cast), ~4 us of a CUDA-graph step each time,
about 290 times a decode step on the release proxy. Here each program stores its partial tile, then counts
itself in on a per-tile counter (an atomic, acquire-release, GPU scope); the one that arrives last sums the SPLIT
partials in split order (so the result does not depend on which program came last: deterministic), stores the
output and resets the counter to 0 for the next call, so the counters need no clearing launch and the whole
call stays CUDA-graph capturable.

* partial fp32 [SPLIT, M, N] (any strides along M, N: the caller's scratch), out [M, N] in the caller's dtype;
* counters int32, one per output tile, zero between calls: `tile_counters(device, n)` keeps one zeroed buffer
  per (device, stream), since two calls in flight on different streams must not share counters.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_COUNTERS: dict[tuple, torch.Tensor] = {}
# Buffers outgrown since, kept allocated: a CUDA graph captured with one baked its address in and reads it at every
# replay, expecting zeros; freed, its memory could go to other tensors (or, in a shared graph pool, another graph's
# scratch) that leave it nonzero, and that graph's tiles would then sum early or never.
_OUTGROWN: list[torch.Tensor] = []


def tile_counters(device: torch.device, n: int) -> torch.Tensor:
    """A zeroed int32 buffer of at least n counters for calls issued on the current stream of `device`. Grows
    (a new zeroed buffer; the old one stays allocated, see _OUTGROWN) when n exceeds it. Graph captures warm up on
    their capture stream (engine.graph_capture), so a capture finds the buffer made and grown already."""
    stream = torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0
    key = (device.type, device.index, stream)
    buf = _COUNTERS.get(key)
    if buf is None or buf.numel() < n:
        if buf is not None:
            _OUTGROWN.append(buf)
        buf = _COUNTERS[key] = torch.zeros(max(n, 1024), dtype=torch.int32, device=device)
    return buf


@triton.jit
def store_split(acc, rm, rn, M, N, part_ptr, spm, sps, o_ptr, som, cnt_ptr, tile, split, SPLIT: tl.constexpr):
    """Store this program's fp32 tile acc [BM, BN] (rows rm, columns rn) as split `split` of SPLIT; if it is the
    last of its tile to arrive, write the sum of all SPLIT partials (in split order) to out."""
    mask = (rm[:, None] < M) & (rn[None, :] < N)
    tl.store(part_ptr + split * sps + rm[:, None] * spm + rn[None, :], acc, mask=mask)
    tl.debug_barrier()  # every thread's partial is written before the count is released
    if tl.atomic_add(cnt_ptr + tile, 1, sem="acq_rel", scope="gpu") == SPLIT - 1:
        total = tl.zeros(acc.shape, tl.float32)
        for s in range(SPLIT):
            # .cg: read at L2, where the other programs' stores landed (this SM's L1 is not coherent with them)
            total += tl.load(
                part_ptr + s * sps + rm[:, None] * spm + rn[None, :], mask=mask, other=0.0, cache_modifier=".cg"
            )
        tl.store(o_ptr + rm[:, None] * som + rn[None, :], total.to(o_ptr.dtype.element_ty), mask=mask)
        tl.atomic_xchg(cnt_ptr + tile, 0, sem="relaxed", scope="gpu")  # ready for the next call or graph replay
