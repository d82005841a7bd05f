"""The engine under tensor parallel (TP2: this process is rank 0, one spawned worker; gloo, fp64, tiny presets)
against the single-process engine with the same options: the same greedy tokens and logits within 1e-9, through
``LLM`` and through ``EngineCore``, over 16 concurrent requests that chunk their prefills, hit the prefix cache,
replay a bounded window (V4.1) and get preempted (a KV cache of a few blocks). One TP engine per model at a time."""

import os
import signal
import threading
import time

import pytest
import torch
from tiny import tiny_model

from dsserve.engine.executor import EngineDeadError
from dsserve.engine.greedy import greedy_generate
from dsserve.engine.llm import LLM
from dsserve.engine.sampling_params import SamplingParams
from dsserve.kv.layout import KVLayout
from dsserve.models.presets import preset

TIMEOUT_S = 15  # a rank lost in a collective fails a test in seconds, not minutes (the group timeout)
os.environ["DSSERVE_DIST_TIMEOUT_S"] = str(TIMEOUT_S)
MAX_NEW = 5


def options(model: str) -> dict:
    """Small steps and a cache too small for every request at once."""
    cfg = preset(model)
    block = 16 if cfg.is_v41 else 128
    lay = KVLayout.build(cfg, block, "auto", torch.float64, window_in_blocks=not cfg.is_v41)
    seqs = 6
    return dict(
        model=model,
        device="cpu",
        dtype="float64",
        block_size=block,
        max_num_seqs=seqs,
        max_num_batched_tokens=48,
        long_prefill_token_threshold=16,
        kv_cache_memory_bytes=(14 if cfg.is_v41 else 7) * lay.bytes_per_block + seqs * lay.bytes_per_slot,
    )


def prompts(model: str) -> list[list[int]]:
    """16 prompts in 4 families that share a prefix of full blocks (two of 16 tokens; V4: one of 128), so later
    ones hit the cache."""
    head = 2 * 16 + 3 if preset(model).is_v41 else 128 + 3
    g = torch.Generator().manual_seed(7)
    heads = [torch.randint(3, 8000, (head,), generator=g).tolist() for _ in range(4)]
    return [heads[i % 4] + torch.randint(3, 8000, (1 + 3 * i,), generator=g).tolist() for i in range(16)]


def serve(llm: LLM, batch: list[list[int]]) -> dict:
    """Runs ``batch`` on the engine core, recording every sampled row's logits from its executor."""
    core, logits = llm.engine, {}
    execute = core.executor.execute

    def recorded(plan):
        sampling, rows = execute(plan)
        for r, row in zip(sampling, rows):
            logits.setdefault(r.request_id, []).append(row.clone())
        return sampling, rows

    core.executor.execute = recorded
    try:
        params = SamplingParams(temperature=0, max_tokens=MAX_NEW)
        exact = SamplingParams(temperature=0, max_tokens=MAX_NEW, prompt_logprobs=2)  # every prompt row's logits
        reqs = [core.add_request(f"r{i}", p, exact if i == 5 else params) for i, p in enumerate(batch)]
        done = {}
        while core.has_unfinished_requests():
            for out in core.step():
                if out.finished:
                    done[out.request_id] = out
    finally:
        del core.executor.execute
    return {
        "tokens": {k: o.outputs[0].token_ids for k, o in done.items()},
        "logits": {k: torch.stack(v) for k, v in logits.items()},
        "cached": sum(o.num_cached_tokens for o in done.values()),
        "preempted": sum(r.num_preemptions for r in reqs),
        "prompt_logprobs": [(lp and {t: x.logprob for t, x in lp.items()}) for lp in done["r5"].prompt_logprobs],
    }


@pytest.fixture(scope="module", params=["tiny", "tiny-v4"])
def engines(request):
    opts = options(request.param)
    one = LLM(**opts)
    two = LLM(tensor_parallel_size=2, **opts)
    yield request.param, one, two
    two.engine.close()


def test_llm_generate_matches_the_single_process_engine(engines):
    model, one, two = engines
    batch = [{"prompt_token_ids": p} for p in prompts(model)[:4]]
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW)
    want = [o.outputs[0].token_ids for o in one.generate(batch, params, use_tqdm=False)]
    got = [o.outputs[0].token_ids for o in two.generate(batch, params, use_tqdm=False)]
    assert got == want


def test_engine_core_tokens_and_logits_match_over_a_busy_batch(engines):
    model, one, two = engines
    one.engine.reset_prefix_cache(), two.engine.reset_prefix_cache()
    skipped = two.engine.runner.decoder_rows_skipped
    want, got = serve(one, prompts(model)), serve(two, prompts(model))
    assert got["tokens"] == want["tokens"] and len(got["tokens"]) == 16
    assert len(got["prompt_logprobs"]) == len(prompts(model)[5])
    for a, b in zip(got["prompt_logprobs"][1:], want["prompt_logprobs"][1:]):
        assert a.keys() == b.keys() and max(abs(a[t] - b[t]) for t in a) < 1e-9
    assert all(len(t) == MAX_NEW for t in got["tokens"].values())
    for rid, rows in want["logits"].items():
        assert rows.shape == got["logits"][rid].shape
        assert (rows - got["logits"][rid]).abs().max().item() < 1e-9
    # the batch did exercise what it claims (the same on both engines: one scheduler, the same decisions)
    assert got["cached"] == want["cached"] > 0, "no prefix hit"
    assert got["preempted"] == want["preempted"] > 0, "no preemption"
    if preset(model).is_v41:  # bounded replay kept prefix-hit rows out of the decoder on the worker's side too
        assert two.engine.runner.decoder_rows_skipped > skipped
    stats = two.engine.executor.stats
    assert stats.max_bytes < 4096, stats  # a step message is small: ids, positions, a few tokens and blocks


def test_a_lost_worker_ends_generate_with_a_clear_error(engines):
    """Last in the module for its engine (it loses its worker). tiny: the worker is killed, generate raises within
    seconds (gloo sees the closed socket), naming the rank and pid. tiny-v4: the worker is stopped (SIGSTOP: alive,
    silent), generate raises when rank 0's collective times out (DSSERVE_DIST_TIMEOUT_S). Either way the worker is
    reaped and later calls fail at once."""
    model, _, two = engines
    pid = two.engine.executor.procs.pids[1]
    killed = model == "tiny"
    lose = threading.Timer(0.5, os.kill, (pid, signal.SIGKILL if killed else signal.SIGSTOP))
    lose.start()
    t = time.monotonic()
    batch = [{"prompt_token_ids": p} for p in prompts(model)[:4]]
    why = f"TP worker rank 1 \\(pid {pid}\\)" if killed else "Timed out"
    with pytest.raises(EngineDeadError, match=why):
        two.generate(batch, SamplingParams(temperature=0, max_tokens=150, ignore_eos=True), use_tqdm=False)
    bound = 10 if killed else TIMEOUT_S + 10  # generous on a shared host: a dead peer is seen in milliseconds
    assert time.monotonic() - t < 0.5 + bound
    assert not two.engine.executor.procs.procs[1].is_alive()  # the stopped one killed by the reaper
    with pytest.raises(EngineDeadError):
        two.generate(batch[:1], SamplingParams(max_tokens=1), use_tqdm=False)


def test_warm_up_and_fixed_shape_decode_steps_run_alike_on_every_rank():
    """The warm-up (engine.warmup, through the executor) and decode steps in fixed shapes (async_scheduling=True on
    the CPU; under TP without the step ahead) on the paged backend, the ops on their torch references: the oracle's
    tokens. (The warm-up's extra buckets, ``ahead_rows``, which the message carries to the workers, run forwards
    only when CUDA graphs capture: on the CPU both ranks build them without a forward, so this cannot check them.)"""
    llm = LLM(
        model="tiny",
        device="cpu",
        dtype="float64",
        tensor_parallel_size=2,
        attention_backend="paged",
        reference_ops="all",
        async_scheduling=True,
        warmup=True,
        max_model_len=128,
        max_num_seqs=2,
        max_num_batched_tokens=64,
    )
    try:
        prompt = list(range(5, 25))  # inside the replay window: the full forward is the oracle
        out = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(temperature=0, max_tokens=6), use_tqdm=False)
        assert llm.engine.runner.graph_steps > 0
        assert out[0].outputs[0].token_ids == greedy_generate(tiny_model("tiny"), prompt, 6, bounded_replay=False)
    finally:
        llm.engine.close()
