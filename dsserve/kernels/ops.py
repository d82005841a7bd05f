"""Which implementation runs each kernelised op: Triton, or its torch reference (for bisecting).

The engine builds one ``KernelOps`` from ``--reference-ops``; the paged attention path (its query path's norm, RoPE
and fake-quant included), the MoE (router and routed experts) and the mHC sites call ops through it.
Every op's reference has the kernel's signature, so switching one op never changes anything else.
"""

from __future__ import annotations

import importlib
import os
from dataclasses import dataclass

import torch

# op name -> (module under dsserve.kernels, functions it provides)
OPS = {
    "attention": ("sparse_attention", ("sparse_attention",)),
    "kv_unpack": ("kv_unpack", ("unpack_rows",)),
    "indexer": ("indexer", ("index_scores", "index_scores_candidates")),
    "topk": ("topk", ("topk", "candidate_blocks")),
    "kv_write": ("kv_write", ("store_window", "store_main", "store_index")),
    "linear": ("fp8_linear", ("fp8_linear",)),
    "router": ("router", ("route",)),
    "moe": ("grouped_moe", ("routed_experts",)),
    "mhc": ("mhc", ("mhc_site", "mhc_expand")),
    "mhc_collapse": ("mhc_collapse", ("mhc_collapse_norm",)),
    "rowwise": ("rowwise", ("rms_norm", "rope_inplace", "fake_quant_fp4_pow2", "fake_quant_fp8_pow2")),
    "entry_rows": ("entry_rows", ("entry_rows",)),
    "engram_rows": ("engram_rows", ("engram_rows",)),
    "engram_mix": ("engram_mix", ("engram_mix",)),
    "swiglu": ("swiglu", ("swiglu",)),
    "window_rows": ("window_rows", ("window_rows",)),
}


def triton_runs_on(device: torch.device) -> bool:
    """Triton compiles for CUDA; on the CPU only its interpreter runs it (tests, tiny shapes)."""
    return device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"


def parse_reference_ops(spec: str) -> frozenset[str]:
    """``--reference-ops``: "" (none), "all", or a comma list of op names."""
    names = {s.strip() for s in spec.split(",") if s.strip()}
    if names == {"all"}:
        return frozenset(OPS)
    unknown = sorted(names - set(OPS))
    if unknown:
        raise ValueError(f"unknown op(s) {unknown} in reference ops; ops are {sorted(OPS)} (or 'all')")
    return frozenset(names)


@dataclass(frozen=True)
class KernelOps:
    reference: frozenset[str] = frozenset()  # ops that run their torch reference

    @classmethod
    def for_device(cls, device: torch.device, reference_ops: str = "") -> "KernelOps":
        ref = parse_reference_ops(reference_ops)
        return cls(ref if triton_runs_on(device) else frozenset(OPS))

    def uses_triton(self, op: str) -> bool:
        return op not in self.reference

    def __getattr__(self, fn: str):
        for op, (module, fns) in OPS.items():
            if fn in fns:
                mod = importlib.import_module(f"dsserve.kernels.{module}")
                return getattr(mod, fn if self.uses_triton(op) else fn + "_ref")
        raise AttributeError(fn)
