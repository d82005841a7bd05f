"""The rejection sampler on given target and draft distributions: what it emits is distributed exactly as the target
(chi-square, fixed seed, enough samples that a 5% bias fails), greedy rows accept the argmax prefix, seeds repeat."""

import pytest
import torch

from dsserve.engine.rejection_sampler import RejectionSampler, accept
from dsserve.engine.sampler import Sampler, SamplingRow
from dsserve.engine.sampling_params import SamplingParams

V, N = 5, 40_000


def chi2_pvalue(counts: torch.Tensor, expected_probs: torch.Tensor) -> float:
    """Pearson's chi-square test of ``counts`` against ``expected_probs`` (cells with mass only)."""
    n = counts.sum()
    live = expected_probs > 0
    assert counts[~live].sum() == 0, "a token of probability 0 was emitted"
    e = expected_probs[live].double() * n
    stat = ((counts[live].double() - e) ** 2 / e).sum()
    df = int(live.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2.0, dtype=torch.float64), stat / 2))


def two_step_setup(seed: int):
    """Request b drafts d1 ~ q0, d2 ~ q1[d1]; its target rows are p0, p1[d1], p2[d1, d2] (the target's distribution
    after the drafts so far, as a verify step gives). The emitted (t1, t2) must follow p0(t1) p1[t1](t2)."""
    g = torch.Generator().manual_seed(seed)
    p0 = torch.rand(V, generator=g) ** 2
    p1 = torch.rand(V, V, generator=g) ** 2
    p2 = torch.rand(V, V, V, generator=g)
    q0 = torch.rand(V, generator=g)
    q1 = torch.rand(V, V, generator=g)
    p0[V - 1] = 0.0  # a token the target never emits: the draft proposing it must always be rejected
    norm = lambda t: t / t.sum(-1, keepdim=True)  # noqa: E731
    return norm(p0), norm(p1), norm(p2), norm(q0), norm(q1)


def run_two_step(p0, p1, p2, q0, q1, one_hot: bool, bias: float = 0.0):
    g = torch.Generator().manual_seed(7)
    d1 = torch.multinomial(q0, N, replacement=True, generator=g)
    d2 = torch.multinomial(q1[d1], 1, generator=g).squeeze(1)
    if one_hot:  # DSpark's greedy drafter: q one-hot at the draft (drafts then need not follow q0, q1)
        d1 = torch.multinomial(torch.full((V,), 1.0 / V), N, replacement=True, generator=g)
        d2 = torch.multinomial(torch.full((V,), 1.0 / V), N, replacement=True, generator=g)
    target = torch.stack((p0.expand(N, V), p1[d1], p2[d1, d2]), 1)
    if bias:  # a wrong sampler for the power check: token 0 of the first row is made 5% likelier
        target[:, 0, 0] *= 1 + bias
        target[:, 0] /= target[:, 0].sum(-1, keepdim=True)
    drafts = torch.stack((d1, d2), 1).tolist()
    q = None if one_hot else torch.stack((q0.expand(N, V), q1[d1]), 1).reshape(2 * N, V)
    tokens, n_acc = accept(target.reshape(3 * N, V), drafts, [None] * N, torch.Generator().manual_seed(11), q)
    t1 = torch.tensor([t[0] for t in tokens])
    pairs = [(t[0], t[1]) for t in tokens if len(t) >= 2]
    return t1, pairs, n_acc


@pytest.mark.parametrize("one_hot", [False, True], ids=["draft-probs", "greedy-draft"])
def test_emitted_tokens_follow_the_target_exactly(one_hot):
    p0, p1, p2, q0, q1 = two_step_setup(0)
    t1, pairs, n_acc = run_two_step(p0, p1, p2, q0, q1, one_hot)
    assert chi2_pvalue(torch.bincount(t1, minlength=V), p0) > 1e-3
    # the second token, given the first: p1[t1] (only where the first draft was accepted and a second token came)
    for a in range(V - 1):
        second = torch.tensor([b for x, b in pairs if x == a], dtype=torch.long)
        if second.numel() > 500:
            assert chi2_pvalue(torch.bincount(second, minlength=V), p1[a]) > 1e-3
    assert 0 < sum(n_acc) < 2 * N  # both acceptance and rejection happen


def test_the_check_has_the_power_to_see_a_five_percent_bias():
    """The same test against a sampler whose target is 5% off for one token fails: the sample size is enough."""
    p0, p1, p2, q0, q1 = two_step_setup(0)
    t1, _, _ = run_two_step(p0, p1, p2, q0, q1, one_hot=False, bias=0.05)
    assert chi2_pvalue(torch.bincount(t1, minlength=V), p0) < 1e-3


def test_greedy_accepts_the_argmax_prefix_and_adds_the_targets_token():
    logits = torch.full((4, 6), -5.0)
    for row, best in enumerate([2, 4, 1, 3]):
        logits[row, best] = 5.0
    sampler = RejectionSampler(Sampler())
    req = SamplingRow(SamplingParams(temperature=0.0), [1, 2], [])
    assert sampler(logits, [req], [[2, 4, 0]]).token_ids == [[2, 4, 1]]  # third draft wrong: the target's 1
    assert sampler(logits, [req], [[2, 4, 1]]).token_ids == [[2, 4, 1, 3]]  # all accepted, plus the bonus
    assert sampler(logits, [req], [[5, 4, 1]]).token_ids == [[2]]
    assert sampler(logits[:1], [req], [[]]).token_ids == [[2]]  # no drafts: a plain greedy step


def test_the_greedy_shortcut_gives_the_walks_verdict():
    """All rows greedy: ``accept`` takes one argmax instead of the draws and races; on one-hot rows the general walk
    (which draws, but whose draws cannot change a one-hot verdict) gives the same tokens."""
    g = torch.Generator().manual_seed(2)
    lengths = [0, 1, 3, 5, 2, 5, 4]
    drafts = [torch.randint(0, 4, (n,), generator=g).tolist() for n in lengths]
    best = torch.randint(0, 4, (sum(lengths) + len(lengths),), generator=g)
    target = torch.zeros(best.shape[0], 4).scatter_(1, best[:, None], 1.0)
    fast = accept(target, drafts, [None] * len(drafts), torch.Generator().manual_seed(0), random=[False] * len(drafts))
    walk = accept(target, drafts, [None] * len(drafts), torch.Generator().manual_seed(0))
    assert fast == walk and 0 < sum(fast[1]) < sum(lengths)


def test_seeded_requests_repeat_and_ignore_the_batch():
    torch.manual_seed(0)
    logits = torch.randn(7, 50)
    p = SamplingParams(temperature=0.9, top_k=20, seed=1234)

    def run(batch_first: bool):
        seeded = SamplingRow(p, [1], [3], torch.Generator().manual_seed(1234))
        other = SamplingRow(SamplingParams(temperature=1.0), [1], [], None)
        reqs, drafts, rows = [seeded, other], [[4, 5, 6], [7, 8]], logits
        if not batch_first:
            reqs, drafts, rows = reqs[::-1], drafts[::-1], torch.cat((logits[4:], logits[:4]))
        v = RejectionSampler(Sampler(generator=torch.Generator().manual_seed(int(batch_first))))(rows, reqs, drafts)
        return v.token_ids[0 if batch_first else 1]

    assert run(True) == run(False)


def test_penalties_see_the_drafts_before_each_row():
    """Row i's target is processed with the drafts before it in the history: a repetition penalty on a draft
    accepted at row 0 changes row 1 (the rows carry the right histories)."""
    logits = torch.tensor([[0.0, 3.0, 2.9], [0.0, 3.0, 2.9]])
    req = SamplingRow(SamplingParams(temperature=0.0, presence_penalty=1.0), [0], [])
    # row 0 accepts draft 1 (argmax); row 1's target has 1 penalised, so its argmax is 2, not the draft's 1
    assert RejectionSampler(Sampler())(logits, [req], [[1]]).token_ids == [[1, 2]]


def test_blocks_of_different_lengths_keep_the_target_exact():
    """Adaptive K: each block verifies 0, 1 or 2 of its drafts, the length a function of the drafts (as the confidence
    head's is of the committed tokens), never of the step's draws: the emitted tokens still follow the target."""
    p0, p1, p2, _, _ = two_step_setup(3)
    g = torch.Generator().manual_seed(5)
    d1 = torch.multinomial(torch.full((V,), 1.0 / V), N, replacement=True, generator=g)
    d2 = torch.multinomial(torch.full((V,), 1.0 / V), N, replacement=True, generator=g)
    lengths = ((d1 + d2) % 3).tolist()  # 0, 1 or 2 drafts, correlated with what is drafted
    drafts = [[a, b][:n] for a, b, n in zip(d1.tolist(), d2.tolist(), lengths)]
    rows = [t for b, n in enumerate(lengths) for t in (p0, p1[d1[b]], p2[d1[b], d2[b]])[: n + 1]]
    tokens, n_acc = accept(torch.stack(rows), drafts, [None] * N, torch.Generator().manual_seed(11))
    assert {0, 1, 2} <= set(n_acc) and all(a <= n for a, n in zip(n_acc, lengths))
    t1 = torch.tensor([t[0] for t in tokens])
    assert chi2_pvalue(torch.bincount(t1, minlength=V), p0) > 1e-3
    pairs = [(t[0], t[1]) for t in tokens if len(t) >= 2]
    for a in range(V - 1):
        second = torch.tensor([b for x, b in pairs if x == a], dtype=torch.long)
        if second.numel() > 200:
            assert chi2_pvalue(torch.bincount(second, minlength=V), p1[a]) > 1e-3
