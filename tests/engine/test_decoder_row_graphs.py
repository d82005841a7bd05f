"""Bounded replay's decoder rows in fixed shapes (the form their CUDA graphs capture) against the eager paths.

The Triton kernels on fixed shapes (padded rows, context-bucketed entry counts) run under the interpreter in
test_decode_graphs; here on a GPU only (the interpreter takes ~40 s for one prompt through every layer).
"""

import pytest
import torch
from test_paged_engine import make_prompts

from dsserve import LLM, SamplingParams
from dsserve.engine import graph_scratch
from dsserve.engine.decoder_row_graphs import DecoderRowGraphs, decoder_context_bucket
from dsserve.engine.graph_capture import GraphCapture, copy_outputs
from dsserve.models.presets import preset

PARAMS = SamplingParams(temperature=0, max_tokens=6, logprobs=2, ignore_eos=True)


def _prompts():
    ps = make_prompts(preset("tiny"), seed=4)
    base = ps[11][:100]
    # two rounds: fresh prompts longer and shorter than the 32-row replay window, then prefix hits on the first
    return [[base + [7, 8, 9], ps[3], ps[0]], [base + [10, 11], ps[5]]]


def test_decoder_context_buckets():
    assert [decoder_context_bucket(n, 1024) for n in (1, 1024, 1025, 5000, 40000, 131073)] == [
        1024,
        1024,
        2048,
        8192,
        65536,
        262144,
    ]


def _run(graphs=None, prompts=None, **kw):
    """Each round's prompts submitted together (mixed steps: one prompt's prefill chunk with the others' decode
    rows). graphs: None (the engine's default), False (every replay step eager) or a DecoderRowGraphs factory. The
    encoder rows run eagerly unless ``encoder_graphs=True`` (test_encoder_graphs covers their graphs)."""
    llm = LLM(model="tiny", swa_bounded_replay=True, max_num_batched_tokens=64, **{"encoder_graphs": False, **kw})
    eng = llm.engine
    if graphs is not None:
        eng.runner.decoder_row_graphs = graphs(eng) if graphs else None
    outs = [o.outputs[0] for batch in (prompts or _prompts()) for o in llm.generate(batch, PARAMS)]
    assert eng.stats.as_dict()["prefix_hit_tokens"] > 0 and eng.stats.as_dict()["decoder_rows_skipped"] > 0
    return [(c.token_ids, [sorted((k, v.logprob) for k, v in d.items()) for d in c.logprobs]) for c in outs], eng


def _long_prompts():
    """Prompts alone in three context buckets of 128 positions doubled (128, 256, 512), then prefix hits on two."""
    gen = torch.Generator().manual_seed(5)
    a, b, c = (torch.randint(3, preset("tiny").vocab_size, (n,), generator=gen).tolist() for n in (300, 150, 40))
    return [[c], [b], [a], [a + [7, 8, 9, 10, 11], b + [12, 13]]]


def _fixed_shape(made, capture=None, row_buckets=(16, 32, 64), ahead_rows=False):
    def make(eng):
        made.append(
            DecoderRowGraphs(eng.model, eng.kv, row_buckets[-1], 4, capture, min_context=128, row_buckets=row_buckets)
        )
        made[-1].ahead_rows = ahead_rows
        return made[-1]

    return make


class EagerCapture:
    """GraphCapture's contract on the CPU: capturing runs the forward once (its writes masked by the caller, as
    for GraphCapture's warm-up runs) and keeps its output buffers (with ``outputs``: the first rows of the kind's
    shared ones, which every graph of the kind writes); a replay runs it again into them. So the masked runs of a
    capture happen here too, on whatever rows the caller filled."""

    def __init__(self):
        self.whats, self.released, self.shared = [], 0, set()

    def __call__(self, run, what="", release=None, outputs=None):
        out = run()
        if outputs is not None:
            out = copy_outputs(outputs.rows_like(out), out)
            self.shared.add(id(outputs))
        self.whats.append(what)
        if release is not None:  # what the run derived: each replay recomputes it
            release()
            self.released += 1
        return _EagerGraph(run, out), out


class _EagerGraph:
    def __init__(self, run, out):
        self.run, self.out = run, out

    def replay(self):
        copy_outputs(self.out, self.run())


@pytest.mark.parametrize("key_tables", [False, True])
def test_fixed_shape_decoder_rows_are_exact(monkeypatch, key_tables):
    """fp64, every op on its torch reference: the decoder rows of replayed prefill steps (fresh prompts, prefix hits,
    mixed with decode rows, padded to a row bucket) give the reference path's tokens and logprobs; also with the
    bf16 key tables of a long chunk forced on (the GPU builds them from 128 decoder rows)."""
    if key_tables:
        import dsserve.layers.attention_paged as AP

        monkeypatch.setattr(AP, "_key_tables", lambda ops, q: True)
        monkeypatch.setattr(AP, "_index_tables", lambda ops, q: True)
    ref, _ = _run(False, dtype="float64", device="cpu", attention_backend="reference")
    made = []
    got, eng = _run(_fixed_shape(made), dtype="float64", device="cpu", attention_backend="paged", reference_ops="all")
    for (tok_a, lp_a), (tok_b, lp_b) in zip(ref, got):
        assert tok_a == tok_b
        assert max(abs(a[1] - b[1]) for da, db in zip(lp_a, lp_b) for a, b in zip(da, db)) < 1e-9
    rep = made[0].report()
    assert rep["runs"] == eng.stats.replay_graph_steps > 0 and rep["padded_rows"] > 0
    assert len({rows for rows, _ in rep["fixed_shape_steps"]}) > 1  # several row buckets
    assert not rep["fallbacks"]


def test_other_replay_form_falls_back():
    """The vllm form narrows after layer 20's attention (its top-k already published): that step runs eagerly,
    counted, and the output is the eager path's."""
    made = []
    eager, _ = _run(
        False, dtype="float64", device="cpu", attention_backend="paged", reference_ops="all", replay_form="vllm"
    )
    got, _ = _run(
        _fixed_shape(made),
        dtype="float64",
        device="cpu",
        attention_backend="paged",
        reference_ops="all",
        replay_form="vllm",
    )
    assert got == eager
    rep = made[0].report()
    assert rep["runs"] == 0 and rep["fallbacks"]["not narrowed at the decoder's KV source (replay form)"] > 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_decoder_row_graphs_on_gpu():
    """On a GPU the engine captures the decoder rows' graphs: replaying them gives the same tokens and
    logprobs, bit for bit, as the same fixed-shape forward run eagerly; and the same greedy tokens as the fully
    eager engine (--enforce-eager) wherever that engine's top-2 margin clears fp32 noise."""
    kw = dict(dtype="float32", device="cuda")
    assert_capture_is_exact(_run, _fixed_shape, kw)
    graphed, eng = _run(None, **kw)  # the engine's own buckets
    rep = eng.runner.decoder_row_graphs.report()
    assert rep["replays"] > 0 and not rep["fallbacks"]
    assert eng.runner.encoder_graphs is None  # --no-encoder-graphs (_run)
    assert eng.stats.graph_captures == len(rep["graphs"]) + len(eng.runner.decode_graphs.report()["graphs"])
    eager, _ = _run(False, enforce_eager=True, **kw)
    assert_greedy_agree(graphed, eager)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("pool", ["own", "shared"])
def test_graphs_read_only_scratch_they_wrote_on_gpu(monkeypatch, pool):
    """With every graph's free pool memory filled with 0xFF bytes (NaN) before each replay, the engine's graphs
    (decode steps, decoder and encoder rows) give the same tokens and logprobs, bit for bit, as without: no kernel
    reads memory it did not write in that replay and that no live tensor holds, with a pool per graph or one shared
    pool."""
    kw = dict(dtype="float32", device="cuda", encoder_graphs=True)
    clean, _ = _run(None, **kw)
    monkeypatch.setenv(graph_scratch.POOL_ENV, pool)
    monkeypatch.setenv(graph_scratch.ENV, "1")
    poisoned, eng = _run(None, **kw)
    graphs = [v.graph for v in eng.runner.decoder_row_graphs._steps.values()] + [
        v.graph for v in eng.runner.decode_graphs._steps.values()
    ]
    encoder = [v.graph for v in eng.runner.encoder_graphs._steps.values() if v.graph is not None]
    assert encoder and graphs and all(isinstance(g, graph_scratch.PoisonedGraph) for g in encoder)
    assert all(isinstance(g, graph_scratch.PoisonedGraph) for g in graphs)
    assert sum(len(g.blocks) for g in graphs) > 0
    assert poisoned == clean


def assert_capture_is_exact(run, fixed_shape, kw) -> None:
    """The same steps run by fixed-shape graphs captured (GraphCapture) and run eagerly give the same tokens and
    logprobs, bit for bit, and every bucket pair run eagerly was captured and replayed. ``run`` / ``fixed_shape``:
    the test file's engine runner and its factory of fixed-shape graphs (made appended to the list given)."""
    made = []
    fixed, _ = run(fixed_shape(made), **kw)
    captured, _ = run(fixed_shape(made, GraphCapture()), **kw)
    assert captured == fixed
    assert made[1].report()["replays"] > 0 and made[1].report()["graphs"] == made[0].report()["fixed_shape_steps"]


def assert_greedy_agree(graphed, eager) -> None:
    """The graphed engine's greedy tokens are the eager engine's up to each sequence's first near-tie (a top-2
    margin under 0.05 nats may go either way in fp32, and everything after follows it), for at least half the
    tokens."""
    checked = 0
    for (tok_g, _), (tok_e, lp_e) in zip(graphed, eager):
        for a, b, lps in zip(tok_g, tok_e, lp_e):
            top = sorted((v for _, v in lps), reverse=True)
            if top[0] - top[1] < 0.05:
                break
            assert a == b
            checked += 1
    assert checked >= sum(len(t) for t, _ in eager) // 2
