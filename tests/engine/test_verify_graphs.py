"""Speculative verify steps in fixed shapes (the form their CUDA graphs capture) against the eager verify step.

fp64, every op on its torch reference: the same requests with the same drafts (the oracle drafter of
test_spec_decode: every acceptance length, every rollback depth, so chunks of 1 + K and 2 + K rows) give the eager
verify step's tokens and logprobs, with every cache kind checked after every step, and drafts off's greedy tokens.
The Triton kernels on fixed shapes run under the interpreter in test_decode_graphs; captured graphs on a GPU only.
"""

import pytest
import torch
from test_decoder_row_graphs import EagerCapture
from test_no_host_sync import no_sync
from test_spec_decode import GREEDY, engine, ids, oracle, prompts, run

from dsserve.engine.graph_capture import GraphCapture
from dsserve.engine.sampling_params import SamplingParams
from dsserve.engine.step_graphs import batch_bucket
from dsserve.engine.verify_graphs import VerifyGraphs, verify_max_seqs, verify_row_buckets

K = 3
PAGED = dict(attention_backend="paged", reference_ops="all", long_prefill_token_threshold=16)
TASKS = ("arithmetic", "chat", "arithmetic")
PARAMS = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=2)


def fixed_shape(eng, capture=None, ahead_rows=False) -> VerifyGraphs:
    g = VerifyGraphs(eng.model, eng.kv, eng.scheduler.config.max_num_seqs, eng.drafter.k, capture, min_context=128)
    g.ahead_rows = ahead_rows
    eng.runner.verify_graphs = g
    return g


def logprob_rows(out: dict) -> dict:
    return {k: [sorted((t, lp.logprob) for t, lp in d.items()) for d in v.logprobs] for k, v in out.items()}


def assert_same(a: dict, b: dict, tol: float = 1e-9) -> None:
    assert ids(a) == ids(b)
    la, lb = logprob_rows(a), logprob_rows(b)
    for k in la:
        for ra, rb in zip(la[k], lb[k]):
            assert [t for t, _ in ra] == [t for t, _ in rb]
            assert max(abs(x - y) for (_, x), (_, y) in zip(ra, rb)) < tol


@pytest.fixture(scope="module")
def reference():
    """Drafts off (the oracle's continuation) and the eager verify step's outputs with the oracle's drafts."""
    off = run(engine(None, **PAGED), prompts(), PARAMS, check=False)
    eager = engine(K, **PAGED)
    oracle(eager, off, K)
    return off, run(eager, prompts(), PARAMS)


def test_row_buckets():
    assert verify_row_buckets(4, 3) == (4, 5, 8, 10, 16, 20)
    assert verify_row_buckets(32, 5)[-1] == 32 * 7
    assert verify_max_seqs(256, 5) == 73 and verify_row_buckets(73, 5)[-1] == 511  # at most 512 rows
    assert verify_max_seqs(4, 5) == 4 and verify_max_seqs(256, 5, max_rows=4) == 1


def test_fixed_shape_verify_steps_are_exact(reference):
    """Every acceptance length and rollback depth: the fixed-shape verify steps (padded rows, several row buckets,
    chunks of 1 + K and 2 + K rows, plain decodes) give the eager verify step's tokens and logprobs and drafts off's
    greedy tokens; the caches hold exactly the committed rows after every step."""
    off, eager = reference
    eng = engine(K, **PAGED)
    oracle(eng, off, K)
    g = fixed_shape(eng)
    got = run(eng, prompts(), PARAMS)
    assert_same(got, eager)
    assert ids(got) == ids(off)
    rep = g.report()
    assert rep["runs"] == eng.stats.verify_graph_steps > 0 and rep["padded_rows"] > 0
    rows = {r for r, _ in rep["fixed_shape_steps"]}
    assert rows & {4 * (K + 1)} and rows & {b * (K + 2) for b in (1, 2, 4)}, rows  # 1 + K and 2 + K a request
    assert set(rep["fallbacks"]) <= {"not a verify step (a prefill chunk)"}  # the prompts' chunks
    st = eng.stats
    assert 0 < st.spec_num_accepted_tokens < st.spec_num_draft_tokens and st.spec_accepted_per_pos[K - 1] > 0


@pytest.mark.parametrize("kw", [dict(swa_bounded_replay=False), dict(engram_tables="host")], ids=["exact", "host"])
def test_exact_mode_and_host_engram_tables(reference, kw):
    """Prefix caching without bounded replay keeps the window in the blocks by position (no ring to restore);
    Engram tables in host memory give the step their rows prefetched (bf16) into the graph's buffers: the fixed-shape
    verify steps give the eager verify step's tokens and logprobs in both."""
    off, _ = reference
    kw = dict(PAGED, **kw)
    eager = engine(K, **kw)
    oracle(eager, off, K)
    want = run(eager, prompts(), PARAMS)
    eng = engine(K, **kw)
    assert eng.kv.layout.window_in_blocks is ("swa_bounded_replay" in kw)
    assert (eng.model.layers[1].engram.table is not None) is ("engram_tables" in kw)
    oracle(eng, off, K)
    g = fixed_shape(eng)
    assert_same(run(eng, prompts(), PARAMS), want)
    assert g.report()["runs"] > 0


def recorded_proposals(eng) -> list:
    """Every proposal the drafter makes, in order: (request id, position, drafts)."""
    real, seen = eng.drafter.hand_out, []

    def hand_out(sampled, proposal, host):
        real(sampled, proposal, host)
        seen.extend((r.request_id, r.num_tokens, list(r.draft_token_ids)) for r in sampled if not r.status.finished)

    eng.drafter.hand_out = hand_out
    return seen


def test_dspark_drafts_fixed_shape_greedy_equals_drafts_off(reference):
    """The model's own DSpark stages (random weights: near-zero acceptance) proposing from rings fed by the
    fixed-shape steps' taps: the same proposals as from the eager steps' taps, and drafts off's greedy tokens."""
    off, _ = reference
    eager = engine(K, **PAGED)
    want = recorded_proposals(eager)
    run(eager, prompts(), GREEDY, check=False)
    eng = engine(K, **PAGED, async_scheduling=True)  # the engine's own: fixed shapes on the CPU, no capture
    g = eng.runner.verify_graphs
    assert g is not None and g.capture is None and not eng.async_scheduling  # steps with drafts are synchronous
    got = recorded_proposals(eng)
    assert ids(run(eng, prompts(), GREEDY)) == ids(off)
    assert g.report()["runs"] > 0 and eng.stats.spec_num_drafts > 0
    assert got == want and sum(len(d) == K for _, _, d in got) > 3


def test_buckets_built_ahead_with_masked_capture_runs(reference):
    """With ``ahead_rows`` (the warm-up's) a step also builds, and runs the masked capture runs of (EagerCapture),
    the larger row buckets at its context: the outputs stay the eager verify step's (the masked runs wrote nothing),
    and later steps replay them."""
    off, eager = reference
    eng = engine(K, **PAGED)
    oracle(eng, off, K)
    capture = EagerCapture()
    g = fixed_shape(eng, capture, ahead_rows=True)
    assert_same(run(eng, prompts(), PARAMS), eager)
    rep = g.report()
    assert rep["graphs"] == rep["fixed_shape_steps"] and rep["replays"] == rep["runs"] > 0
    rows = {r for r, _ in rep["fixed_shape_steps"]}
    assert len(rows) > 1 and rows == {r for r in verify_row_buckets(4, K) if r >= min(rows)}
    assert capture.released == len(capture.whats) and len(capture.shared) == 1


def test_steps_it_cannot_take_fall_back(reference):
    """The reference attention backend never reaches it (not the paged path); a bucket list too small for the
    step runs it eagerly, counted; the outputs stay the eager path's."""
    off, eager = reference
    eng = engine(K, **PAGED)
    oracle(eng, off, K)
    g = VerifyGraphs(eng.model, eng.kv, 2, K, None, min_context=128)  # two requests a step at most: here three
    eng.runner.verify_graphs = g
    assert_same(run(eng, prompts(), PARAMS), eager)
    rep = g.report()
    assert rep["fallbacks"]["batch size outside the buckets"] > 0
    ref_eng = engine(K, long_prefill_token_threshold=16)
    g = VerifyGraphs(ref_eng.model, ref_eng.kv, 4, K, None, min_context=128)
    ref_eng.runner.verify_graphs = g
    assert ids(run(ref_eng, prompts(), GREEDY, check=False)) == ids(off)
    assert g.report()["runs"] == 0 and g.report()["fallbacks"]["not the paged batched path"] > 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_verify_graphs_on_gpu():
    """On a GPU the engine captures verify graphs by default: replaying them gives the same tokens and logprobs, bit
    for bit, as the same fixed-shape forward run eagerly (no capture), and drafts off's greedy tokens wherever the
    eager engine's top-2 margin clears fp32 noise. The built-in trained model on its own tasks: its choices have real
    margins (a random tiny model's fp32 logits are near-ties at most steps, which leaves the last check vacuous)."""
    from dsserve.train.tasks import problem, prompt_ids

    kw = dict(model="tiny-trained", dtype="float32", device="cuda", long_prefill_token_threshold=16)
    off_eng = engine(None, enforce_eager=True, **kw)
    ps = [prompt_ids(off_eng.tokenizer, problem(task, "eval", i).prompt) for i, task in enumerate(TASKS)]
    off = run(off_eng, ps, PARAMS, check=False)
    graphed = engine(K, **kw)
    g = graphed.runner.verify_graphs
    assert g is not None and isinstance(g.capture, GraphCapture)
    oracle(graphed, off, K)
    got = run(graphed, ps, PARAMS)
    rep = g.report()
    assert rep["replays"] > 0 and rep["graphs"]
    fixed = engine(K, **kw)
    oracle(fixed, off, K)
    g0 = VerifyGraphs(fixed.model, fixed.kv, fixed.scheduler.config.max_num_seqs, K, None, min_context=g.min_context)
    fixed.runner.verify_graphs = g0
    assert logprob_rows(run(fixed, ps, PARAMS)) == logprob_rows(got)
    checked = 0
    for k, lps in logprob_rows(off).items():
        for a, b, row in zip(ids(got)[k], ids(off)[k], lps):
            top = sorted((v for _, v in row), reverse=True)
            if top[0] - top[1] < 0.05:
                break
            assert a == b
            checked += 1
    assert checked >= sum(len(v) for v in ids(off).values()) // 2


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_verify_graph_step_makes_no_host_sync():
    """A verify step replayed from a CUDA graph: building its rows on the host (Engram row ids hashed there and
    uploaded), refilling the buffers, the replay, copying logits and taps out, the host's counts; then the drafting
    step up to the host's one read (the rejection sampler's verdict, the rings' ingestion, the proposal's inputs,
    the proposal replayed from its graph) and after it (the rejected rows dropped, the cache rolled back): nothing
    waits for the device (torch's sync debug mode raises on any such wait). The first run of a bucket pair captures
    (and synchronises): unguarded; so is a proposal bucket's first (its capture)."""
    eng = engine(K, dtype="bfloat16", device="cuda", long_prefill_token_threshold=16)
    graphs = eng.runner.verify_graphs
    run_step, guarded = graphs.run, []

    def step_no_sync(plan, key):
        if key not in graphs._steps:
            return run_step(plan, key)
        return no_sync(run_step, guarded)(plan, key)

    graphs.run = step_no_sync
    drafting, d = [], eng.drafter
    eng.rejection_sampler.decide = no_sync(eng.rejection_sampler.decide, drafting)
    d.ingest, d.inputs, d.settle = (no_sync(f, drafting) for f in (d.ingest, d.inputs, d.settle))
    propose, propose_guarded = d.propose, no_sync(d.propose, drafting)

    def propose_no_sync(requests, *a):  # a bucket's first proposal captures its graph (and synchronises): unguarded
        b = batch_bucket(len(requests), d.graphs.max_seqs, d.graphs.buckets)
        return (propose_guarded if b in d.graphs._graphs else propose)(requests, *a)

    d.propose = propose_no_sync
    run(eng, prompts(lens=(40, 40, 40)), GREEDY, check=False)
    assert guarded and graphs.replays > len(graphs.report()["graphs"])
    assert {"decide", "ingest", "inputs", "propose", "settle"} <= set(drafting)
    assert d.graphs.report()["replays"] > 1
