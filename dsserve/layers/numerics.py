"""Accumulation precision: fp32 for half-precision inputs, fp64 kept as is.

Running the reference in fp64 makes chunked and one-shot prefill agree to ~1e-12, so the QAT fake-quant
rounding (which turns 1e-7 reduction-order noise into whole quantisation steps) is tested exactly too.
"""
import torch


def acc(x: torch.Tensor) -> torch.Tensor:
    return x if x.dtype == torch.float64 else x.float()


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype ``acc`` gives a tensor of ``dtype``."""
    return torch.float64 if dtype == torch.float64 else torch.float32
