"""Triton's JIT compiles in this process: how many, how long, and which kernels, so that a stalled step can be named.

Triton compiles a kernel the first time the process launches it with a new specialisation: new constexprs (tile
sizes, a row count rounded to a power of two), or an int argument newly a multiple of 16 or equal to 1. A compile
takes 0.1-5 s on the H200 (a load from Triton's on-disk cache a few ms) and stalls the step that launched it; CUDA
graphs hide the ones whose shapes they fix, an eager prefill of a new row count does not. The engine's warm-up
(engine.warmup) runs the shapes traffic will take; what it missed shows here: every compile adds to the counters
(`dsserve:triton_compiles_total`, `dsserve:triton_compile_seconds_total`), and one slower than ``LOG_SECONDS`` is
logged with the kernel's name and specialisation.

It hooks ``triton.knobs.runtime.jit_cache_hook`` (called before a compile; a true return would skip it, so it
returns what a hook installed before it returns) and ``jit_post_compile_hook`` (after). Tritons without those
knobs, and the interpreter (it compiles nothing), leave the counters at zero.
"""
from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field

log = logging.getLogger("dsserve")

LOG_SECONDS = 0.5


@dataclass
class JitCompiles:
    count: int = 0
    seconds: float = 0.0
    by_kernel: dict[str, list] = field(default_factory=dict)  # kernel name -> [compiles, seconds]
    # (kernel "module:name", Triton's specialization_data) of each compile, in order: engine.kernel_manifest
    specs: dict[tuple[str, str], None] = field(default_factory=dict)
    _started: dict[int, float] = field(default_factory=dict)  # thread id -> the compile it is in since
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def started(self) -> None:
        self._started[threading.get_ident()] = time.perf_counter()

    def finished(self, name: str, what: str, spec: tuple[str, str] | None = None) -> None:
        t0 = self._started.pop(threading.get_ident(), None)
        took = 0.0 if t0 is None else time.perf_counter() - t0
        with self._lock:
            self.count += 1
            self.seconds += took
            k = self.by_kernel.setdefault(name, [0, 0.0])
            k[0] += 1
            k[1] += took
            if spec is not None:
                self.specs[spec] = None
        if took >= LOG_SECONDS:
            log.info("triton compiled %s in %.2f s: %s", name, took, what[:1500])

    def snapshot(self) -> tuple[int, float]:
        return self.count, self.seconds


def _what(kwargs: dict) -> str:
    """The specialisation, for the log: the constexprs' values, then the arguments with their specialised types (an
    int Triton saw as a multiple of 16 or as 1 shows there), warps and stages."""
    comp = kwargs.get("compile") or {}
    names = [p.name for p in getattr(getattr(kwargs.get("fn"), "jit_function", None), "params", [])]
    consts = comp.get("constants") or {}
    shown = ", ".join(f"{names[k[0]] if isinstance(k, tuple) and k and k[0] < len(names) else k}={v}"
                      for k, v in consts.items() if not callable(v))
    return f"constexprs {{{shown}}}; {kwargs.get('repr', '')}"


def _spec(kwargs: dict) -> tuple[str, str] | None:
    """("module:name", specialization_data): what JITFunction.preload compiles again (engine.kernel_manifest)."""
    fn, data = kwargs.get("fn"), (kwargs.get("compile") or {}).get("specialization_data")
    module = getattr(fn, "module", None)
    module = getattr(module, "__name__", module)  # Triton passes the module's name
    if not (isinstance(module, str) and getattr(fn, "name", None) and isinstance(data, str)):
        return None
    return f"{module}:{fn.name}", data


COMPILES = JitCompiles()
_installed = False


def watch() -> bool:
    """Install the hooks once per process; False where this Triton has no such knobs."""
    global _installed
    if _installed:
        return True
    try:
        from triton import knobs
        rt = knobs.runtime
        before_cache, before_post = rt.jit_cache_hook, rt.jit_post_compile_hook
    except (ImportError, AttributeError):
        return False

    def cache_hook(*args, **kwargs):
        COMPILES.started()
        return before_cache(*args, **kwargs) if before_cache else None

    def post_hook(*args, **kwargs):
        fn = kwargs.get("fn")
        COMPILES.finished(getattr(fn, "name", "?"), _what(kwargs), _spec(kwargs))
        return before_post(*args, **kwargs) if before_post else None

    rt.jit_cache_hook, rt.jit_post_compile_hook = cache_hook, post_hook
    _installed = True
    return True
