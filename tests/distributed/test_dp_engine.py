"""DEP2 (DP attention x EP2) engine cores in lockstep (distributed.dp_rank): each rank's EngineCore, its MoE layers
expert-parallel over the two gloo ranks, gives the greedy tokens of a single-process engine serving the same requests
and logits within 1e-9 (fp64), over chunked prefills, prefix hits with bounded replay (V4.1) and preemption; a rank
with nothing to serve joins every forward idle, without a hang.

The reference is a single-process engine with the same arguments fed the rank's own requests in the same waves (the
spec's section 7: the scheduler then plans the same batches, so preemption and prefix hits fall alike; bounded replay
is an approximation, so a hit must be compared with a hit). Both run on the rank, side by side."""

import pytest
import torch

from dsserve.distributed.dp_rank import build_rank_core, rank_args
from dsserve.distributed.groups import new_groups
from dsserve.engine.args import EngineArgs
from dsserve.engine.core import EngineCore
from dsserve.engine.sampling_params import SamplingParams
from dsserve.kv.paged import KVLayout
from dsserve.models.presets import preset

MAX_NEW = 4
# KV blocks a rank's cache holds besides its window slots: too few for the waves' running requests, which preempt
BLOCKS = {"tiny": 12, "tiny-v4": 5}
BLOCK_SIZE = {"tiny": 16, "tiny-v4": 128}  # V4: a multiple of its compress ratio 128
LONG = {"tiny": 90, "tiny-v4": 150}  # wave 1's longest prompt: at least one full block, so wave 2 hits it


def engine_args(name: str) -> EngineArgs:
    lay = KVLayout.build(preset(name), BLOCK_SIZE[name], "auto", torch.float64, window_in_blocks=name == "tiny-v4")
    return EngineArgs(
        model=name,
        dtype="float64",
        device="cpu",
        max_num_seqs=8,
        max_num_batched_tokens=40,
        long_prefill_token_threshold=12,  # chunked prefill: prompts of up to 90 tokens take several steps
        block_size=BLOCK_SIZE[name],
        max_model_len=256,
        kv_cache_memory_bytes=8 * lay.bytes_per_slot + BLOCKS[name] * lay.bytes_per_block,
        seed=0,
    )


def waves(rank: int, name: str) -> list[list[tuple[str, list[int]]]]:
    """Three waves of (request id, prompt): 16 concurrent requests over both ranks (rank 0 holds 10), then 8 that
    extend wave 1's prompts on the rank that served them (prefix hits), then 3 on rank 0 alone (rank 1 idle)."""
    g = torch.Generator().manual_seed(7)
    first = [
        torch.randint(3, 8000, (n,), generator=g).tolist() for n in (LONG[name], 33, 47, LONG[name], 5, 64, 18, 71)
    ]
    first += [torch.randint(3, 8000, (n,), generator=g).tolist() for n in (9, 40, 12, 55, 26, 3, 60, 31)]
    owner = [0, 1, 0, 1, 0, 1, 0, 0, 1, 0, 1, 0, 0, 1, 0, 1]
    ext = [p + torch.randint(3, 8000, (10,), generator=g).tolist() for p in first[:8]]
    alone = [torch.randint(3, 8000, (n,), generator=g).tolist() for n in (30, 7, 50)]
    w1 = [(f"a{i}", p) for i, p in enumerate(first) if owner[i] == rank]
    w2 = [(f"b{i}", p) for i, p in enumerate(ext) if owner[i] == rank]
    w3 = [(f"c{i}", p) for i, p in enumerate(alone)] if rank == 0 else []
    return [w1, w2, w3]


def serve(core: EngineCore, rank_waves) -> dict:
    """Each wave's requests added at once, stepped until every rank is done (with lockstep: until the wave ends
    on both ranks); the sampled rows' logits recorded at the runner."""
    logits, tokens, preempted = {}, {}, [0]
    execute, schedule = core.runner.execute, core.scheduler.schedule

    def recording(plan):
        sampling, rows = execute(plan)
        for r, row in zip(sampling, rows):
            logits.setdefault(r.request_id, []).append(row.clone())
        return sampling, rows

    def counting():
        plan = schedule()
        preempted[0] += len(plan.preempted)
        return plan

    core.runner.execute, core.scheduler.schedule = recording, counting
    lock = core.lockstep
    for wave in rank_waves:
        for rid, prompt in wave:
            core.add_request(rid, prompt, SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True))
        if lock is not None:  # what the rank loop does when the front end announces the wave's requests
            lock.seen, lock.awake = lock.seen + 1, True
        while lock.awake if lock is not None else core.has_unfinished_requests():
            for out in core.step():
                if out.finished:
                    tokens[out.request_id] = out.outputs[0].token_ids
    return {
        "tokens": tokens,
        "logits": {k: torch.stack(v) for k, v in logits.items()},
        "preempted": preempted[0],
        "hits": core.stats.prefix_hit_tokens,
        "replayed": core.stats.replayed_rows,
        "idle_steps": 0 if lock is None else lock.idle_steps,
    }


@torch.no_grad()
def _dep2(rank: int, name: str) -> dict:
    g = new_groups(1, 2)
    args = engine_args(name)
    dep = serve(build_rank_core(args, g.dp_rank, 2, g.ep), waves(rank, name))
    alone = serve(EngineCore(rank_args(args, expert_parallel=True)), waves(rank, name))  # the same core, no EP
    return {"dep": dep, "ref": alone}


@pytest.mark.parametrize("name", ["tiny", "tiny-v4"])
def test_dep2_engine_equals_single_process(workers, name):
    out = workers.run(_dep2, name)
    for rank, o in enumerate(out):
        dep, ref = o["dep"], o["ref"]
        assert dep["tokens"] == ref["tokens"] and len(dep["tokens"]) == sum(len(w) for w in waves(rank, name))
        for rid, want in ref["logits"].items():
            assert dep["logits"][rid].shape == want.shape
            assert (dep["logits"][rid] - want).abs().max().item() < 1e-9, (rank, rid)
        assert (dep["preempted"], dep["hits"]) == (ref["preempted"], ref["hits"])
        assert dep["hits"] > 0  # wave 2 extends wave 1's prompts on the same rank
    assert sum(o["dep"]["preempted"] for o in out) > 0  # the small cache preempted somewhere
    if name == "tiny":
        assert sum(o["dep"]["replayed"] for o in out) > 0  # V4.1: the hits rebuilt their windows by bounded replay
    assert out[1]["dep"]["idle_steps"] > 0  # rank 1 joined wave 3 (and its own tails) with idle forwards


@torch.no_grad()
def _dep2_eplb(rank: int, name: str) -> dict:
    from dataclasses import replace

    g = new_groups(1, 2)
    args = replace(
        engine_args(name),
        enable_eplb=True,
        num_redundant_experts=2,
        eplb_window_size=3,
        eplb_step_interval=2,
        eplb_transfer_chunk=4,
        eplb_min_gain=0.0,
    )
    core = build_rank_core(args, g.dp_rank, 2, g.ep)
    dep = serve(core, waves(rank, name))
    eplb = core.lockstep.eplb
    dep["switched"] = len(eplb.models[0].switched)  # the target's layer switches: experts really moved
    dep["boundaries"] = eplb.steps
    return {"dep": dep, "ref": serve(EngineCore(rank_args(args, expert_parallel=True)), waves(rank, name))}


def test_dep2_engine_with_eplb_rebalancing_equals_single_process(workers):
    """--enable-eplb in the DP rank's core: redundant slots, a rebalance due every 2 steps, experts moved between
    the ranks mid-run; the tokens and logits stay the single-process engine's."""
    out = workers.run(_dep2_eplb, "tiny")
    for o in out:
        dep, ref = o["dep"], o["ref"]
        assert dep["tokens"] == ref["tokens"]
        for rid, want in ref["logits"].items():
            assert (dep["logits"][rid] - want).abs().max().item() < 1e-9
        assert dep["boundaries"] > 2 and dep["switched"] > 0


@torch.no_grad()
def _dep2_eplb_uniform(rank: int) -> dict:
    from dataclasses import replace

    g = new_groups(1, 2)
    args = replace(engine_args("tiny"), enable_eplb=True, num_redundant_experts=2, eplb_window_size=64)
    core = build_rank_core(args, g.dp_rank, 2, g.ep, uniform_routing=True)
    dep = serve(core, waves(rank, "tiny")[:1])
    load = core.lockstep.eplb.models[0].load.window_load()  # this rank's picks per (layer, expert)
    return {"tokens": dep["tokens"], "load": load}


def test_dep2_engine_with_eplb_and_uniform_routing(workers):
    """--uniform-routing with --enable-eplb: the picks are replaced before EPLB's replica map and load recorder (the
    balanced reference of the EPLB figures); each rank draws its own."""
    out = workers.run(_dep2_eplb_uniform)
    for rank, o in enumerate(out):
        assert len(o["tokens"]) == len(waves(rank, "tiny")[0])
        load = o["load"].double()
        assert load.min() > 0 and (load.max(1).values / load.mean(1)).max() < 1.6, load  # even, not the router's
    assert not torch.equal(out[0]["load"], out[1]["load"])
