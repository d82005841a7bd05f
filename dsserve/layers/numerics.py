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


def fp32_param(p: torch.Tensor) -> torch.Tensor:
    """A parameter in fp32, converted once per value: a cast at every call is a launch and a copy per layer and
    step. The copy is kept on the tensor with a view of the storage it came from (held, so no later tensor can
    take its address) and that storage's version: a load in place or a swap of ``.data`` converts again."""
    if p.dtype == torch.float32:
        return p
    if p.requires_grad and torch.is_grad_enabled():  # training: the conversion must stay differentiable
        return p.float()
    try:
        version = p._version
    except RuntimeError:  # an inference tensor keeps no version: convert every time
        return p.float()
    hit = getattr(p, "_fp32_copy", None)
    if (
        hit is None
        or hit[1] != version
        or hit[0].data_ptr() != p.data_ptr()
        or hit[0].device != p.device
        or hit[0].dtype != p.dtype
    ):
        src = p.detach()
        hit = (src, version, src.float())
        p._fp32_copy = hit
    return hit[2]


def acc_param(p: torch.Tensor) -> torch.Tensor:
    """acc(p) for a parameter: fp64 kept, anything else fp32_param."""
    return p if p.dtype == torch.float64 else fp32_param(p)
