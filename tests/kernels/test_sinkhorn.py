"""The training Sinkhorn kernel (forward and backward) against layers.mhc.sinkhorn under torch autograd."""

import pytest
import torch

from dsserve.kernels.sinkhorn import sinkhorn_trainable
from dsserve.layers.mhc import sinkhorn

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("t,iters", [(1, 1), (5, 2), (45, 20), (0, 3)])
def test_forward_and_backward_match_autograd_of_the_reference(t, iters):
    gen = torch.Generator().manual_seed(t * 100 + iters)
    logits = torch.randn(t, 4, 4, generator=gen, dtype=torch.float64)
    c0 = (torch.softmax(logits, -1) + 1e-6).to(DEVICE)
    upstream = torch.randn(t, 4, 4, generator=gen, dtype=torch.float64).to(DEVICE)
    ref_in = c0.clone().requires_grad_()
    ref = sinkhorn(ref_in, iters, 1e-6)  # the oracle in fp64
    (ref * upstream).sum().backward()
    got_in = c0.float().requires_grad_()
    got = sinkhorn_trainable(got_in, iters, 1e-6)
    (got * upstream.float()).sum().backward()
    assert got.shape == ref.shape and got_in.grad.shape == ref_in.grad.shape
    torch.testing.assert_close(got.double(), ref.detach(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got_in.grad.double(), ref_in.grad, rtol=1e-4, atol=1e-5)


def test_other_inputs_take_the_reference():
    c = torch.rand(3, 4, 4, dtype=torch.float64)
    assert torch.equal(sinkhorn_trainable(c, 4, 1e-6), sinkhorn(c, 4, 1e-6))


def test_a_block_with_the_kernel_trains_as_with_torch():
    """The model's mixing sites with the kernel swapped in (as training on a GPU does) give the same loss and
    gradients."""
    from dsserve.kernels.sinkhorn import sinkhorn_trainable
    from dsserve.models.checkpoint import dummy_weights
    from dsserve.models.model import DeepseekForCausalLM
    from dsserve.models.presets import preset

    cfg = preset("tiny")
    t = torch.randint(3, 8000, (40,), generator=torch.Generator().manual_seed(2))
    grads = []
    for fused in (False, True):
        m = DeepseekForCausalLM(cfg)
        dummy_weights(m, cfg, seed=0)
        if fused:
            for block in m.layers:
                block.sinkhorn = sinkhorn_trainable
        loss = torch.nn.functional.cross_entropy(m.logits(m.forward(t).hidden)[:-1], t[1:])
        loss.backward()
        grads.append(
            (
                loss.detach(),
                {n: p.grad for n, p in m.named_parameters() if n.startswith("layers.") and n.endswith("hc_attn_fn")},
            )
        )
    (l0, g0), (l1, g1) = grads
    torch.testing.assert_close(l1, l0, rtol=1e-5, atol=1e-5)
    assert len(g0) == cfg.num_hidden_layers
    for name in g0:
        torch.testing.assert_close(g1[name], g0[name], rtol=1e-3, atol=1e-6 * float(g0[name].abs().max()))
