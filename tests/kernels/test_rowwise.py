"""dsserve.kernels.rowwise against the layers' torch functions (the interpreter on the CPU; the GPU when present).

RoPE and the FP4 / FP8 fake-quants reproduce their references bit for bit; RMSNorm up to the order of its fp32 sum.
"""

import pytest
import torch

from dsserve.kernels import rowwise as R
from dsserve.layers import quant
from dsserve.layers.norm import rms_norm
from dsserve.layers.rope import rotate

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def _x(shape, dtype, device, seed):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g) * torch.logspace(-3, 2, shape[-1])).to(dtype).to(device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("d,weighted", [(40, True), (64, False), (96, True)])
def test_rms_norm(device, dtype, d, weighted):
    x = _x((5, 3, d), dtype, device, d)
    w = (torch.rand(d, generator=torch.Generator().manual_seed(1)) + 0.5).to(device) if weighted else None
    out, ref = R.rms_norm(x, w, 1e-6), rms_norm(x, w, 1e-6)
    assert out.dtype == dtype and out.shape == x.shape
    if dtype == torch.float32:
        torch.testing.assert_close(out, ref, rtol=2e-6, atol=0)
    else:  # the fp32 values differ by summation order only: at most one bf16 step apart
        torch.testing.assert_close(out.float(), ref.float(), rtol=2**-7, atol=0)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape,r2", [((7, 4, 64), 8), ((9, 32), 16), ((3, 2, 5, 48), 4)])
def test_rope_inplace_is_rotate(device, dtype, shape, r2):
    x = _x(shape, dtype, device, len(shape) + r2)
    ang = torch.rand(shape[0], r2, generator=torch.Generator().manual_seed(2), dtype=torch.float64) * 50
    cos, sin = ang.cos().float().to(device), ang.sin().float().to(device)
    ref = rotate(x, cos, sin)
    keep = x.clone()
    out = R.rope_inplace(x, cos, sin)
    assert out.data_ptr() == x.data_ptr()
    assert torch.equal(out, ref)
    assert torch.equal(out[..., : shape[-1] - 2 * r2], keep[..., : shape[-1] - 2 * r2])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("group", [32, 16])
def test_fake_quant_fp4_pow2_bit_exact(device, dtype, group):
    x = _x((6, 4, 128), dtype, device, group)
    x[0, 0, :group] = 0.0  # an all-zero group: the amax floor
    x[0, 1, :group] = -0.0
    # tiny values: the scale near the bottom of its range (and subnormal inputs; not bf16 ones on the CPU, where
    # the Triton 3.9 interpreter's bf16 -> fp32 load mis-converts subnormals)
    x[1, 0, :group] *= 2.0 ** (-100 if dtype == torch.bfloat16 and device == "cpu" else -120)
    x[2, 2, 3] = x[2, 2, :group].abs().max() * 2 / 3  # ties and midpoints of the grid in one group
    out, ref = R.fake_quant_fp4_pow2(x, group), quant.fake_quant_fp4_pow2(x, group)
    assert out.dtype == dtype and torch.equal(out, ref)
    assert torch.equal(torch.signbit(out), torch.signbit(ref))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("group", [64, 32])
def test_fake_quant_fp8_pow2_bit_exact(device, dtype, group):
    """V4's window / main QAT (FP8, power-of-two scales per 64 channels)."""
    x = _x((6, 4, 448 if group == 64 else 128), dtype, device, group + 1)
    x[0, 0, :group] = 0.0  # an all-zero group: the amax floor
    x[0, 1, :group] = -0.0
    x[1, 0, :group] *= 2.0**-20  # below the floor: the scale stays 2^ceil(log2(1e-4 / 448))
    x[2, 2, 3] = x[2, 2, :group].abs().max() * 9 / 448  # on e4m3's subnormal grid after scaling
    out, ref = R.fake_quant_fp8_pow2(x, group), quant.fake_quant_fp8_pow2(x, group)
    assert out.dtype == dtype and torch.equal(out, ref)
    assert torch.equal(torch.signbit(out), torch.signbit(ref))


def test_fp64_runs_the_reference_and_bad_input_is_named():
    x = torch.randn(3, 32, dtype=torch.float64)
    cos, sin = torch.rand(3, 4, dtype=torch.float64), torch.rand(3, 4, dtype=torch.float64)
    assert torch.equal(R.rms_norm(x, None, 1e-6), rms_norm(x, None, 1e-6))
    assert torch.equal(R.fake_quant_fp4_pow2(x, 32), quant.fake_quant_fp4_pow2(x, 32))
    assert torch.equal(R.rope_inplace(x.clone(), cos, sin), rotate(x, cos, sin))
    with pytest.raises(ValueError, match="kernels take"):
        R.rms_norm(torch.zeros(2, 4, dtype=torch.int32), None, 1e-6)
    with pytest.raises(ValueError, match="weight"):
        R.rms_norm(torch.zeros(2, 4), torch.ones(5), 1e-6)
    with pytest.raises(ValueError, match="contiguous"):
        R.rope_inplace(torch.zeros(8, 3).t(), torch.zeros(3, 1), torch.zeros(3, 1))
    with pytest.raises(ValueError, match="cos, sin"):
        R.rope_inplace(torch.zeros(3, 8), torch.zeros(3, 5), torch.zeros(3, 5))
    with pytest.raises(ValueError, match="group"):
        R.fake_quant_fp4_pow2(torch.zeros(2, 48), 32)
