"""The safetensors files of a checkpoint: their headers, and reads of whole tensors or row/column slices.

Reads are plain ``pread``s into freshly allocated tensors rather than ``safe_open``'s memory map: a map keeps
every page it touched resident (and counted in the process's RSS) until the file is closed, so streaming a
checkpoint through it holds the whole file, while a read holds only the tensor just read. The format is the one
safetensors documents: an 8-byte little-endian header length, a JSON header ``{name: {dtype, shape,
data_offsets: [begin, end]}}`` with offsets relative to the end of the header, then the data, row-major.
``bytes_read`` counts what was read from the files (the tests check that a rank reads only its share).
"""

from __future__ import annotations

import json
import math
import os
import struct
import threading
from dataclasses import dataclass

import torch

from .checkpoint_layout import ST_DTYPES

SINGLE_FILE, INDEX_FILE = "model.safetensors", "model.safetensors.index.json"
ST_ITEMSIZE = {
    "BF16": 2,
    "F16": 2,
    "F32": 4,
    "F64": 8,
    "F8_E4M3": 1,
    "F8_E8M0": 1,
    "I8": 1,
    "U8": 1,
    "I32": 4,
    "I64": 8,
}


class CheckpointError(ValueError):
    """A checkpoint (or a model) that does not match the layout of its config."""


@dataclass(frozen=True)
class StoredTensor:
    """One tensor's header entry: its file, dtype (safetensors name), shape and absolute byte range."""

    file: str
    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.begin


def read_header(fn: str) -> dict[str, StoredTensor]:
    """The tensors of one safetensors file; raises CheckpointError for a file too short for its own header."""
    size = os.path.getsize(fn)
    with open(fn, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise CheckpointError(f"{fn}: {size} bytes, too short for a safetensors header")
        (n,) = struct.unpack("<Q", head)
        if 8 + n > size:
            raise CheckpointError(f"{fn}: header of {n} bytes runs past the end of the file ({size} bytes)")
        try:
            header = json.loads(f.read(n))
        except json.JSONDecodeError as e:
            raise CheckpointError(f"{fn}: header is not valid JSON: {e}") from None
    base = 8 + n
    out = {}
    for name, h in header.items():
        if name == "__metadata__":
            continue
        b, e = h["data_offsets"]
        out[name] = StoredTensor(fn, h["dtype"], tuple(h["shape"]), base + b, base + e)
    return out


class CheckpointFiles:
    """The tensors of a checkpoint directory (``model.safetensors``, or shards listed by
    ``model.safetensors.index.json``) or of one file: ``tensors`` maps each name to its ``StoredTensor``."""

    def __init__(self, path: str):
        self.path = path
        if os.path.isfile(path):
            files, listed = [path], None
        elif os.path.exists(os.path.join(path, INDEX_FILE)):
            with open(os.path.join(path, INDEX_FILE)) as f:
                wm = json.load(f)["weight_map"]
            listed = {k: os.path.join(path, v) for k, v in wm.items()}
            files = sorted(set(listed.values()))
        elif os.path.exists(os.path.join(path, SINGLE_FILE)):
            files, listed = [os.path.join(path, SINGLE_FILE)], None
        else:
            raise CheckpointError(f"no {SINGLE_FILE} or {INDEX_FILE} in {path}")
        self.tensors: dict[str, StoredTensor] = {}
        self.problems: list[str] = []  # listed but absent, truncated: reported with the layout's problems
        self.sizes: dict[str, int] = {}
        for fn in files:
            if not os.path.exists(fn):
                raise CheckpointError(f"checkpoint {path}: shard {fn} named in {INDEX_FILE} does not exist")
            self.sizes[fn] = os.path.getsize(fn)
            for name, t in read_header(fn).items():
                if listed is not None and listed.get(name) != fn:
                    continue
                self.tensors[name] = t
                want = math.prod(t.shape) * ST_ITEMSIZE.get(t.dtype, 0)
                if t.end > self.sizes[fn]:
                    self.problems.append(
                        f"tensor {name!r}: its bytes [{t.begin}, {t.end}) run past the end of {fn} "
                        f"({self.sizes[fn]} bytes): a truncated shard"
                    )
                elif t.dtype in ST_ITEMSIZE and t.nbytes != want:
                    self.problems.append(
                        f"tensor {name!r}: {t.nbytes} bytes stored, {want} for {list(t.shape)} {t.dtype}"
                    )
        for name, fn in (listed or {}).items():
            if name not in self.tensors:
                self.problems.append(f"tensor {name!r} is listed in {INDEX_FILE} but absent from {fn}")
        self.bytes_read = 0
        self._lock = threading.Lock()
        self._fds: dict[str, int] = {}
        self._maps: dict = {}

    def mapped(self, fn: str):
        """``fn`` mapped copy-on-write (layers.engram_table.FileMemory), one mapping per file; it outlives close()."""
        from ..layers.engram_table import FileMemory

        if fn not in self._maps:
            self._maps[fn] = FileMemory(fn)
        return self._maps[fn]

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()

    def __enter__(self) -> "CheckpointFiles":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _fd(self, fn: str) -> int:
        with self._lock:
            if fn not in self._fds:
                self._fds[fn] = os.open(fn, os.O_RDONLY)
            return self._fds[fn]

    def _pread(self, t: StoredTensor, name: str, out: torch.Tensor, offset: int) -> None:
        view = memoryview(out.numpy()).cast("B")
        got = os.preadv(self._fd(t.file), [view], offset)
        if got != view.nbytes:
            raise CheckpointError(f"tensor {name!r}: read {got} of {view.nbytes} bytes from {t.file}: truncated")
        with self._lock:
            self.bytes_read += got

    def buffer(self, name: str, dim: int | None = None, part: tuple[int, int] | None = None) -> torch.Tensor:
        """Uninitialised uint8 storage for ``read(name, dim, part)`` (a reader thread then only fills it: memory
        freed by the thread that allocated it goes back to that thread's malloc arena, so allocating in the
        consuming thread keeps the read-ahead from spreading freed memory over one arena per reader)."""
        t = self.tensors[name]
        n = t.nbytes if part is None else t.nbytes // t.shape[dim] * (part[1] - part[0])
        return torch.empty(n, dtype=torch.uint8)

    def read(
        self, name: str, dim: int | None = None, part: tuple[int, int] | None = None, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Tensor `name` (a CPU tensor of its stored dtype), or only indices [part[0], part[1]) along `dim`
        (0 or 1): a row slice is one read, a column slice one read per row. out: a ``buffer`` to read into."""
        t = self.tensors[name]
        dtype, item = ST_DTYPES[t.dtype], ST_ITEMSIZE[t.dtype]
        shape = list(t.shape)
        out = self.buffer(name, dim, part) if out is None else out
        if part is None:
            self._pread(t, name, out, t.begin)
            return out.view(dtype).view(shape)
        lo, hi = part
        if dim == 0:
            row = item * math.prod(shape[1:])
            self._pread(t, name, out, t.begin + lo * row)
            return out.view(dtype).view([hi - lo, *shape[1:]])
        if dim != 1 or len(shape) != 2:
            raise ValueError(f"tensor {name!r}: slices along dim 0, or dim 1 of a matrix, not dim {dim} of {shape}")
        rows, cols = shape
        out = out.view(rows, (hi - lo) * item)
        for r in range(rows):
            self._pread(t, name, out[r], t.begin + (r * cols + lo) * item)
        return out.view(dtype)
