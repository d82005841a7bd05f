import math

import pytest
import torch

from dsserve.engine.outputs import Logprob, RequestMetrics, make_logprob_dict
from dsserve.engine.sampler import (
    Sampler,
    SamplingRow,
    apply_min_p,
    apply_penalties,
    apply_top_k,
    apply_top_p,
    make_generator,
)
from dsserve.engine.sampling_params import SamplingParams

EOS = 1


def row(**kw):
    prompt, output = kw.pop("prompt", ()), kw.pop("output", ())
    kw.pop("tag", None)  # test-only: picks the row's logits stream
    params = SamplingParams(**kw)
    gen = make_generator(params.seed) if params.seed is not None else None
    return SamplingRow(params, prompt, output, gen)


def kept(logits: torch.Tensor) -> set[int]:
    return set(torch.isfinite(logits).nonzero().flatten().tolist())


def support(logits_row: list[float], draws: int = 3000, seed: int = 0, **kw) -> set[int]:
    """Tokens drawn over many rows that share one distribution (one sampler call)."""
    logits = torch.tensor(logits_row).repeat(draws, 1)
    out = Sampler(EOS, make_generator(seed))(logits, [row(**kw) for _ in range(draws)])
    return set(out.sampled_token_ids.tolist())


def log_probs(p):
    return torch.tensor(p, dtype=torch.float32).log()


# ---------------------------------------------------------------- greedy and seeds
def test_greedy_is_argmax_with_ties_to_lowest_id():
    torch.manual_seed(0)
    logits = torch.randn(6, 100)
    logits[5, [7, 3, 42]] = 50.0  # a three-way tie
    out = Sampler(EOS)(logits, [row(temperature=0.0) for _ in range(6)])
    assert out.sampled_token_ids.tolist()[:5] == logits[:5].argmax(-1).tolist()
    assert out.sampled_token_ids[5] == 3


def test_input_logits_untouched():
    logits = torch.randn(2, 32)
    before = logits.clone()
    Sampler(EOS)(logits, [row(top_k=3, repetition_penalty=2.0, prompt=[1, 2]), row(temperature=0.0, min_tokens=3)])
    assert torch.equal(logits, before)


def _run_steps(batch_kws: list[dict], steps: int, seed_logits: int = 123) -> list[list[int]]:
    """Sample ``steps`` tokens for every row; logits depend only on the row's own identity and step."""
    rows = [row(**kw) for kw in batch_kws]
    sampler = Sampler(EOS, make_generator(999))
    toks: list[list[int]] = [[] for _ in rows]
    for step in range(steps):
        logits = torch.stack(
            [
                torch.randn(64, generator=make_generator(seed_logits + 1000 * kw.get("tag", 0) + step))
                for kw in batch_kws
            ]
        )
        out = sampler(logits, rows).sampled_token_ids.tolist()
        for i, t in enumerate(out):
            toks[i].append(t)
            rows[i].output_token_ids = toks[i]
    return toks


def test_seeded_rows_reproduce_and_ignore_batch_composition():
    a = dict(seed=11, top_k=20, tag=1)
    b = dict(seed=22, top_p=0.9, temperature=0.7, repetition_penalty=1.3, tag=2)
    alone_a = _run_steps([a], 12)[0]
    alone_b = _run_steps([b], 12)[0]
    assert _run_steps([a], 12)[0] == alone_a  # reproducible
    mixed = _run_steps([dict(tag=3), b, dict(temperature=0.0, tag=4), a, dict(min_p=0.1, tag=5)], 12)
    assert mixed[1] == alone_b and mixed[3] == alone_a
    swapped = _run_steps([a, b], 12)
    assert swapped == [alone_a, alone_b]
    assert _run_steps([dict(seed=12, top_k=20, tag=1)], 12)[0] != alone_a  # the seed matters


# ---------------------------------------------------------------- filters
def test_top_k_keeps_ties_at_the_boundary():
    logits = torch.tensor([[3.0, 2.0, 2.0, 1.0, 0.0], [0.0, 1.0, 2.0, 3.0, 4.0]])
    out = apply_top_k(logits.clone(), torch.tensor([2, 0]))
    assert kept(out[0]) == {0, 1, 2} and kept(out[1]) == {0, 1, 2, 3, 4}
    assert torch.equal(out[0, :3], logits[0, :3])
    assert support([3.0, 2.0, 2.0, 1.0, 0.0], top_k=2) == {0, 1, 2}
    assert support([0.0, 0.5, 0.2, 0.1, 0.4], top_k=1) == {1}


@pytest.mark.parametrize(
    "probs, p, want",
    [
        ([0.4, 0.3, 0.2, 0.1], 0.6, {0, 1}),  # 0.4 < 0.6 so token 1 joins; 0.7 >= 0.6 stops
        ([0.4, 0.3, 0.2, 0.1], 0.3, {0}),
        ([0.1, 0.2, 0.3, 0.4], 0.95, {0, 1, 2, 3}),
        ([0.4, 0.2, 0.2, 0.2], 0.5, {0, 1, 2, 3}),  # tie at the boundary: all three 0.2s kept
        ([0.3, 0.3, 0.2, 0.2], 0.25, {0, 1}),  # tie at the top
        ([0.25, 0.25, 0.25, 0.25], 0.1, {0, 1, 2, 3}),
    ],
)
def test_top_p_keeps_the_nucleus(probs, p, want):
    out = apply_top_p(log_probs([probs]), torch.tensor([p]))
    assert kept(out[0]) == want
    assert support(log_probs(probs).tolist(), top_p=p) == want


@pytest.mark.parametrize(
    "probs, min_p, want",
    [
        ([0.5, 0.3, 0.15, 0.05], 0.25, {0, 1, 2}),  # threshold 0.125
        ([0.5, 0.3, 0.15, 0.05], 0.5, {0, 1}),  # threshold 0.25
        ([0.4, 0.4, 0.1, 0.1], 1.0, {0, 1}),  # only the (tied) maxima
    ],
)
def test_min_p(probs, min_p, want):
    assert kept(apply_min_p(log_probs([probs]), torch.tensor([min_p]))[0]) == want
    assert support(log_probs(probs).tolist(), min_p=min_p) == want


def test_filters_follow_temperature_and_vllm_v1_order():
    # top_p after temperature: T=0.5 sharpens [2,1,0] to probs ~[.87,.12,.02]
    assert support([2.0, 1.0, 0.0], top_p=0.85, temperature=1.0) == {0, 1}
    assert support([2.0, 1.0, 0.0], top_p=0.85, temperature=0.5) == {0}
    # min_p runs before top_p (vLLM v1): min_p drops 0.2, renormalised [.625,.375], top_p=0.6 keeps only 0
    assert support(log_probs([0.5, 0.3, 0.2]).tolist(), min_p=0.5, top_p=0.6) == {0}
    assert support(log_probs([0.5, 0.3, 0.2]).tolist(), top_p=0.6) == {0, 1}


def test_random_sampling_matches_the_distribution():
    probs = [0.5, 0.25, 0.15, 0.1]
    draws = 20000
    logits = log_probs(probs).repeat(draws, 1)
    out = Sampler(EOS, make_generator(5))(logits, [row() for _ in range(draws)]).sampled_token_ids
    freq = torch.bincount(out, minlength=4).double() / draws
    assert torch.allclose(freq, torch.tensor(probs, dtype=torch.float64), atol=0.015)


# ---------------------------------------------------------------- penalties and min_tokens
def test_penalties_against_hand_computation():
    logits = torch.tensor([[2.0, -1.0, 0.5, 1.9, 0.0, 0.0, -0.5]])
    out = apply_penalties(
        logits.clone(), [[1, 5]], [[3, 3, 2, 6]], torch.tensor([2.0]), torch.tensor([0.1]), torch.tensor([0.2])
    )
    want = [
        2.0,  # unseen
        -2.0,  # prompt only, negative: multiplied
        0.5 / 2 - 0.1 - 0.2,  # output once, positive: divided, then frequency and presence
        1.9 / 2 - 0.2 - 0.2,  # output twice
        0.0,  # unseen
        0.0,  # seen in prompt, zero stays zero
        -0.5 * 2 - 0.1 - 0.2,
    ]  # output once, negative
    assert torch.allclose(out[0], torch.tensor(want), atol=1e-6)


def test_penalties_change_the_greedy_choice():
    logits = torch.tensor([[2.0, 1.5, 0.0]]).repeat(3, 1)
    rows = [
        row(temperature=0.0, output=[0]),
        row(temperature=0.0, output=[0], repetition_penalty=1.5),
        row(temperature=0.0, output=[0, 0, 0], frequency_penalty=0.2),
    ]
    assert Sampler(EOS)(logits, rows).sampled_token_ids.tolist() == [0, 1, 1]


def test_min_tokens_masks_eos_and_stop_ids():
    logits = torch.tensor([[0.0, 9.0, 0.0, 8.0, 1.0]]).repeat(4, 1)  # EOS (1) best, then stop id 3
    rows = [
        row(temperature=0.0, min_tokens=2, stop_token_ids=[3], output=[4]),
        row(temperature=0.0, min_tokens=2, stop_token_ids=[3], output=[4, 4]),
        row(temperature=0.0, min_tokens=2, ignore_eos=True, output=[4]),  # vLLM masks EOS anyway
        row(min_tokens=5, stop_token_ids=[3], top_k=1, seed=3),
    ]  # masked before top-k
    assert Sampler(EOS)(logits, rows).sampled_token_ids.tolist() == [4, 1, 3, 4]


def test_logit_bias_against_hand_computation():
    """The bias is added to the raw logits before penalties and temperature; the logprobs stay raw."""
    logits = torch.tensor([[2.0, -1.0, 0.5, 1.9]])
    bias = {0: -3.0, 2: 1.25, 3: 100.0}
    # greedy: argmax of [2 - 3, -1, 0.5 + 1.25, 1.9 + 100] = token 3
    assert Sampler(EOS)(logits, [row(temperature=0.0, logit_bias=bias)]).sampled_token_ids.tolist() == [3]
    # repetition penalty 2 on the output token 2, applied after the bias: (0.5 + 1.25) / 2 = 0.875; with token 3
    # banned (-100) the greedy choice is token 2 (0.875) over token 0 (2 - 3 = -1) and token 1 (-1)
    r = row(temperature=0.0, logit_bias={0: -3.0, 2: 1.25, 3: -100.0}, repetition_penalty=2.0, output=[2])
    assert Sampler(EOS)(logits, [r]).sampled_token_ids.tolist() == [2]
    # the distribution a random row draws from: softmax((logits + bias) / T)
    draws, t = 20000, 0.5
    b = {1: 2.0, 3: -1.5}
    want = torch.softmax((logits[0] + torch.tensor([0.0, 2.0, 0.0, -1.5])) / t, -1)
    out = Sampler(EOS, make_generator(7))(
        logits.repeat(draws, 1), [row(temperature=t, logit_bias=b) for _ in range(draws)]
    ).sampled_token_ids
    freq = torch.bincount(out, minlength=4).double() / draws
    assert torch.allclose(freq, want.double(), atol=0.015)
    # raw logprobs ignore the bias (vLLM's raw_logprobs); the caller's logits are untouched
    lp = Sampler(EOS)(logits, [row(temperature=0.0, logit_bias=bias, logprobs=1)]).logprobs[0]
    assert lp.sampled_logprob == pytest.approx(float(torch.log_softmax(logits[0], -1)[3]), abs=1e-6)
    assert torch.equal(logits, torch.tensor([[2.0, -1.0, 0.5, 1.9]]))
    # rows without a bias are not touched; an id outside the vocabulary is an error
    two = Sampler(EOS)(logits.repeat(2, 1), [row(temperature=0.0), row(temperature=0.0, logit_bias={1: 50.0})])
    assert two.sampled_token_ids.tolist() == [0, 1]
    with pytest.raises(ValueError, match="outside the vocabulary of 4"):
        Sampler(EOS)(logits, [row(temperature=0.0, logit_bias={4: 1.0})])


# ---------------------------------------------------------------- logprobs
def test_logprobs_are_raw_and_top_n_correct():
    torch.manual_seed(1)
    logits = torch.randn(3, 40)
    rows = [
        row(logprobs=5, temperature=0.3, repetition_penalty=1.7, prompt=list(range(20))),
        row(logprobs=0, temperature=0.0),
        row(),
    ]
    out = Sampler(EOS)(logits, rows)
    raw = torch.log_softmax(logits, -1)
    lp0, lp1 = out.logprobs[0], out.logprobs[1]
    assert out.logprobs[2] is None
    top = raw[0].topk(5)
    assert lp0.top_token_ids == top.indices.tolist()
    assert lp0.top_logprobs == pytest.approx(top.values.tolist(), abs=1e-6)
    t0 = int(out.sampled_token_ids[0])
    assert lp0.sampled_logprob == pytest.approx(float(raw[0, t0]), abs=1e-6)
    assert lp0.sampled_rank == 1 + int((raw[0] > raw[0, t0]).sum())
    assert lp1.top_token_ids == [] and lp1.sampled_rank == 1
    assert math.isclose(lp1.sampled_logprob, float(raw[1].max()), abs_tol=1e-6)


def test_make_logprob_dict():
    class Tok:
        def decode(self, ids):
            return f"<{ids[0]}>"

    d = make_logprob_dict(7, -2.0, 3, [4, 9], [-0.5, -1.0], Tok())
    assert list(d) == [7, 4, 9]
    assert d[7] == Logprob(-2.0, 3, "<7>") and d[4] == Logprob(-0.5, 1, "<4>")
    d = make_logprob_dict(4, -0.5, 1, [4, 9], [-0.5, -1.0])
    assert list(d) == [4, 9] and d[4].rank == 1 and d[9].decoded_token is None


def test_request_metrics():
    m = RequestMetrics(arrival_time=10.0, first_scheduled_time=10.5)
    assert m.ttft is None and m.mean_time_per_output_token is None
    for t in (11.0, 11.5, 12.0, 13.0):
        m.record_token(t)
    m.finished_time = 13.5
    assert m.time_in_queue == 0.5 and m.ttft == 1.0 and m.e2e_latency == 3.5
    assert m.mean_time_per_output_token == pytest.approx(2.0 / 3) == m.tpot
