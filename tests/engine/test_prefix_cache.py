"""Prefix caching with SWA bounded replay, against references of the truncated semantics (spec 2.9)."""

import random

import pytest
import torch

from dsserve import LLM, SamplingParams
from dsserve.engine.greedy import greedy_generate
from dsserve.engine.stats import persistent_bytes
from dsserve.kv.paged import KVLayout
from dsserve.kv.sequence_cache import SequenceCache
from dsserve.models.presets import preset

BS, NEW = 16, 6


def make_llm(replay, window=None, budget=512, **kw):
    return LLM(
        model="tiny",
        dtype="float64",
        device="cpu",
        block_size=BS,
        max_num_batched_tokens=budget,
        max_num_seqs=8,
        swa_bounded_replay=replay,
        replay_window=window,
        enable_prefix_caching=True,
        **kw,
    )


def capture_logits(llm):
    """Wrap the runner so every sampled row's logits are kept per request."""
    seen, execute = {}, llm.engine.runner.execute

    def wrapped(plan):
        reqs, logits = execute(plan)
        for r, row in zip(reqs, logits):
            seen.setdefault(r.request_id, []).append(row)
        return reqs, logits

    llm.engine.runner.execute = wrapped
    return seen


def greedy(llm, prompt, rid_logits=None):
    sp = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True)
    return llm.generate([prompt], sp, use_tqdm=False)[0]


@torch.no_grad()
def reference_after_hit(model, tokens, hit, window):
    """The truncated semantics: global KV of [0, hit) from a cold run of the prefix; the encoder replays
    rows [hit - window, hit) with every window clipped there; the decoder runs on the last `window` prompt
    rows; then greedy decode. Returns (tokens, logits)."""
    cold = SequenceCache(model.cfg.sliding_window)
    model(torch.tensor(tokens[:hit]), cold)
    s = max(0, hit - window)
    c = SequenceCache(model.cfg.sliding_window)
    for src in {r.kv_source for r in model.cfg.roles if r.owns_compressor}:
        c.push_global(src, *cold.global_kv(src))
    c.published_until, c.num_tokens = hit, s
    c.engram_history = model.engram_token_map[torch.tensor(tokens[max(0, s - 3) : s])]
    floor = max(0, len(tokens) - window)
    out = model(torch.tensor(tokens[s:]), c, decoder_start=floor)
    logits = [model.logits(out.hidden[-1:])[0]]
    gen = [int(logits[-1].argmax())]
    for _ in range(NEW - 1):
        out = model(torch.tensor(gen[-1:]), c, decoder_start=floor)
        logits.append(model.logits(out.hidden)[0])
        gen.append(int(logits[-1].argmax()))
    return gen, torch.stack(logits)


def rand_tokens(n, seed):
    rng = random.Random(seed)
    return [rng.randrange(3, 8190) for _ in range(n)]


# windows 31/32/33 give both parities of the replay floor; budgets 20 and 7 chunk the replayed prefill;
# prompts end mid-block (70+25), right after a block (64+1) and far past the hit (90+50)
@pytest.mark.parametrize(
    "window,budget,prefix_len,suffix_len",
    [(32, 512, 70, 25), (31, 512, 64, 1), (33, 7, 90, 50), (32, 20, 64, 1), (31, 20, 70, 25), (32, 512, 90, 50)],
)
def test_replay_after_a_hit_matches_the_truncated_reference(window, budget, prefix_len, suffix_len):
    llm = make_llm(True, window, budget)
    seen = capture_logits(llm)
    prefix = rand_tokens(prefix_len, 1)
    greedy(llm, prefix + rand_tokens(20, 2))  # request A fills the cache
    b = prefix + rand_tokens(suffix_len, 3)
    out = greedy(llm, b)
    hit = min(prefix_len, len(b) - 1) // BS * BS
    assert out.num_cached_tokens == hit > 0
    ref_tokens, ref_logits = reference_after_hit(llm.engine.model, b, hit, window)
    assert out.outputs[0].token_ids == ref_tokens
    assert (torch.stack(seen[out.request_id]) - ref_logits).abs().max() < 1e-9
    assert llm.engine.stats.replayed_rows > 0


@pytest.mark.parametrize("prefix_len", [20, 31])
def test_prompts_and_hits_within_the_window_are_exact(prefix_len):
    llm = make_llm(True, 32)
    seen = capture_logits(llm)
    prefix = rand_tokens(prefix_len, 4)
    greedy(llm, prefix + [5])
    b = prefix + [6]  # P <= W: the decoder floor is 0
    out = greedy(llm, b)
    assert out.num_cached_tokens == 16
    model = llm.engine.model
    cold = model.reference_logits(torch.tensor(b + out.outputs[0].token_ids[:-1]))[len(b) - 1 :]
    assert (torch.stack(seen[out.request_id]) - cold).abs().max() < 1e-9


def test_exact_mode_hit_equals_the_cold_run():
    llm = make_llm(False)
    seen = capture_logits(llm)
    prefix = rand_tokens(80, 5)
    greedy(llm, prefix + rand_tokens(9, 6))
    b = prefix + rand_tokens(13, 7)
    out = greedy(llm, b)
    assert out.num_cached_tokens == 80
    model = llm.engine.model
    cold = model.reference_logits(torch.tensor(b + out.outputs[0].token_ids[:-1]))[len(b) - 1 :]
    assert (torch.stack(seen[out.request_id]) - cold).abs().max() < 1e-9
    assert out.outputs[0].token_ids == [int(r.argmax()) for r in cold]


@pytest.mark.parametrize("replay", [True, False])
def test_multi_turn_hit_covers_the_previous_turn(replay):
    llm = make_llm(replay, 32)
    history = rand_tokens(40, 8)
    prev_computed = 0
    for turn in range(3):
        out = greedy(llm, history)
        computed = len(history) + NEW - 1  # the last sampled token never ran through the model
        if turn:
            assert out.num_cached_tokens == min(prev_computed, len(history) - 1) // BS * BS
        history = history + out.outputs[0].token_ids + rand_tokens(11, 9 + turn)
        prev_computed = computed


def test_eviction_under_pressure_never_touches_blocks_in_use():
    # exact mode, a pool far smaller than the traffic: any wrongly evicted block would change logits
    llm = make_llm(False, kv_cache_memory=2 << 20)
    assert llm.engine.kv.blocks.num_blocks < 200
    seen = capture_logits(llm)
    rng = random.Random(10)
    prefixes = [rand_tokens(48, 20 + i) for i in range(3)]
    prompts = [
        rng.choice(prefixes)[: rng.randrange(16, 49)] + rand_tokens(rng.randrange(1, 30), 40 + i) for i in range(12)
    ]
    sp = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True)
    eng = llm.engine
    for i, p in enumerate(prompts):
        eng.add_request(f"e{i}", p, sp)
    outs = {}
    while eng.has_unfinished_requests():
        for o in eng.step():
            if o.finished:
                outs[o.request_id] = o
        eng.scheduler.check()
    assert eng.stats.prefix_hit_tokens > 0
    model = eng.model
    for i, p in enumerate(prompts):
        o = outs[f"e{i}"]
        cold = model.reference_logits(torch.tensor(p + o.outputs[0].token_ids[:-1]))[len(p) - 1 :]
        assert (torch.stack(seen[f"e{i}"]) - cold).abs().max() < 1e-9, i


def test_cache_salt_isolates_tenants():
    llm = make_llm(True, 32)
    prefix = rand_tokens(50, 11)
    llm.generate([{"prompt_token_ids": prefix + [1], "cache_salt": "a"}], SamplingParams(max_tokens=2), use_tqdm=False)
    other = llm.generate(
        [{"prompt_token_ids": prefix + [2], "cache_salt": "b"}], SamplingParams(max_tokens=2), use_tqdm=False
    )[0]
    same = llm.generate(
        [{"prompt_token_ids": prefix + [3], "cache_salt": "a"}], SamplingParams(max_tokens=2), use_tqdm=False
    )[0]
    assert other.num_cached_tokens == 0 and same.num_cached_tokens == 48


@pytest.mark.parametrize("retention", [0.0, 3600.0])
def test_session_retention_keeps_a_paused_agents_prefix(retention):
    llm = make_llm(True, 32, kv_cache_memory=600_000, session_retention=retention)
    blocks = llm.engine.kv.blocks.num_blocks
    agent = rand_tokens(64, 12)
    llm.generate([{"prompt_token_ids": agent, "session_id": "s1"}], SamplingParams(max_tokens=2), use_tqdm=False)
    # other traffic that needs every block while the agent waits for its tool
    filler = rand_tokens(2 * blocks * BS, 13)  # more than the pool: plain LRU must cycle through every block
    llm.generate(
        [filler[i : i + 200] for i in range(0, len(filler), 200)], SamplingParams(max_tokens=1), use_tqdm=False
    )
    back = llm.generate(
        [{"prompt_token_ids": agent + [9, 9], "session_id": "s1"}], SamplingParams(max_tokens=2), use_tqdm=False
    )[0]
    assert (back.num_cached_tokens == 64) == (retention > 0)


@pytest.mark.parametrize("replay", [True, False])
def test_reset_prefix_cache_forgets_every_prefix_only_when_idle(replay):
    llm = make_llm(replay, 32, session_retention=3600.0)
    prefix, sp = rand_tokens(64, 14), SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    first = llm.generate([{"prompt_token_ids": prefix + [1], "session_id": "s"}], sp, use_tqdm=False)[0]
    assert llm.engine.kv.blocks._held  # the session holds its blocks ahead of the LRU queue
    llm.engine.add_request("busy", prefix + [2], sp)
    assert not llm.engine.reset_prefix_cache()  # a running request would go on registering its blocks
    while llm.engine.has_unfinished_requests():
        llm.engine.step()
    assert llm.engine.reset_prefix_cache()
    kv = llm.engine.kv
    assert len(kv.prefix) == 0 and not kv.blocks._held and kv.blocks.num_used == 0
    again = llm.generate([prefix + [1]], sp, use_tqdm=False)[0]
    assert again.num_cached_tokens == 0 and again.outputs[0].token_ids == first.outputs[0].token_ids
    assert llm.generate([prefix + [3]], sp, use_tqdm=False)[0].num_cached_tokens == 64  # caching goes on


def test_stats_for_the_real_config():
    b = persistent_bytes(KVLayout.build(preset("v41-flash")))
    assert b["persistent_bytes_per_token"] == 890
    assert b["window_bytes_per_token"] == 40 * 528
    assert b["persistent_bytes_per_token_with_window"] == 890 + 40 * 528
    assert b["window_cost_ratio"] > 10  # the seeds: the window would cost more than 10x the global KV
    assert (b["cached_bytes_per_token_main"], b["cached_bytes_per_token_index"]) == (720, 170)


def test_vllm_replay_form_runs_and_batches_with_empty_rows():
    llm = make_llm(True, 32, budget=20, replay_form="vllm")
    outs = llm.generate(
        [rand_tokens(70, 30), rand_tokens(3, 31)], SamplingParams(temperature=0, max_tokens=3), use_tqdm=False
    )
    assert all(len(o.outputs[0].token_ids) == 3 for o in outs)


@pytest.mark.parametrize("paged", [True, False])
def test_v4_prefix_hit_reruns_the_overlapping_compressors_group(paged):
    """V4's ratio-4 compressors mix each entry with the previous group's rows, which the cache does not keep: a hit
    resumes layout.resume_rows (4) rows early, pools that group again without re-publishing its entry, and leaves
    the shared cached window rows alone. fp64, every op on its reference; the paged batched path and the
    per-sequence one (the reference backend) both equal the oracle after a hit (before the fix: a shape error)."""
    llm = LLM(
        model="tiny-v4",
        dtype="float64",
        device="cpu",
        attention_backend="paged" if paged else "reference",
        seed=0,
        max_num_seqs=2,
        max_num_batched_tokens=64,
        enable_prefix_caching=True,
        reference_ops="all",
    )
    m = llm.engine.model
    base = [5 + (j * 37) % 900 for j in range(300)]
    for tail in ([7, 8, 9], [10, 11, 12, 13]):
        p = base + tail
        out = llm.generate([p], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)[0]
        assert out.outputs[0].token_ids == greedy_generate(m, p, 4, bounded_replay=False)
    assert out.num_cached_tokens == 256  # two 128-token blocks (tiny-v4's block: lcm of its ratios and 64)
