"""engine.warmup: the warm-up runs the shapes it promises, then leaves no trace in outputs, cache or counters."""

import pytest
import torch
from test_decoder_row_graphs import EagerCapture
from test_paged_engine import make_prompts

from dsserve import LLM, SamplingParams
from dsserve.engine.decoder_row_graphs import ROW_BUCKETS, DecoderRowGraphs
from dsserve.engine.encoder_graphs import EncoderGraphs
from dsserve.engine.step_graphs import bucket_sizes
from dsserve.engine.warmup import (
    attention_split_rows,
    batch_sizes,
    context_ladder,
    moe_run_rows,
    prefill_rows,
    router_split_rows,
    wanted,
    warm_up,
)
from dsserve.kernels import grouped_moe, moe_permute, router, sparse_attention
from dsserve.models.presets import preset

PARAMS = SamplingParams(temperature=0, max_tokens=5, logprobs=2, ignore_eos=True)
# the paged backend's fixed-shape decode steps, with the ops' torch references (the kernels: tests/kernels)
KW = dict(
    model="tiny",
    device="cpu",  # the references sync the host (masks), so no graph could capture them: the GPU test is below
    dtype="float32",
    attention_backend="paged",
    reference_ops="all",
    async_scheduling=True,
    max_num_seqs=3,
    max_num_batched_tokens=256,
    max_model_len=2100,
    swa_bounded_replay=True,
)


def _rounds():
    ps = make_prompts(preset("tiny"), seed=9)
    base = torch.randint(0, preset("tiny").vocab_size, (150,), generator=torch.Generator().manual_seed(9)).tolist()
    return [[base + [5, 6], ps[4], ps[1]], [base + [7], ps[3]]]  # the second round: a prefix hit on the first


def _serve(llm):
    outs = [o.outputs[0] for batch in _rounds() for o in llm.generate(batch, PARAMS, use_tqdm=False)]
    return [(c.token_ids, [sorted((k, v.logprob) for k, v in d.items()) for d in c.logprobs]) for c in outs]


def _warm_up_recording_prefills(eng):
    """warm_up(eng), and the (rows, prefix hit tokens) of every step it ran with a prompt's rows."""
    steps, execute = [], eng.runner.execute

    def recording(plan):
        if any(c.request.num_computed_tokens < c.request.num_prompt_tokens for c in plan.chunks):
            cs = plan.chunks
            steps.append((sum(c.num_tokens for c in cs), sum(c.request.num_cached_tokens for c in cs)))
        return execute(plan)

    eng.runner.execute = recording
    try:
        return warm_up(eng), steps
    finally:
        eng.runner.execute = execute


def test_batch_sizes():
    assert batch_sizes(64) == [1, 2, 4, 8, 16, 24, 32, 48, 64]
    assert batch_sizes(3) == [1, 2, 3]
    assert batch_sizes(1) == [1]


def test_context_ladder():
    assert context_ladder(40000, 1024) == [1024 * i for i in range(1, 9)] + [
        10240,
        12288,
        14336,
        16384,
        20480,
        24576,
        28672,
        32768,
    ]
    assert context_ladder(1000, 1024) == []


def test_prefill_rows():
    assert prefill_rows(8192, 1024) == [
        1,
        3,
        7,
        15,
        16,
        31,
        32,
        63,
        64,
        127,
        128,
        192,
        255,
        256,
        384,
        511,
        512,
        768,
        1023,
        1024,
        2047,
        4095,
        8191,
        8192,
    ]
    assert prefill_rows(8192, 0) == [1, 3, 7, 15, 31, 63, 127, 255, 511, 1023, 2047, 4095, 8191, 8192]
    assert prefill_rows(100, 64) == [1, 3, 7, 15, 16, 31, 32, 63, 64, 100]
    assert prefill_rows(100, 0, (38, 66, 120)) == [1, 3, 7, 15, 31, 38, 63, 66, 100]


@pytest.mark.parametrize("model", ["proxy-h200-release", "tiny"])
def test_row_ladder_runs_every_split_k_variant_of_the_attention(model):
    """Below the prefill kernel's rows the attention's split-K constexprs follow from the row count: every variant
    that 1-127 rows take (on the H200's fill), for layers with selected entries and window-only ones, is one that a
    row of the ladder takes; without the split rows the release proxy's 38-52 and 66-87 rows (compiled in traffic on
    a bare machine) are missed."""
    cfg = preset(model)
    tiles = dict(sparse_attention._tiles(1, cfg.num_attention_heads, cfg.head_dim), fill=sparse_attention._FILL)

    def variants(rows, k):
        return {
            sparse_attention.split_plan(t, cfg.num_attention_heads, cfg.sliding_window, k, tiles)
            for t in rows
            if t < sparse_attention.prefill.PREFILL_MIN_ROWS
        }

    ladder = prefill_rows(8192, 1024, attention_split_rows(cfg))
    for k in (cfg.index_topk, 0):
        assert variants(range(1, 8192), k) == variants(ladder, k)
    if model == "proxy-h200-release":
        k = cfg.index_topk
        assert variants(range(1, 8192), k) - variants(prefill_rows(8192, 1024), k) == variants([38, 66], k)


@pytest.mark.parametrize("model", ["proxy-h200-release", "tiny"])
@pytest.mark.parametrize("sms", [132, 1])
def test_row_ladder_runs_every_launch_variant_of_the_router(model, sms):
    """The router's tiles and split of d follow from the row count and the SM count: every variant of 1-8192 rows
    is one that a row of the ladder takes; without the router's rows the release proxy on an H200's 132 SMs misses
    7 of them, among them SPLIT=6 (1153-1408 rows), which a bare machine's traffic compiled."""
    cfg = preset(model)

    def variants(rows):
        return {tuple(sorted(router._plan(t, cfg.n_routed_experts, cfg.hidden_size, sms, {})[0].items())) for t in rows}

    others = attention_split_rows(cfg)
    ladder = prefill_rows(8192, 1024, others + router_split_rows(cfg, sms, 8192))
    assert variants(range(1, 8193)) == variants(ladder)
    assert max(router_split_rows(cfg, sms, 100)) <= 100
    if model == "proxy-h200-release" and sms == 132:
        missed = variants(range(1, 8193)) - variants(prefill_rows(8192, 1024, others))
        assert missed == variants([513, 577, 833, 1025, 1153, 1409, 2113])
        assert router._plan(1153, cfg.n_routed_experts, cfg.hidden_size, sms, {})[0]["SPLIT"] == 6


@pytest.mark.parametrize("model", ["proxy-h200-release", "tiny"])
def test_row_ladder_runs_every_launch_variant_of_the_expert_run(model):
    """The expert-run kernel's sizes and its tile rows BM follow from the token count (up to the kernel's 1024
    pairs), with packed MXFP4 tiles or not: every variant is one a row of the ladder takes; without the MoE's rows
    the release proxy misses 2 tokens and 129-170 (BM 32, TMAX 32: most likely the one a bare machine's replay-off
    traffic compiled)."""
    cfg = preset(model)
    k, e = cfg.num_experts_per_tok, cfg.n_routed_experts

    def variants(rows):
        out = set()
        for t in rows:
            if t * k <= moe_permute.MAX_KERNEL_PAIRS:
                for packed in (False, True):
                    bm = grouped_moe._config(t * k, e, cfg.hidden_size, cfg.moe_intermediate_size, {}, scaled=packed)[
                        "BM"
                    ]
                    out.add(tuple(sorted(moe_permute.run_constexprs(t * k, e, bm).items())))
        return out

    others = attention_split_rows(cfg) + router_split_rows(cfg, 132, 8192)
    assert variants(range(1, 8193)) == variants(prefill_rows(8192, 1024, others + moe_run_rows(cfg)))
    if model == "proxy-h200-release":
        missed = variants(range(1, 8193)) - variants(prefill_rows(8192, 1024, others))
        assert missed == variants([2, 129]) and len(missed) == 2
        assert dict(next(iter(variants([129]))))["TMAX"] == 32


def test_wanted():
    assert wanted(None, torch.device("cuda")) and not wanted(None, torch.device("cpu"))
    assert wanted(True, torch.device("cpu")) and not wanted(False, torch.device("cuda"))


def _row_graphs(eng, capture) -> None:
    """Bounded replay's row graphs on the CPU engine (which has none), with the decode graphs' context buckets as on
    a GPU: fixed shapes, run eagerly (capture None) or through EagerCapture (a capture's masked runs, replays)."""
    eng.runner.decoder_row_graphs, eng.runner.encoder_graphs = (
        cls(eng.model, eng.kv, 128, 3, capture, min_context=1024, row_buckets=(16, 32, 64, 128))
        for cls in (DecoderRowGraphs, EncoderGraphs)
    )


def test_warm_up_runs_every_bucket_and_hits_then_leaves_no_trace():
    cold, warm = LLM(**KW), LLM(**KW)
    eng = warm.engine
    _row_graphs(cold.engine, None)
    _row_graphs(eng, EagerCapture())
    report, steps = _warm_up_recording_prefills(eng)
    ladder = prefill_rows(
        256, 128, attention_split_rows(eng.cfg) + router_split_rows(eng.cfg, 1, 256) + moe_run_rows(eng.cfg)
    )
    assert 65 in ladder  # the router's first split-K row count on one SM
    assert report.requests == 3 + 2 * (1 + 2 + 3) + 1 + len(ladder) and report.prefix_hit_tokens > 0
    assert min(report.round_seconds) > 0 and sum(report.round_seconds) == pytest.approx(report.seconds)
    assert report.capture_seconds == 0  # the CPU captures nothing
    # the row ladder: a prefill step of each row count, alone; past the replay window (32) a prefix hit
    assert all((r, 0) in steps for r in ladder if r <= 32) and all(
        any(rows == r and hit > 0 for rows, hit in steps) for r in ladder if r > 32
    ), steps
    # the fixed-shape decode steps of every batch bucket at every context bucket were built (on a GPU: their graphs
    # captured), those of 2 and 3 rows at 2048 from the ladder's lone sequence
    assert set(eng.runner.decode_graphs.report()["fixed_shape_steps"]) == {
        (b, c) for b in (1, 2, 3) for c in (1024, 2048)
    }
    assert not eng.runner.decode_graphs.ahead_rows  # for the warm-up only
    # the row graphs at every context the ladder reached: the decoder's every row bucket, the encoder's from a
    # hit's rows up (the replayed window of 32 plus 61 new rows: 128)
    dec, enc = (
        set(g.report()["fixed_shape_steps"]) for g in (eng.runner.decoder_row_graphs, eng.runner.encoder_graphs)
    )
    contexts = {c for _, c in dec}
    assert contexts == {1024, 2048} and dec == {(r, c) for r in (16, 32, 64, 128) for c in contexts}
    assert {(128, c) for c in contexts} <= enc, enc
    assert not eng.runner.decoder_row_graphs.ahead_rows and not eng.runner.encoder_graphs.ahead_rows
    # nothing left: no request, every block and window slot free, every counter zero
    assert not eng.has_unfinished_requests() and not eng.scheduler.requests
    assert eng.kv.blocks.num_used == 0 and eng.kv.slots.num_used == 0
    assert eng.stats.steps == 0 and eng.stats.prefix_query_tokens == 0 and eng.stats.prefill_rows == 0
    assert eng.runner.graph_steps == 0 and eng.runner.decode_graphs.report()["replays"] == 0
    # and the same traffic afterwards gives the same tokens, logprobs and counts as on an engine never warmed
    assert _serve(warm) == _serve(cold)
    a, b = ({k: v for k, v in llm.engine.stats.as_dict().items() if not k.endswith("_seconds")} for llm in (warm, cold))
    assert a == b and a["prefix_hit_tokens"] > 0  # the warm-up's salted blocks gave no user prompt a hit


def test_row_ladder_without_replay_runs_hits_of_every_row_count():
    kw = {**KW, "swa_bounded_replay": False, "max_num_seqs": 1, "max_model_len": 1100, "max_num_batched_tokens": 128}
    _, steps = _warm_up_recording_prefills(LLM(**kw).engine)
    assert all(
        any(rows == r and hit > 0 for rows, hit in steps)
        for r in prefill_rows(128, 0, attention_split_rows(preset("tiny")))
    ), steps


def test_warmup_option_and_busy_engine():
    llm = LLM(**KW, warmup=True)  # LLM(warmup=True) warms up in its constructor
    assert {b for b, _ in llm.engine.runner.decode_graphs.report()["fixed_shape_steps"]} == {1, 2, 3}
    assert llm.engine.stats.steps == 0
    llm.engine.add_request("busy", [1, 2, 3], PARAMS)
    with pytest.raises(RuntimeError, match="idle engine"):
        warm_up(llm.engine)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_warm_up_captures_graphs_on_gpu():
    """On a GPU the warm-up captures the graphs of its shapes (decode steps, decoder and encoder rows), and traffic
    after it gives the same tokens and logprobs, bit for bit, as on an engine that captures on first use."""
    kw = dict(
        model="tiny", dtype="float32", device="cuda", max_num_seqs=3, max_num_batched_tokens=256, max_model_len=2100
    )
    cold, warm = LLM(**kw), LLM(**kw)
    report = warm_up(warm.engine)
    eng = warm.engine
    assert report.graph_captures > 0 and report.nonfinite_logit_rows == 0
    assert 0 < report.capture_seconds < report.seconds
    assert eng.stats.graph_captures == report.graph_captures  # counted though the other counts were zeroed
    assert eng.runner.decoder_row_graphs.report()["graphs"] and eng.runner.encoder_graphs.report()["graphs"]
    # the decoder rows' graphs of every row bucket at both contexts (1024, 2048), most captured ahead
    dec = set(eng.runner.decoder_row_graphs.report()["graphs"])
    assert dec == {(r, c) for r in bucket_sizes(256, ROW_BUCKETS) for c in (1024, 2048)}
    assert _serve(warm) == _serve(cold)
