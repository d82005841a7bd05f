"""Packed KV rows -> bf16 rows in natural channel order: the key tables a prefill chunk's attention reads.

* pool [N, B] uint8 rows of fmt: "fp8" (formats.SWA_FP8), "fp4" (formats.MAIN_FP4), "index_fp4"
  (formats.INDEX_FP4) or "bf16" (formats.BF16_ROWS), D channels;
* rows [M] int32 / int64 physical row ids, -1 = absent (a zero row). Ids are not range-checked (that needs a sync).
-> [M, D] bf16: each key rounded to bf16 as the attention kernels round it for their bf16 dots (FP8 and FP4 codes
   times their scales have at most 6 significant bits: exact, barring scales below bf16's range).

``decode_rows`` is the in-register decoder the attention kernels share.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dsserve.kernels.launch import launch
from dsserve.kv import formats

FORMATS = {"fp8": formats.SWA_FP8, "fp4": formats.MAIN_FP4, "bf16": formats.BF16_ROWS, "index_fp4": formats.INDEX_FP4}
FMT_CODE = {"fp8": 0, "fp4": 1, "bf16": 2, "index_fp4": 3}
_ROWS = 16


def _check(pool, fmt, rows):
    if fmt not in FORMATS:
        raise ValueError(f"fmt {fmt!r}: expected one of {sorted(FORMATS)}")
    if pool.dim() != 2 or pool.dtype != torch.uint8 or pool.shape[1] % FORMATS[fmt].with_channels(32).row_bytes:
        raise ValueError(f"pool: expected uint8 [N, row bytes] rows of {fmt}, got {pool.dtype} {tuple(pool.shape)}")
    if rows.dim() != 1 or rows.is_floating_point():
        raise ValueError(f"rows: expected int [M], got {rows.dtype} {tuple(rows.shape)}")
    d = pool.shape[1] * 32 // FORMATS[fmt].with_channels(32).row_bytes
    return FORMATS[fmt].with_channels(d)


def unpack_rows_ref(pool, fmt, rows):
    rf = _check(pool, fmt, rows)
    valid = rows >= 0
    if pool.shape[0] == 0:
        return torch.zeros(rows.shape[0], rf.channels, dtype=torch.bfloat16, device=pool.device)
    out = rf.unpack(pool[rows.clamp(min=0).long()], torch.float32).to(torch.bfloat16)
    return out.masked_fill(~valid[:, None], 0)


@triton.jit
def decode_rows(pool, stride, rows, valid, FMT: tl.constexpr, D: tl.constexpr, BLOCK_N: tl.constexpr):
    """Keys of BLOCK_N pool rows (uint8 rows of FMT: 0 fp8, 1 fp4, 2 bf16, 3 index fp4) as fp32 [BLOCK_N, D] in
    natural channel order, scaled per group; invalid rows are 0. Whole-row loads, 16-byte vectors when the row
    stride allows."""
    base = pool + rows.to(tl.int64)[:, None] * stride
    m = valid[:, None]
    if FMT == 1 or FMT == 3:  # e2m1 codes, byte j = channels 2j (low nibble), 2j+1; sign bit 3, exponent bits 1-2
        b = tl.load(base + tl.arange(0, D // 2)[None, :], mask=m, other=0).to(tl.int32)
        c = tl.reshape(tl.join(b & 15, b >> 4), [BLOCK_N, D])
        e = (c >> 1) & 3
        bits = tl.where(e > 0, ((e + 126) << 23) | ((c & 1) << 22), (c & 1) * (126 << 23))  # e = 0: 0 or 0.5
        v = (bits | ((c & 8) << 28)).to(tl.float32, bitcast=True)
        if FMT == 1:  # main: an e4m3 scale per 16 channels, subnormals included
            sb = tl.load(base + D // 2 + tl.arange(0, D // 16)[None, :], mask=m, other=0)
            s = sb.to(tl.float8e4nv, bitcast=True).to(tl.float32)
            v = tl.reshape(tl.reshape(v, [BLOCK_N, D // 16, 16]) * s[:, :, None], [BLOCK_N, D])
        else:  # index: a ue8m0 scale 2^(e-127) per 32 channels (e = 0 -> 2^-127)
            e8 = tl.load(base + D // 2 + tl.arange(0, D // 32)[None, :], mask=m, other=0).to(tl.int32)
            s = tl.where(e8 == 0, 1 << 22, e8 << 23).to(tl.float32, bitcast=True)
            v = tl.reshape(tl.reshape(v, [BLOCK_N, D // 32, 32]) * s[:, :, None], [BLOCK_N, D])
    elif FMT == 0:  # e4m3 * 2^(e-127), e the ue8m0 byte of each 32 channels (e = 0 -> 2^-127 as in quant)
        v = tl.load(base + tl.arange(0, D)[None, :], mask=m, other=0).to(tl.float8e4nv, bitcast=True)
        e = tl.load(base + D + tl.arange(0, D // 32)[None, :], mask=m, other=0).to(tl.int32)
        s = tl.where(e == 0, 1 << 22, e << 23).to(tl.float32, bitcast=True)
        v = tl.reshape(tl.reshape(v.to(tl.float32), [BLOCK_N, D // 32, 32]) * s[:, :, None], [BLOCK_N, D])
    else:  # bf16 pairs read as one little-endian int32: channel 2j in the low half
        x = tl.load(
            pool.to(tl.pointer_type(tl.int32))
            + rows.to(tl.int64)[:, None] * (stride // 4)
            + tl.arange(0, D // 2)[None, :],
            mask=m,
            other=0,
        )
        v = tl.reshape(
            tl.join((x << 16).to(tl.float32, bitcast=True), (x & -65536).to(tl.float32, bitcast=True)), [BLOCK_N, D]
        )
    return v


@triton.jit
def _unpack_kernel(pool, stride, rows_ptr, out, M, FMT: tl.constexpr, D: tl.constexpr, ROWS: tl.constexpr):
    r = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    rows = tl.load(rows_ptr + r, mask=r < M, other=-1)
    v = decode_rows(pool, stride, rows, rows >= 0, FMT, D, ROWS)
    ch = tl.arange(0, D)
    tl.store(out + r.to(tl.int64)[:, None] * D + ch[None, :], v.to(tl.bfloat16), mask=(r < M)[:, None])


def unpack_rows(pool, fmt, rows):
    rf = _check(pool, fmt, rows)
    d, m = rf.channels, rows.shape[0]
    out = torch.empty(m, d, dtype=torch.bfloat16, device=pool.device)
    if m and pool.shape[0]:
        if d & (d - 1) or (fmt == "bf16" and (pool.stride(0) | pool.data_ptr()) % 4) or pool.stride(1) != 1:
            raise ValueError(f"pool: D={d} must be a power of two, rows contiguous (bf16: 4-byte aligned)")
        launch(
            _unpack_kernel,
            (triton.cdiv(m, _ROWS),),
            pool.device,
            pool,
            pool.stride(0),
            rows.contiguous(),
            out,
            m,
            FMT=FMT_CODE[fmt],
            D=d,
            ROWS=_ROWS,
            num_warps=4,
        )
    elif m:
        out.zero_()
    return out
