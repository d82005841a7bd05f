"""DSpark speculative decoding under tensor parallel (TP2: this process is rank 0, one spawned worker; gloo, fp64,
the built-in trained model, whose drafts are mostly but not always accepted): the greedy tokens of one engine with
drafts off, every emitted token's logits within 1e-9 of that engine's, over concurrent requests that chunk their
prefills, hit the prefix cache, get preempted (a KV cache of a few blocks) and one aborted with drafts pending, on
the reference backend and on the paged one (verify steps in fixed shapes). After every step rank 0's caches pass the
single-engine spec tests' check and the worker's caches (every kind, ``tp_worker.sequence_state``) equal rank 0's.
-tp 2 inside -dp 2 (with and without EP) gives the same tokens. A worker killed mid-run fails the engine cleanly."""

import os
import signal
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from dsserve.distributed.tp_worker import sequence_state
from dsserve.engine.args import EngineArgs
from dsserve.engine.core import EngineCore
from dsserve.engine.executor import EngineDeadError
from dsserve.engine.sampling_params import SamplingParams
from dsserve.kv.layout import KVLayout
from dsserve.models.loader import resolve_config

sys.path.insert(0, str(Path(__file__).parents[1] / "engine"))
from test_spec_decode import check_caches  # noqa: E402

TIMEOUT_S = 15  # a rank lost in a collective fails a test in seconds, not minutes (the group timeout)
os.environ["DSSERVE_DIST_TIMEOUT_S"] = str(TIMEOUT_S)
SPEC = {"method": "dspark", "num_speculative_tokens": 3}
MAX_NEW = 14


def options() -> dict:
    """Chunked prefills of 16 rows, prefix caching (bounded replay), a cache too small for every request at once."""
    cfg = resolve_config("tiny-trained")
    lay = KVLayout.build(cfg, 16, "auto", torch.float64, window_in_blocks=False)
    seqs = 4
    return dict(
        model="tiny-trained",
        device="cpu",
        dtype="float64",
        block_size=16,
        max_num_seqs=seqs,
        max_model_len=256,
        max_num_batched_tokens=32,
        long_prefill_token_threshold=16,
        enable_prefix_caching=True,
        kv_cache_memory_bytes=8 * lay.bytes_per_block + seqs * lay.bytes_per_slot,
        seed=0,
        warmup=False,
    )


TEXTS = [
    "12+7=19. 3+4=7. 8+1=9. 5+5=",
    "Q: 3*4 A: 12. Q: 2*5 A:",
    "abcabcabcabcabcabcabcabcabcabcabcabcabc",
    "Hello, how are you today? I am fine, thank you. And how",
    "12+7=19. 3+4=7. 8+1=9. 5+5= 6+2=8. 1+1=",  # r0's prompt and more: a prefix hit once r0's blocks are full
    "Hello, how are you today? I am fine, thank you. And how? Fine too",
]


BACKENDS = {
    "reference": {},  # eager steps, the compressors' carried rows on the per-sequence path
    # verify steps in fixed shapes (VerifyGraphs, uncaptured on the CPU), carries in PagedKVCache.carry
    "paged": dict(attention_backend="paged", reference_ops="all", async_scheduling=True),
}


@pytest.fixture(scope="module")
def plain():
    return EngineCore(EngineArgs(**options()))


@pytest.fixture(scope="module", params=list(BACKENDS))
def engines(request, plain):
    """The drafts-off single engine, and a TP2 engine with drafts (one TP engine at a time: one world a process)."""
    two = EngineCore(
        EngineArgs(**options(), **BACKENDS[request.param], tensor_parallel_size=2, speculative_config=SPEC)
    )
    yield plain, two
    two.close()


def compare(rid: str, key: str, a, b) -> None:
    """Rank 0's state ``a`` against a worker's ``b``: equal, floats within 1e-9."""
    where = f"request {rid}, {key}"
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.shape == b.shape and a.dtype == b.dtype, where
        if a.is_floating_point():
            assert torch.allclose(a, b, rtol=0, atol=1e-9), where
        else:
            assert torch.equal(a, b), where
    elif isinstance(a, (tuple, list)):
        assert isinstance(b, (tuple, list)) and len(a) == len(b), where
        for x, y in zip(a, b):
            compare(rid, key, x, y)
    else:
        assert a == b, where


def check_ranks(core: EngineCore) -> tuple[int, bool]:
    """Rank 0's caches pass the single-engine check; the worker's equal them, request by request. Returns how many
    requests had a DSpark ring compared, and whether ``check_caches`` ran (it expects a sequence's carried compressor
    rows, which a bounded replay after a prefix hit does not keep until it passes the hit: it fails there with drafts
    off too, so it runs when no request is replaying; the ranks' comparison runs always)."""
    checked = all(r.kv.num_tokens >= r.kv.published_until for r in core.scheduler.running)
    if checked:
        check_caches(core)
    (theirs,) = core.executor.audit()
    rings = 0
    for r in core.scheduler.running:
        mine = sequence_state(r)
        assert r.request_id in theirs, f"the worker lost request {r.request_id}"
        got = theirs[r.request_id]
        assert mine.keys() == got.keys(), (r.request_id, mine.keys() ^ got.keys())
        for key in mine:
            compare(r.request_id, key, mine[key], got[key])
        rings += "draft" in mine
    return rings, checked


def run(core: EngineCore, each_step=None, abort=None) -> dict:
    """Greedy tokens per request id (the aborted one left out); ``abort``: a request id aborted after the first step
    that leaves it drafts to verify."""
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW)
    reqs = [core.add_request(f"r{i}", core.tokenizer.encode(t), params) for i, t in enumerate(TEXTS)]
    done, aborted = {}, None
    while core.has_unfinished_requests():
        for out in core.step():
            if out.finished:
                done[out.request_id] = list(out.outputs[0].token_ids)
        for r in reqs:
            if r.request_id == abort and aborted is None and r.draft_token_ids and len(r.output_token_ids) > 2:
                core.abort_request(abort)
                aborted = r
        if each_step is not None:
            each_step(core)
    done.pop(abort, None)
    return {"tokens": done, "preempted": sum(r.num_preemptions for r in reqs), "aborted": aborted}


def test_tp2_with_drafts_gives_one_engines_tokens_and_logits_with_every_cache_equal_on_every_rank(engines):
    one, two = engines
    plain = {}
    execute = one.executor.execute

    def recorded(plan, speculative=False):
        sampling, rows = execute(plan)
        for r, row in zip(sampling, rows):
            plain.setdefault(r.request_id, []).append(row.clone())
        return sampling, rows

    one.executor.execute = recorded
    want = run(one)
    del one.executor.execute
    graph_steps = 0 if two.runner.verify_graphs is None else two.runner.verify_graphs.runs

    spec, last, decide, run_step = {}, [], two.rejection_sampler.decide, two.executor.execute

    def stepped(plan, speculative=False):
        sampling, rows = run_step(plan, speculative)
        last[:] = [rows]  # fp64 (the rejection sampler gets them in fp32)
        return sampling, rows

    def judged(logits, requests, drafts):
        pending = decide(logits, requests, drafts)
        v = pending.to_host(pending.tensors())  # (the CPU: read here, as the engine reads it later)
        at = 0
        for r, d, toks in zip(requests, drafts, v.token_ids):  # the rows that emitted a token: one per token
            spec.setdefault(r.request_id, []).extend(last[0][at : at + len(toks)].clone())
            at += len(d) + 1
        return pending

    two.executor.execute, two.rejection_sampler.decide = stepped, judged
    rings = []
    try:
        got = run(two, lambda core: rings.append(check_ranks(core)), abort="r2")
    finally:
        del two.rejection_sampler.decide
        del two.executor.execute
    assert got["aborted"] is not None, "r2 was not aborted with drafts pending"
    want["tokens"].pop("r2")
    assert got["tokens"] == want["tokens"] and len(got["tokens"]) == len(TEXTS) - 1
    for rid, tokens in got["tokens"].items():
        rows = spec[rid][: len(tokens)]
        assert len(rows) == len(tokens) and len(plain[rid]) >= len(tokens)
        diff = (torch.stack(rows) - torch.stack(plain[rid][: len(tokens)])).abs().max().item()
        assert diff < 1e-9, (rid, diff)
    # the run did exercise what it claims
    s = two.stats
    assert s.spec_num_drafts > 0 and 0 < s.spec_num_accepted_tokens < s.spec_num_draft_tokens, "no rejected draft"
    assert got["preempted"] > 0, "no preemption"
    assert s.prefix_hit_tokens > 0 and s.replayed_rows > 0, "no prefix hit"
    assert max(n for n, _ in rings) > 0, "no DSpark ring compared"
    assert sum(ok for _, ok in rings) > len(rings) // 2, "check_caches ran on too few steps"
    if two.runner.verify_graphs is not None:
        assert two.runner.verify_graphs.runs > graph_steps, "no verify step in fixed shapes"
    assert two.executor.stats.max_bytes < 4096, two.executor.stats


@pytest.mark.parametrize("ep", [False, True])
def test_tp2_inside_dp2_with_drafts_gives_one_engines_tokens(engines, ep):
    """-tp 2 -dp 2 (four spawned ranks): each DP rank drafts for its own requests on its TP group; with EP (TP inside
    DEP ranks) every rank joins every draft pass, a DP rank with nothing to draft through its executor's
    ``idle_draft`` (its TP worker too)."""
    from dsserve.distributed.dp_client import DPClient

    one, two = engines
    if two.runner.verify_graphs is not None:
        pytest.skip("once is enough (the reference backend's run)")
    want = run(one)["tokens"]
    args = EngineArgs(
        **options(),
        tensor_parallel_size=2,
        data_parallel_size=2,
        enable_expert_parallel=ep,
        speculative_config=SPEC,
    )
    client = DPClient(args)
    try:
        params = SamplingParams(temperature=0, max_tokens=MAX_NEW)
        for i, text in enumerate(TEXTS):
            client.add_request(f"r{i}", one.tokenizer.encode(text), params)
        got = {}
        while client.has_unfinished_requests():
            for out in client.step():
                if out.finished:
                    got[out.request_id] = list(out.outputs[0].token_ids)
        assert got == want
        assert all(n > 0 for n in client.router.routed), client.router.routed  # both ranks served
        assert sum(x.counters["spec_num_accepted_tokens"] for x in client.rank_loads) > 0
    finally:
        client.close()


def test_a_killed_worker_during_spec_decoding_fails_the_engine_cleanly(engines):
    """Last in the module (it loses the worker): generation raises EngineDeadError naming the rank and pid within
    seconds, the worker is reaped and later steps fail at once."""
    _, two = engines
    pid = two.executor.procs.pids[1]
    params = SamplingParams(temperature=0, max_tokens=90, ignore_eos=True)
    for i, text in enumerate(TEXTS[:2]):
        two.add_request(f"k{i}", two.tokenizer.encode(text), params)
    two.step()
    assert two.stats.spec_num_drafts or any(r.draft_token_ids for r in two.scheduler.running)
    threading.Timer(0.3, os.kill, (pid, signal.SIGKILL)).start()
    t = time.monotonic()
    with pytest.raises(EngineDeadError, match=f"TP worker rank 1 \\(pid {pid}\\)"):
        while two.has_unfinished_requests():
            two.step()
    assert time.monotonic() - t < 0.3 + 10  # generous on a shared host: a dead peer is seen in milliseconds
    assert not two.executor.procs.procs[1].is_alive()
    with pytest.raises(EngineDeadError):
        two.step()
