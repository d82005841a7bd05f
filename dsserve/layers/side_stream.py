"""The second CUDA stream of a device: small-batch overlap of independent work (the shared expert beside the
routed experts, an mHC site's mixes beside the sublayer they feed).

At a few rows every kernel is short and the device sits between dependent launches; two streams let independent
kernels fill those gaps, inside CUDA graphs too (a captured fork / join by events). Work forked here must be
joined with ``join`` before anything on the main stream reads its outputs.
"""

from __future__ import annotations

import torch

_STREAMS: dict = {}


def side_stream(x: torch.Tensor, max_rows: int):
    """The side stream of ``x``'s device, or None: on the CPU, or for more than ``max_rows`` rows of x."""
    if not x.is_cuda or not 0 < x.shape[0] <= max_rows:
        return None
    key = x.device.index if x.device.index is not None else torch.cuda.current_device()
    if key not in _STREAMS:
        _STREAMS[key] = torch.cuda.Stream(x.device)
    return _STREAMS[key]


def fork(side, fn, *args):
    """``fn(*args)`` on ``side`` after everything queued so far on the current stream; returns (its result, the
    event it is done at). Its tensors are made on the side stream and used on the main one: recorded there, so
    that the allocator does not hand their memory out early (graph capture has its own pool and needs none)."""
    main = torch.cuda.current_stream(side.device)
    side.wait_stream(main)
    with torch.cuda.stream(side):
        out = fn(*args)
        ready = torch.cuda.Event()
        ready.record(side)
    if not torch.cuda.is_current_stream_capturing():
        for t in out if isinstance(out, tuple) else (out,):
            t.record_stream(main)
    return out, ready


def join(ready, device: torch.device) -> None:
    """The current stream of ``device`` waits for ``ready`` (an event from ``fork``; None: nothing was forked)."""
    if ready is not None:
        torch.cuda.current_stream(device).wait_event(ready)
