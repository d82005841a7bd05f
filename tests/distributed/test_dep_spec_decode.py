"""DSpark speculative decoding under DEP (DP attention x EP2 over two gloo ranks, the built-in trained model in
fp64): the drafter's MoE is expert parallel too, so every rank joins every draft pass (``idle_draft`` where it has
nothing to draft), agreed through the lockstep's step summary. The greedy tokens equal one engine's with drafts off,
over concurrent requests with one rank idle for part of the run (no hang); with --enable-eplb and a rebalance due
every few steps the draft's placement really switches and the tokens do not change; the DP front end's /metrics
then carries the draft's EPLB balance gauges."""

import pytest
import torch

from dsserve.distributed import eplb_policy
from dsserve.distributed.dp_client import DPClient
from dsserve.distributed.dp_rank import build_rank_core
from dsserve.distributed.groups import new_groups
from dsserve.engine.args import EngineArgs
from dsserve.engine.core import EngineCore
from dsserve.engine.sampling_params import SamplingParams
from dsserve.server.metrics import EngineMetrics

ARGS = dict(model="tiny-trained", dtype="float64", device="cpu", max_num_seqs=4, max_model_len=256, seed=0)
SPEC = {"method": "dspark", "num_speculative_tokens": 3}
EPLB = dict(
    enable_eplb=True,
    num_redundant_experts=2,
    num_redundant_draft_experts=2,
    eplb_window_size=3,
    eplb_step_interval=2,
    eplb_transfer_chunk=4,
    eplb_min_gain=0.0,
    eplb_figures_interval=1,
)
PROMPTS = ["12+7=", "Q: 3*4 A:", "abcabcabc", "Hello, how", "9-5=", "x y x y x", "1 2 3 4", "The cat"]
# (rank, prompt index, max tokens): wave 1 on both ranks, rank 1's requests short (it idles while rank 0 drafts on);
# wave 2 on rank 0 alone
WAVES = [[(0, 0, 14), (0, 1, 10), (0, 2, 12), (1, 3, 4), (1, 4, 3)], [(0, 5, 9), (0, 6, 6)]]


def params(n: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)


@pytest.fixture(scope="module")
def want() -> dict:
    """One engine, drafts off, every request of the waves."""
    engine = EngineCore(EngineArgs(**ARGS))
    for wave in WAVES:
        for _, i, n in wave:
            engine.add_request(f"r{i}", engine.tokenizer.encode(PROMPTS[i]), params(n))
    out = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                out[o.request_id] = list(o.outputs[0].token_ids)
    return out


@torch.no_grad()
def _dep2(rank: int, eplb: bool) -> dict:
    g = new_groups(1, 2)
    args = EngineArgs(**ARGS, speculative_config=SPEC, **(EPLB if eplb else {}))
    core = build_rank_core(args, g.dp_rank, 2, g.ep)
    lock, tokens = core.lockstep, {}
    for wave in WAVES:
        for r, i, n in wave:
            if r == rank:
                core.add_request(f"r{i}", core.tokenizer.encode(PROMPTS[i]), params(n))
        lock.seen, lock.awake = lock.seen + 1, True  # what the rank loop does when the front end announces a wave
        while lock.awake:
            for o in core.step():
                if o.finished:
                    tokens[o.request_id] = list(o.outputs[0].token_ids)
    out = {
        "tokens": tokens,
        "drafts": core.stats.counters()["spec_num_drafts"],
        "accepted": core.stats.counters()["spec_num_accepted_tokens"],
        "draft_steps": lock.draft_steps,
        "idle_drafts": lock.idle_drafts,
        "idle_steps": lock.idle_steps,
        "draft_calls": core.model.mtp[0].ffn.calls,
    }
    if eplb:
        e = lock.eplb
        e.close()
        out.update(
            switched={m.name: len(m.switched) for m in e.models},
            rebalances={m.name: m.rebalances for m in e.models},
            phy2log={m.name: m.phy2log for m in e.models},
            report=e.report(),
        )
    return out


def _check_tokens(out: list[dict], want: dict) -> None:
    for rank, o in enumerate(out):
        mine = {f"r{i}" for wave in WAVES for r, i, _ in wave if r == rank}
        assert o["tokens"] == {k: want[k] for k in mine}
        assert o["drafts"] > 0 and o["accepted"] > 0  # the trained drafter proposed, and was mostly right
    a, b = out
    # every rank ran the same draft passes, rank 1 idle in some (its requests done, or none in wave 2)
    assert a["draft_steps"] == b["draft_steps"] > 0 and a["draft_calls"] == b["draft_calls"]
    assert b["idle_drafts"] > 0 and b["idle_steps"] > 0


def test_dep2_with_drafts_gives_the_tokens_of_one_engine_without_them(workers, want):
    _check_tokens(workers.run(_dep2, False), want)


def test_dep2_with_drafts_and_eplb_rebalancing_keeps_the_tokens(workers, want):
    """A rebalance due every 2 steps, with redundant slots in the target and the drafter: both placements switch
    mid-run (experts moved between the ranks), the tokens stay one engine's."""
    out = workers.run(_dep2, True)
    _check_tokens(out, want)
    a, b = out
    assert a["phy2log"] == b["phy2log"]
    for name in ("target", "draft"):
        assert a["rebalances"][name] >= 1 and a["switched"][name] > 0, (a["rebalances"], a["switched"])
    initial = tuple(eplb_policy.initial_layer(4, 2, 2))  # tiny-trained's drafter: 4 experts, 2 redundant slots
    assert any(p != initial for p in a["phy2log"]["draft"])
    (fig,) = [f for f in a["report"].models if f.model == "draft"]
    overall, layers = fig.balance["step"]
    assert 0 < overall <= 1 and len(layers) == len(a["phy2log"]["draft"])
    assert fig.rebalances == a["rebalances"]["draft"] and fig.bytes_moved_total > 0


def test_dep2_front_end_metrics_carry_the_drafts_eplb_balance(want):
    """`-dp 2 --enable-expert-parallel --enable-eplb` with drafts through the DP front end (spawned ranks): the
    tokens are one engine's, and /metrics carries the draft's EPLB figures next to the target's."""
    client = DPClient(
        EngineArgs(**ARGS, data_parallel_size=2, enable_expert_parallel=True, speculative_config=SPEC, **EPLB)
    )
    try:
        metrics = EngineMetrics(model_name="tiny-trained")
        reqs = [(i, n) for wave in WAVES for _, i, n in wave]
        for i, n in reqs:
            client.add_request(f"r{i}", client.tokenizer.encode(PROMPTS[i]), params(n))
        got = {}
        while client.has_unfinished_requests():
            for o in client.step():
                if o.finished:
                    got[o.request_id] = list(o.outputs[0].token_ids)
            metrics.observe_step(client)
        assert got == want
        assert all(n > 0 for n in client.router.routed), client.router.routed
        text = metrics.render()[0].decode()
        for kind in ("step", "window"):
            for layer in ("all", "0"):
                line = f'dsserve:eplb_balance_{kind}{{layer="{layer}",model="draft",model_name="tiny-trained"}}'
                assert line in text, text
        drafts = [x for x in text.splitlines() if x.startswith("dsserve:eplb_balance_step{") and 'model="draft"' in x]
        assert drafts and all(0 < float(x.split()[-1]) <= 1 for x in drafts), drafts
    finally:
        client.close()
