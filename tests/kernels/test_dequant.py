"""dsserve.kernels.dequant: FP8 block and MXFP4 weights decoded to a float dtype, bit-exact against the torch decode."""

import pytest
import torch
import triton
import triton.language as tl

from dsserve.kernels import dequant as Q
from dsserve.layers.quant import dequant_mxfp4, pack_mxfp4, quant_fp8_block

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def fp8_weight(n, k, block, device="cpu", seed=0):
    g = torch.Generator(device=device).manual_seed(seed)
    # magnitudes spread over rows and columns: each block gets its own scale, some tiny (e8m0 near 0)
    w = torch.randn(n, k, generator=g, device=device) * torch.logspace(-30, 3, n, device=device)[:, None]
    w *= torch.logspace(0, 2, k, device=device)[None, :]
    q, s = quant_fp8_block(w, block)
    return q, s.view(torch.uint8)


@pytest.mark.parametrize("n,k,block", [(70, 300, 32), (64, 256, 128), (33, 40, 64)])  # ragged edge blocks too
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_fp8_is_the_torch_decode_exactly(n, k, block, dtype):
    q, s = fp8_weight(n, k, block, seed=n)
    out = Q.dequant_fp8(q, s, block, dtype)
    assert out.dtype == dtype and torch.equal(out, Q.dequant_fp8_ref(q, s, block, dtype))
    assert torch.equal(Q.dequant_fp8(q.view(torch.uint8), s, block, dtype), out)  # raw bytes accepted


@pytest.mark.parametrize("shape", [(5, 64), (3, 7, 128)])  # an expert stack [E, out, in] as well as one matrix
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_mxfp4_is_the_torch_decode_exactly(shape, dtype):
    g = torch.Generator().manual_seed(len(shape))
    w = torch.randn(*shape, generator=g) * torch.logspace(-3, 3, shape[-1])  # every scale and code in use
    p, s = pack_mxfp4(w)
    out = Q.dequant_mxfp4(p, s, dtype)
    assert out.shape == shape and torch.equal(out, Q.dequant_mxfp4_ref(p, s, dtype))


def test_rejects_bad_operands():
    q, s = fp8_weight(64, 64, 32)
    with pytest.raises(ValueError, match="w_s"):
        Q.dequant_fp8(q, s[:1], 32)
    with pytest.raises(ValueError, match="w_q"):
        Q.dequant_fp8(q.float(), s, 32)
    with pytest.raises(ValueError, match="dtype"):
        Q.dequant_fp8(q, s, 32, torch.int32)
    p, sc = pack_mxfp4(torch.randn(4, 64))
    with pytest.raises(ValueError, match="scale"):
        Q.dequant_mxfp4(p, sc[:, :1])
    with pytest.raises(ValueError, match="multiple of 32"):
        Q.dequant_mxfp4(p[:, :8], sc)
    assert Q.dequant_fp8(q[:0], s[:0], 32).shape == (0, 64)


@cuda
def test_gpu_release_shapes():
    q, s = fp8_weight(32768, 1024, 32, "cuda")  # attn.wq_b
    out = torch.full((32768, 1024), float("nan"), dtype=torch.bfloat16, device="cuda")
    del out  # the freed block is poisoned: the kernel must write every element
    assert torch.equal(Q.dequant_fp8(q, s, 32), Q.dequant_fp8_ref(q, s, 32))
    w = torch.randn(48, 512, 5120, device="cuda")  # one EP rank's w1 (inter cut to 512)
    p, sc = pack_mxfp4(w)
    assert torch.equal(Q.dequant_mxfp4(p, sc), Q.dequant_mxfp4_ref(p, sc))


@triton.jit
def _ptx_tile_kernel(w32_ptr, s_ptr, o_ptr, N: tl.constexpr, K: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    rn = tl.arange(0, BN)
    for t in range(K // BK):
        v = Q.mxfp4_tile_bf16(w32_ptr, s_ptr, tl.program_id(0), rn, t * BK, N, K, BN, BK)
        kk = t * BK + tl.arange(0, BK)
        tl.store(o_ptr + tl.program_id(0) * N * K + rn[:, None] * K + kk[None, :], v, mask=rn[:, None] < N)


@cuda
@pytest.mark.parametrize("bk", [32, 128])
def test_gpu_mxfp4_ptx_decode_is_exact(bk):
    """The PTX decode (eight nibbles a word, one bf16x2 multiply by 2^(s - 1)) against quant.dequant_mxfp4, bit for
    bit: every byte value in every nibble position, every scale byte it takes (0..128: subnormal and normal
    results), ragged rows (N = 200 in 256-row tiles), two experts."""
    g = torch.Generator().manual_seed(3)
    e, n, k = 2, 200, 256
    packed = torch.randint(0, 256, (e, n, k // 2), generator=g, dtype=torch.uint8)
    packed[0, :, :128] = torch.arange(256, dtype=torch.uint8).view(2, 128).repeat(100, 1)  # every byte, both nibbles
    scale = torch.randint(0, 129, (e, n, k // 32), generator=g, dtype=torch.uint8)
    scale[0, :129, 0] = torch.arange(129, dtype=torch.uint8)
    want = torch.stack([dequant_mxfp4(packed[i], scale[i]) for i in range(e)]).bfloat16()
    out = torch.full((e, n, k), float("nan"), dtype=torch.bfloat16, device="cuda")
    _ptx_tile_kernel[(e,)](packed.cuda().view(torch.int32), scale.cuda(), out, N=n, K=k, BN=256, BK=bk)
    assert torch.equal(out.cpu().view(torch.int16), want.view(torch.int16))
