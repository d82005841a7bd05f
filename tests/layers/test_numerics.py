"""layers.numerics: the cached fp32 copies of parameters follow every change of the parameter."""

import torch
from torch import nn

from dsserve.layers.numerics import acc_param, fp32_param


def test_fp32_param_converts_once_and_follows_changes():
    p = nn.Parameter(torch.randn(4, 8).bfloat16())
    with torch.no_grad():
        _cached_conversions(p)
    g = fp32_param(p)  # training (grad on): a differentiable conversion, never the cached copy
    assert g.grad_fn is not None and g is not fp32_param(p)
    q = nn.Parameter(torch.randn(3))
    assert fp32_param(q) is q  # already fp32: itself
    d = nn.Parameter(torch.randn(3, dtype=torch.float64))
    assert acc_param(d) is d and fp32_param(d).dtype == torch.float32


def _cached_conversions(p):
    a = fp32_param(p)
    assert a.dtype == torch.float32 and torch.equal(a, p.float())
    assert fp32_param(p) is a  # cached: no second conversion
    with torch.no_grad():
        p.mul_(2)  # in place (a checkpoint load copies in place too): the version moves
    b = fp32_param(p)
    assert b is not a and torch.equal(b, p.float())
    p.data = torch.randn(4, 8).bfloat16()  # a swap (Module.to does this): new storage
    assert torch.equal(fp32_param(p), p.float())
