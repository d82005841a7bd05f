"""Engram table rows gathered and decoded by one device kernel, straight from the table wherever it lives.

* data: an ``EngramTable.data`` (layouts in layers/engram_table.py), last dim contiguous:
  fmt "fp8": uint8 [rows, D + D/32], the e4m3 bytes of a row then its e8m0 scale bytes (one per 32 columns);
  fmt "bf16": bfloat16 [rows, D]; fmt "float": float32 / bfloat16 / float16 / float64 [rows, D].
* ids: int64 / int32 of any shape on the compute device (CUDA; CPU tensors under TRITON_INTERPRET=1).
-> [*ids.shape, D] of ``dtype`` (float32, bfloat16, float16, float64) on ids.device, row r decoded as
   ``EngramTable._decode`` does: fp8 = quant.dequant_engram (e4m3 * 2^(scale - 127), float32) then cast;
   the others = a cast. Bitwise equal to ``engram_gather_ref``.

``data`` need not be on ids' device: a host table registered with cudaHostRegister (``HostMemory`` does it) is
read by the kernel over PCIe through its pointer. Triton's launcher maps every pointer argument with
cuPointerGetAttribute(CU_POINTER_ATTRIBUTE_DEVICE_POINTER), which succeeds for registered host memory (under
UVA cudaHostRegisterDefault is mapped and portable, so any GPU of the process may read it) and rejects unregistered
host memory with ValueError("Pointer argument cannot be accessed from Triton (cpu tensor?)").

The call allocates only its output, never synchronises with the host and checks no id on the device: ids come from
the hasher and always lie in [0, rows); an id out of range reads outside the table (garbage or a fault). So it can
be captured in a CUDA graph whose replays refill the ids buffer.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from ..layers.quant import MX_BLOCK, dequant_engram
from .launch import launch

FORMATS = ("float", "bf16", "fp8")
OUT_DTYPES = {
    torch.float32: tl.float32,
    torch.bfloat16: tl.bfloat16,
    torch.float16: tl.float16,
    torch.float64: tl.float64,
}
_FLOAT_DATA = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
_ELEMS = 1024  # values a program decodes: 4 warps x 8 (8 bytes of e4m3 per thread: one vector load)
_MAX_BLOCK_D = 256  # the release D: one column block, so a program reads whole rows (and their scale bytes)


def _check(data: torch.Tensor, ids: torch.Tensor, fmt: str, dim: int, dtype: torch.dtype) -> None:
    if fmt not in FORMATS:
        raise ValueError(f"fmt must be one of {FORMATS}, got {fmt!r}")
    if not isinstance(dim, int) or dim < 1 or (fmt == "fp8" and dim % MX_BLOCK):
        raise ValueError(f"dim must be a positive int (a multiple of {MX_BLOCK} for fp8), got {dim!r}")
    width, allowed = (
        (dim + dim // MX_BLOCK, (torch.uint8,))
        if fmt == "fp8"
        else (dim, (torch.bfloat16,) if fmt == "bf16" else _FLOAT_DATA)
    )
    if data.dim() != 2 or data.shape[1] != width or data.dtype not in allowed or data.shape[0] == 0:
        raise ValueError(
            f"data for fmt {fmt!r}, dim {dim}: expected {allowed} [rows >= 1, {width}], "
            f"got {data.dtype} {tuple(data.shape)}"
        )
    if data.stride(1) != 1:
        raise ValueError(f"data rows must be contiguous (stride 1 along dim), got strides {data.stride()}")
    if ids.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"ids must be int64 or int32, got {ids.dtype}")
    if dtype not in OUT_DTYPES:
        raise ValueError(f"dtype must be one of {tuple(OUT_DTYPES)}, got {dtype}")


def engram_gather_ref(data: torch.Tensor, ids: torch.Tensor, fmt: str, dim: int, dtype: torch.dtype) -> torch.Tensor:
    """Torch on any device: gathers the rows on data's device, moves them to ids.device (may sync), decodes there
    exactly as EngramTable does. The fallback and the kernel's oracle."""
    _check(data, ids, fmt, dim, dtype)
    rows = data.index_select(0, ids.reshape(-1).to(data.device, torch.int64)).to(ids.device)
    out = dequant_engram(rows[:, :dim], rows[:, dim:]) if fmt == "fp8" else rows
    return out.to(dtype).view(*ids.shape, dim)


@triton.jit
def _to_bf16(x):
    """fp32 -> bf16 rounded to nearest even on the bits: the interpreter's own cast truncates and flushes
    subnormals to zero (on the GPU this is what cvt.rn.bf16.f32 computes)."""
    b = x.to(tl.int32, bitcast=True)
    return ((b + 0x7FFF + ((b >> 16) & 1)) >> 16).to(tl.int16).to(tl.bfloat16, bitcast=True)


@triton.jit(do_not_specialize=["n"])  # the row count: only a row mask
def _engram_gather_kernel(
    data_ptr,
    ids_ptr,
    out_ptr,
    n,
    DIM: tl.constexpr,
    ROW_STRIDE: tl.constexpr,
    FP8: tl.constexpr,
    DT: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    r = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    c = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    live = r < n
    m = live[:, None] & (c[None, :] < DIM)
    # ROW_STRIDE constexpr: the compiler then knows rows start 8-byte aligned (264 = 8 x 33) and vectorises
    row = tl.load(ids_ptr + r, mask=live, other=0).to(tl.int64)
    base = data_ptr + row[:, None] * ROW_STRIDE
    if FP8:
        q = tl.load(base + c[None, :], mask=m, other=0).to(tl.float8e4nv, bitcast=True).to(tl.float32)
        # a warp's lanes sharing a scale byte share one load transaction
        e = tl.load(base + DIM + c[None, :] // 32, mask=m, other=127).to(tl.int32)
        # quant._exp2_biased: 2^(e - 127) from the bits, e = 0 the subnormal 2^-127, e = 255 NaN
        s = tl.where(e == 0, 1 << 22, tl.where(e == 255, 0x7FC00000, e << 23)).to(tl.float32, bitcast=True)
        v = q * s
    else:
        v = tl.load(base + c[None, :], mask=m, other=0)
    if DT == tl.bfloat16:
        v = _to_bf16(v.to(tl.float32))
    tl.store(out_ptr + r.to(tl.int64)[:, None] * DIM + c[None, :], v.to(DT), mask=m)


def _tiles(dim: int) -> tuple[int, int]:
    block_d = min(triton.next_power_of_2(dim), _MAX_BLOCK_D)
    return max(1, _ELEMS // block_d), block_d


def engram_gather(data: torch.Tensor, ids: torch.Tensor, fmt: str, dim: int, dtype: torch.dtype) -> torch.Tensor:
    """[*ids.shape, dim] rows ``ids`` of ``data`` decoded to ``dtype`` on ids.device, in one launch (see the
    module docstring; no bounds check, no sync, allocates only the output)."""
    _check(data, ids, fmt, dim, dtype)
    if ids.device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(f"ids must be on a CUDA device (or TRITON_INTERPRET=1), got {ids.device}")
    out = torch.empty(*ids.shape, dim, dtype=dtype, device=ids.device)
    flat = ids.reshape(-1)  # a view when ids are contiguous (the hasher's are)
    n = flat.numel()
    if n == 0:
        return out
    rows, block_d = _tiles(dim)
    grid = (triton.cdiv(n, rows), triton.cdiv(dim, block_d))
    args = (data, flat, out, n)
    meta = dict(
        DIM=dim,
        ROW_STRIDE=data.stride(0),
        FP8=fmt == "fp8",
        DT=OUT_DTYPES[dtype],
        ROWS=rows,
        BLOCK_D=block_d,
        num_warps=4,
    )
    launch(_engram_gather_kernel, grid, ids.device, *args, **meta)
    return out


def bench(
    device: str = "cuda",
    table_gb: float = 1.0,
    columns: int = 24,
    dim: int = 256,
    tokens=(1, 8, 32, 128),
    calls: int = 20,
) -> dict:
    """Per B tokens (B x columns rows, bf16 out) from an fp8 table of ``table_gb`` GB: device ms of the kernel
    reading registered host memory (CUDA graph of ``calls`` gathers with distinct ids, L2 flushed per replay) and
    eager; the same kernel on a device-resident copy; and the existing host path (EngramTable.gather: host
    index_select + copy, synchronous). ``equal``: the kernel's rows equal EngramTable.gather's."""
    from ..bench.device_timing import eager_ms, graph_ms
    from ..layers.engram_table import EngramTable, allocate_host

    width = dim + dim // MX_BLOCK
    n_rows = int(table_gb * 2**30) // width
    g = torch.Generator().manual_seed(0)
    mem = allocate_host(n_rows * width)
    table = EngramTable(mem.tensor.view(n_rows, width), "fp8", dim, mem)
    table.data[:, :dim].random_(0, 0x7F, generator=g)  # finite e4m3 bytes
    table.data[:, dim:].random_(117, 137, generator=g)  # scales 2^-10 .. 2^9
    on_device = table.data.to(device)
    out: dict = {"rows": n_rows, "pinned": mem.pinned}
    for b in tokens:
        host_ids = [torch.randint(0, n_rows, (b, columns), generator=g) for _ in range(calls)]
        ids = [i.to(device) for i in host_ids]
        k = engram_gather(table.data, ids[0], "fp8", dim, torch.bfloat16)
        out[b] = {
            "equal": bool(torch.equal(k, table.gather(host_ids[0], device, torch.bfloat16))),
            "kernel_host_graph_ms": graph_ms(
                lambda i: engram_gather(table.data, ids[i], "fp8", dim, torch.bfloat16), calls, calls
            ),
            "kernel_host_eager_ms": eager_ms(
                lambda i: engram_gather(table.data, ids[i], "fp8", dim, torch.bfloat16), calls
            ),
            "kernel_device_graph_ms": graph_ms(
                lambda i: engram_gather(on_device, ids[i], "fp8", dim, torch.bfloat16), calls, calls
            ),
            "host_gather_ms": eager_ms(lambda i: table.gather(host_ids[i], device, torch.bfloat16), calls),
        }
    return out
