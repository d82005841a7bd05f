"""A layer's old window rows from its ring's position tags, in one launch (torch takes 3: index, eq, where).

* tags: int64 [N], contiguous: one layer's ``PagedKVCache.window_tags`` (the ring's position tag per ring row,
  -1 never written, plus one spare element at the end; kv/paged.py);
* tag_at: int64 [T, W], indices into tags (all in [0, N): not checked, that would need a sync);
* q: int64 [T, W], the positions p-W+1..p of row t's window;
* rows: int32 [T, W], the ring rows holding them if written before this step, -1 where absent.
-> int32 [T, W], contiguous: ``torch.where(tags[tag_at] == q, rows, -1)`` (kv/paged_batch.py old_window_rows):
   a ring row keeps its physical row only while its tag says it still holds position q.
W is the sliding window (128 in the release, 32 in tiny), a compile-time constant.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from .launch import launch

_ELEMS = 512  # values a program covers: 4 rows of the release window, so T = 128 (a decode batch) is 32 programs


def _check(tags: torch.Tensor, tag_at: torch.Tensor, q: torch.Tensor, rows: torch.Tensor) -> None:
    if tags.dim() != 1 or tags.dtype != torch.int64 or tags.numel() == 0 or tags.stride(0) != 1:
        raise ValueError(
            f"tags: expected a contiguous int64 [N >= 1], got {tags.dtype} {tuple(tags.shape)} strides {tags.stride()}"
        )
    if tag_at.dim() != 2 or tag_at.dtype != torch.int64 or tag_at.shape[1] == 0:
        raise ValueError(f"tag_at: expected int64 [T, W >= 1], got {tag_at.dtype} {tuple(tag_at.shape)}")
    shape = tuple(tag_at.shape)
    if tuple(q.shape) != shape or q.dtype != torch.int64:
        raise ValueError(f"q: expected int64 {shape}, got {q.dtype} {tuple(q.shape)}")
    if tuple(rows.shape) != shape or rows.dtype != torch.int32:
        raise ValueError(f"rows: expected int32 {shape}, got {rows.dtype} {tuple(rows.shape)}")
    if any(x.device != tags.device for x in (tag_at, q, rows)):
        raise ValueError(
            f"tags, tag_at, q, rows must share a device, got {tags.device}, {tag_at.device}, {q.device}, {rows.device}"
        )


def window_rows_ref(tags: torch.Tensor, tag_at: torch.Tensor, q: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """Torch on any device: the engine's line. The fallback and the kernel's oracle."""
    _check(tags, tag_at, q, rows)
    return torch.where(tags[tag_at] == q, rows, -1)


@triton.jit(do_not_specialize=["t"])  # the row count: only a row mask
def _window_rows_kernel(
    tags_ptr, at_ptr, q_ptr, rows_ptr, out_ptr, t, W: tl.constexpr, BLOCK_W: tl.constexpr, ROWS: tl.constexpr
):
    r = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    j = tl.arange(0, BLOCK_W)
    m = (r[:, None] < t) & (j[None, :] < W)
    at = r.to(tl.int64)[:, None] * W + j[None, :]
    tag = tl.load(tags_ptr + tl.load(at_ptr + at, mask=m, other=0), mask=m, other=-1)
    q = tl.load(q_ptr + at, mask=m, other=0)
    rows = tl.load(rows_ptr + at, mask=m, other=-1)
    tl.store(out_ptr + at, tl.where(tag == q, rows, -1), mask=m)


def window_rows(tags: torch.Tensor, tag_at: torch.Tensor, q: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """[T, W] int32 = torch.where(tags[tag_at] == q, rows, -1) in one launch; allocates only its output, no host
    sync (graph-capturable)."""
    _check(tags, tag_at, q, rows)
    if not tags.is_cuda and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(f"tensors must be on a CUDA device (or TRITON_INTERPRET=1), got {tags.device}")
    t, w = tag_at.shape
    out = torch.empty(t, w, dtype=torch.int32, device=tag_at.device)
    if t == 0:
        return out
    block_w = triton.next_power_of_2(w)
    n_rows = max(1, _ELEMS // block_w)
    args = (tags, tag_at.contiguous(), q.contiguous(), rows.contiguous(), out, t)
    meta = dict(W=w, BLOCK_W=block_w, ROWS=n_rows, num_warps=4)
    grid = (triton.cdiv(t, n_rows),)
    launch(_window_rows_kernel, grid, tags.device, *args, **meta)
    return out
