"""mhc_collapse_norm (Triton) == its reference, and == the h that mhc_site computes (its d-split sums aside)."""

import pytest
import torch

from dsserve.kernels.mhc import example_inputs, mhc_site
from dsserve.kernels.mhc_collapse import mhc_collapse_norm, mhc_collapse_norm_ref

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _rel(out, ref):
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


def _args(t, d, dtype, device="cpu", seed=0):
    x, fn, base, scale, pre_in, norm_w, norm_eps, rms_eps, hc_eps, iters = example_inputs(t, 4, d, dtype, device, seed)
    return (x, fn, base, scale, pre_in, norm_w, norm_eps, rms_eps, hc_eps, iters), (x, pre_in, norm_w, norm_eps)


@pytest.mark.parametrize("t,d", [(1, 64), (5, 96), (3, 200)])  # d off a power of two: masked tail
def test_fp32_equals_reference_and_site(t, d):
    site_args, args = _args(t, d, torch.float32, seed=t)
    h = mhc_collapse_norm(*args)
    assert h.dtype == torch.float32 and h.shape == (t, d)
    assert _rel(h, mhc_collapse_norm_ref(*args)) < 1e-6
    assert _rel(h, mhc_site(*site_args)[0]) < 1e-6


def test_fp16_rounds_as_the_site():
    # fp16, not bf16: the interpreter truncates fp32 -> bf16 casts (the kernels round bf16 on the bits instead)
    site_args, args = _args(4, 128, torch.float16, seed=3)
    h, want = mhc_collapse_norm(*args), mhc_site(*site_args)[0]
    assert h.dtype == torch.float16 and (h != want).double().mean().item() < 0.02 and _rel(h, want) < 1e-3


def test_rejects_bad_operands():
    _, (x, pre_in, norm_w, eps) = _args(2, 64, torch.float32)
    with pytest.raises(ValueError, match="pre_in"):
        mhc_collapse_norm(x, pre_in[:1], norm_w, eps)
    with pytest.raises(ValueError, match="norm_w"):
        mhc_collapse_norm_ref(x, pre_in, norm_w[:3], eps)
    with pytest.raises(ValueError, match=r"\[T, n, d\]"):
        mhc_collapse_norm(x[0], pre_in, norm_w, eps)
    with pytest.raises(ValueError, match="fp32/bf16/fp16"):
        mhc_collapse_norm(x.double(), pre_in, norm_w, eps)
    assert mhc_collapse_norm(x[:0], pre_in[:0], norm_w, eps).shape == (0, 64)


@cuda
@pytest.mark.parametrize("t", [1, 7, 64])
def test_gpu_release_width(t):
    site_args, args = _args(t, 5120, torch.bfloat16, "cuda", seed=t)
    torch.full((t * 5120,), float("nan"), dtype=torch.bfloat16, device="cuda")  # freed: the output block is poisoned
    h = mhc_collapse_norm(*args)
    want = mhc_site(*site_args)[0]
    assert not h.isnan().any() and _rel(h, mhc_collapse_norm_ref(*args)) < 1e-2
    assert (h != want).double().mean().item() < 0.01 and _rel(h, want) < 1e-2  # only sum-order ties may flip
