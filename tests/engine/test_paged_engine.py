"""Scheduler + paged KV cache + runner against the reference path, greedy, with replay off."""

import random

import pytest
import torch

from dsserve.engine.greedy import greedy_generate
from dsserve.engine.request import Request, RequestStatus
from dsserve.engine.runner import ModelRunner
from dsserve.engine.sampling_params import SamplingParams
from dsserve.engine.scheduler import Scheduler, SchedulerConfig, StepOutput
from dsserve.kv.paged import KVLayout, PagedKVCache
from dsserve.layers import attention

N_REQ, MAX_NEW = 16, 10


def make_prompts(cfg, seed):
    rng = random.Random(seed)
    lens = [1, 2, 5, 33, 64, 90, 7, 31, 32, 50, 3, 120, 17, 65, 40, 11]
    return [[rng.randrange(3, cfg.vocab_size) for _ in range(n)] for n in lens[:N_REQ]]


@pytest.fixture(scope="module")
def references(tiny_models):
    """Greedy continuations, and the oracle's logits at every sampled position (one full-recompute forward
    over prompt + continuation)."""
    out = {}
    for name, m in tiny_models.items():
        prompts = make_prompts(m.cfg, seed=1)
        conts = [greedy_generate(m, p, MAX_NEW, bounded_replay=False) for p in prompts]
        with torch.no_grad():
            logits = [m.reference_logits(torch.tensor(p + c[:-1]))[len(p) - 1 :] for p, c in zip(prompts, conts)]
        out[name] = (prompts, conts, logits)
    return out


def run_engine(
    model,
    prompts,
    chunk,
    num_blocks=None,
    abort_at=None,
    block_size=None,
    kv_dtype="auto",
    dtype=torch.float64,
    device="cpu",
    window_in_blocks=False,
    decode_graphs=None,
):
    """``decode_graphs``: kv cache -> engine.decode_graphs.DecodeGraphs for the runner (None: every step eager)."""
    cfg = model.cfg
    layout = KVLayout.build(
        cfg, block_size=block_size, kv_cache_dtype=kv_dtype, dtype=dtype, window_in_blocks=window_in_blocks
    )
    if num_blocks is None:
        num_blocks = sum(-(-(len(p) + MAX_NEW) // layout.block_size) for p in prompts)
    kv = PagedKVCache(layout, num_blocks, N_REQ, dtype=dtype, device=device)
    sched = Scheduler(
        SchedulerConfig(max_num_batched_tokens=256, max_num_seqs=N_REQ, long_prefill_token_threshold=chunk), kv
    )
    runner = ModelRunner(model, decode_graphs=None if decode_graphs is None else decode_graphs(kv))
    reqs = [Request(str(i), list(p), SamplingParams(temperature=0, max_tokens=MAX_NEW)) for i, p in enumerate(prompts)]
    logits_seen = {r.request_id: [] for r in reqs}
    for r in reqs:
        sched.add(r)
    steps, preemptions = 0, 0
    while sched.has_unfinished():
        plan = sched.schedule()
        preemptions += len(plan.preempted)
        sampling, logits = runner.execute(plan)
        for r, row in zip(sampling, logits):
            logits_seen[r.request_id].append(row)
        sched.update(plan, StepOutput({r.request_id: [int(row.argmax())] for r, row in zip(sampling, logits)}))
        for r in sampling:
            if len(r.output_token_ids) == MAX_NEW:
                sched.finish(r, RequestStatus.FINISHED_LENGTH)
        steps += 1
        if abort_at and steps in abort_at:
            for rid in abort_at[steps]:
                sched.abort(rid)
        sched.check()  # after every step: no leaked block or window slot
        assert steps < 5000
    assert kv.blocks.num_free == kv.blocks.num_blocks and kv.slots.num_free == kv.slots.num_blocks
    return (
        reqs,
        preemptions,
        [torch.stack(logits_seen[r.request_id]) if logits_seen[r.request_id] else None for r in reqs],
    )


# one-token chunks on V4 too would add ~25 s of CI for what its 7-token chunks and decode steps already cover
@pytest.mark.parametrize(
    "name, chunk",
    [("tiny", 1), ("tiny", 7), ("tiny", 64), ("tiny", 0), ("tiny-v4", 7), ("tiny-v4", 64), ("tiny-v4", 0)],
)
def test_engine_greedy_equals_reference(tiny_models, references, name, chunk):
    prompts, expected, ref_logits = references[name]
    if chunk == 1:  # one-token chunks: 8 of the 16 requests (prompt lengths 1 to 90) keep CI time in bounds
        prompts, expected, ref_logits = prompts[:8], expected[:8], ref_logits[:8]
    reqs, _, logits = run_engine(tiny_models[name], prompts, chunk)
    assert [r.output_token_ids for r in reqs] == expected
    for got, ref in zip(logits, ref_logits):
        assert (got - ref).abs().max() < 1e-9


@pytest.mark.parametrize("name", ["tiny", "tiny-v4"])
def test_engine_long_chunks_read_in_blocks_equal_the_masked_square(tiny_models, name, monkeypatch):
    """Prompts of several chunks of more than BANDED_FROM_WINDOWS windows: each chunk reads its own rows in blocks
    and the paged ring's window rows (ring order, empty rows at -1) beside them; tokens and logits are the oracle's
    with every window read as the masked square."""
    m = tiny_models[name]
    band = attention.BANDED_FROM_WINDOWS * m.cfg.sliding_window
    rng = random.Random(7)
    prompts = [[rng.randrange(3, m.cfg.vocab_size) for _ in range(n)] for n in (3 * band + 40, 2 * band + 9)]
    with monkeypatch.context() as square_only, torch.no_grad():
        square_only.setattr(attention, "BANDED_FROM_WINDOWS", 10**9)
        conts = [greedy_generate(m, p, MAX_NEW, bounded_replay=False) for p in prompts]
        ref_logits = [m.reference_logits(torch.tensor(p + c[:-1]))[len(p) - 1 :] for p, c in zip(prompts, conts)]
    banded, calls = attention.banded_attention_with_sink, []
    monkeypatch.setattr(attention, "banded_attention_with_sink", lambda *a, **k: calls.append(1) or banded(*a, **k))
    reqs, _, logits = run_engine(m, prompts, band + 10)
    assert calls
    assert [r.output_token_ids for r in reqs] == conts
    for got, ref in zip(logits, ref_logits):
        assert (got - ref).abs().max() < 1e-9


def test_engine_bf16_kv_rows_are_exact_for_qat_values(tiny_models, references):
    """FP8/FP4-on-grid values fit bf16 exactly, so the debug layout reproduces the reference too."""
    prompts, expected, ref_logits = references["tiny"]
    reqs, _, logits = run_engine(tiny_models["tiny"], prompts, 16, kv_dtype="bf16")
    assert [r.output_token_ids for r in reqs] == expected
    assert max((g - r).abs().max() for g, r in zip(logits, ref_logits)) < 1e-9


@pytest.mark.parametrize("name,paged", [("tiny", False), ("tiny-v4", False), ("tiny-v4", True)])
def test_engine_with_forced_preemption_and_aborts(tiny_models, references, name, paged, monkeypatch):
    """paged: V4 on the batched paged path (every op on its reference), which a preempted request re-enters."""
    import dsserve.layers.attention_paged as AP
    from dsserve.kernels.ops import OPS, KernelOps

    calls, real = [], AP.forward_paged
    monkeypatch.setattr(AP, "forward_paged", lambda *a: calls.append(1) or real(*a))
    prompts, expected, _ = references[name]
    bs = 128 if name == "tiny-v4" else 64
    m = tiny_models[name]
    m.kernel_ops = KernelOps(frozenset(OPS)) if paged else None
    try:
        reqs, preemptions, _ = run_engine(
            m, prompts, chunk=16, num_blocks=6 if bs == 64 else 2, abort_at={3: ["3", "5"], 9: ["0"]}, block_size=bs
        )
    finally:
        m.kernel_ops = None
    assert preemptions > 0 and bool(calls) == paged
    for r, exp in zip(reqs, expected):
        if r.request_id in ("3", "5", "0"):
            assert r.status == RequestStatus.FINISHED_ABORTED and r.output_token_ids == exp[: len(r.output_token_ids)]
        else:
            assert r.output_token_ids == exp
