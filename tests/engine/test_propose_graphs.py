"""The drafter's proposal in fixed shapes (engine.propose_graphs, DSpark.propose_fixed) against the per-sequence
proposal (DSpark.propose, the oracle) and the batched one (DSpark.propose_batch).

fp64 on the CPU: rings of every fill (empty, partial, past the window, stale rows after a gap), batches padded to a
bucket, buffers refilled with fewer and shorter rings, a batch past the largest bucket, the capture/replay flow with
GraphCapture's CPU stand-in, rings holding rows past the committed position (the engine's, before its verdict is
read); in the engine, greedy with drafts on through the fixed shapes equals drafts off. The GPU's kernel ops in
Triton's CPU interpreter (fp32). CUDA (skipped without one): a replayed graph equals the same fixed shapes run
eagerly, and a replay makes no host sync.
"""

import pytest
import torch
from test_decoder_row_graphs import EagerCapture
from test_no_host_sync import no_sync
from test_spec_decode import GREEDY, engine, ids, prompts, run
from test_verify_graphs import recorded_proposals

from dsserve.engine.propose_graphs import ProposeGraphs
from dsserve.kernels.ops import KernelOps


def ingest(model, state, positions, gen):
    cfg = model.cfg
    n = len(positions)
    taps = {
        layer: torch.randn(n, cfg.hidden_size, generator=gen, dtype=torch.float64)
        for layer in cfg.dspark_target_layer_ids
    }
    with torch.no_grad():
        model.mtp.ingest(taps, torch.as_tensor(positions), state)
    return taps


def rings(model, seed: int, fills: list) -> tuple[list[int], list[int], list]:
    """(last tokens, committed positions, states): per fill "empty", a row count (positions 0..n-1), or
    ("gap", n, p): rows 0..n-1 then row p alone, far enough past them that every earlier row is stale."""
    gen = torch.Generator().manual_seed(seed)
    ys, ps, states = [], [], []
    for fill in fills:
        st = model.mtp.new_state()
        if fill == "empty":
            p = -1
        elif isinstance(fill, int):
            ingest(model, st, list(range(fill)), gen)
            p = fill - 1
        else:
            _, n, p = fill
            ingest(model, st, list(range(n)), gen)
            ingest(model, st, [p], gen)
        states.append(st)
        ps.append(p)
        ys.append(int(torch.randint(3, model.cfg.vocab_size, (1,), generator=gen)))
    return ys, ps, states


def assert_per_sequence(model, ys, ps, states, drafts, conf) -> None:
    assert drafts.shape == conf.shape == (len(states), model.cfg.dspark_block_size)
    with torch.no_grad():
        for i in range(len(states)):
            d, c, _ = model.mtp.propose(ys[i], ps[i], states[i], model.embed, model.head)
            assert drafts[i].tolist() == d.tolist(), f"block {i}"
            torch.testing.assert_close(conf[i], c, rtol=0, atol=1e-9)


@pytest.mark.parametrize("ops", [None, "reference"])
def test_fixed_shape_proposal_equals_per_sequence_propose(tiny_models, ops):
    """Five blocks (a bucket of 8: three dummy rows) with rings empty, partial, full past the window, and after a
    gap (the stale rows must be hidden: the same drafts as a ring holding the one visible row); then three blocks
    in a bucket of 4 on the same buffers, which still hold the first proposal's rings (stale slots inside a new
    ring's window: the refill must hide them). Torch ops, or the
    kernel ops' references (the GPU's op choice; on the CPU they reproduce the torch forward)."""
    model = tiny_models["tiny"]
    w = model.cfg.sliding_window
    kernel_ops = None if ops is None else KernelOps.for_device(torch.device("cpu"), "all")
    g = ProposeGraphs(model, 16, None, ops=kernel_ops)
    ys, ps, states = rings(model, 0, ["empty", 3, w + 9, ("gap", 10, w + 30), w])
    drafts, conf = g.propose(ys, ps, states)
    assert_per_sequence(model, ys, ps, states, drafts, conf)
    with torch.no_grad():
        d, c = model.mtp.propose_batch(ys, ps, states, model.embed, model.head, ops=kernel_ops)
    assert torch.equal(drafts, d)
    torch.testing.assert_close(conf, c, rtol=0, atol=1e-9)
    # the gap: rows 0..9 are stale at p = W + 30, so only the last row counts
    alone = model.mtp.new_state()
    key, pos = states[3].ring
    alone.push(key[-1:], pos[-1:], int(pos[-1]))
    d_alone, _ = g.propose([ys[3]], [ps[3]], [alone])
    assert d_alone[0].tolist() == drafts[3].tolist()
    # row 2 held W rows at positions 9..W + 8; its new ring's window [14, W + 13] would see them if left
    ys2, ps2, states2 = rings(model, 1, [2, ("gap", w, 3 * w), ("gap", 10, w + 13)])
    drafts2, conf2 = g.propose(ys2, ps2, states2)
    assert_per_sequence(model, ys2, ps2, states2, drafts2, conf2)
    rep = g.report()
    assert rep["fixed_shape_steps"] == [1, 4, 8] and rep["graphs"] == [] and rep["runs"] == 3
    assert rep["padded_rows"] == 3 + 0 + 1 and rep["fallbacks"] == {}


def test_past_the_largest_bucket_runs_on_buffers_of_its_own_size(tiny_models):
    model = tiny_models["tiny"]
    g = ProposeGraphs(model, 2, None)
    assert g.buckets == (1, 2)
    ys, ps, states = rings(model, 2, [4, 7, 1])
    drafts, conf = g.propose(ys, ps, states)
    assert_per_sequence(model, ys, ps, states, drafts, conf)
    assert g.report()["fallbacks"] == {"batch size outside the buckets": 1} and g.runs == 0
    with pytest.raises(ValueError, match="ingested up to 3"):
        g.propose(ys[:1], [ps[0] + 1], states[:1])


def test_capture_then_replays(tiny_models):
    """The capture flow (GraphCapture's CPU stand-in: capturing runs the pass once into the shared outputs, a replay
    runs it again into them): a bucket is captured on its first proposal and replayed after, each proposal's
    copies kept past the next replay, the RoPE tables forgotten after each capture."""
    model = tiny_models["tiny"]
    capture = EagerCapture()
    g = ProposeGraphs(model, 4, capture)
    first = rings(model, 3, [5, 2, 40])
    second = rings(model, 4, [40, 1, 6])
    out1 = g.propose(*first)
    out2 = g.propose(*second)
    for (ys, ps, states), (d, c) in ((first, out1), (second, out2)):
        assert_per_sequence(model, ys, ps, states, d, c)
    rep = g.report()
    assert rep["graphs"] == [4] and rep["runs"] == 2 and rep["replays"] == 2
    assert capture.whats == ["draft proposal: 4 blocks"] and capture.released == 1 and len(capture.shared) == 1


def test_rows_past_the_committed_position_are_invisible_then_dropped(tiny_models):
    """The engine's drafter ingests a verify chunk's rows before the host knows which are committed: a ring holding
    rows past the block's committed position p (given as device tensors, as the engine's are) proposes what the ring
    without them proposes; ``drop_after(p)`` then leaves exactly that ring, the window whole (the spare rows)."""
    model = tiny_models["tiny"]
    w, block = model.cfg.sliding_window, model.cfg.dspark_block_size
    gen = torch.Generator().manual_seed(9)
    n, rejected = w + 7, 3
    taps = {
        layer: torch.randn(n, model.cfg.hidden_size, generator=gen, dtype=torch.float64)
        for layer in model.cfg.dspark_target_layer_ids
    }
    full, committed = model.mtp.new_state(spare=block), model.mtp.new_state(spare=block)
    with torch.no_grad():
        model.mtp.ingest({k: v[: n - rejected - 1] for k, v in taps.items()}, torch.arange(n - rejected - 1), full)
        model.mtp.ingest_spans(taps, [(full, slice(n - rejected - 1, n), n - rejected - 1)])  # a chunk of 1 + 3
        model.mtp.ingest({k: v[: n - rejected] for k, v in taps.items()}, torch.arange(n - rejected), committed)
    p = n - rejected - 1
    assert full.last_position == n - 1 and full.ring[0].shape[0] == w + rejected + 1  # (ingest keeps the last w)
    g = ProposeGraphs(model, 4, None)
    y = torch.tensor([17, 17])
    drafts, conf = g.propose(y, torch.tensor([p, p]), [full, committed])
    assert torch.equal(drafts[0], drafts[1]) and torch.equal(conf[0], conf[1])
    full.drop_after(p)
    m = committed.ring[0].shape[0]
    assert full.last_position == p and full.ring[0].shape[0] == w + 1 and m == w
    assert torch.equal(full.ring[1][-m:], committed.ring[1]) and torch.equal(full.ring[0][-m:], committed.ring[0])
    with pytest.raises(ValueError, match="holds rows up to"):
        model.mtp.new_state().drop_after(-5)


def test_engine_drafts_through_fixed_shapes_greedy_equals_drafts_off():
    """The engine's drafter with its proposal in fixed shapes (on the CPU run eagerly): a batch past the largest
    bucket proposes what buckets do, step by step, and greedy tokens equal drafts off's."""
    off = run(engine(None, long_prefill_token_threshold=16), prompts(), GREEDY, check=False)
    eager = engine(3, long_prefill_token_threshold=16)
    assert eager.drafter.graphs.capture is None  # the CPU engine's fixed shapes run eagerly
    want = recorded_proposals(eager)
    run(eager, prompts(), GREEDY, check=False)
    eng = engine(3, long_prefill_token_threshold=16)
    eng.drafter.graphs = ProposeGraphs(eng.model, 2, None)  # 3 requests at first: a fallback, then buckets
    got = recorded_proposals(eng)
    assert ids(run(eng, prompts(), GREEDY)) == ids(off)
    assert got == want and sum(len(d) == 3 for _, _, d in got) > 3
    rep = eng.drafter.report()["proposal_graphs"]
    assert rep["runs"] == eng.stats.propose_graph_steps > 0 and rep["fallbacks"]["batch size outside the buckets"]


@pytest.mark.interpreter
def test_kernel_ops_in_fixed_shapes_interpreted():
    """The Triton kernels the GPU's proposal graphs run (mHC sites, router, grouped experts), in Triton's CPU
    interpreter on the tiny model (fp32): a batch of 3 in a bucket of 4 gives propose_batch's drafts on the same ops
    and on the torch ops."""
    from dsserve.models.checkpoint import dummy_weights
    from dsserve.models.model import DeepseekForCausalLM
    from dsserve.models.presets import preset

    cfg = preset("tiny")
    model = DeepseekForCausalLM(cfg).eval()
    dummy_weights(model, cfg, seed=0)
    ops = KernelOps.for_device(torch.device("cpu"))
    assert ops.uses_triton("moe") and ops.uses_triton("mhc") and ops.uses_triton("router")
    gen = torch.Generator().manual_seed(6)
    ys, ps, states = [], [], []
    for n in (3, cfg.sliding_window + 8, 17):
        st = model.mtp.new_state()
        taps = {layer: torch.randn(n, cfg.hidden_size, generator=gen) for layer in cfg.dspark_target_layer_ids}
        with torch.no_grad():
            model.mtp.ingest(taps, torch.arange(n), st)
        states.append(st)
        ps.append(n - 1)
        ys.append(int(torch.randint(3, cfg.vocab_size, (1,), generator=gen)))
    drafts, conf = ProposeGraphs(model, 4, None, ops=ops).propose(ys, ps, states)
    with torch.no_grad():
        for o in (ops, None):
            d, c = model.mtp.propose_batch(ys, ps, states, model.embed, model.head, ops=o)
            assert torch.equal(drafts, d)
            torch.testing.assert_close(conf, c, rtol=0, atol=1e-4)


def _cuda_setup():
    from dsserve.models.checkpoint import dummy_weights
    from dsserve.models.model import DeepseekForCausalLM
    from dsserve.models.presets import preset

    cfg = preset("tiny")
    model = DeepseekForCausalLM(cfg).eval()
    dummy_weights(model, cfg, seed=0)
    model = model.to("cuda", torch.bfloat16)
    w = cfg.sliding_window
    gen = torch.Generator().manual_seed(5)
    ys, ps, states = [], [], []
    for n in (3, w + 9, w, 1, 17):  # (the longest ring fills its capacity: the window + the block's spare rows)
        st = model.mtp.new_state(spare=cfg.dspark_block_size)
        taps = {layer: torch.randn(n, cfg.hidden_size, generator=gen) for layer in cfg.dspark_target_layer_ids}
        with torch.no_grad():
            model.mtp.ingest({k: v.to("cuda", torch.bfloat16) for k, v in taps.items()}, torch.arange(n), st)
        states.append(st)
        ps.append(n - 1)
        ys.append(int(torch.randint(3, cfg.vocab_size, (1,), generator=gen)))
    return model, ys, ps, states


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_proposal_graph_replay_equals_eager_and_makes_no_host_sync():
    """On a GPU with the kernel ops: a captured proposal's replays give, bit for bit, the same fixed shapes run
    eagerly, and the drafts of propose_batch with the same ops; a replay (the ring copies, the upload, the replay,
    the copies out) makes no host sync (torch's sync debug mode raises on any). The first proposal of a bucket
    captures (and synchronises): unguarded. (propose_batch is compared where it runs the same shapes: a batch of
    a bucket's size; with padding rows a kernel may split its sums differently, within bf16 rounding.)"""
    from dsserve.engine.graph_capture import GraphCapture

    model, ys, ps, states = _cuda_setup()
    ops = KernelOps.for_device(torch.device("cuda"))
    eager = ProposeGraphs(model, 8, None, ops=ops)
    graphed = ProposeGraphs(model, 8, GraphCapture(), ops=ops)
    graphed.propose(ys, ps, states)  # captures bucket 8
    for n in (5, 4):  # a replay of bucket 8, then bucket 4's capture and a replay
        graphed.propose(ys[:n], ps[:n], states[:n])
        d, c = no_sync(graphed.propose, [])(ys[:n], ps[:n], states[:n])
        de, ce = eager.propose(ys[:n], ps[:n], states[:n])
        assert torch.equal(d, de) and torch.equal(c, ce)
    # a full bucket whose longest ring fills its capacity: propose_batch runs the same shapes
    with torch.no_grad():
        db, _ = model.mtp.propose_batch(ys[:4], ps[:4], states[:4], model.embed, model.head, ops=ops)
    assert torch.equal(d, db)
    rep = graphed.report()
    assert rep["graphs"] == [4, 8] and rep["replays"] == 5  # a capturing call replays too


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_engine_on_gpu_builds_proposal_graphs():
    """The engine on a GPU with drafts on builds proposal graphs (not with --enforce-eager), replays them in its
    steps and counts them. Its tokens are not compared here: on the random tiny model fp32 near-ties make that
    vacuous; test_verify_graphs_on_gpu compares drafts on with drafts off on the trained model."""
    kw = dict(dtype="float32", device="cuda", long_prefill_token_threshold=16)
    assert engine(3, enforce_eager=True, **kw).drafter.graphs.capture is None
    eng = engine(3, **kw)
    g = eng.drafter.graphs
    assert g is not None and g.capture is eng.graph_capture
    run(eng, prompts(), GREEDY, check=False)
    rep = g.report()
    assert rep["replays"] > 0 and rep["graphs"] and eng.stats.propose_graph_steps == rep["runs"]
