"""Triton's JIT compiles in this process: how many, how long, and which kernels, so that a stalled step can be named.

Triton compiles a kernel the first time the process launches it with a new specialisation: new constexprs (tile
sizes, a row count rounded to a power of two), or an int argument newly a multiple of 16 or equal to 1. A compile
takes 0.1-5 s on the H200 and stalls the step that launched it; CUDA graphs hide the ones whose shapes they fix, an
eager prefill of a new row count does not. A kernel in Triton's on-disk cache (compiled by an earlier process, or by
engine.kernel_manifest's workers) is loaded instead, in a few ms. The engine's warm-up (engine.warmup) runs the
shapes traffic will take; what it missed shows here: every compile adds to the counters
(`dsserve:triton_compiles_total`, `dsserve:triton_compile_seconds_total`) and every load to
`dsserve:triton_cache_loads_total`, and one slower than ``LOG_SECONDS`` is logged with the kernel's name and
specialisation.

It hooks ``triton.knobs.runtime.jit_cache_hook`` (called before a compile; a true return would skip it, so it
returns what a hook installed before it returns) and ``jit_post_compile_hook`` (after), and
``knobs.compilation.listener`` (inside; it says whether the disk cache held the kernel: without it, loads count as
compiles). Each chains what was installed before it. Tritons without those knobs, and the interpreter (it compiles
nothing), leave the counters at zero.
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
    count: int = 0  # compiles
    seconds: float = 0.0
    loads: int = 0  # kernels loaded from Triton's disk cache (their seconds are in load_seconds)
    load_seconds: float = 0.0
    by_kernel: dict[str, list] = field(default_factory=dict)  # kernel name -> [compiles, seconds]
    # (kernel "module:name", Triton's specialization_data) of each compile, in order: engine.kernel_manifest
    specs: dict[tuple[str, str], None] = field(default_factory=dict)
    _started: dict[int, float] = field(default_factory=dict)  # thread id -> the compile it is in since
    _cache_hit: dict[int, bool] = field(default_factory=dict)  # thread id -> what the listener said of it
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def started(self) -> None:
        me = threading.get_ident()
        self._cache_hit.pop(me, None)  # a direct triton.compile's, with no JIT hooks around it
        self._started[me] = time.perf_counter()

    def listened(self, cache_hit: bool) -> None:
        self._cache_hit[threading.get_ident()] = bool(cache_hit)

    def finished(self, name: str, what: str, spec: tuple[str, str] | None = None) -> None:
        me = threading.get_ident()
        t0, hit = self._started.pop(me, None), self._cache_hit.pop(me, False)
        took = 0.0 if t0 is None else time.perf_counter() - t0
        with self._lock:
            if spec is not None:  # loaded or compiled, the next start on a bare machine needs it
                self.specs[spec] = None
            if hit:
                self.loads += 1
                self.load_seconds += took
                return
            self.count += 1
            self.seconds += took
            k = self.by_kernel.setdefault(name, [0, 0.0])
            k[0] += 1
            k[1] += took
        if took >= LOG_SECONDS:
            log.info("triton compiled %s in %.2f s: %s", name, took, what[:1500])

    def snapshot(self) -> tuple[int, float, int]:
        """(compiles, their seconds, loads from the disk cache)."""
        return self.count, self.seconds, self.loads


def _what(kwargs: dict) -> str:
    """The specialisation, for the log: the constexprs' values, then the arguments with their specialised types (an
    int Triton saw as a multiple of 16 or as 1 shows there), warps and stages."""
    comp = kwargs.get("compile") or {}
    names = [p.name for p in getattr(getattr(kwargs.get("fn"), "jit_function", None), "params", [])]
    consts = comp.get("constants") or {}
    shown = ", ".join(
        f"{names[k[0]] if isinstance(k, tuple) and k and k[0] < len(names) else k}={v}"
        for k, v in consts.items()
        if not callable(v)
    )
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
    comp = getattr(knobs, "compilation", None)
    before_listener = getattr(comp, "listener", None)

    def cache_hook(*args, **kwargs):
        COMPILES.started()
        return before_cache(*args, **kwargs) if before_cache else None

    def post_hook(*args, **kwargs):
        fn = kwargs.get("fn")
        COMPILES.finished(getattr(fn, "name", "?"), _what(kwargs), _spec(kwargs))
        return before_post(*args, **kwargs) if before_post else None

    def listener(*args, **kwargs):
        COMPILES.listened(kwargs.get("cache_hit", False))
        return before_listener(*args, **kwargs) if before_listener else None

    rt.jit_cache_hook, rt.jit_post_compile_hook = cache_hook, post_hook
    if comp is not None and hasattr(comp, "listener"):
        comp.listener = listener
    _installed = True
    return True
