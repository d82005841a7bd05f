"""Asynchronous scheduling: decode steps launched from the previous step's device tokens give the outputs of the
synchronous engine, request by request, through finishes of every kind, sampling that must stay synchronous,
arrivals and aborts while a step is in flight.

Both engines run the tiny model in fp64 on the paged backend (the async one in fixed-shape decode steps, run
eagerly on the CPU, the form CUDA graphs capture), so their logits agree to ~1e-12 and so do their tokens."""

import pytest
import torch

from dsserve.engine.args import EngineArgs
from dsserve.engine.core import EngineCore
from dsserve.engine.sampling_params import SamplingParams

PROMPTS = [[5 + (7 * i + 3 * j) % 900 for j in range(n)] for i, n in enumerate((3, 40, 17, 70, 9, 33, 25))]


def _core(async_on: bool, max_num_seqs: int = 8) -> EngineCore:
    return EngineCore(
        EngineArgs(
            model="tiny",
            dtype="float64",
            device="cpu",
            attention_backend="paged",
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=64,
            async_scheduling=async_on,
            kv_cache_memory=64 << 20,
            reference_ops="all",
        )
    )


def _params(stop_id: int) -> list[SamplingParams]:
    return [
        SamplingParams(temperature=0, max_tokens=26, ignore_eos=True, logprobs=3),  # alone at the end: runs ahead
        SamplingParams(temperature=0, max_tokens=30, stop_token_ids=[stop_id], ignore_eos=True),  # stops mid-run
        SamplingParams(temperature=0, max_tokens=9, min_tokens=6, ignore_eos=True),  # synchronous until 6 outputs
        SamplingParams(temperature=0.9, top_k=7, seed=11, max_tokens=12, ignore_eos=True),  # seeded, batch-independent
        SamplingParams(temperature=0, max_tokens=10, presence_penalty=0.7, ignore_eos=True),  # always synchronous
        SamplingParams(temperature=0, max_tokens=20, ignore_eos=True),  # aborted while in flight
        SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),  # arrives mid-run
    ]


LOGPROBS: dict = {}  # request 0's logprobs, per engine kind


def _run(core: EngineCore, params: list[SamplingParams]) -> dict:
    done, seen = {}, {}
    for i in range(6):
        core.add_request(str(i), PROMPTS[i], params[i])
    added = aborted = False
    while core.has_unfinished_requests():
        for out in core.step():
            seen[out.request_id] = len(out.outputs[0].token_ids)
            if out.finished:
                done[out.request_id] = (out.outputs[0].token_ids, out.outputs[0].finish_reason)
                if out.outputs[0].logprobs:
                    LOGPROBS[core.async_scheduling] = out.outputs[0].logprobs
        if not added and seen.get("0", 0) >= 4:
            core.add_request("6", PROMPTS[6], params[6])
            added = True
        if not aborted and seen.get("5", 0) >= 5:
            out = core.abort_request("5")
            done["5"] = (out.outputs[0].token_ids[:5], out.outputs[0].finish_reason)
            aborted = True
        core.scheduler.check()
    core.scheduler.check()
    assert core.kv.blocks.num_free == core.kv.blocks.num_blocks  # nothing leaked, ahead steps of finished rows too
    return done


@pytest.fixture(scope="module")
def cores():
    return _core(False), _core(True)


def test_async_engine_equals_sync_engine(cores):
    sync, asyn = cores
    first = sync.add_request("probe", PROMPTS[1], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    while sync.has_unfinished_requests():
        sync.step()
    stop_id = first.output_token_ids[7]
    want = _run(sync, _params(stop_id))
    got = _run(asyn, _params(stop_id))
    assert got == want
    a, b = LOGPROBS[False], LOGPROBS[True]  # logprobs copied back with the tokens, read one step later
    assert len(a) == len(b) == 26
    for da, db in zip(a, b):
        assert list(da) == list(db) and all(
            abs(da[k].logprob - db[k].logprob) < 1e-9 and da[k].rank == db[k].rank for k in da
        )
    assert want["1"][1] == "stop" and len(want["1"][0]) <= 8 and want["5"][1] == "abort"
    assert want["0"][1] == "length" and len(want["0"][0]) == 26
    assert sync.stats.ahead_steps == 0 and asyn.stats.ahead_steps >= 8  # it did run ahead
    assert asyn.async_scheduling and not sync.async_scheduling


def test_async_engine_steady_decode_runs_ahead(cores):
    """Plain greedy decodes with nothing waiting: every decode step is launched ahead, the first one from the
    prefill step's tokens."""
    _, asyn = cores
    before = asyn.stats.ahead_steps
    for i in range(3):
        asyn.add_request(f"s{i}", PROMPTS[i], SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))
    outs = {}
    while asyn.has_unfinished_requests():
        for o in asyn.step():
            outs[o.request_id] = o
    assert all(len(o.outputs[0].token_ids) == 10 for o in outs.values())
    # 9 decode steps, each launched from the step before (the first from the prefill's tokens); none is needed
    # after the 10th token
    assert asyn.stats.ahead_steps - before == 9


def test_async_engine_runs_ahead_while_a_full_batch_keeps_others_waiting():
    """max_num_seqs 2, five requests: while the batch is full the waiting ones could not be admitted anyway, so
    steps still run ahead; each request's tokens are the synchronous engine's (admissions one step later)."""
    outs = {}
    for async_on in (False, True):
        core = _core(async_on, max_num_seqs=2)
        for i in range(5):
            core.add_request(str(i), PROMPTS[i], SamplingParams(temperature=0, max_tokens=6 + 3 * i, ignore_eos=True))
        got = {}
        while core.has_unfinished_requests():
            for o in core.step():
                if o.finished:
                    got[o.request_id] = o.outputs[0].token_ids
            core.scheduler.check()
        outs[async_on] = (got, core.stats.ahead_steps)
    assert outs[True][0] == outs[False][0] and len(outs[True][0]) == 5
    assert outs[False][1] == 0 and outs[True][1] >= 20  # 15 if it waited for the queue to empty


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _gpu_core(async_on: bool, **kw) -> EngineCore:
    return EngineCore(
        EngineArgs(
            model="tiny",
            dtype="bfloat16",
            device="cuda",
            max_num_seqs=8,
            max_num_batched_tokens=64,
            async_scheduling=async_on,
            kv_cache_memory=64 << 20,
            **kw,
        )
    )


@needs_cuda
@pytest.mark.parametrize("tables", ["device", "host-fp8"])
def test_async_graph_engine_equals_sync_on_gpu(tables):
    """CUDA graphs both ways: the same kernels on the same batches, so the same tokens, bit for bit; Engram rows
    hashed and gathered in the graph (host tables read in place)."""
    sync, asyn = _gpu_core(False, engram_tables=tables), _gpu_core(True, engram_tables=tables)
    first = sync.add_request("probe", PROMPTS[1], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    while sync.has_unfinished_requests():
        sync.step()
    stop_id = first.output_token_ids[7]
    assert _run(asyn, _params(stop_id)) == _run(sync, _params(stop_id))
    assert asyn.stats.ahead_steps >= 8 and sync.stats.ahead_steps == 0


@needs_cuda
def test_async_steady_step_makes_no_host_sync():
    """A step launched ahead (refill from the device tokens, replay, sampling with logprobs and a seeded row, the
    copy back) and the reading of the step before it: nothing waits for the device but the copy back's event."""
    core = _gpu_core(True, engram_tables="host-fp8")
    for i in range(3):
        core.add_request(
            str(i),
            PROMPTS[i],
            SamplingParams(
                temperature=0.8,
                top_k=5,
                max_tokens=12,
                ignore_eos=True,
                logprobs=2 if i else None,
                seed=7 if i == 2 else None,
            ),
        )
    for _ in range(3):  # the prefill, the first decode step (captures its graph), one step ahead
        core.step()
    before = core.stats.ahead_steps
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(4):
            core.step()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert core.stats.ahead_steps - before == 4
