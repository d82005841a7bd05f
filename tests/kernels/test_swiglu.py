"""dsserve.kernels.swiglu against its torch reference (layers.moe.clamped_swiglu on the chunked h).

CPU: the Triton interpreter on ragged tiny shapes. Its exp is numpy's, not torch's CPU silu's, so fp32 agrees to a
few ulp and bf16 / fp16 almost always bitwise. GPU: the release shapes, bitwise equal expected."""

import pytest
import torch

from dsserve.kernels.swiglu import swiglu, swiglu_ref

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
LIMIT = 10.0  # ModelConfig.swiglu_limit
_BITS = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}


def _h(t, inter, dtype, limit, seed, device="cpu", pad=0):
    """[t, 2 * inter] spanning past +-limit, with the bounds, exp's overflow (-100) and zeros; rows strided by pad."""
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(t, 2 * inter + pad, generator=g) * (1.5 * limit)
    specials = torch.tensor([limit, -limit, -100.0, 100.0, 0.0, -0.0, 1e-3, -2 * limit])
    flat = h.view(-1)
    flat[torch.randint(0, flat.numel(), (len(specials) * 2,), generator=g)] = specials.repeat(2)
    return h.to(dtype).to(device)[:, : 2 * inter]


def _ulps(out, ref):
    """|out - ref| in units in the last place (adjacent values of one sign differ by 1 in their bits)."""
    bits = _BITS[out.dtype]
    return (out.view(bits).long() - ref.view(bits).long()).abs()


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the interpreter's exp overflows on purpose (-100)
@pytest.mark.parametrize("t,inter,pad", [(1, 3, 0), (2, 17, 5), (3, 64, 0), (5, 37, 1), (7, 100, 0)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_matches_ref_interpreted(t, inter, pad, dtype):
    h = _h(t, inter, dtype, LIMIT, seed=t * inter, pad=pad)
    out, ref = swiglu(h, LIMIT), swiglu_ref(h, LIMIT)
    assert out.shape == (t, inter) and out.dtype == dtype and out.is_contiguous()
    assert out.isfinite().all() and (out.abs() > 0).any()
    if dtype == torch.float32:  # numpy's exp vs torch's: a few ulp
        assert _ulps(out, ref).max() <= 4
    else:
        assert _ulps(out, ref).max() <= 1 and (out == ref).float().mean() >= 0.999


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
def test_rounded_limit_and_nan_interpreted():
    """bf16 over many values, a limit bf16 cannot hold (the clamp bound is the limit rounded, as torch's) and NaN."""
    limit = 7.01
    h = _h(64, 96, torch.bfloat16, limit, seed=3)
    h[0, 0] = h[1, 96] = float("nan")  # a gate and an up
    out, ref = swiglu(h, limit), swiglu_ref(h, limit)
    assert torch.equal(out.isnan(), ref.isnan()) and out[0, 0].isnan() and out[1, 0].isnan()
    live = ~ref.isnan()
    assert (out[live] == ref[live]).float().mean() >= 0.999 and _ulps(out[live], ref[live]).max() <= 1
    assert out[live].abs().amax() <= limit * torch.nn.functional.silu(torch.tensor(limit)) * 1.01


def test_bad_input_is_named():
    with pytest.raises(ValueError, match="even last dim"):
        swiglu(torch.zeros(2, 7), LIMIT)
    with pytest.raises(ValueError, match=r"\[T, 2I\]"):
        swiglu(torch.zeros(8), LIMIT)
    with pytest.raises(ValueError, match="must be one of"):
        swiglu(torch.zeros(2, 8, dtype=torch.int32), LIMIT)
    with pytest.raises(ValueError, match="contiguous"):
        swiglu(torch.zeros(8, 2).t(), LIMIT)
    with pytest.raises(ValueError, match="limit"):
        swiglu(torch.zeros(2, 8), -1.0)
    assert swiglu(torch.zeros(0, 8), LIMIT).shape == (0, 4)


@needs_cuda
@pytest.mark.parametrize(
    "t,dtype",
    [(1, torch.bfloat16), (37, torch.bfloat16), (8192, torch.bfloat16), (37, torch.float32), (37, torch.float16)],
)
def test_release_shapes_bitwise(t, dtype):
    inter = 2304
    h = _h(t, inter, dtype, LIMIT, seed=t, device="cuda")
    torch.full((t * inter,), float("nan"), dtype=dtype, device="cuda")  # freed: the output's block is poisoned
    out, ref = swiglu(h, LIMIT), swiglu_ref(h, LIMIT)
    diff = out != ref
    assert torch.equal(out, ref), f"{int(diff.sum())} of {out.numel()} differ, max {int(_ulps(out, ref).max())} ulp"
    strided = _h(t, inter, dtype, LIMIT, seed=t + 1, device="cuda", pad=8)  # rows of a wider product
    strided[0, 1] = strided[-1, inter + 2] = float("nan")  # a gate and an up: NaN kept as torch's clamp keeps it
    out, ref = swiglu(strided, LIMIT), swiglu_ref(strided, LIMIT)
    assert out[0, 1].isnan() and out[-1, 2].isnan() and torch.equal(out.nan_to_num(7.0), ref.nan_to_num(7.0))
