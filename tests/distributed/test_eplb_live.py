"""EPLB live on DEP2 (two gloo ranks, fp64, tiny): the engine's paged path in lockstep and DSpark draft passes, with
redundant experts and a rebalance forced every few steps (weights moved chunk by chunk between steps, maps switched
between steps): greedy tokens and logits equal the same run without EPLB, and the single-process oracle's; every
rank agrees on the placement; no step boundary ran more than one transfer chunk."""

import torch
from test_expert_parallel import _draft
from test_paged_parallel import RANK_PROMPTS, Serving, _check
from tiny import sequences, tiny_model

from dsserve.distributed.eplb import Eplb, EplbConfig, UniformRouting
from dsserve.distributed.expert_parallel import idle_draft, idle_forward, shard_expert_parallel
from dsserve.distributed.groups import new_groups
from dsserve.distributed.step_sync import StepSummary, StepSync

CFG = EplbConfig(
    window_size=3,
    step_interval=2,
    num_redundant_experts=2,
    num_redundant_draft_experts=2,
    transfer_chunk=16,
    min_gain=0.0,
)
DRAFT_STEPS = 8


def _serve(model, rank, group, eplb):
    s, sync = Serving(model, RANK_PROMPTS[rank]), StepSync(group)
    while True:
        plan = s.sched.schedule() if s.sched.has_unfinished() else None
        n = 0 if plan is None else plan.num_tokens
        summary = StepSummary(n, 0 if plan is None else len(plan.chunks), int(s.sched.has_unfinished()), 0)
        if StepSync.wave_done(sync.gather(summary)):
            break
        s.step(plan) if n else idle_forward(model)
        if eplb is not None:
            eplb.step()
    return s.result()


def _drafts(model, rank, eplb):
    """DRAFT_STEPS steps of a target forward and a draft block a rank (rank 1 idles in the last two draft passes),
    the sequence growing by the target's greedy token each step."""
    seq, out = sequences(40 + rank, (20,))[0], []
    for i in range(DRAFT_STEPS):
        if rank == 1 and i >= DRAFT_STEPS - 2:
            model(seq)
            idle_draft(model)
        else:
            out.append(_draft(model, seq))
        seq = torch.cat((seq, model.logits(model(seq).hidden[-1:]).argmax(-1)))
        if eplb is not None:
            eplb.step()
    return out


@torch.no_grad()
def _run(rank: int, with_eplb: bool) -> dict:
    g = new_groups(1, 2)
    if with_eplb:
        model, eplb = Eplb.shard(tiny_model("tiny"), g.dp_rank, 2, g.ep, CFG)
    else:
        model, eplb = shard_expert_parallel(tiny_model("tiny"), g.dp_rank, 2, g.ep), None
    result = _serve(model, rank, g.ep, eplb)
    served = 0 if eplb is None else eplb.steps
    drafts = _drafts(model, rank, eplb)
    out = {"result": result, "drafts": drafts}
    if eplb is not None:
        while eplb.transfers:  # let the last rebalance land (idle boundaries), as serving would
            eplb.step()
        eplb.close()
        out.update(
            steps=eplb.steps,
            served=served,
            switched={m.name: m.switched for m in eplb.models},
            waited=eplb.steps_waited,
            chunks=eplb.chunks_total,
            max_chunks=eplb.max_chunks_per_step,
            rebalances={m.name: m.rebalances for m in eplb.models},
            phy2log={m.name: m.phy2log for m in eplb.models},
            moved={m.name: m.last_bytes_moved for m in eplb.models},
            peak={m.name: (m.staging_peak, m.staging_bound) for m in eplb.models},
            report=eplb.report(),
        )
    return out


def test_rebalancing_mid_run_changes_no_output(workers):
    plain = workers.run(_run, False)
    live = workers.run(_run, True)
    for rank in range(2):
        _check(RANK_PROMPTS[rank], live[rank]["result"])
        for (t0, l0), (t1, l1) in zip(plain[rank]["result"], live[rank]["result"]):
            assert t0 == t1
            assert (l0 - l1).abs().max().item() < 1e-12
        assert len(live[rank]["drafts"]) == len(plain[rank]["drafts"]) > 0
        for a, b in zip(plain[rank]["drafts"], live[rank]["drafts"]):
            assert torch.equal(a[0], b[0])  # the draft tokens
            assert max((x - y).abs().max().item() for x, y in zip(a[1:], b[1:])) < 1e-12
    ref = tiny_model("tiny")
    with torch.no_grad():
        want = _draft(ref, sequences(40, (20,))[0])
    assert torch.equal(live[0]["drafts"][0][0], want[0])
    a, b = live
    assert a["phy2log"] == b["phy2log"] and a["steps"] == b["steps"]
    for name in ("target", "draft"):  # both models rebalanced, their own placements, weights really moved
        assert a["rebalances"][name] >= 1, a["rebalances"]
        assert a["moved"][name] > 0
        assert any(p != tuple(s % len(set(p)) for s in range(len(p))) for p in a["phy2log"][name])
        for rank in range(2):
            peak, bound = live[rank]["peak"][name]
            assert 0 < peak <= bound
        (fig,) = [f for f in a["report"].models if f.model == name]
        assert fig.rebalances == a["rebalances"][name] and fig.bytes_moved_last == a["moved"][name]
        assert fig.bytes_moved_total >= fig.bytes_moved_last and fig.staging_peak == a["peak"][name][0]
        for kind in ("step", "window", "before", "before_predicted", "after_predicted"):
            overall, layers = fig.balance[kind]
            assert 0 < overall <= 1 and len(layers) == len(a["phy2log"][name]), (kind, fig.balance)
            assert all(0 < b <= 1 for b in layers)
    # a rebalance never blocks a step for longer than one transfer chunk: every chunk ran at its own boundary
    assert a["max_chunks"] == 1 and a["waited"] == a["chunks"] > 0
    # layers switched mid-run: while serving (target) and between draft passes (draft)
    assert any(step < a["served"] for _, step in a["switched"]["target"])
    assert any(a["served"] < step < a["served"] + DRAFT_STEPS for _, step in a["switched"]["draft"])
    assert a["report"].steps_waited == a["waited"] and a["report"].steps == a["steps"]


@torch.no_grad()
def _packed(rank: int, fmt: str) -> dict:
    """Reference forwards of this rank's sequences with packed experts only (no dense copies), a rebalance forced
    before each: the packed bytes and scales are what moves."""
    from dsserve.models.quantize import quantize_experts

    g = new_groups(1, 2)
    model = tiny_model("tiny")
    quantize_experts(model, fmt, keep_dense=False)
    cfg = EplbConfig(num_redundant_experts=2, num_redundant_draft_experts=2, transfer_chunk=4, min_gain=0.0)
    model, eplb = Eplb.shard(model, g.dp_rank, 2, g.ep, cfg)
    logits = []
    for s in sequences(50 + rank, (12, 30, 7, 21, 16)):
        logits.append(model.reference_logits(s))
        eplb.rebalance_next()
        eplb.step()
    while eplb.transfers or eplb._policy is not None:
        eplb.step()
    eplb.close()
    return {"logits": logits, "switched": len(eplb.models[0].switched), "moved": eplb.models[0].last_bytes_moved}


def test_packed_experts_move_too(workers):
    out = workers.run(_packed, "mxfp4")
    from dsserve.models.quantize import quantize_experts

    ref = tiny_model("tiny")
    quantize_experts(ref, "mxfp4", keep_dense=False)
    with torch.no_grad():
        for rank, o in enumerate(out):
            assert o["switched"] > 0 and o["moved"] > 0
            for s, got in zip(sequences(50 + rank, (12, 30, 7, 21, 16)), o["logits"]):
                assert (got - ref.reference_logits(s)).abs().max().item() < 1e-9


def test_uniform_routing_draws_distinct_experts_evenly():
    model, eplb = Eplb.shard(tiny_model("tiny"), 0, 1, None, EplbConfig(window_size=2))
    eplb.uniform_routing(seed=1)
    with torch.no_grad():
        model(sequences(60, (400,))[0])
    eplb.step()
    eplb.close()
    load = eplb.models[0].load.window_load()  # [12, 8]: 400 rows x top-2 a layer
    assert load.sum(1).tolist() == [800] * 12
    assert load.min() > 60 and load.max() < 140  # ~100 each (uniform); the router's own: 0 to ~400 an expert
    picks = UniformRouting(8, seed=2)(torch.zeros(500, 3, dtype=torch.long))
    assert (
        (picks[:, 0] != picks[:, 1]).all() and (picks[:, 1] != picks[:, 2]).all() and (picks[:, 0] != picks[:, 2]).all()
    )
