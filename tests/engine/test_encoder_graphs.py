"""A replayed step's encoder rows in fixed shapes (the form their CUDA graphs capture) against the eager paths.

The Triton kernels on fixed shapes run under the interpreter in test_decode_graphs; here on a GPU only.
"""

import re

import pytest
import torch
from test_decoder_row_graphs import (
    PARAMS,
    EagerCapture,
    _long_prompts,
    _prompts,
    assert_capture_is_exact,
    assert_greedy_agree,
)

from dsserve import LLM
from dsserve.engine.decoder_row_graphs import DecoderRowGraphs
from dsserve.engine.encoder_graphs import EncoderGraphs


def _run(graphs=None, prompts=None, **kw):
    """Each round's prompts submitted together (mixed steps: prefill chunks with other prompts' decode rows, prefix
    hits on the first round). graphs: None (the engine's default), False (every step eager) or a factory of
    (EncoderGraphs, DecoderRowGraphs or None)."""
    llm = LLM(model="tiny", swa_bounded_replay=True, **{"max_num_batched_tokens": 64, **kw})
    eng = llm.engine
    if graphs is not None:
        eng.runner.encoder_graphs, eng.runner.decoder_row_graphs = graphs(eng) if graphs else (None, None)
    outs = [o.outputs[0] for batch in (prompts or _prompts()) for o in llm.generate(batch, PARAMS)]
    assert eng.stats.as_dict()["prefix_hit_tokens"] > 0 and eng.stats.as_dict()["decoder_rows_skipped"] > 0
    return [(c.token_ids, [sorted((k, v.logprob) for k, v in d.items()) for d in c.logprobs]) for c in outs], eng


def _fixed_shape(made, capture=None, row_buckets=(16, 32, 64), decoder=True, ahead_rows=False):
    def make(eng):
        made.append(
            EncoderGraphs(eng.model, eng.kv, row_buckets[-1], 4, capture, min_context=128, row_buckets=row_buckets)
        )
        rep = (
            DecoderRowGraphs(eng.model, eng.kv, row_buckets[-1], 4, capture, min_context=128, row_buckets=row_buckets)
            if decoder
            else None
        )
        for g in (made[-1], rep):
            if g is not None:
                g.ahead_rows = ahead_rows
        return made[-1], rep

    return make


def _close(ref, got, tol=1e-9):
    for (tok_a, lp_a), (tok_b, lp_b) in zip(ref, got):
        assert tok_a == tok_b
        assert max(abs(a[1] - b[1]) for da, db in zip(lp_a, lp_b) for a, b in zip(da, db)) < tol


@pytest.mark.parametrize("decoder", [True, False])
def test_fixed_shape_encoder_rows_are_exact(decoder):
    """fp64, every op on its torch reference: the encoder rows of replayed steps (fresh prompts in chunks, prefix
    hits with their replayed window rows, decode rows of other sequences, odd and even first positions, padded to a
    row bucket), with the decoder rows in fixed shapes too or eager, give the reference path's tokens and
    logprobs: the compressors' entries and carried rows, windows and Engram rows are the eager path's."""
    ref, _ = _run(False, dtype="float64", device="cpu", attention_backend="reference")
    made = []
    got, eng = _run(
        _fixed_shape(made, decoder=decoder),
        dtype="float64",
        device="cpu",
        attention_backend="paged",
        reference_ops="all",
    )
    _close(ref, got)
    rep = made[0].report()
    assert rep["runs"] == eng.stats.encoder_graph_steps > 0 and rep["padded_rows"] > 0
    assert len({rows for rows, _ in rep["fixed_shape_steps"]}) > 1  # several row buckets
    assert set(rep["fallbacks"]) <= {"rows outside the buckets"}  # only the 64-row chunks of a 64-row budget


def test_row_buckets_built_ahead_are_exact():
    """fp64, every op on its torch reference: with ``ahead_rows`` (the warm-up's) on both pieces, a step also builds,
    and runs the masked capture runs of (EagerCapture), other row buckets at its context: the encoder rows the larger
    ones, from its rows padded; the decoder rows every one, the smaller ones from its first rows. The outputs stay
    the reference path's (the masked runs wrote nothing), and later steps of other row counts replay those. The
    encoder steps run 16 and 64 rows at 128 and 512 positions, 16, 32 and 64 at 256: (32, 128) and (32, 512) are
    built ahead only; the decoder steps run (16, 128), (32, 128), (16, 512), (32, 512), (64, 512): (64, 128) only
    ahead, from the first 16 or 32 rows of a step of 64."""
    ref, _ = _run(False, _long_prompts(), dtype="float64", device="cpu", attention_backend="reference")
    made, capture = [], EagerCapture()
    got, eng = _run(
        _fixed_shape(made, capture, ahead_rows=True),
        _long_prompts(),
        dtype="float64",
        device="cpu",
        attention_backend="paged",
        reference_ops="all",
    )
    _close(ref, got)
    rep = made[0].report()
    assert set(rep["fixed_shape_steps"]) == {(r, c) for r in (16, 32, 64) for c in (128, 256, 512)}
    assert rep["graphs"] == rep["fixed_shape_steps"] and rep["replays"] == rep["runs"] and not rep["fallbacks"]
    assert sum(w.startswith("encoder rows") for w in capture.whats) == 9
    # a step's captures go largest first (the smaller ones reuse its freed scratch), each dropping what it derived
    shapes = [tuple(int(x) for x in re.findall(r"\d+", w)) + (w.split(":")[0],) for w in capture.whats]
    for (r0, c0, k0), (r1, c1, k1) in zip(shapes, shapes[1:]):
        assert not (c0 == c1 and k0 == k1 and r1 >= r0), capture.whats
    assert capture.released == len(capture.whats)
    assert len(capture.shared) == 2  # one set of output buffers per kind (encoder, decoder rows) for all its graphs
    dec = eng.runner.decoder_row_graphs.report()
    assert set(dec["fixed_shape_steps"]) == {(r, c) for r in (16, 32, 64) for c in (128, 512)}
    assert dec["graphs"] == dec["fixed_shape_steps"] and dec["replays"] == dec["runs"] == 5 and not dec["fallbacks"]


def test_host_engram_tables_and_odd_starts():
    """Engram tables in host memory (rows prefetched into the graph's buffers) and a prompt whose rows start at odd
    positions (a chunk budget of 37 rows leaves the ratio-2 compressors a carried row between steps)."""
    ref, _ = _run(False, dtype="float64", device="cpu", attention_backend="reference")
    made = []
    got, eng = _run(
        _fixed_shape(made, row_buckets=(16, 40)),
        dtype="float64",
        device="cpu",
        attention_backend="paged",
        reference_ops="all",
        engram_tables="host",
        max_num_batched_tokens=37,
    )
    assert eng.model.layers[1].engram.table is not None
    _close(ref, got, 2e-2)  # bf16 tables: the reference reads the fp64 weights
    exact, _ = _run(
        False,
        dtype="float64",
        device="cpu",
        attention_backend="paged",
        reference_ops="all",
        engram_tables="host",
        max_num_batched_tokens=37,
    )
    _close(exact, got)
    assert made[0].report()["runs"] > 0


def test_steps_it_cannot_take_fall_back():
    """Steps that do not narrow never reach it; the vllm form and V4 are not its concern; a step past the largest
    row bucket runs eagerly, counted."""
    made = []
    eager, _ = _run(False, dtype="float64", device="cpu", attention_backend="paged", reference_ops="all")
    got, _ = _run(
        _fixed_shape(made, row_buckets=(16,)),
        dtype="float64",
        device="cpu",
        attention_backend="paged",
        reference_ops="all",
    )
    _close(eager, got)
    rep = made[0].report()
    assert rep["fallbacks"]["rows outside the buckets"] > 0 and rep["runs"] > 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_encoder_graphs_on_gpu():
    """On a GPU the engine (by default) captures the encoder rows' graphs: replaying them gives the same tokens and
    logprobs, bit for bit, as the same fixed-shape forward run eagerly; and the eager engine's greedy tokens wherever
    its top-2 margin clears fp32 noise."""
    kw = dict(dtype="float32", device="cuda")
    assert_capture_is_exact(_run, _fixed_shape, kw)
    graphed, eng = _run(None, **kw)  # the default: --encoder-graphs
    rep = eng.runner.encoder_graphs.report()
    assert rep["replays"] > 0
    _, off = _run(None, encoder_graphs=False, **kw)  # --no-encoder-graphs: the decoder rows' graphs only
    assert off.runner.encoder_graphs is None and off.stats.replay_graph_steps > 0
    eager, _ = _run(False, enforce_eager=True, **kw)
    assert_greedy_agree(graphed, eager)
