"""engine.graph_scratch: the pool switch, and the poison catching a graph that reads scratch it did not write."""

import pytest
import torch

from dsserve.engine import graph_scratch
from dsserve.engine.graph_capture import GraphCapture


def test_pool_switch(monkeypatch):
    monkeypatch.delenv(graph_scratch.POOL_ENV, raising=False)
    assert graph_scratch.shared_pool() is True
    monkeypatch.setenv(graph_scratch.POOL_ENV, "own")
    assert graph_scratch.shared_pool() is False
    monkeypatch.setenv(graph_scratch.POOL_ENV, "one")
    with pytest.raises(ValueError, match="'own' or 'shared'"):
        graph_scratch.shared_pool()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("shared", [False, True])
def test_poison_shows_a_read_of_unwritten_scratch_on_gpu(monkeypatch, shared):
    """A graph that reads a temporary it never writes gives NaN under the poison, every replay; one that writes its
    temporaries first gives its result."""
    monkeypatch.setenv(graph_scratch.ENV, "1")
    x = torch.arange(1 << 16, dtype=torch.float32, device="cuda")
    cap = GraphCapture(warmups=1, shared_pool=shared)
    # reads memory no kernel of it wrote (a temporary of another size class than good's tensors, so that in the
    # shared pool none of them, live, can sit on it)
    bad, bad_out = cap(lambda: torch.empty(5 << 16, device="cuda")[: x.numel()] + 1)
    good, good_out = cap(lambda: (x * 2) + 1)
    assert isinstance(bad, graph_scratch.PoisonedGraph) and bad.blocks
    for _ in range(2):
        good.replay()
        bad.replay()
        torch.cuda.synchronize()
        assert bool(bad_out.isnan().all())
        assert torch.equal(good_out, x * 2 + 1)
