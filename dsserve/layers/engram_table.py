"""One Engram layer's table in host memory, and asynchronous copies of the rows a step needs (spec 1.5, 2.7).

The release tables are 2 x ~98 GB, too big for the GPU. Rows depend only on token ids, so a step's rows are
known before its layers run: ``prefetch`` gathers them on the host into a reusable (pinned) staging buffer and
copies them to the device on a side stream while the layers before the Engram layer run.

Host layouts (row-major, one row per table row, D = engram_head_dim = 256 in the release):

* ``"fp8"``: uint8 [rows, D + D/32]: the e4m3 bytes of the row, then its e8m0 scale bytes (one per 32 columns),
  i.e. the release ``engram.embed.weight`` and ``engram.embed.scale`` side by side, so one row is one contiguous
  gather and one copy. Decoded on the device with ``quant.dequant_engram`` (float32, exact), then cast.
* ``"fp8"`` with ``scale``: the same bytes as two tensors, ``data`` uint8 [rows, D] and ``scale`` uint8
  [rows, D/32]: the release file's own tensors memory-mapped (``FileMemory``), no copy in host memory.
* ``"bf16"``: bfloat16 [rows, D] (the table rounded to bf16); ``"float"``: the source weight's dtype, unchanged.

The processes of one engine group (DP ranks, TP workers) share one copy of each table per node through an
``engram_store.EngramStore`` (``from_weight``'s ``store``): ``memory`` is then its read-only ``SharedTable``.

``gather(rows)`` and ``prefetch(rows).wait()`` return [*rows.shape, D] in the requested dtype on the requested
device; without CUDA everything is synchronous on the CPU with the same API.
"""

from __future__ import annotations

import mmap
import time

import torch

from .engram_store import host_memory
from .quant import MX_BLOCK, dequant_engram, quant_engram

FORMATS = ("float", "bf16", "fp8")
_CHUNK_ELEMS = 1 << 24  # fp8 quantisation of a table streams in chunks of about this many values


class HostMemory:
    """Anonymous host memory from ``mmap`` as a uint8 tensor; optionally huge pages, pinned when CUDA exists."""

    def __init__(self, nbytes: int, huge_pages: bool = False):
        if nbytes <= 0:
            raise ValueError(f"nbytes must be positive, got {nbytes}")
        self._map = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        self.huge_pages, self.huge_pages_reason = False, None if huge_pages else "not requested"
        if huge_pages:
            if not hasattr(mmap, "MADV_HUGEPAGE"):
                self.huge_pages_reason = "this OS/Python has no MADV_HUGEPAGE"
            else:
                try:  # advice only: the kernel may still back the range with small pages
                    self._map.madvise(mmap.MADV_HUGEPAGE)
                    self.huge_pages = True
                except OSError as e:
                    self.huge_pages_reason = f"madvise(MADV_HUGEPAGE) failed: {e}"
        self.tensor = torch.frombuffer(self._map, dtype=torch.uint8)
        self.pinned = False
        if torch.cuda.is_available():
            err = torch.cuda.cudart().cudaHostRegister(self.tensor.data_ptr(), nbytes, 0)
            self.pinned = int(err) == 0

    def __del__(self):
        if getattr(self, "pinned", False):
            torch.cuda.cudart().cudaHostUnregister(self.tensor.data_ptr())


class FileMemory:
    """A file mapped copy-on-write: its pages are read on first touch and shared with every other mapping through
    the page cache (DP engines of one host hold the tables once). ``tensor`` is the file's bytes (uint8)."""

    pinned, huge_pages = False, False

    def __init__(self, path: str):
        with open(path, "rb") as f:
            self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
        self.tensor = torch.frombuffer(self._map, dtype=torch.uint8)


def allocate_host(nbytes: int, huge_pages: bool = False) -> HostMemory:
    """``nbytes`` of zeroed anonymous host memory (``.tensor``: uint8 [nbytes]); see ``HostMemory``."""
    return HostMemory(nbytes, huge_pages)


class EngramRows:
    """Handle of one prefetch: the device rows [T, columns, D] once ``wait()`` has ordered the current stream
    after the copy. ``seq_lens``: rows per sequence at prefetch time, so a later narrowing (bounded replay keeps
    a suffix of each sequence) can be applied with ``for_seqs``."""

    def __init__(self, rows: torch.Tensor, seq_lens: list[int], event=None, stream=None):
        self._rows, self.seq_lens, self.event, self.stream = rows, list(seq_lens), event, stream
        self._waited = False

    def wait(self) -> torch.Tensor:
        if self.event is not None and not self._waited:
            cur = torch.cuda.current_stream(self._rows.device)
            cur.wait_event(self.event)
            self._rows.record_stream(cur)  # allocated on the side stream, consumed on this one
        self._waited = True
        return self._rows

    def for_seqs(self, seq_rows: list[slice]) -> torch.Tensor:
        """The rows of ``seq_rows`` (each sequence's slice, possibly narrowed to a suffix of its rows)."""
        rows = self.wait()
        lens = [s.stop - s.start for s in seq_rows]
        if len(lens) != len(self.seq_lens) or any(n > m for n, m in zip(lens, self.seq_lens)):
            raise ValueError(f"prefetched rows for sequences of {self.seq_lens} rows cannot serve {lens}")
        if lens == self.seq_lens:
            return rows
        keep, start = [], 0
        for n, m in zip(lens, self.seq_lens):
            keep.append(torch.arange(start + m - n, start + m))
            start += m
        return rows[torch.cat(keep).to(rows.device)]


class EngramTable:
    """A layer's table in host memory (see the module docstring for layouts)."""

    def __init__(self, data: torch.Tensor, fmt: str, dim: int, memory=None, scale: torch.Tensor | None = None) -> None:
        if fmt not in FORMATS:
            raise ValueError(f"fmt must be one of {FORMATS}, got {fmt!r}")
        if scale is not None and (fmt != "fp8" or tuple(scale.shape) != (data.shape[0], dim // MX_BLOCK)):
            raise ValueError(f"a separate scale is [rows, D/{MX_BLOCK}] of an fp8 table, got {tuple(scale.shape)}")
        self.data, self.fmt, self.dim, self.memory, self.scale = data, fmt, dim, memory, scale
        self._staging: torch.Tensor | None = None
        self._last_copy = None  # event of the latest copy out of the staging buffer
        self._streams: dict = {}

    @property
    def num_rows(self) -> int:
        return self.data.shape[0]

    @classmethod
    def from_weight(
        cls, weight: torch.Tensor, fmt: str = "bf16", huge_pages: bool = False, store=None, key: str | None = None
    ) -> "EngramTable":
        """From a float table [rows, D] on any device; "fp8" quantises it exactly as the checkpoint does.
        ``store`` (``engram_store.EngramStore``) and ``key`` (the table's module name): the node's shared copy,
        converted here only where no other process of the group has converted it yet."""
        if fmt not in FORMATS:
            raise ValueError(f"fmt must be one of {FORMATS}, got {fmt!r}")
        if weight.dim() != 2 or weight.shape[0] == 0:
            raise ValueError(f"weight must be a non-empty [rows, D] table, got shape {tuple(weight.shape)}")
        rows, d = weight.shape
        if fmt == "fp8":
            if d % MX_BLOCK:
                raise ValueError(f"fp8 needs D a multiple of {MX_BLOCK}, got {d}")
            width = d + d // MX_BLOCK

            def fill(buf: torch.Tensor) -> None:
                data = buf.view(rows, width)
                step = max(1, _CHUNK_ELEMS // d)
                for r in range(0, rows, step):
                    q, s = quant_engram(weight[r : r + step].detach())
                    data[r : r + step, :d].copy_(q.view(torch.uint8))
                    data[r : r + step, d:].copy_(s.view(torch.uint8))

            mem = host_memory(rows * width, fill, store, key and f"{key}.fp8.{rows}x{width}", huge_pages)
            return cls(mem.tensor.view(rows, width), fmt, d, mem)
        dt = torch.bfloat16 if fmt == "bf16" else weight.dtype
        nbytes = rows * d * dt.itemsize

        def fill(buf: torch.Tensor) -> None:
            buf.view(dt).view(rows, d).copy_(weight.detach())

        mem = host_memory(
            nbytes, fill, store, key and f"{key}.{fmt}.{str(dt).removeprefix('torch.')}.{rows}x{d}", huge_pages
        )
        return cls(mem.tensor.view(dt).view(rows, d), fmt, d, mem)

    @classmethod
    def from_fp8(cls, weight: torch.Tensor, scale: torch.Tensor, huge_pages: bool = False) -> "EngramTable":
        """From the release tensors: e4m3 [rows, D] and e8m0 [rows, D/32] (any 1-byte dtype)."""
        rows, d = weight.shape
        if weight.element_size() != 1 or scale.element_size() != 1 or tuple(scale.shape) != (rows, d // MX_BLOCK):
            raise ValueError(
                f"expected 1-byte weight [rows, D] and scale [rows, D/{MX_BLOCK}], got "
                f"{weight.dtype} {tuple(weight.shape)} and {scale.dtype} {tuple(scale.shape)}"
            )
        mem = allocate_host(rows * (d + d // MX_BLOCK), huge_pages)
        data = mem.tensor.view(rows, d + d // MX_BLOCK)
        data[:, :d].copy_(weight.view(torch.uint8))
        data[:, d:].copy_(scale.view(torch.uint8))
        return cls(data, "fp8", d, mem)

    # ------------------------------------------------------------------ gathering
    def side_stream(self, device: torch.device):
        key = str(device)
        if key not in self._streams:
            self._streams[key] = torch.cuda.Stream(device)
        return self._streams[key]

    def _stage(self, idx: torch.Tensor) -> torch.Tensor:
        """index_select into the reusable staging buffer (grown by doubling; pinned when CUDA exists)."""
        n = idx.numel()
        if self._last_copy is not None:  # the previous copy may still read the staging buffer
            self._last_copy.synchronize()
            self._last_copy = None
        width = self.data.shape[1] + (0 if self.scale is None else self.scale.shape[1])
        if self._staging is None or self._staging.shape[0] < n:
            cap = max(n, 2 * (0 if self._staging is None else self._staging.shape[0]), 16)
            self._staging = torch.empty(cap, width, dtype=self.data.dtype, pin_memory=torch.cuda.is_available())
        out = self._staging[:n]
        if self.scale is None:
            torch.index_select(self.data, 0, idx, out=out)
        else:  # a mapped release file: weight and scale rows side by side in the staging buffer
            out[:, : self.dim].copy_(self.data.index_select(0, idx))
            out[:, self.dim :].copy_(self.scale.index_select(0, idx))
        return out

    def _decode(self, staged: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        if self.fmt == "fp8":
            return dequant_engram(staged[:, : self.dim], staged[:, self.dim :]).to(dtype)
        return staged.to(dtype)

    def _index(self, rows: torch.Tensor) -> torch.Tensor:
        if rows.dtype not in (torch.int64, torch.int32):
            raise ValueError(f"rows must be an integer tensor, got {rows.dtype}")
        idx = rows.reshape(-1).to("cpu", torch.int64)
        if idx.numel() and (int(idx.min()) < 0 or int(idx.max()) >= self.num_rows):
            raise ValueError(f"rows must lie in [0, {self.num_rows}); got [{int(idx.min())}, {int(idx.max())}]")
        return idx

    def prefetch(
        self, rows: torch.Tensor, device=None, dtype: torch.dtype = torch.float32, seq_lens: list[int] | None = None
    ) -> EngramRows:
        """Start gathering ``rows`` (any shape, any device) to ``device``; the handle's ``wait()`` gives
        [*rows.shape, D]. CUDA: host gather now, copy + decode on this table's side stream."""
        device = torch.device(device if device is not None else rows.device)
        idx = self._index(rows)
        shape = (*rows.shape, self.dim)
        seq_lens = [rows.shape[0]] if seq_lens is None else seq_lens
        if idx.numel() == 0:
            return EngramRows(torch.empty(shape, dtype=dtype, device=device), seq_lens)
        staged = self._stage(idx)
        if device.type != "cuda":
            # a copy: the staging buffer is reused by the next call
            return EngramRows(self._decode(staged.to(device, copy=True), dtype).view(shape), seq_lens)
        stream = self.side_stream(device)
        with torch.cuda.stream(stream):
            out = self._decode(staged.to(device, non_blocking=True), dtype).view(shape)
            event = torch.cuda.Event()
            event.record(stream)
        self._last_copy = event
        return EngramRows(out, seq_lens, event, stream)

    def gather(self, rows: torch.Tensor, device=None, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """[*rows.shape, D] rows of the table on ``device`` (default: rows' device), decoded to ``dtype``."""
        return self.prefetch(rows, device, dtype).wait()

    def device_gather(self, rows: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """``gather`` to rows' device without the host: on a GPU a kernel reads the pinned table in place (so a
        CUDA graph can capture it; rows are not range-checked there: the hasher's are always in range)."""
        if rows.device.type == "cuda" and self.memory is not None and self.memory.pinned and self.scale is None:
            from ..kernels.engram_gather import engram_gather

            return engram_gather(self.data, rows, self.fmt, self.dim, dtype)
        return self.gather(rows, rows.device, dtype)


def bench(
    device: str = "cuda",
    table_gb: float = 4.0,
    columns: int = 24,
    dim: int = 256,
    tokens=(1, 32, 128),
    work_ms: float = 2.0,
) -> dict:
    """Per step and B tokens: ms of a synchronous gather+copy, and ms the consumer waits when the prefetch
    was started before a ~``work_ms`` GPU workload (fp8 table of ``table_gb`` GB in host memory)."""
    from triton.testing import do_bench

    rows = int(table_gb * 2**30) // (dim + dim // MX_BLOCK)
    g = torch.Generator().manual_seed(0)
    mem = allocate_host(rows * (dim + dim // MX_BLOCK), huge_pages=True)
    table = EngramTable(mem.tensor.view(rows, -1), "fp8", dim, mem)
    table.data[:, :dim].random_(0, 0x7F, generator=g)  # finite e4m3 values
    table.data[:, dim:].fill_(127)
    a = torch.randn(4096, 4096, device=device, dtype=torch.bfloat16)
    mm_ms = do_bench(lambda: a @ a, return_mode="median")
    reps = max(1, round(work_ms / mm_ms))
    out = {"matmul_ms": mm_ms, "work_reps": reps}
    for b in tokens:
        idx = torch.randint(0, rows, (b, columns), generator=g)
        sync_ms = do_bench(lambda: table.gather(idx, device, torch.bfloat16), return_mode="median")
        waits, host = [], []
        for _ in range(20):
            t0 = time.perf_counter()
            h = table.prefetch(idx, device, torch.bfloat16)
            host.append((time.perf_counter() - t0) * 1e3)  # host gather + launch, before the workload
            for _ in range(reps):
                a @ a
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            h.wait()
            end.record()  # the gap the consumer stream stalls on the copy, beyond the workload
            torch.cuda.synchronize()
            waits.append(start.elapsed_time(end))
        out[b] = {
            "sync_ms": sync_ms,
            "prefetched_wait_ms": sorted(waits)[len(waits) // 2],
            "prefetch_host_ms": sorted(host)[len(host) // 2],
        }
    return out
