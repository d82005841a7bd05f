"""EngineMetrics against a real tiny engine: counters move by the right amounts, gauges settle, names are prefixed."""

import random
from types import SimpleNamespace

import pytest

pytest.importorskip("prometheus_client")
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from dsserve.engine.args import EngineArgs  # noqa: E402
from dsserve.engine.core import EngineCore  # noqa: E402
from dsserve.engine.sampling_params import SamplingParams  # noqa: E402
from dsserve.server.metrics import EngineMetrics  # noqa: E402


def parse(metrics):
    body, ctype = metrics.render()
    assert ctype.startswith("text/plain")
    fams = list(text_string_to_metric_families(body.decode()))
    samples = {(s.name, frozenset(s.labels.items())): s.value for f in fams for s in f.samples}
    return fams, samples


def value(samples, name, model_name="tiny", **labels):
    return samples[(name, frozenset({"model_name": model_name, **labels}.items()))]


def drive(engine, metrics, finals, snapshots=None):
    while engine.has_unfinished_requests():
        outs = engine.step()
        metrics.observe_step(engine)
        for o in outs:
            metrics.observe_output(o)
            if o.finished:
                finals[o.request_id] = o
        if snapshots is not None:
            snapshots.append(parse(metrics)[1])


@pytest.fixture(scope="module")
def engine():
    return EngineCore(EngineArgs(model="tiny", max_num_seqs=4))


def test_counters_gauges_histograms(engine):
    m = EngineMetrics(model_name="tiny")
    rng = random.Random(0)
    vocab = engine.cfg.vocab_size
    long_prompt = [rng.randrange(3, vocab) for _ in range(80)]
    short_prompt = [rng.randrange(3, vocab) for _ in range(20)]  # under one block: no prefix hit
    greedy = dict(temperature=0.0, ignore_eos=True)
    finals = {}

    # A greedy probe, then the same prompt stopped on its second token: finish reason "stop". "cache" puts a
    # full block in the prefix cache that "hit" then reuses.
    engine.add_request("probe", short_prompt, SamplingParams(max_tokens=3, **greedy))
    engine.add_request("cache", long_prompt, SamplingParams(max_tokens=1, **greedy))
    drive(engine, m, finals)
    probe = finals["probe"].outputs[0].token_ids
    engine.add_request("stop", short_prompt, SamplingParams(max_tokens=10, stop_token_ids=[probe[1]], **greedy))
    engine.add_request("hit", long_prompt, SamplingParams(max_tokens=2, **greedy))
    engine.add_request("abort", [5, 6, 7, 8], SamplingParams(max_tokens=50, **greedy))
    # More than max_num_seqs=4 at once, so some wait.
    for i in range(5):
        p = [rng.randrange(3, vocab) for _ in range(rng.randrange(3, 40))]
        engine.add_request(f"len{i}", p, SamplingParams(max_tokens=4 + i, **greedy))
    snaps = []
    for _ in range(3):
        for o in engine.step():
            m.observe_output(o)
            if o.finished:
                finals[o.request_id] = o
        m.observe_step(engine)
        snaps.append(parse(m)[1])
    assert value(snaps[0], "dsserve:num_requests_waiting") > 0
    ab = engine.abort_request("abort")
    assert ab is not None and ab.outputs[0].token_ids  # still in flight (it asked for 50 tokens)
    m.observe_output(ab)
    finals["abort"] = ab
    drive(engine, m, finals, snaps)
    m.observe_step(engine)
    m.observe_step(engine)  # idempotent on totals
    m.observe_error("bad_request")
    m.observe_error("bad_request")
    m.observe_error("internal")

    fams, s = parse(m)
    assert fams and all(f.name.startswith("dsserve:") for f in fams)
    outs = list(finals.values())
    assert len(outs) == 10
    reasons = [o.outputs[0].finish_reason for o in outs]
    assert finals["stop"].outputs[0].finish_reason == "stop" and finals["abort"].outputs[0].finish_reason == "abort"
    for r in ("stop", "length", "abort"):
        assert value(s, "dsserve:request_success_total", finished_reason=r) == reasons.count(r)
    assert reasons.count("length") == 8

    gen = sum(len(o.outputs[0].token_ids) for o in outs)
    assert value(s, "dsserve:generation_tokens_total") == gen
    with_tokens = [o for o in outs if o.outputs[0].token_ids]
    assert value(s, "dsserve:prompt_tokens_total") == sum(len(o.prompt_token_ids) for o in with_tokens)

    assert value(s, "dsserve:e2e_request_latency_seconds_count") == len(outs)
    assert value(s, "dsserve:time_to_first_token_seconds_count") == len(with_tokens)
    assert value(s, "dsserve:request_queue_time_seconds_count") == sum(
        o.metrics.first_scheduled_time is not None for o in outs
    )
    assert value(s, "dsserve:request_generation_tokens_count") == len(outs)
    assert value(s, "dsserve:request_generation_tokens_sum") == gen
    assert value(s, "dsserve:request_prompt_tokens_sum") == sum(len(o.prompt_token_ids) for o in outs)
    itl = sum(len(o.outputs[0].token_ids) - 1 for o in with_tokens)
    assert value(s, "dsserve:inter_token_latency_seconds_count") == itl
    assert value(s, "dsserve:time_per_output_token_seconds_count") == itl
    assert value(s, "dsserve:request_time_per_output_token_seconds_count") == sum(
        len(o.outputs[0].token_ids) >= 2 for o in outs
    )
    assert value(s, "dsserve:time_to_first_token_seconds_bucket", le="+Inf") == len(with_tokens)

    st = engine.stats
    assert value(s, "dsserve:prefix_cache_queries_total") == st.prefix_query_tokens > 0
    assert value(s, "dsserve:prefix_cache_hits_total") == st.prefix_hit_tokens > 0  # "hit" reused "cache"'s block
    assert value(s, "dsserve:replayed_rows_total") == st.replayed_rows
    assert value(s, "dsserve:decoder_rows_skipped_total") == st.decoder_rows_skipped
    assert value(s, "dsserve:decode_graph_steps_total") == st.graph_steps  # 0 on the CPU: no capture
    assert st.steps > 0 and st.step_host_seconds > 0 and st.step_wait_seconds >= 0
    assert value(s, "dsserve:num_preemptions_total") == 0
    assert value(s, "dsserve:request_errors_total", kind="bad_request") == 2
    assert value(s, "dsserve:request_errors_total", kind="internal") == 1

    assert value(s, "dsserve:num_requests_running") == 0 and value(s, "dsserve:num_requests_waiting") == 0
    assert max(value(x, "dsserve:num_requests_running") for x in snaps) == 4
    assert value(s, "dsserve:kv_cache_usage_perc", kind="global") == 0
    assert value(s, "dsserve:kv_cache_blocks", kind="global", state="total") == engine.kv.blocks.num_blocks
    assert value(s, "dsserve:kv_cache_blocks", kind="window", state="total") == engine.kv.slots.num_blocks
    peak = max(value(x, "dsserve:kv_cache_usage_perc", kind="window") for x in snaps)
    assert 0 < peak <= 1
    assert m._requests == {}  # finished requests are forgotten


def test_waiting_abort_and_separate_registries(engine):
    a, b = EngineMetrics(model_name="tiny"), EngineMetrics(model_name="other")
    engine.add_request("w", [3, 4, 5], SamplingParams(max_tokens=2))
    a.observe_step(engine)
    assert value(parse(a)[1], "dsserve:num_requests_waiting") == 1
    out = engine.abort_request("w")  # aborted before it was scheduled: no tokens, no prompt tokens counted
    a.observe_output(out)
    a.observe_step(engine)
    s = parse(a)[1]
    assert value(s, "dsserve:request_success_total", finished_reason="abort") == 1
    assert value(s, "dsserve:prompt_tokens_total") == 0 and value(s, "dsserve:generation_tokens_total") == 0
    assert value(s, "dsserve:e2e_request_latency_seconds_count") == 1
    assert value(s, "dsserve:time_to_first_token_seconds_count") == 0
    assert value(s, "dsserve:request_queue_time_seconds_count") == 0
    assert value(s, "dsserve:num_requests_waiting") == 0
    sb = parse(b)[1]
    assert value(sb, "dsserve:request_success_total", model_name="other", finished_reason="abort") == 0


def test_stat_deltas_and_preemptions_from_a_fake_engine():
    pool = SimpleNamespace(num_blocks=10, num_used=3)
    req = SimpleNamespace(num_preemptions=0)
    stats = SimpleNamespace(
        prefix_query_tokens=100,
        prefix_hit_tokens=64,
        replayed_rows=5,
        prefill_rows=36,
        decoder_rows_skipped=7,
        graph_steps=3,
        replay_graph_steps=2,
        encoder_graph_steps=5,
        graph_captures=4,
        graph_capture_seconds=1.25,
        graph_pool_bytes=3 << 20,
        ahead_steps=6,
        nonfinite_logit_rows=2,
        triton_compiles=9,
        triton_compile_seconds=3.5,
        triton_cache_loads=11,
        spec_num_drafts=4,
        spec_num_draft_tokens=12,
        spec_num_accepted_tokens=7,
        spec_accepted_per_pos=[3, 2, 2],
        spec_mean_acceptance_length=2.75,
    )
    eng = SimpleNamespace(
        scheduler=SimpleNamespace(running=[req], waiting=[], requests={"r": req}),
        kv=SimpleNamespace(blocks=pool, slots=SimpleNamespace(num_blocks=4, num_used=1)),
        stats=stats,
    )
    m = EngineMetrics()
    m.observe_step(eng)
    m.observe_step(eng)
    stats.prefix_query_tokens, req.num_preemptions = 130, 1
    m.observe_step(eng)
    m.observe_step(eng)
    s = parse(m)[1]
    assert value(s, "dsserve:prefix_cache_queries_total") == 130
    assert value(s, "dsserve:prefix_cache_hits_total") == 64
    assert value(s, "dsserve:decode_graph_steps_total") == 3
    assert value(s, "dsserve:replay_graph_steps_total") == 2
    assert value(s, "dsserve:encoder_graph_steps_total") == 5
    assert value(s, "dsserve:graph_captures_total") == 4
    assert value(s, "dsserve:graph_capture_seconds_total") == 1.25  # seconds stay fractional
    assert value(s, "dsserve:graph_pool_bytes_total") == 3 << 20
    assert value(s, "dsserve:async_ahead_steps_total") == 6
    assert value(s, "dsserve:nonfinite_logit_rows_total") == 2
    assert value(s, "dsserve:triton_compiles_total") == 9
    assert value(s, "dsserve:triton_compile_seconds_total") == 3.5
    assert value(s, "dsserve:triton_cache_loads_total") == 11
    assert value(s, "dsserve:num_preemptions_total") == 1
    assert value(s, "dsserve:spec_decode_num_drafts_total") == 4
    assert value(s, "dsserve:spec_decode_num_draft_tokens_total") == 12
    assert value(s, "dsserve:spec_decode_num_accepted_tokens_total") == 7
    assert [value(s, "dsserve:spec_decode_num_accepted_tokens_per_pos_total", position=str(i)) for i in range(3)] == [
        3,
        2,
        2,
    ]
    assert value(s, "dsserve:spec_decode_mean_acceptance_length") == 2.75
    assert value(s, "dsserve:kv_cache_usage_perc", kind="global") == pytest.approx(0.3)
    assert value(s, "dsserve:kv_cache_usage_perc", kind="window") == pytest.approx(0.25)
    assert value(s, "dsserve:kv_cache_blocks", kind="global", state="used") == 3
    # A new engine (new stats object) starts from zero: its totals add on, nothing goes backwards.
    eng.stats = SimpleNamespace(
        prefix_query_tokens=20,
        prefix_hit_tokens=0,
        replayed_rows=0,
        prefill_rows=0,
        decoder_rows_skipped=0,
        graph_steps=0,
        replay_graph_steps=0,
        encoder_graph_steps=0,
        graph_captures=0,
        graph_capture_seconds=0.0,
        graph_pool_bytes=0,
        ahead_steps=0,
        nonfinite_logit_rows=0,
        triton_compiles=0,
        triton_compile_seconds=0.0,
        triton_cache_loads=0,
        spec_num_drafts=1,
        spec_num_draft_tokens=3,
        spec_num_accepted_tokens=1,
        spec_accepted_per_pos=[1, 0, 0],
        spec_mean_acceptance_length=2.0,
    )
    m.observe_step(eng)
    assert value(parse(m)[1], "dsserve:prefix_cache_queries_total") == 150
    assert value(parse(m)[1], "dsserve:spec_decode_num_accepted_tokens_per_pos_total", position="0") == 4


def test_render_from_another_thread_while_the_loop_observes(engine):
    import threading

    m, stop, errors = EngineMetrics(), threading.Event(), []

    def scrape():
        while not stop.wait(0.005):  # a scraper polls; a busy loop would only starve the engine of the GIL
            try:
                parse(m)
            except Exception as e:  # pragma: no cover - reported below
                errors.append(e)

    th = threading.Thread(target=scrape)
    th.start()
    finals = {}
    for i in range(4):
        engine.add_request(f"t{i}", [3 + i, 4, 5], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
    drive(engine, m, finals)
    stop.set()
    th.join()
    assert not errors
    assert value(parse(m)[1], "dsserve:generation_tokens_total") == 24


def test_spec_decode_counters_under_vllms_names():
    from dsserve.engine.stats import EngineStats

    stats = EngineStats.__new__(EngineStats)
    stats.__dict__.update({f: 0 for f in EngineStats.__dataclass_fields__ if f not in ("layout", "cfg")})
    stats.spec_accepted_per_pos = []
    stats.spec_counted(3, 2)
    stats.spec_counted(3, 0)
    pool = SimpleNamespace(num_blocks=10, num_used=0)
    eng = SimpleNamespace(
        scheduler=SimpleNamespace(running=[], waiting=[], requests={}),
        kv=SimpleNamespace(blocks=pool, slots=pool),
        stats=stats,
    )
    m = EngineMetrics(names="vllm")
    m.observe_step(eng)
    s = parse(m)[1]
    v = lambda name, **kw: s[(name, frozenset({"model_name": "tiny", "engine": "0", **kw}.items()))]  # noqa: E731
    assert v("vllm:spec_decode_num_drafts_total") == 2
    assert v("vllm:spec_decode_num_draft_tokens_total") == 6
    assert v("vllm:spec_decode_num_accepted_tokens_total") == 2
    assert [v("vllm:spec_decode_num_accepted_tokens_per_pos_total", position=str(i)) for i in (0, 1)] == [1, 1]
    assert value(s, "dsserve:spec_decode_mean_acceptance_length") == 2.0  # (2 blocks, 2 accepted): 1 + 2 / 2
