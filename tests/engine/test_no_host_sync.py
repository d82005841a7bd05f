"""A decode step's batched forward reads nothing back from the GPU (what CUDA graphs and an async scheduler need).

torch's sync debug mode raises on any call that makes the host wait for the device (a .item(), a boolean mask
index, a blocking copy). Skipped without CUDA.
"""

import pytest
import torch

from dsserve import LLM, SamplingParams

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def no_sync(fn, log: list):
    """``fn`` run under torch's sync debug mode (which raises on any wait for the device), each call's name appended
    to ``log``."""

    def guarded(*a, **k):
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            return fn(*a, **k)
        finally:
            torch.cuda.set_sync_debug_mode(0)
            log.append(fn.__name__)

    return guarded


def _engine(model="tiny", **kw):
    llm = LLM(model=model, dtype="bfloat16", device="cuda", enable_prefix_caching=False, max_num_seqs=4, **kw)
    eng = llm.engine
    for i in range(3):  # ragged prompts, longer than the 32-row window: ring, compressor and indexer all run
        eng.add_request(
            f"r{i}", list(range(5, 45 + 7 * i)), SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
        )
    eng.step()  # the prefill, unguarded
    return eng


@needs_cuda
@pytest.mark.parametrize("model", ["tiny", "tiny-v4"])
def test_decode_step_forward_makes_no_host_sync(model):
    """The eager decode step; tiny-v4: V4's batched paged attention (raw bf16 rows, HCA over every visible entry,
    window entries stored by host-listed rows) and its per-sequence compressors."""
    eng = _engine(model, enforce_eager=True)
    model = eng.model
    guarded = []
    model.forward_batch = no_sync(model.forward_batch, guarded)
    for _ in range(2):  # decode steps: every row one token
        eng.step()
    assert len(guarded) == 2


@needs_cuda
def test_graph_decode_step_makes_no_host_sync():
    """A decode step replayed from a CUDA graph: refilling its buffers, the replay, the host's bookkeeping."""
    eng = _engine()
    graphs = eng.runner.decode_graphs
    run, guarded = graphs.run, []
    run_guarded = no_sync(run, guarded)

    def run_step(plan, key, tokens=None):  # the first step of a bucket captures (and synchronises): unguarded
        return (run if key not in graphs._steps else run_guarded)(plan, key, tokens)

    graphs.run = run_step
    for _ in range(3):
        eng.step()
    assert len(guarded) == 2 and graphs.replays == 3


def _guard_replays(graphs, ctx_of) -> list:
    """Wraps ``graphs.run``: every run of a bucket pair already captured runs under torch's sync debug mode (the
    first captures, and synchronises: unguarded). ``ctx_of``: the run's ForwardContext from its arguments. Returns
    the list that grows by one per guarded run."""
    run, guarded = graphs.run, []
    run_guarded = no_sync(run, guarded)

    def run_step(*args):
        return (run if graphs.key(ctx_of(args)) not in graphs._steps else run_guarded)(*args)

    graphs.run = run_step
    return guarded


def _three_prompts(llm) -> None:
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    for i in range(3):  # same length: one bucket pair, captured by the first
        llm.generate([list(range(5 + i, 85 + i))], params)


@needs_cuda
def test_replay_graph_step_makes_no_host_sync():
    """Bounded replay's decoder rows replayed from a CUDA graph (a prefill step past the window): refilling the
    buffers, copying the narrowed stream in, the replay."""
    llm = LLM(
        model="tiny",
        dtype="bfloat16",
        device="cuda",
        enable_prefix_caching=False,
        max_num_seqs=4,
        swa_bounded_replay=True,
    )
    graphs = llm.engine.runner.decoder_row_graphs
    guarded = _guard_replays(graphs, lambda args: args[2])  # run(start, parts, ctx)
    _three_prompts(llm)
    assert len(guarded) == 2 and graphs.replays == 3


@needs_cuda
def test_encoder_graph_step_makes_no_host_sync():
    """A replayed step's encoder rows replayed from a CUDA graph: refilling the buffers (Engram row ids hashed on
    the host and uploaded), the replay, the host's compressor counts."""
    llm = LLM(
        model="tiny",
        dtype="bfloat16",
        device="cuda",
        enable_prefix_caching=False,
        max_num_seqs=4,
        swa_bounded_replay=True,
        encoder_graphs=True,
    )
    graphs = llm.engine.runner.encoder_graphs
    guarded = _guard_replays(graphs, lambda args: args[0])  # run(ctx, host_ids)
    _three_prompts(llm)
    assert len(guarded) == 2 and graphs.replays == 3
