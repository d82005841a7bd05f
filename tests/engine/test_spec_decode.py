"""Speculative decoding in the engine: greedy with drafts on gives drafts off's tokens, token for token (fp64), with
every cache kind checked after every step (nothing left behind by rejected rows).

Three drafters: the model's own DSpark stages (random weights on ``tiny``: acceptance near zero), and an oracle that
proposes the drafts-off continuation with one draft in each block made wrong at a position that cycles through the
block, so every acceptance length (0..K) and so every rollback depth happens."""

import random

import pytest
import torch

from dsserve.engine.args import EngineArgs
from dsserve.engine.core import EngineCore
from dsserve.engine.sampling_params import SamplingParams

BASE = dict(model="tiny", dtype="float64", device="cpu", max_num_seqs=4, max_num_batched_tokens=64, warmup=False)
MAX_NEW = 12


def engine(spec_k: int | None = None, **kw) -> EngineCore:
    spec = None if spec_k is None else {"method": "dspark", "num_speculative_tokens": spec_k}
    return EngineCore(EngineArgs(**{**BASE, **kw}, speculative_config=spec))


def prompts(seed=1, lens=(5, 41, 23)):
    rng = random.Random(seed)
    return [[rng.randrange(3, 8000) for _ in range(n)] for n in lens]


def check_caches(eng: EngineCore) -> None:
    """Every state kind of every running request holds exactly its committed rows."""
    eng.scheduler.check()
    kv = eng.kv
    lay = kv.layout
    for r in eng.scheduler.running:
        s = r.kv
        n = s.num_tokens
        assert n == r.num_computed_tokens <= r.num_tokens - 1 or r.num_computed_tokens == 0
        assert len(s.block_table) == -(-max(n, s.published_until) // lay.block_size), "blocks past the kept rows"
        for src, (ratio, _) in lay.sources.items():
            assert s.num_entries(src) == max(n, s.published_until) // ratio, f"entries of source {src}"
            if eng.model.kernel_ops is not None:  # the batched paged path: carried rows in PagedKVCache.carry
                assert ratio == 1 or s.carried.get(src, 0) == n % ratio
                continue
            pend = s.pending(src) if ratio > 1 else None
            if n % ratio == 0:
                assert pend is None or pend[0].shape[0] == 0
            else:
                assert pend is not None and pend[2] == n - n % ratio and pend[0].shape[0] == n % ratio
        for layer, tags in kv.window_pos.items():
            live = tags[s.slot][tags[s.slot] >= 0]
            assert live.unique().numel() == live.numel() and bool((live < n).all()), f"ring of layer {layer}"
            assert bool((live >= n - lay.window).all())
        if kv.engram_token_map is not None:
            want = kv.engram_token_map[torch.tensor(r.all_token_ids[max(0, n - lay.engram_lookback) : n])]
            assert torch.equal(s.engram_history, want), "Engram lookback"
        if r.draft_state is not None:
            assert r.draft_state.last_position <= r.num_tokens - 2, "a draft ring holds an uncommitted position"


def run(eng: EngineCore, ps, params, abort: dict | None = None, check=True) -> dict:
    """Token ids per request id; ``abort``: step -> request ids aborted after it."""
    for i, p in enumerate(ps):
        eng.add_request(str(i), p, params[i] if isinstance(params, list) else params)
    out, step = {}, 0
    eng.preempted = 0
    while eng.has_unfinished_requests():
        for o in eng.step():
            if o.finished:
                out[o.request_id] = o.outputs[0]
        step += 1
        for rid in (abort or {}).get(step, ()):
            eng.abort_request(rid)
        if check:
            check_caches(eng)
    return out


def oracle(eng: EngineCore, reference: dict, k: int, wrong: bool = True) -> None:
    """Replaces the drafts of each block by the reference continuation, one draft wrong at a cycling position
    (``wrong`` False: every draft right)."""
    real, count = eng.drafter.hand_out, [0]

    def hand_out(sampled, proposal, host):
        real(sampled, proposal, host)  # the DSpark stages still ran (and read their rings)
        for r in proposal.requests:
            if r.status.finished:
                continue
            ref = reference[r.request_id].token_ids
            n = len(r.output_token_ids)
            drafts = list(ref[n : n + k])
            bad = count[0] % (k + 2) if wrong else k  # k or k + 1: no wrong draft (whole-block acceptance)
            count[0] += 1
            if bad < len(drafts):
                drafts[bad] = (drafts[bad] + 1) % eng.cfg.vocab_size
            if r.draft_state is not None and r.draft_state.last_position == r.num_tokens - 2:
                r.draft_token_ids = drafts

    eng.drafter.hand_out = hand_out


GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)


@pytest.fixture(scope="module")
def drafts_off():
    """Drafts-off tokens: chunked prefill (chunks of 16), prefix caching with bounded replay (the defaults)."""
    return run(engine(long_prefill_token_threshold=16), prompts(), GREEDY, check=False)


def ids(out: dict) -> dict:
    return {k: v.token_ids for k, v in out.items()}


def test_dspark_drafts_random_weights_greedy_equals_drafts_off(drafts_off):
    eng = engine(3, long_prefill_token_threshold=16)
    assert ids(run(eng, prompts(), GREEDY)) == ids(drafts_off)
    st = eng.stats
    assert st.spec_num_drafts > 0 and st.spec_num_draft_tokens == 3 * st.spec_num_drafts or st.spec_num_drafts > 0


@pytest.mark.parametrize("replay", [True, False], ids=["bounded-replay", "exact-window-in-blocks"])
def test_oracle_drafts_every_acceptance_length_greedy_equals_drafts_off(drafts_off, replay):
    """With bounded replay the window is a ring per request (rolled back from the saved rows); in exact mode
    (prefix caching without replay) it lives in the blocks by position."""
    ref = (
        drafts_off
        if replay
        else run(engine(long_prefill_token_threshold=16, swa_bounded_replay=False), prompts(), GREEDY)
    )
    eng = engine(5, long_prefill_token_threshold=16, swa_bounded_replay=replay)
    assert eng.kv.layout.window_in_blocks is not replay
    oracle(eng, ref, 5)
    assert ids(run(eng, prompts(), GREEDY)) == ids(ref)
    st = eng.stats
    assert st.spec_num_accepted_tokens > 0 and st.spec_accepted_per_pos[4] > 0  # whole blocks accepted too
    assert st.spec_num_accepted_tokens < st.spec_num_draft_tokens  # and drafts rejected


def test_paged_backend_oracle_drafts_greedy_equals_drafts_off(drafts_off):
    """The batched paged attention path (the GPU's, here with the torch references): carried compressor rows in the
    cache's device buffer, window rows written by the fused store."""
    eng = engine(5, long_prefill_token_threshold=16, attention_backend="paged", reference_ops="all")
    assert eng.model.kernel_ops is not None
    oracle(eng, drafts_off, 5)
    assert ids(run(eng, prompts(), GREEDY)) == ids(drafts_off)
    assert 0 < eng.stats.spec_num_accepted_tokens < eng.stats.spec_num_draft_tokens


def test_preemption_and_aborts_mid_block(drafts_off):
    """A KV cache too small for every request at once (preemption by recompute), and an abort mid-way."""
    small = dict(long_prefill_token_threshold=16, block_size=16)
    per_block = engine(None, **small).kv.layout.bytes_per_block
    small["kv_cache_memory_bytes"] = 6 * per_block + 4 * engine(None, **small).kv.layout.bytes_per_slot
    ref = run(engine(None, **small), prompts(), GREEDY, abort={3: ["0"]})
    eng = engine(5, **small)
    assert eng.kv.blocks.num_blocks == 6
    oracle(eng, drafts_off, 5)
    preempt, seen = eng.scheduler._preempt, []
    eng.scheduler._preempt = lambda r: (seen.append(r.request_id), preempt(r))
    got = run(eng, prompts(), GREEDY, abort={3: ["0"]})
    assert seen, "the cache was meant to be too small for every request at once"
    assert "0" not in got or got["0"].finish_reason == "abort" or "0" in ref
    assert {k: v.token_ids for k, v in got.items() if k != "0"} == {k: v.token_ids for k, v in ref.items() if k != "0"}
    assert ids(got)["1"] == ids(drafts_off)["1"] and ids(got)["2"] == ids(drafts_off)["2"]


def test_stops_and_max_tokens_inside_an_accepted_block(drafts_off):
    """Every draft right (blocks of 1 + 5 tokens): a stop token, a stop string and max_tokens each end a request
    inside a block; the tokens after the stop are dropped, text and finish reasons as with drafts off."""
    tok = engine(None).tokenizer
    ref = ids(drafts_off)
    first_new = next(i for i in range(3, MAX_NEW) if ref["0"][i] not in ref["0"][:i])
    text = [tok.decode(ref["1"][:i]) for i in range(MAX_NEW + 1)]
    cut = next(
        i
        for i in range(4, MAX_NEW)
        if text[i + 1][len(text[i]) :].strip() and text[i + 1][len(text[i]) :] not in text[i]
    )
    stop_str = text[cut + 1][len(text[cut]) :]
    params = [
        SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True, stop_token_ids=[ref["0"][first_new]]),
        SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True, stop=[stop_str]),
        SamplingParams(temperature=0.0, max_tokens=9, ignore_eos=True),
    ]
    off = run(engine(None, long_prefill_token_threshold=16), prompts(), params, check=False)
    eng = engine(5, long_prefill_token_threshold=16)
    oracle(eng, drafts_off, 5, wrong=False)
    on = run(eng, prompts(), params)
    for k in off:
        a, b = on[k], off[k]
        assert (a.token_ids, a.text, a.finish_reason, a.stop_reason) == (
            b.token_ids,
            b.text,
            b.finish_reason,
            b.stop_reason,
        )
    assert len(on["0"].token_ids) == first_new + 1 and on["0"].finish_reason == "stop"
    assert on["1"].finish_reason == "stop" and len(on["2"].token_ids) == 9
    assert eng.stats.spec_accepted_per_pos[4] > 0


def test_prefix_hit_with_bounded_replay_and_logprobs():
    """A second request on the first's prompt hits the prefix cache and replays the window; with drafts its tokens and
    logprobs are drafts off's."""
    kw = dict(long_prefill_token_threshold=32, block_size=16)
    base = prompts(seed=3, lens=(70,))[0]
    second = base + prompts(seed=4, lens=(9,))[0]
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True, logprobs=2)
    off_eng = engine(None, **kw)
    off = [run(off_eng, [base], params, check=False)["0"], run(off_eng, [second], params, check=False)["0"]]
    eng = engine(4, **kw)
    oracle(eng, {"0": off[0]}, 4)
    first = run(eng, [base], params)["0"]
    oracle(eng, {"0": off[1]}, 4)
    hit = run(eng, [second], params)["0"]
    assert eng.scheduler.config.swa_bounded_replay
    for a, b in ((first, off[0]), (hit, off[1])):
        assert a.token_ids == b.token_ids
        for la, lb in zip(a.logprobs, b.logprobs):
            assert la.keys() == lb.keys()
            assert all(abs(la[t].logprob - lb[t].logprob) < 1e-9 and la[t].rank == lb[t].rank for t in la)
    assert eng.stats.prefix_hit_tokens >= 64 and eng.stats.replayed_rows > 0
    assert eng.stats.spec_num_accepted_tokens > 0


@pytest.mark.parametrize("adaptive", [False, True], ids=["K", "adaptive-K"])
def test_sampling_with_drafts_keeps_the_targets_distribution(adaptive):
    """Engine level: temperature 1 with top-k 3 (three live tokens), the second token verified against a draft (the
    target's argmax, so accepted often, rejected often): the empirical (t1, t2) over many requests matches the
    target's p(t1) p(t2 | t1), computed from the reference forward and the sampler's own processing. Adaptive K: the
    confidence head decides whether the block is verified at all, with a threshold between its confidences after
    the different first tokens, so the block's length depends on t1; the distribution must not move."""
    from test_spec_decode_sampler import chi2_pvalue

    from dsserve.engine.sampler import Sampler, SamplingRow

    n_req = 360
    eng = engine(1, dtype="float32", max_num_seqs=180, max_num_batched_tokens=1024, enable_prefix_caching=False, seed=5)
    prompt = prompts(seed=9, lens=(4,))[0]
    params = SamplingParams(temperature=1.0, top_k=3, max_tokens=3, ignore_eos=True)
    model, sampler = eng.model, Sampler()
    with torch.no_grad():
        p1 = sampler.target_probs(model.reference_logits(torch.tensor(prompt))[-1:], [SamplingRow(params, prompt)])[0][
            0
        ]
        firsts = p1.nonzero().squeeze(1).tolist()
        p2 = {
            t: sampler.target_probs(
                model.reference_logits(torch.tensor(prompt + [t]))[-1:], [SamplingRow(params, prompt, [t])]
            )[0][0]
            for t in firsts
        }
    best = {t: int(p.argmax()) for t, p in p2.items()}
    real = eng.drafter.hand_out
    if adaptive:  # the confidence (of the first draft) after each first token, from the prompt's rings
        with torch.no_grad():
            out = model.forward(torch.tensor(prompt))
            state = model.mtp.new_state()
            model.mtp.ingest(out.taps, torch.arange(len(prompt)), state)
            conf = {
                t: float(
                    torch.sigmoid(
                        model.mtp.propose_batch([t], [len(prompt) - 1], [state], model.embed, model.head)[1][0, 0]
                    )
                )
                for t in firsts
            }
        lo, hi = sorted(conf.values())[:2]
        eng.drafter.threshold = (lo + hi) / 2  # the least confident first token drafts nothing, the others 1

    def hand_out(sampled, proposal, host):  # the oracle's draft, verified only where adaptive K keeps a draft
        real(sampled, proposal, host)
        for r in proposal.requests:
            keep = len(r.draft_token_ids) if adaptive else 1
            r.draft_token_ids = []
            if r.status.finished:
                continue
            if len(r.output_token_ids) == 1 and r.draft_state.last_position == r.num_tokens - 2:
                r.draft_token_ids = [best[r.output_token_ids[0]]][:keep]

    eng.drafter.hand_out = hand_out
    out = run(eng, [prompt] * n_req, params, check=False)
    if adaptive:
        assert 0 < eng.stats.spec_num_drafts < n_req  # some blocks were cut to nothing, some verified
    else:
        assert eng.stats.spec_num_drafts == n_req
    assert 0 < eng.stats.spec_num_accepted_tokens < eng.stats.spec_num_drafts
    cells = [(a, b) for a in firsts for b in p2[a].nonzero().squeeze(1).tolist()]
    expected = torch.tensor([float(p1[a] * p2[a][b]) for a, b in cells])
    seen = [tuple(o.token_ids[:2]) for o in out.values()]
    counts = torch.tensor([seen.count(c) for c in cells], dtype=torch.float64)
    assert counts.sum() == n_req
    assert chi2_pvalue(counts, expected / expected.sum()) > 1e-3


def test_trained_model_greedy_equals_drafts_off():
    """The built-in model with its checkpoint's draft stages (real acceptance when they are trained)."""
    from dsserve.train.tasks import problem, prompt_ids

    kw = dict(model="tiny-trained", long_prefill_token_threshold=32)
    tok = engine(None, **kw).tokenizer
    ps = [prompt_ids(tok, problem("arithmetic", "eval", i).prompt) for i in range(3)]
    params = SamplingParams(temperature=0.0, max_tokens=16)
    off = run(engine(None, **kw), ps, params, check=False)
    eng = engine(4, **kw)
    assert ids(run(eng, ps, params)) == ids(off)
    assert eng.stats.spec_num_drafts > 0
    # adaptive K: the confidence head cuts blocks short (a high threshold, so that it does), tokens unchanged
    ada = EngineCore(
        EngineArgs(**{**BASE, **kw}, speculative_config={"num_speculative_tokens": 4, "confidence_threshold": 0.99})
    )
    assert ids(run(ada, ps, params)) == ids(off)
    st = ada.stats
    assert 0 < st.spec_num_draft_tokens < 4 * st.spec_num_drafts


def test_batched_proposal_equals_one_block_at_a_time(tiny_models, monkeypatch):
    """DSpark.propose_batch (the drafter's) gives each sequence the drafts and confidences DSpark.propose gives it
    alone, on rings ingested to different positions (one past the window, one empty), its attention over every
    block at once (DraftAttention._attend_blocks: the per-block loop is not reached)."""
    import dsserve.models.dspark as dspark

    model = tiny_models["tiny"]
    cfg = model.cfg
    gen = torch.Generator().manual_seed(0)
    states, ys, ps = [], [], []
    assert cfg.sliding_window < 40
    for n in (3, 40, 17, 0):
        st = model.mtp.new_state()
        taps = {
            layer: torch.randn(n, cfg.hidden_size, generator=gen, dtype=torch.float64)
            for layer in cfg.dspark_target_layer_ids
        }
        model.mtp.ingest(taps, torch.arange(n), st)
        states.append(st)
        ys.append(int(torch.randint(3, cfg.vocab_size, (1,), generator=gen)))
        ps.append(n - 1)
    per_block = dspark.sparse_attention_with_sink
    with torch.no_grad():
        monkeypatch.setattr(dspark, "sparse_attention_with_sink", None)  # the batched pass must not need it
        drafts, conf = model.mtp.propose_batch(ys, ps, states, model.embed, model.head)
        monkeypatch.setattr(dspark, "sparse_attention_with_sink", per_block)
        for i in range(4):
            d, c, _ = model.mtp.propose(ys[i], ps[i], states[i], model.embed, model.head)
            assert drafts[i].tolist() == d.tolist()
            assert torch.allclose(conf[i], c, atol=1e-9)
            # one block alone (B = 1: the per-block attention, the Markov steps on one row)
            d1, c1 = model.mtp.propose_batch([ys[i]], [ps[i]], [states[i]], model.embed, model.head)
            assert d1[0].tolist() == d.tolist()
            assert torch.allclose(c1[0], c, atol=1e-9)


def test_block_lengths_follow_the_confidence_product(tiny_models):
    """Adaptive K keeps a block's drafts while the product of sigmoid(confidence) stays at or above the threshold."""
    from dsserve.engine.drafter import Drafter

    logit = lambda p: torch.logit(torch.tensor(p, dtype=torch.float64))  # noqa: E731
    conf = torch.stack([logit([0.99, 0.9, 0.99]), logit([0.5, 0.99, 0.99]), logit([0.99, 0.99, 0.99])])
    model = tiny_models["tiny"]
    assert Drafter(model, 3, None).block_lengths(conf).tolist() == [3, 3, 3]
    d = Drafter(model, 3, None, confidence_threshold=0.885)
    assert d.block_lengths(conf).tolist() == [2, 0, 3]  # 0.99 * 0.9 = 0.891, then 0.882; 0.5 first; 0.970 at the end
    with pytest.raises(ValueError, match=r"adaptive K takes \[0, 1\)"):
        Drafter(model, 3, None, confidence_threshold=1.0)
