"""Engram table rows from each token's id and lookbacks in one launch: ``EngramHasher.rows_of_lookbacks``, where
torch takes ~19 launches per layer (a decode step's CUDA graph pays ~2-3 us of device time for each).

* src: int64 [T, max_ngram] (any strides), column 0 the token's compressed id, column s the id s tokens back;
  negative = dead (-1) or before the sequence start (-2). Blocking is sticky: from the first negative column on,
  every column (that one included) hashes as ``pad_id``.
* mult int64 [max_ngram], primes / offs int64 [max_ngram - 1, heads]: the hasher's ``constants(device)``; primes > 0.
-> int64 [T, (max_ngram - 1) * heads] on src.device, column (s - 1) * heads + h = (XOR over j <= s of
   v_j * mult_j) floor-mod primes[s - 1, h] + offs[s - 1, h].

Semantics match torch bit for bit: int64 products wrap (two's complement) on the GPU and in the interpreter alike,
but Triton's signed ``%`` truncates (C ``srem``; checked in Triton 3.9's interpreter: -7 % 3 == -1), while torch's
is a floor mod, so a negative remainder gets the (positive) prime added back. A wrapped, negative hash only arises
from multipliers near 2^63 / ids (the release's are ~2^46 x ids < 2^17), but the kernel must not depend on that.

The call allocates only its output, never synchronises with the host and checks no value on the device, so it can
be captured in a CUDA graph whose replays refill src.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from .launch import launch

_ROWS = 16  # rows a program hashes: a decode step's 1..32 rows spread over 1-2 SMs; 16 x heads (8) = 128 threads


def _check(src, mult, primes, offs, pad_id) -> tuple[int, int]:
    for name, t in (("src", src), ("mult", mult), ("primes", primes), ("offs", offs)):
        if not isinstance(t, torch.Tensor) or t.dtype != torch.int64:
            raise ValueError(f"{name} must be an int64 tensor, got {getattr(t, 'dtype', type(t))}")
    if mult.dim() != 1 or mult.numel() < 2:
        raise ValueError(f"mult must be [max_ngram >= 2], got {tuple(mult.shape)}")
    k = mult.numel()
    if primes.dim() != 2 or primes.shape[0] != k - 1 or primes.shape[1] < 1 or offs.shape != primes.shape:
        raise ValueError(
            f"primes, offs must both be [max_ngram - 1 = {k - 1}, heads >= 1], "
            f"got {tuple(primes.shape)}, {tuple(offs.shape)}"
        )
    if src.dim() != 2 or src.shape[1] != k:
        raise ValueError(f"src must be [T, max_ngram = {k}], got {tuple(src.shape)}")
    if not isinstance(pad_id, int) or not -(2**63) <= pad_id < 2**63:
        raise ValueError(f"pad_id must be an int64 value, got {pad_id!r}")
    return k, primes.shape[1]


def engram_rows_ref(
    src: torch.Tensor, mult: torch.Tensor, primes: torch.Tensor, offs: torch.Tensor, pad_id: int
) -> torch.Tensor:
    """The body of EngramHasher.rows_of_lookbacks (torch, any device): the fallback and the kernel's oracle."""
    max_ngram, heads = _check(src, mult, primes, offs, pad_id)
    T = src.shape[0]
    blocked = torch.cumsum((src < 0).to(torch.int64), dim=1) > 0  # sticky
    v = torch.where(blocked, torch.full_like(src, pad_id), src)
    prod = v * mult  # int64, wraps on overflow (never for in-range ids)
    out = torch.empty(T, (max_ngram - 1) * heads, dtype=torch.int64, device=src.device)
    r = prod[:, 0]
    for s in range(1, max_ngram):
        r = r ^ prod[:, s]
        # torch's % is a floor mod: non-negative for positive primes, even for a wrapped (negative) hash
        out[:, (s - 1) * heads : s * heads] = r[:, None] % primes[s - 1] + offs[s - 1]
    return out


@triton.jit(do_not_specialize=["n_rows"])  # the row count: only a row mask
def _engram_rows_kernel(
    src_ptr,
    mult_ptr,
    primes_ptr,
    offs_ptr,
    out_ptr,
    n_rows,
    s_row,
    s_col,
    pad_id,
    MAX_NGRAM: tl.constexpr,
    HEADS: tl.constexpr,
    BLOCK_H: tl.constexpr,
    ROWS: tl.constexpr,
):
    r = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    h = tl.arange(0, BLOCK_H)
    live = r < n_rows
    hm = h < HEADS
    r64 = r.to(tl.int64)
    blocked = r < 0  # all False, [ROWS]
    acc = tl.zeros([ROWS], dtype=tl.int64)
    for s in tl.static_range(MAX_NGRAM):
        v = tl.load(src_ptr + r64 * s_row + s * s_col, mask=live, other=0)
        blocked = blocked | (v < 0)
        # int64 multiply wraps like torch's
        acc = acc ^ (tl.where(blocked, pad_id, v).to(tl.int64) * tl.load(mult_ptr + s))
        if s > 0:
            p = tl.load(primes_ptr + (s - 1) * HEADS + h, mask=hm, other=1)
            o = tl.load(offs_ptr + (s - 1) * HEADS + h, mask=hm, other=0)
            m = acc[:, None] % p[None, :]  # truncating: sign of acc
            m = tl.where(m < 0, m + p[None, :], m)  # -> floor mod (p > 0)
            at = r64[:, None] * ((MAX_NGRAM - 1) * HEADS) + (s - 1) * HEADS + h[None, :]
            tl.store(out_ptr + at, m + o[None, :], mask=live[:, None] & hm[None, :])


def engram_rows(
    src: torch.Tensor, mult: torch.Tensor, primes: torch.Tensor, offs: torch.Tensor, pad_id: int
) -> torch.Tensor:
    """engram_rows_ref in one launch (see the module docstring; no value checks, no sync, allocates the output)."""
    max_ngram, heads = _check(src, mult, primes, offs, pad_id)
    if src.device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(f"src must be on a CUDA device (or TRITON_INTERPRET=1), got {src.device}")
    for name, t in (("mult", mult), ("primes", primes), ("offs", offs)):
        if t.device != src.device:
            raise ValueError(f"{name} must be on src's device {src.device}, got {t.device}")
    T = src.shape[0]
    out = torch.empty(T, (max_ngram - 1) * heads, dtype=torch.int64, device=src.device)
    if T == 0:
        return out
    # the hasher's constants are contiguous already: these are no-ops there
    mult, primes, offs = mult.contiguous(), primes.contiguous(), offs.contiguous()
    grid = (triton.cdiv(T, _ROWS),)
    args = (src, mult, primes, offs, out, T, src.stride(0), src.stride(1), pad_id)
    meta = dict(MAX_NGRAM=max_ngram, HEADS=heads, BLOCK_H=triton.next_power_of_2(heads), ROWS=_ROWS, num_warps=4)
    launch(_engram_rows_kernel, grid, src.device, *args, **meta)
    return out
