"""kernels.split_k: the last program of each output tile sums the split partials; counters are left at zero."""

import gc
import weakref

import pytest
import torch

import dsserve.kernels.fp8_linear as F
from dsserve.kernels.split_k import tile_counters
from dsserve.layers.quant import quant_fp8_block

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def operands(m, n, k, seed):
    g = torch.Generator().manual_seed(seed)
    w_q, w_s = quant_fp8_block(torch.randn(n, k, generator=g) * 0.1, 32)
    return torch.randn(m, k, generator=g).to(DEV), w_q.to(DEV), w_s.view(torch.uint8).to(DEV)


@pytest.mark.parametrize("m,n,k,split", [(3, 96, 256, 4), (1, 64, 160, 5), (F.IN_KERNEL_SPLIT_ROWS + 4, 64, 160, 3)])
def test_split_sum_repeats_and_resets(m, n, k, split):
    """In-kernel sums up to IN_KERNEL_SPLIT_ROWS rows, torch's above: both equal the reference, call after call."""
    x, w_q, w_s = operands(m, n, k, split)
    cfg = {"SPLIT_K": split, "BK": 32, "BN": 32}
    ref = F.fp8_linear_ref(x, w_q, w_s, 32)
    first = F.fp8_linear(x, w_q, w_s, 32, config=cfg)
    # a counter left non-zero would make the next call's tiles never finish (unwritten output)
    assert int(tile_counters(x.device, 1).abs().sum()) == 0
    second = F.fp8_linear(x, w_q, w_s, 32, config=cfg)
    assert torch.equal(first, second)  # the sum runs in split order whichever program arrives last
    assert ((first - ref).norm() / ref.norm()) < 1e-5
    # the same call without splitting agrees up to fp32 summation order
    whole = F.fp8_linear(x, w_q, w_s, 32, config={"SPLIT_K": 1, "BK": 32, "BN": 32})
    assert ((first - whole).norm() / whole.norm()) < 1e-6


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_split_sum_under_graph_replay():
    x, w_q, w_s = operands(4, 1280, 5120, 0)
    x = x.bfloat16()
    ref = F.fp8_linear_ref(x, w_q, w_s, 32).float()
    out = F.fp8_linear(x, w_q, w_s, 32)  # the decode default splits K (20 tiles of 64 over 132 SMs)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        y = F.fp8_linear(x, w_q, w_s, 32)
    for _ in range(3):
        y.fill_(float("nan"))
        g.replay()
        torch.cuda.synchronize()
        assert torch.equal(y, out)
    assert ((out.float() - ref).norm() / ref.norm()) < 1e-2


def test_outgrown_tile_counters_stay_allocated():
    """A graph captured with a counters buffer reads it at every replay: growing the buffer must not free the old
    one (freed, other tensors or another graph's scratch may take its memory)."""
    dev = torch.device("cpu")
    old = tile_counters(dev, 1 << 20)
    gone = weakref.ref(old)
    del old
    tile_counters(dev, (1 << 20) + 1)  # grows: a new buffer
    gc.collect()
    assert gone() is not None
