"""A manifest of the Triton kernels a server compiled, so that the next start compiles them in parallel first.

A server's first start on a machine compiles its kernels one after another in the warm-up (376 compiles, 261 of
its 300 s for the release proxy on a bare H200: benchmarks/results/agentx-replay-off-compiles-h200), and Triton's
on-disk cache (~/.triton/cache) only helps a machine that kept it. `dsserve serve --kernel-manifest FILE` keeps
the list instead: after the warm-up and at shutdown the file is rewritten with every kernel specialisation this
process compiled (Triton's own serialisation, ``specialization_data``, which engine.jit_compiles records), and at
the next start, before the model is built, worker processes compile everything the file lists
(``JITFunction.preload``) into the disk cache, in parallel, so the warm-up only loads them.

Workers are spawned (each makes its own CUDA context: they finish before the KV cache is sized); an entry that no
longer matches its kernel (the code changed) fails in its worker and is only counted.
"""

from __future__ import annotations

import importlib
import json
import logging
import multiprocessing
import os
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from . import jit_compiles

log = logging.getLogger("dsserve")


@dataclass(frozen=True)
class PrecompileReport:
    entries: int
    failed: int
    seconds: float
    workers: int


def load(path: str | os.PathLike) -> list[tuple[str, str]]:
    """(kernel "module:name", specialization_data) per line; [] for a missing file."""
    p = Path(path)
    if not p.exists():
        return []
    out = []
    for n, line in enumerate(p.read_text().splitlines(), 1):
        if line.strip():
            try:
                e = json.loads(line)
                out.append((e["kernel"], e["data"]))
            except (ValueError, KeyError, TypeError) as err:
                raise ValueError(
                    f"{p}:{n}: not a kernel manifest line ({err!r}): expected "
                    '{"kernel": "module:name", "data": "<specialization_data>"}'
                ) from None
    return out


def save(path: str | os.PathLike) -> int:
    """Rewrite ``path`` with its entries plus every specialisation this process compiled; returns the count."""
    entries = dict.fromkeys(load(path))
    entries.update(dict.fromkeys(jit_compiles.COMPILES.specs))
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    tmp = p.with_name(p.name + ".tmp")
    tmp.write_text("".join(json.dumps({"kernel": k, "data": d}) + "\n" for k, d in entries))
    tmp.replace(p)
    return len(entries)


def preload_one(entry: tuple[str, str]) -> str | None:
    """Compile one entry into Triton's caches (in a worker); the error, or None."""
    kernel, data = entry
    try:
        module, name = kernel.rsplit(":", 1)
        getattr(importlib.import_module(module), name).preload(data)
        return None
    except Exception as e:  # noqa: BLE001 - a stale or foreign entry is counted, not fatal
        return f"{kernel}: {e!r}"[:300]


def precompile(path: str | os.PathLike, workers: int) -> PrecompileReport:
    """Compile every kernel ``path`` lists, ``workers`` processes at once (0: in this process, one by one)."""
    entries = load(path)
    t0 = time.perf_counter()
    if not entries:
        return PrecompileReport(0, 0, 0.0, 0)
    if workers <= 0:
        errors = [preload_one(e) for e in entries]
    else:
        ctx = multiprocessing.get_context("spawn")  # no CUDA state forked
        with ProcessPoolExecutor(workers, mp_context=ctx) as pool:
            errors = list(pool.map(preload_one, entries, chunksize=max(1, len(entries) // (4 * workers))))
    failed = [e for e in errors if e]
    report = PrecompileReport(len(entries), len(failed), time.perf_counter() - t0, workers)
    log.info(
        "kernel manifest %s: %d kernels precompiled in %.1f s by %d workers, %d failed%s",
        path,
        report.entries - report.failed,
        report.seconds,
        workers,
        report.failed,
        f" (first: {failed[0]})" if failed else "",
    )
    return report


def default_workers() -> int:
    return min(16, os.cpu_count() or 1)
