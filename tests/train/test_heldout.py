"""Held-out completion nats (train.heldout): the batched forward gives each problem's own teacher-forced
log-likelihood, and the near retrieval variant asks about the last fact."""

import torch

from dsserve.models.checkpoint import dummy_weights
from dsserve.models.model import DeepseekForCausalLM
from dsserve.models.presets import preset
from dsserve.models.tokenizer import Tokenizer
from dsserve.train.heldout import VARIANTS, completion_nats, heldout_nats, near
from dsserve.train.tasks import final_answer, problem, prompt_ids


def test_near_asks_about_the_last_fact():
    p = problem("retrieval", "eval", 3, min_back=64)
    q = near(p)
    last = p.context.splitlines()[-1]
    assert q.prompt.startswith(p.context) and q.prompt.endswith("?\n")
    assert (
        last == f"The code for {q.prompt.splitlines()[-1][len('Question: What is the code for ') : -1]} is {q.answer}."
    )
    assert final_answer(q.completion) == q.answer != p.answer


def test_batched_nats_are_each_problems_own():
    cfg = preset("tiny")
    m = DeepseekForCausalLM(cfg)
    dummy_weights(m, cfg, seed=0)
    m.to(torch.float64)
    tok = Tokenizer.for_preset("tiny")
    ps = [problem("arithmetic", "eval", i) for i in range(2)] + [problem("retrieval", "eval", 0, min_back=64)]
    for dense in (False, True):  # the indexers' top-k, or every visible entry (the dense warm-up's mode)
        want = []
        for p in ps:
            a, b = prompt_ids(tok, p.prompt), tok.encode(p.completion, add_bos=False)
            with torch.no_grad():
                lp = torch.log_softmax(m.logits(m.forward(torch.tensor(a + b), dense_entries=dense).hidden).float(), -1)
            want.append(-float(sum(lp[len(a) - 1 + i, t] for i, t in enumerate(b))))
        assert abs(completion_nats(m, tok, ps, dense) - sum(want) / 3) < 1e-4
    assert completion_nats(m, tok, ps[2:], True) != completion_nats(m, tok, ps[2:], False)
    out = heldout_nats(m, tok, 2, 64)
    assert set(out) == set(VARIANTS) and all(v > 1 for v in out.values())  # random weights: far from the answers
