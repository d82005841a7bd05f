"""engine.graph_capture: graphs in one shared memory pool keep reading only memory that a live tensor holds."""
import gc
import weakref

import pytest
import torch

import dsserve.kernels.fp8_linear as F
from dsserve.engine.graph_capture import GraphCapture
from dsserve.kernels.split_k import tile_counters
from dsserve.layers.quant import quant_fp8_block


def test_outgrown_tile_counters_stay_allocated():
    """A graph captured with a counters buffer reads it at every replay: growing the buffer must not free the old
    one (freed, a later capture in the shared pool may take it for scratch)."""
    dev = torch.device("cpu")
    old = tile_counters(dev, 1 << 20)
    gone = weakref.ref(old)
    del old
    tile_counters(dev, (1 << 20) + 1)  # grows: a new buffer
    gc.collect()
    assert gone() is not None


def _operands(m, n, k, seed):
    g = torch.Generator().manual_seed(seed)
    w_q, w_s = quant_fp8_block(torch.randn(n, k, generator=g) * 0.1, 32)
    x = torch.randn(m, k, generator=g)
    return x.cuda().bfloat16(), w_q.cuda(), w_s.view(torch.uint8).cuda()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_shared_pool_graphs_replay_in_any_order_on_gpu():
    """Three graphs in the shared pool: a split-K GEMM, one with more output tiles than any before (its counters
    grow), then one that fills scratch of the counters' sizes with 7s (what a freed counters buffer would hold after
    another graph's replay). Replayed after the third, the first still gives its eager output: its counters were
    made before its capture and never freed."""
    cfg = {"SPLIT_K": 2, "BK": 32, "BN": 32}
    small = _operands(4, 256, 64, 0)
    big = _operands(4, 32 * 4096, 64, 1)  # 4096 tiles: past any counters buffer made so far
    want = F.fp8_linear(*small, 32, config=cfg).clone()
    cap = GraphCapture()
    g_small, out_small = cap(lambda: F.fp8_linear(*small, 32, config=cfg))
    cap(lambda: F.fp8_linear(*big, 32, config=cfg))
    # scratch blocks of every counters buffer's size (1024 and 4096 int32) in the pool, filled with 7s at replay
    g_fill, _ = cap(lambda: torch.cat([torch.full((n,), 7, dtype=torch.int32, device="cuda") + i
                                       for i in range(32) for n in (1024, 4096)]))
    for _ in range(3):
        g_fill.replay()
        out_small.fill_(float("nan"))  # tiles the replay does not write would show
        g_small.replay()
        torch.cuda.synchronize()
        assert torch.equal(out_small, want)
