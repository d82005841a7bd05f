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


def oracle(eng: EngineCore, reference: dict, k: int) -> None:
    """Replaces the drafts of each block by the reference continuation, one draft wrong at a cycling position."""
    real, count = eng.drafter.propose, [0]

    def propose(requests):
        real(requests)  # the DSpark stages still run (and read their rings)
        for r in requests:
            ref = reference[r.request_id].token_ids
            n = len(r.output_token_ids)
            drafts = list(ref[n : n + k])
            bad = count[0] % (k + 2)  # k or k + 1: no wrong draft (whole-block acceptance)
            count[0] += 1
            if bad < len(drafts):
                drafts[bad] = (drafts[bad] + 1) % eng.cfg.vocab_size
            if r.draft_state is not None and r.draft_state.last_position == r.num_tokens - 2:
                r.draft_token_ids = drafts

    eng.drafter.propose = propose


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


def test_oracle_drafts_every_acceptance_length_greedy_equals_drafts_off(drafts_off):
    eng = engine(5, long_prefill_token_threshold=16)
    oracle(eng, drafts_off, 5)
    assert ids(run(eng, prompts(), GREEDY)) == ids(drafts_off)
    st = eng.stats
    assert st.spec_num_accepted_tokens > 0 and st.spec_accepted_per_pos[4] > 0  # whole blocks accepted too
    assert st.spec_num_accepted_tokens < st.spec_num_draft_tokens  # and drafts rejected


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
