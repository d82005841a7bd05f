"""engine.graph_capture: the shared output buffers of one kind of graph, and graphs writing them on a GPU."""

import pytest
import torch

from dsserve.engine import graph_scratch
from dsserve.engine.graph_capture import GraphCapture, SharedOutputs, copy_outputs


def test_shared_outputs_are_views_of_one_buffer_per_part():
    out = SharedOutputs(8)
    a = out.rows_like((torch.zeros(3, 4), torch.zeros(3, dtype=torch.int32)))
    b = out.rows_like((torch.zeros(8, 4), torch.zeros(8, dtype=torch.int32)))
    assert [tuple(t.shape) for t in a] == [(3, 4), (3,)] and [tuple(t.shape) for t in b] == [(8, 4), (8,)]
    assert all(x.data_ptr() == y.data_ptr() for x, y in zip(a, b))
    copy_outputs(b, (torch.ones(8, 4), torch.arange(8, dtype=torch.int32)))
    assert torch.equal(a[0], torch.ones(3, 4)) and a[1].tolist() == [0, 1, 2]
    one = SharedOutputs(4)
    assert one.rows_like(torch.zeros(2, 5)).shape == (2, 5)
    for bad in (torch.zeros(5, 5), torch.zeros(2, 6), torch.zeros(2, 5, dtype=torch.float64), (torch.zeros(2, 5),) * 2):
        with pytest.raises(ValueError, match="do not fit the shared buffers"):
            one.rows_like(bad)


def test_shared_outputs_need_a_warm_up():
    with pytest.raises(ValueError, match="warmups must be >= 1"):
        GraphCapture(warmups=0)(lambda: torch.zeros(1), outputs=SharedOutputs(1))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_graphs_of_one_kind_share_their_outputs_on_gpu():
    """Two graphs of one kind write the first rows of one buffer made outside the pool, each its own result at each
    replay; their results are not left alive in the shared pool, where without ``outputs`` they are."""
    x = torch.arange(1 << 20, dtype=torch.float32, device="cuda").view(1 << 10, 1 << 10)
    cap, out = GraphCapture(), SharedOutputs(1 << 10)
    big, big_out = cap(lambda: x * 2, outputs=out)
    small, small_out = cap(lambda: x[:16] + 1, outputs=out)
    assert big_out.data_ptr() == small_out.data_ptr() and small_out.shape == (16, 1 << 10)
    assert graph_scratch.pool_usage(cap.pool)[0] < x.numel() * 4  # neither result stays alive in the pool
    for _ in range(2):
        big.replay()
        torch.cuda.synchronize()
        assert torch.equal(big_out, x * 2)
        small.replay()
        torch.cuda.synchronize()
        assert torch.equal(small_out, x[:16] + 1) and torch.equal(big_out[16:], x[16:] * 2)
    plain = GraphCapture()
    _, kept = plain(lambda: x * 3)
    assert graph_scratch.pool_usage(plain.pool)[0] >= kept.numel() * 4
