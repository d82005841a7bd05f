"""Warm-in (train.warm_in): at level 0 the model is the plain-residual model without its MoE, at level 1 the model
itself; the ramp and its errors; a training run ends with the model whole."""

import pytest
import torch

from dsserve.layers.moe import MoE
from dsserve.models import block as block_module
from dsserve.models.checkpoint import dummy_weights
from dsserve.models.model import DeepseekForCausalLM
from dsserve.models.presets import preset
from dsserve.train.train import TrainConfig, train
from dsserve.train.warm_in import WarmIn, warm_in_level


def _model():
    cfg = preset("tiny")
    m = DeepseekForCausalLM(cfg)
    dummy_weights(m, cfg, seed=5)
    return cfg, m


def _logits(m, t):
    with torch.no_grad():
        return m.logits(m.forward(t).hidden)


def test_level_one_is_the_model_itself():
    cfg, m = _model()
    t = torch.randint(3, cfg.vocab_size, (70,), generator=torch.Generator().manual_seed(0))
    whole = _logits(m, t)
    warm = WarmIn(m, 10, 20)
    assert warm.set(25) == 1.0 and all(b.warm_in is warm.level for b in m.layers)
    torch.testing.assert_close(_logits(m, t), whole, rtol=1e-5, atol=1e-5)
    warm.detach()
    assert all(b.warm_in is None for b in m.layers)
    assert torch.equal(_logits(m, t), whole)


def test_level_zero_is_a_plain_residual_without_the_moe(monkeypatch):
    cfg, m = _model()
    t = torch.randint(3, cfg.vocab_size, (70,), generator=torch.Generator().manual_seed(1))
    whole = _logits(m, t)
    warm = WarmIn(m, 10, 20)
    assert warm.set(3) == 0.0
    warmed = _logits(m, t)
    warm.detach()
    n = cfg.hc_mult

    def plain(x, *args):
        rows = x.shape[0]
        return (torch.full((rows, n), 1 / n), torch.ones(rows, n), torch.eye(n).expand(rows, n, n))

    monkeypatch.setattr(block_module, "hc_mix", plain)
    monkeypatch.setattr(MoE, "forward", lambda self, h, *args, **kw: torch.zeros_like(h))
    ablated = _logits(m, t)
    torch.testing.assert_close(warmed, ablated, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(ablated, whole, atol=1e-2)  # the parts held out matter


def test_the_ramp_and_bad_ranges():
    assert [warm_in_level(s, 10, 20) for s in (0, 10, 15, 20, 30)] == [0.0, 0.0, 0.5, 1.0, 1.0]
    assert warm_in_level(5, 0, 0) == 1.0 and warm_in_level(4, 5, 5) == 0.0 and warm_in_level(5, 5, 5) == 1.0
    _, m = _model()
    for start, end in ((-1, 5), (5, 2)):
        with pytest.raises(ValueError, match="0 <= start <= end"):
            WarmIn(m, start, end)
    off = WarmIn(m, 0, 0)
    assert off.set(0) == 1.0 and all(b.warm_in is None for b in m.layers)


def test_a_run_ramps_in_and_ends_whole():
    cfg = TrainConfig(
        steps=6,
        batch=2,
        lr=3e-3,
        warmup=1,
        min_back=32,
        log_every=1,
        heldout_n=0,
        mix=(("arithmetic", 1.0),),
        warm_in_start=0.25,
        warm_in_end=0.75,
    )
    out = train(cfg, None)
    assert [c["warm_in"] for c in out["curve"]] == [
        0.0,
        0.0,
        pytest.approx(1 / 6),
        pytest.approx(0.5),
        pytest.approx(5 / 6),
        1.0,
    ]
    assert all(torch.isfinite(torch.tensor([c["ce"] for c in out["curve"]])))


@pytest.mark.parametrize("start,end", [(0.8, 0.5), (0.2, 1.5), (-0.1, 0.5)])
def test_a_run_that_would_not_end_whole_is_refused(start, end):
    cfg = TrainConfig(steps=2, batch=2, heldout_n=0, warm_in_start=start, warm_in_end=end)
    with pytest.raises(ValueError, match="--warm-in-start and --warm-in-end are shares of the run"):
        train(cfg, None)
