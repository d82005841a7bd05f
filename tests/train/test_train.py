"""Training (issue 10) on the CPU: the fake quants pass gradients straight through, every indexer learns from its
KL to the main attention, a few steps lower the loss, and the checkpoint serves."""

import os

import pytest
import torch

from dsserve.layers import quant
from dsserve.models.checkpoint import dummy_weights
from dsserve.models.model import DeepseekForCausalLM
from dsserve.models.presets import preset
from dsserve.train.train import TrainConfig, train


def test_fake_quants_are_straight_through_only_under_grad():
    x = torch.randn(4, 64, dtype=torch.float64, requires_grad=True)
    w = torch.arange(64.0, dtype=torch.float64)
    for fq in (quant.fake_quant_fp8_pow2, quant.fake_quant_fp4_e4m3scale, quant.fake_quant_fp4_pow2):
        y = fq(x)
        (y * w).sum().backward()
        assert torch.equal(x.grad, w.expand(4, 64))  # the identity backward
        x.grad = None
        with torch.no_grad():
            exact = fq(x)
        assert torch.equal(y.detach(), exact) and not torch.equal(exact, x.detach())


def test_indexers_learn_only_from_their_kl():
    cfg = preset("tiny")
    m = DeepseekForCausalLM(cfg)
    dummy_weights(m, cfg, seed=0)
    kl = []
    t = torch.randint(3, cfg.vocab_size, (120,), generator=torch.Generator().manual_seed(0))
    hidden = m.forward(t, index_kl=kl).hidden
    n_indexers = sum(b.attn.indexer is not None for b in m.layers)
    assert len(kl) == n_indexers and all(float(k.detach()) > 0 for k in kl)
    torch.nn.functional.cross_entropy(m.logits(hidden)[:-1], t[1:]).backward()
    ix = [p for n, p in m.named_parameters() if ".indexer." in n]
    assert ix and all(p.grad is None for p in ix)  # the LM loss does not reach them (top-k, detached inputs)
    m.zero_grad()
    kl = []
    m.forward(t, index_kl=kl)
    torch.stack(kl).sum().backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in ix)
    others = [p for n, p in m.named_parameters() if ".indexer." not in n and p.grad is not None]
    assert all(float(p.grad.abs().sum()) == 0 for p in others)  # and teaches the layer nothing


def test_a_few_steps_lower_the_loss_and_the_checkpoint_serves(tmp_path):
    from dataclasses import replace

    from dsserve import LLM, SamplingParams

    cfg = TrainConfig(
        steps=8,
        batch=2,
        lr=3e-3,
        warmup=1,
        min_back=32,
        log_every=1,
        heldout_n=0,
        mix=(("arithmetic", 0.5), ("retrieval", 0.5)),
    )
    out = train(replace(cfg, heldout_n=1), str(tmp_path))
    assert set(out["heldout_nats"]) == {"arithmetic", "retrieval", "retrieval-near", "chat"}
    ce = [c["ce"] for c in out["curve"]]
    assert len(ce) == 8 and all(torch.isfinite(torch.tensor(ce)))
    assert sum(ce[-3:]) < sum(ce[:3])
    assert {"config.json", "model.safetensors", "tokenizer.json", "train.json", "loss.png"} <= set(os.listdir(tmp_path))
    assert os.path.getsize(tmp_path / "model.safetensors") < 40 << 20
    again = train(replace(cfg, steps=1, seed=1, init=str(tmp_path)), None)  # --init: from the trained weights
    fresh = train(replace(cfg, steps=1, seed=1), None)
    assert again["curve"][0]["ce"] < fresh["curve"][0]["ce"] - 0.5
    with pytest.raises(ValueError, match="must be a checkpoint directory of the tiny shape"):
        train(replace(cfg, init=str(tmp_path / "none")), None)
    llm = LLM(model=str(tmp_path), max_num_seqs=1)
    o = llm.generate(["Question: Ana has 3 apples."], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    assert len(o[0].outputs[0].token_ids) == 4


def test_a_shape_too_large_to_train_is_named(capsys):
    from dsserve.train.train import main

    assert main(["--model", "v41-flash", "--steps", "1"]) == 2
    assert "tiny shapes" in capsys.readouterr().err
    assert main(["--steps", "0"]) == 2 and "must be >= 1" in capsys.readouterr().err
    assert main(["--mix", "retrieval=1,poetry=2"]) == 2 and "'poetry=2'" in capsys.readouterr().err
    assert main(["--pack", "99999"]) == 2 and "pack must be 0" in capsys.readouterr().err
    assert main(["--drills", "-1"]) == 2 and "drills -1" in capsys.readouterr().err
    assert main(["--lr", "0"]) == 2 and "lr must be > 0" in capsys.readouterr().err
    assert main(["--data-workers", "-3"]) == 2 and "data_workers must be -1" in capsys.readouterr().err
    assert main(["--dist-backend", "mpi"]) == 2 and "dist backend 'mpi'" in capsys.readouterr().err
    assert main(["--time-limit", "-1"]) == 2 and "time_limit -1" in capsys.readouterr().err
    assert main(["--min-back-low", "9999"]) == 2 and "--min-back-low 9999 is past" in capsys.readouterr().err
    assert main(["--model", "tiny-v4", "--pack", "256"]) == 2 and "--no-isolate-problems" in capsys.readouterr().err


def test_min_back_low_draws_retrieval_distances_from_its_range():
    from dsserve.models.tokenizer import Tokenizer
    from dsserve.train.train import batch_of

    tok = Tokenizer.for_preset("tiny")
    at = TrainConfig(batch=24, mix=(("retrieval", 1.0),))
    ranged = TrainConfig(batch=24, mix=(("retrieval", 1.0),), min_back_low=8)
    fixed = [len(ids) for ids, _ in batch_of(at, 0, tok, 300)]
    drawn = [len(ids) for ids, _ in batch_of(ranged, 0, tok, 300)]
    # every problem at the distance: ~300 tokens of facts and more; drawn from [8, 300]: from a few facts up
    assert min(fixed) > 300 and min(drawn) < 150 and max(drawn) > 300
    assert batch_of(ranged, 0, tok, 300) == batch_of(ranged, 0, tok, 300)  # still seeded


@pytest.mark.parametrize("isolate", [True, False])
def test_isolated_packs_start_each_problem_on_the_alignment(isolate):
    """Packed and isolated (the default), each problem's BOS sits at a multiple of problem_align (4 for tiny); the
    end-of-sequence tokens padding up to it are None and no row is trained to predict them. Not isolated: no padding."""
    from dsserve.models.tokenizer import Tokenizer
    from dsserve.train.train import batch_of, token_weights

    tok = Tokenizer.for_preset("tiny")
    cfg = TrainConfig(
        batch=6, pack=512, isolate=isolate, mix=(("arithmetic", 0.5), ("retrieval", 0.5)), min_back_low=16
    )
    batch = batch_of(cfg, 0, tok, 128)
    starts = [t for ids, _ in batch for t, i in enumerate(ids) if i == tok.bos_id]
    pads = [
        (ids[t], w[t - 1])
        for (ids, done), w in zip(batch, token_weights(batch, 0.5))
        for t, c in enumerate(done)
        if c is None
    ]
    assert len(starts) > 2 * len(batch) and all(len(ids) <= 512 for ids, _ in batch)
    if isolate:
        assert all(t % 4 == 0 for t in starts) and pads and set(pads) == {(tok.eos_id, 0.0)}
    else:
        assert any(t % 4 for t in starts) and not pads


def test_dense_entries_equal_a_top_k_that_keeps_every_entry():
    """The dense warm-up attends every visible entry: the same as the sparse path when its top-k (and the decoder's
    candidate pool) keep them all, and not the same at the model's own top-k."""
    from dataclasses import replace

    t = torch.randint(3, 8000, (160,), generator=torch.Generator().manual_seed(1))
    out = {}
    for name, cfg in (
        ("tiny", preset("tiny")),
        ("keep-all", replace(preset("tiny"), index_topk=1024, candidate_topk_blocks=1024)),
    ):
        m = DeepseekForCausalLM(cfg)
        dummy_weights(m, cfg, seed=0)
        m.to(torch.float64)  # exact up to the summation order of the softmax
        with torch.no_grad():
            out[name, False] = m.forward(t).hidden
            out[name, True] = m.forward(t, dense_entries=True).hidden
    assert torch.allclose(out["keep-all", True], out["keep-all", False], atol=1e-10, rtol=0)
    assert torch.equal(out["keep-all", True], out["tiny", True])  # top-k plays no part when dense
    assert not torch.allclose(out["tiny", False], out["tiny", True], atol=1.0)


@pytest.mark.parametrize("name", ["tiny", "tiny-v4"])  # V4: hash-routed layers too
def test_every_expert_trains_as_the_routed_loop(name):
    """MoE.every_expert (training on a GPU: all experts on all rows, weighted 0 where not chosen) gives the routed
    loop's loss and gradients."""
    t = torch.randint(3, 8000, (50,), generator=torch.Generator().manual_seed(3))
    out = []
    for every in (False, True):
        cfg = preset(name)
        m = DeepseekForCausalLM(cfg)
        dummy_weights(m, cfg, seed=0)
        m.to(torch.float64)
        for block in m.layers:
            block.ffn.every_expert = every
            if block.ffn.gate.hash_routed:  # a token whose hash names one expert twice: counted twice
                block.ffn.gate.tid2eid[t[:5]] = 3
        loss = torch.nn.functional.cross_entropy(m.logits(m.forward(t).hidden)[:-1], t[1:])
        loss.backward()
        out.append(
            (
                loss.detach(),
                {
                    n: p.grad
                    for n, p in m.named_parameters()
                    if n.startswith("layers.") and ".ffn." in n and p.grad is not None
                },
            )
        )
    (l0, g0), (l1, g1) = out
    assert torch.allclose(l0, l1, rtol=0, atol=1e-12)
    assert g0.keys() == g1.keys() and any("experts.w2" in n for n in g0)
    for name in g0:
        assert torch.allclose(g0[name], g1[name], rtol=1e-9, atol=1e-12), name


def test_a_time_limit_stops_the_run_on_its_clock(monkeypatch):
    """--time-limit: the schedule follows the clock (here a fake one, 1 s a reading) and the run stops at the limit;
    the dense share is a share of that time."""
    import itertools

    from dsserve.train import train as train_mod

    clock = itertools.count()
    monkeypatch.setattr(train_mod.time, "perf_counter", lambda: float(next(clock)))
    cfg = TrainConfig(
        steps=100,
        batch=1,
        warmup=1,
        min_back=32,
        log_every=1,
        time_limit=6,
        dense_share=0.5,
        heldout_n=0,
        mix=(("arithmetic", 1.0),),
    )
    out = train(cfg, None)
    lrs = [c["lr"] for c in out["curve"]]
    assert 1 < out["steps_run"] < 100 and out["dense_until"] < out["steps_run"]
    assert lrs == sorted(lrs, reverse=True) and lrs[-1] < cfg.lr / 2
