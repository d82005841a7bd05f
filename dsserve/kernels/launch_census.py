"""Which compiled kernels a run needs, found on the CPU: every Triton launch's compile key, recorded, not run.

On a GPU Triton compiles a kernel once per key: its constexprs, its tensors' dtypes and 16-byte alignment, each int
argument as a multiple of 16, as 1 or neither (unless ``do_not_specialize``), and the launch's warps and stages. A
key first met while serving stalls that step for the compile (engine.jit_compiles counts them on the GPU). The
census finds such keys without a GPU: ``CensusOps`` runs each op's Triton wrapper with its launches recorded and
skipped (under the interpreter, ``TRITON_INTERPRET=1``), then returns the op's torch reference result, so the model
runs as usual and every launch its GPU path would make is listed. A test can then ask, for example, whether a prefix
hit at a new context length needs any kernel an earlier hit did not.

While recording, ``torch.empty`` allocates zeros: the skipped kernels leave their outputs as allocated, and a wrapper
that reads one on the host (an index for a gather) must see valid values. The wrappers get copies of the op's
tensors, so nothing they write in place reaches the model.
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
from dataclasses import dataclass, field

import torch

from .ops import OPS, KernelOps


def _kind(value, name: str, constexpr: bool, unspecialized: set) -> object:
    """One argument's part of the compile key."""
    if constexpr:
        return repr(value)
    if isinstance(value, torch.Tensor):
        return (str(value.dtype), value.data_ptr() % 16 == 0)
    if isinstance(value, bool) or value is None:
        return value
    if isinstance(value, int):
        width = "i64" if not -(2**31) <= value < 2**31 else "i32"
        if name in unspecialized:
            return width
        return width + ("=1" if value == 1 else "%16" if value % 16 == 0 else "")
    if isinstance(value, float):
        return "fp32"
    return type(value).__name__  # a tensor descriptor: its shape enters the key through the kernel's constexprs


@dataclass
class LaunchCensus:
    keys: dict[str, set] = field(default_factory=dict)  # kernel name -> compile keys launched
    launches: int = 0
    errors: list[str] = field(default_factory=list)  # wrappers that failed on the skipped kernels' outputs

    def record(self, fn, args, kwargs) -> None:
        params = inspect.signature(fn.fn).parameters
        bound = dict(zip(fn.arg_names, args), **{k: v for k, v in kwargs.items() if k in params})
        spec = fn.kwargs.get("do_not_specialize") or ()
        unspecialized = {fn.arg_names[s] if isinstance(s, int) else s for s in spec}
        key = tuple(
            (name, _kind(v, name, "constexpr" in str(params[name].annotation), unspecialized))
            for name, v in bound.items()
        )
        options = tuple(sorted((k, v) for k, v in kwargs.items() if k not in params))
        self.keys.setdefault(fn.fn.__name__, set()).add(key + options)
        self.launches += 1

    def snapshot(self) -> dict[str, frozenset]:
        return {name: frozenset(keys) for name, keys in self.keys.items()}

    def new_since(self, before: dict[str, frozenset]) -> dict[str, int]:
        """Kernel name -> how many keys appeared after ``before`` (a snapshot): the compiles a GPU would add."""
        out = {name: len(keys - before.get(name, frozenset())) for name, keys in self.keys.items()}
        return {name: n for name, n in out.items() if n}

    @contextlib.contextmanager
    def recording(self):
        from triton.runtime.interpreter import InterpretedFunction

        real_run, real_empty = InterpretedFunction.run, torch.empty

        def run(fn, *args, grid, warmup, **kwargs):
            if not warmup:
                self.record(fn, args, kwargs)

        def zeros(*args, **kwargs):
            return torch.zeros(*args, **kwargs)

        InterpretedFunction.run, torch.empty = run, zeros
        try:
            yield self
        finally:
            InterpretedFunction.run, torch.empty = real_run, real_empty


def _copied(value):
    if isinstance(value, torch.Tensor):
        return value.clone()
    if isinstance(value, (list, tuple)):
        return type(value)(_copied(v) for v in value)
    return value


@dataclass(frozen=True)
class CensusOps(KernelOps):
    """Every op on its Triton path for the census (launches recorded, not run), its result from the reference."""

    census: LaunchCensus = field(default_factory=LaunchCensus)

    def uses_triton(self, op: str) -> bool:
        return True

    def __getattr__(self, fn: str):
        for module, fns in OPS.values():
            if fn in fns:
                mod = importlib.import_module(f"dsserve.kernels.{module}")
                kernel, ref = getattr(mod, fn), getattr(mod, fn + "_ref")
                return lambda *a, **kw: self._both(fn, kernel, ref, a, kw)
        raise AttributeError(fn)

    def _both(self, name, kernel, ref, args, kwargs):
        with self.census.recording():
            try:
                kernel(*_copied(args), **{k: _copied(v) for k, v in kwargs.items()})
            except Exception as e:  # noqa: BLE001 - recorded: a census with errors is incomplete, and tests say so
                self.census.errors.append(f"{name}: {e!r}"[:300])
        return ref(*args, **kwargs)
