"""Fixed-shape decode steps (the form CUDA graphs capture) against the reference forward.

On the CPU the fixed-shape step runs eagerly: padded batch buckets, block tables and index scores sized by the
context bucket, the compressor's carry in device buffers, host bookkeeping after the step. With every op on its
torch reference in fp64 it must equal the oracle exactly. On a GPU, graph replay must equal the same fixed-shape
step run eagerly, bit for bit, and the engine's greedy tokens must agree with the oracle.
"""

import pytest
import torch
from test_paged_attention import _engine, _greedy_agrees_with_oracle, _tiny
from test_paged_engine import make_prompts

from dsserve.engine.decode_graphs import DecodeGraphs, batch_bucket, context_bucket
from dsserve.engine.graph_capture import GraphCapture
from dsserve.engine.greedy import greedy_generate
from dsserve.kernels.ops import OPS, KernelOps


def test_buckets():
    assert [batch_bucket(b, 64) for b in (1, 3, 8, 9, 33, 64)] == [1, 4, 8, 16, 48, 64]
    assert batch_bucket(5, 6) == 6  # the engine's max_num_seqs is the last bucket
    assert [context_bucket(n, 1024) for n in (1, 1024, 1025, 3000, 8192, 8193, 16385, 131073)] == [
        1024,
        1024,
        2048,
        3072,
        8192,
        10240,
        20480,
        163840,
    ]


def _graphs(capture, made, min_context=128, ahead_rows=False, **kw):
    def make(kv):
        g = DecodeGraphs(
            model, kv, max_batch=8, capture=GraphCapture() if capture else None, min_context=min_context, **kw
        )  # 5 rows pad to 8
        g.ahead_rows = ahead_rows
        made.append(g)
        return g

    return make


def _fixed_shape_vs_oracle(m, prompt_ids, chunk=7, min_context=128, ahead_rows=False, **kw) -> dict:
    """The engine (fp64, references, fixed-shape decode steps run eagerly) on make_prompts' ``prompt_ids``, 24 tokens
    each: its greedy tokens and logits equal the oracle's; returns the DecodeGraphs report."""
    global model
    model = m
    prompts = [make_prompts(m.cfg, seed=1)[i] for i in prompt_ids]
    conts = [greedy_generate(m, p, 24, bounded_replay=False) for p in prompts]
    with torch.no_grad():
        ref = [m.reference_logits(torch.tensor(p + c[:-1]))[len(p) - 1 :] for p, c in zip(prompts, conts)]
    made = []
    reqs, _, logits = _engine(
        m,
        prompts,
        chunk,
        KernelOps(frozenset(OPS)),
        torch.float64,
        "cpu",
        24,
        decode_graphs=_graphs(False, made, min_context=min_context, ahead_rows=ahead_rows),
        **kw,
    )
    assert [r.output_token_ids for r in reqs] == conts
    assert max(float((g - r).abs().max()) for g, r in zip(logits, ref)) < 1e-9
    return made[0].report()


def test_fixed_shape_decode_is_exact(tiny_models):
    """Ragged prompts (mixed steps fall back to the eager path) and decode steps of several batch buckets, some
    padded, whose positions cross two context buckets (odd and even positions: the compressor's carry): fp64 logits
    equal the oracle's. With ``ahead_rows`` (the warm-up's), as here, a step also builds the larger batch buckets
    at its context from its own rows (writes masked); later steps of more rows run in them, refilled."""
    rep = _fixed_shape_vs_oracle(tiny_models["tiny"], (11, 3, 9, 0, 6), ahead_rows=True)
    # the first step at context 128 had 4 rows, at 256 one row: every larger bucket was built then. Without
    # ahead_rows this run takes (4, 128), (8, 128), (1, 256), (2, 256), (4, 256): so (8, 128), (2, 256) and
    # (4, 256) ran steps in batches built from fewer rows
    assert set(rep["fixed_shape_steps"]) == {(4, 128), (8, 128), (1, 256), (2, 256), (4, 256), (8, 256)}
    assert rep["padded_rows"] > 0
    assert rep["fallbacks"]["not a decode step"] > 0


@pytest.mark.parametrize("where", ["window in blocks", "host Engram tables"])
def test_fixed_shape_decode_exact_mode_and_host_tables(where):
    """Exact-mode prefix caching (window rows in the blocks, no ring) and Engram tables in host memory (rows
    prefetched into the step's buffers): still the oracle's logits."""
    global model
    model = m = _tiny(torch.float64)
    prompts = [make_prompts(m.cfg, seed=4)[i] for i in (3, 9, 0)]
    conts = [greedy_generate(m, p, 12, bounded_replay=False) for p in prompts]
    with torch.no_grad():
        ref = [m.reference_logits(torch.tensor(p + c[:-1]))[len(p) - 1 :] for p, c in zip(prompts, conts)]
    if where == "host Engram tables":
        for b in m.layers:
            if b.engram is not None:
                b.engram.move_table_to_host("float")
    made = []
    reqs, _, logits = _engine(
        m,
        prompts,
        0,
        KernelOps(frozenset(OPS)),
        torch.float64,
        "cpu",
        12,
        decode_graphs=_graphs(False, made),
        window_in_blocks=where == "window in blocks",
    )
    assert [r.output_token_ids for r in reqs] == conts
    assert max(float((g - r).abs().max()) for g, r in zip(logits, ref)) < 1e-9
    assert made[0].report()["fixed_shape_steps"]


def test_unpinned_host_tables_send_decode_steps_to_the_eager_path():
    """On a GPU a decode step reads host Engram tables in place, which needs them pinned; when registration failed,
    every decode step falls back (named) instead of capturing a graph that would have to wait for the host."""
    from dsserve.engine.scheduler import StepPlan
    from dsserve.kv.paged import KVLayout, PagedKVCache

    m = _tiny(torch.float32)
    for b in m.layers:
        if b.engram is not None:
            b.engram.move_table_to_host("fp8")
            b.engram.table.memory.pinned = False  # as when cudaHostRegister fails
    m.kernel_ops = KernelOps(frozenset(OPS))
    layout = KVLayout.build(m.cfg, None, "auto", torch.float32)
    kv = PagedKVCache(layout, 8, 2, torch.float32)
    assert DecodeGraphs(m, kv, 2, None)._unfit(StepPlan([], [])) != "Engram tables in unpinned host memory"
    kv.device = torch.device("cuda")  # the check only; nothing runs
    assert DecodeGraphs(m, kv, 2, None)._unfit(StepPlan([], [])) == "Engram tables in unpinned host memory"


def test_paged_kernels_interpreted_eager_prefill_then_fixed_shape_decode():
    """The paged path's kernels on the interpreter: a 40-token prompt (past the 32-row window, 20 ratio-2 entries >
    top-16) prefilled eagerly, then decode steps padded to 2 rows (masked stores, index scores over the context
    bucket). The interpreter runs a program at a time, so this is kept small; the row-wise ops (router, MoE, mHC)
    run their references to keep CI inside its budget (their kernels: tests/models/test_rowwise_ops.py). fp32
    tokens equal the oracle's here."""
    global model
    model = m = _tiny(torch.float32)
    p = make_prompts(m.cfg, seed=3)[14]
    made = []
    reqs, _, _ = _engine(
        m,
        [p],
        0,
        KernelOps(frozenset({"router", "moe", "mhc"})),
        torch.float32,
        "cpu",
        2,
        decode_graphs=_graphs(False, made, batch_buckets=(2,)),
    )
    assert reqs[0].output_token_ids == greedy_generate(m, p, 2, bounded_replay=False)
    assert made[0].report()["padded_rows"] > 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_graph_replay_equals_the_fixed_shape_step_on_gpu():
    """CUDA graphs captured per bucket and replayed give the same logits, bit for bit, as the same fixed-shape
    steps run eagerly; and the engine's greedy tokens with graphs agree with the oracle (as in test_paged_attention:
    every choice whose top-2 margin clears the rounding noise)."""
    global model
    runs = {}
    # (True, True): graphs of larger batches captured ahead from a step's fewer rows (the warm-up's way) replay the
    # same: a graph depends on its buffers' shapes, not on the rows it was captured from
    for capture, ahead in ((False, False), (True, False), (True, True)):
        model = m = _tiny(torch.float32, "cuda")
        prompts = [make_prompts(m.cfg, seed=3)[i] for i in (11, 3, 9, 0, 6)]
        made = []
        reqs, _, logits = _engine(
            m,
            prompts,
            7,
            KernelOps(),
            torch.float32,
            "cuda",
            24,
            decode_graphs=_graphs(capture, made, ahead_rows=ahead),
        )
        runs[capture, ahead] = [r.output_token_ids for r in reqs], logits, made[0].report()
    eager = runs[False, False]
    for key in ((True, False), (True, True)):
        assert runs[key][0] == eager[0]
        assert all(torch.equal(a, b) for a, b in zip(runs[key][1], eager[1])), key
        assert runs[key][2]["replays"] > 0
    assert runs[True, False][2]["graphs"] == eager[2]["fixed_shape_steps"]
    assert set(runs[True, True][2]["graphs"]) > set(eager[2]["fixed_shape_steps"])
    made = []
    model = _tiny(torch.float32, "cuda")
    _greedy_agrees_with_oracle("cuda", range(16), 10, 0, KernelOps(), model=model, decode_graphs=_graphs(True, made))
    assert made[0].report()["replays"] > 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("capture", [False, True])
def test_mhc_mixes_on_a_side_stream_on_gpu(monkeypatch, capture):
    """A decode step's mHC mixes on the side stream (models.block, a few rows): the same logits, bit for bit, as the
    same kernels queued on one stream (the side stream replaced by the current one), eagerly and in graph replay.
    (Against the fused site the sublayer input differs in its norm's sum order, which a tiny random model's
    routing can amplify: the collapse kernel is checked against its reference in tests/kernels.)"""
    import dsserve.models.block as B

    global model
    monkeypatch.setattr(B, "MHC_SIDE_STREAM_MAX_ROWS", 64)
    real = B.side_stream

    def one_stream(x, rows):
        return torch.cuda.current_stream(x.device) if real(x, rows) is not None else None

    runs = {}
    for single in (True, False):
        monkeypatch.setattr(B, "side_stream", one_stream if single else real)
        model = m = _tiny(torch.float32, "cuda")
        prompts = [make_prompts(m.cfg, seed=3)[i] for i in (11, 3, 9)]
        made = []
        reqs, _, logits = _engine(
            m, prompts, 7, KernelOps(), torch.float32, "cuda", 12, decode_graphs=_graphs(capture, made)
        )
        runs[single] = [r.output_token_ids for r in reqs], logits, made[0].report()["replays"]
    assert runs[False][0] == runs[True][0]
    assert all(torch.equal(a, b) for a, b in zip(runs[False][1], runs[True][1]))
    assert (runs[False][2] > 0) == capture


def test_fixed_shape_decode_after_prefix_hits_with_and_without_bounded_replay():
    """The engine's defaults: prefix hits, bounded replay (a hit resumes at the replay floor; the compressor skips
    the cached entries) and exact mode: decode steps in fixed shapes give the reference path's tokens and
    logprobs, fp64."""
    from dsserve import LLM, SamplingParams
    from dsserve.models.presets import preset

    base = make_prompts(preset("tiny"), seed=4)[11][:100]
    prompts = [base + [7, 8, 9], base + [10, 11]]
    params = SamplingParams(temperature=0, max_tokens=9, logprobs=2)
    for replay in (True, False):
        outs = []
        for backend in ("reference", "paged"):
            llm = LLM(
                model="tiny",
                dtype="float64",
                device="cpu",
                attention_backend=backend,
                reference_ops="all",
                swa_bounded_replay=replay,
                max_num_batched_tokens=64,
            )
            eng = llm.engine
            if backend == "paged":
                eng.runner.decode_graphs = DecodeGraphs(eng.model, eng.kv, 4, capture=None, min_context=128)
            got = [o.outputs[0] for p in prompts for o in llm.generate([p], params)]
            outs.append([(c.token_ids, [sorted(d.items()) for d in c.logprobs]) for c in got])
            assert eng.stats.as_dict()["prefix_hit_tokens"] > 0
        assert eng.stats.graph_steps >= 2 * 8  # every decode step of both requests ran in fixed shapes
        for (tok_a, lp_a), (tok_b, lp_b) in zip(*outs):
            assert tok_a == tok_b
            for da, db in zip(lp_a, lp_b):
                assert [k for k, _ in da] == [k for k, _ in db]
                assert all(abs(a.logprob - b.logprob) < 1e-9 for (_, a), (_, b) in zip(da, db))


@pytest.mark.parametrize("window_in_blocks", [False, True])
def test_v4_fixed_shape_decode_is_exact(tiny_models, window_in_blocks):
    """V4 (tiny-v4): its compressors pool from the cache's rings in fixed-shape steps (ratio 4 overlapping the group
    before, ratio 128 completing an entry inside them: a 120-token prompt decodes past 128); steps beside prefill
    chunks run eagerly, reading the rings back. fp64 logits equal the oracle's, ring and window-in-blocks alike."""
    rep = _fixed_shape_vs_oracle(
        tiny_models["tiny-v4"], (11, 5, 13, 3, 0), min_context=256, window_in_blocks=window_in_blocks
    )
    assert rep["fixed_shape_steps"] and rep["padded_rows"] > 0 and rep["fallbacks"]["not a decode step"] > 0


def test_v4_engine_fixed_shape_steps_between_eager_ones():
    """The engine on tiny-v4 (fp64, paged, fixed-shape decode steps run eagerly on the CPU): a 2-token prompt decodes
    alone (its first ratio-4 group completes inside a fixed-shape step: the empty group before it masked), a
    120-token prompt arrives (its chunks make mixed eager steps, which read the first one's rings back) and decodes
    past position 128 beside it, then a third arrives. Every request's greedy tokens equal the oracle's."""
    from dsserve.engine.args import EngineArgs
    from dsserve.engine.core import EngineCore
    from dsserve.engine.sampling_params import SamplingParams

    core = EngineCore(
        EngineArgs(
            model="tiny-v4",
            dtype="float64",
            device="cpu",
            attention_backend="paged",
            max_num_seqs=4,
            max_num_batched_tokens=32,
            async_scheduling=True,
            kv_cache_memory=64 << 20,
            reference_ops="all",
        )
    )
    prompts = [[9, 4], [5 + (7 * j) % 900 for j in range(120)], [11 + (3 * j) % 700 for j in range(40)]]
    n_out = [30, 14, 6]
    got, seen = {}, {}
    core.add_request("0", prompts[0], SamplingParams(temperature=0, max_tokens=n_out[0], ignore_eos=True))
    while core.has_unfinished_requests():
        for out in core.step():
            seen[out.request_id] = len(out.outputs[0].token_ids)
            if out.finished:
                got[out.request_id] = list(out.outputs[0].token_ids)
        for i, (after, n) in enumerate((("0", 4), ("1", 3)), start=1):
            if str(i) not in seen and seen.get(after, 0) >= n:
                core.add_request(
                    str(i), prompts[i], SamplingParams(temperature=0, max_tokens=n_out[i], ignore_eos=True)
                )
                seen[str(i)] = 0
    want = {
        str(i): greedy_generate(core.model, p, n, bounded_replay=False) for i, (p, n) in enumerate(zip(prompts, n_out))
    }
    assert got == want
    rep = core.runner.decode_graphs.report()
    assert rep["fixed_shape_steps"] and rep["fallbacks"]["not a decode step"] > 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_v4_graph_replay_equals_the_fixed_shape_step_on_gpu():
    """tiny-v4 in bf16 on the kernels (raw bf16 rows): graph replay gives the fixed-shape eager steps' logits bit for
    bit (ring writes, masked window and entry stores inside the graph)."""
    global model
    runs = {}
    for capture in (False, True):
        model = m = _tiny(torch.bfloat16, "cuda", name="tiny-v4")
        prompts = [make_prompts(m.cfg, seed=1)[i] for i in (11, 5, 13, 3, 0)]
        made = []
        reqs, _, logits = _engine(
            m,
            prompts,
            7,
            KernelOps(),
            torch.bfloat16,
            "cuda",
            24,
            decode_graphs=_graphs(capture, made, min_context=256),
        )
        runs[capture] = [r.output_token_ids for r in reqs], logits, made[0].report()
    assert runs[True][0] == runs[False][0]
    assert all(torch.equal(a, b) for a, b in zip(runs[True][1], runs[False][1]))
    assert runs[True][2]["replays"] > 0 and runs[True][2]["graphs"] == runs[False][2]["fixed_shape_steps"]
