"""The EPLB placement policy, the replica choice and the load recorder, in one process: balance >= 0.9 on skewed
(Zipf) loads and on the built-in model's recorded loads where redundancy allows it, never worse than no redundancy,
within a few percent of an exhaustive search on small cases, and slot-preserving."""

import itertools
import random

import pytest
import torch

from dsserve.distributed.eplb_load import ExpertLoad
from dsserve.distributed.eplb_policy import (
    balance,
    check_slots,
    initial_layer,
    place,
    place_layer,
    rank_loads,
)
from dsserve.distributed.eplb_replicas import ReplicaMap
from dsserve.distributed.groups import ParallelConfigError


def zipf(n: int, s: float, seed: int) -> list[float]:
    rng = random.Random(seed)
    w = [1000.0 / (i + 1) ** s for i in range(n)]
    rng.shuffle(w)
    return w


def bal(load, phy2log, ep):
    return balance(rank_loads(load, phy2log, ep))


def check(phy2log, n_experts, n_slots):
    assert len(phy2log) == n_slots and sorted(set(phy2log)) == list(range(n_experts))


@pytest.mark.parametrize("e,ep,r", [(64, 8, 8), (64, 8, 16), (96, 32, 32), (96, 8, 8), (32, 4, 4)])
def test_zipf_loads_balance_with_redundancy(e, ep, r):
    for seed in range(5):
        load = zipf(e, 1.0, seed)
        p = place_layer(load, ep, e + r)
        check(p, e, e + r)
        assert bal(load, p, ep) >= 0.9, (e, ep, r, seed, bal(load, p, ep))


def test_redundancy_is_never_worse_than_none():
    for e, ep in ((16, 4), (32, 8), (24, 2), (12, 3)):
        for s in (0.6, 1.0, 1.4):
            for seed in range(4):
                load = zipf(e, s, seed)
                none = bal(load, place_layer(load, ep, e), ep)
                assert none >= bal(load, initial_layer(e, 0, ep), ep) - 1e-12  # the policy beats contiguous
                for r in range(ep, 3 * ep + 1, ep):
                    now = bal(load, place_layer(load, ep, e + r), ep)
                    assert now >= none - 1e-12, (e, ep, s, seed, r, now, none)


def _best_max(load, ep, n_slots):
    """The lowest possible most-loaded rank: every replica count (<= ep each), every assignment of the replicas to
    ranks of n_slots / ep slots (packs taken in order to skip relabelled ranks). Replicas share load evenly."""
    e, per, best = len(load), n_slots // ep, float("inf")
    for extra in itertools.combinations_with_replacement(range(e), n_slots - e):
        counts = [1 + extra.count(i) for i in range(e)]
        if max(counts) > ep:
            continue
        items = sorted((load[i] / counts[i] for i in range(e) for _ in range(counts[i])), reverse=True)

        def go(j, packs, sizes):
            nonlocal best
            if max(packs) >= best:
                return
            if j == len(items):
                best = max(packs)
                return
            tried = set()
            for p in range(ep):
                if sizes[p] < per and (packs[p], sizes[p]) not in tried:
                    tried.add((packs[p], sizes[p]))
                    packs[p] += items[j]
                    sizes[p] += 1
                    go(j + 1, packs, sizes)
                    packs[p] -= items[j]
                    sizes[p] -= 1

        go(0, [0.0] * ep, [0] * ep)
    return best


@pytest.mark.parametrize("e,ep,r", [(4, 2, 0), (4, 2, 2), (6, 3, 0), (6, 3, 3), (6, 2, 2), (5, 3, 1)])
def test_close_to_an_exhaustive_search_on_small_cases(e, ep, r):
    worst = 1.0
    for seed in range(6):
        load = [float(x) for x in zipf(e, 1.2, seed)]
        p = place_layer(load, ep, e + r)
        best = _best_max(load, ep, e + r)
        got = max(rank_loads(load, p, ep))
        assert got >= best - 1e-9  # the search really is a lower bound
        worst = min(worst, best / got)
    assert worst >= 0.95, worst


def test_a_rebalance_keeps_slots_and_skips_layers_it_cannot_improve():
    e, ep, r = 32, 4, 4
    load = zipf(e, 1.0, 1)
    first = place([load, [0.0] * e], ep, r)
    assert first[1] == first[1] and len(first[1]) == e + r
    again = place([load, [0.0] * e], ep, r, old=first)
    assert again == first  # the same load: nothing moves
    old = initial_layer(e, r, ep)
    new = place_layer(load, ep, e + r, old=old)
    per = (e + r) // ep
    for rank in range(ep):  # an expert that stays on a rank stays in its slot
        for s in range(rank * per, (rank + 1) * per):
            if old[s] in new[rank * per : (rank + 1) * per]:
                assert new[s] == old[s]
    assert place([[0.0] * e], ep, r, old=[old]) == [old]  # nothing recorded: no moves


def test_nodes_pack_before_ranks():
    load = zipf(48, 1.0, 3)
    p = place_layer(load, 8, 64, n_nodes=2)
    check(p, 48, 64)
    assert bal(load, p, 8) >= 0.9


def test_slot_counts_are_checked():
    assert check_slots(8, 2, 2) == 10
    with pytest.raises(ParallelConfigError, match="split evenly over 4"):
        check_slots(8, 2, 4)
    with pytest.raises(ParallelConfigError, match=">= 0"):
        check_slots(8, -1, 1)
    with pytest.raises(ValueError, match="missing"):
        ReplicaMap((0, 1, 1), 3)


def test_replicas_share_a_hot_expert_and_the_choice_is_deterministic():
    m = ReplicaMap((0, 1, 2, 0, 3, 0), 4)  # expert 0 in slots 0, 3, 5
    ids = torch.zeros(300, 2, dtype=torch.long)
    ids[:, 1] = torch.arange(300) % 3 + 1
    slots = m.route(ids, ep_rank=1)
    assert torch.equal(slots, m.route(ids, ep_rank=1))
    hot = torch.bincount(slots[:, 0], minlength=6)[[0, 3, 5]]
    assert hot.tolist() == [100, 100, 100]
    assert torch.equal(torch.tensor(m.phy2log)[slots], ids)  # every pair runs on a replica of its own expert


def test_each_rank_splits_every_expert_exactly_over_its_replicas():
    g = torch.Generator().manual_seed(1)
    phy2log = [0, 1, 2, 0, 3, 0, 1, 4]  # expert 0 on three slots, 1 on two
    m = ReplicaMap(phy2log, 5)
    for rank in range(4):
        ids = torch.randint(0, 5, (37, 2), generator=g)
        slots = m.route(ids, ep_rank=rank)
        assert torch.equal(torch.tensor(phy2log)[slots], ids)
        per_slot = torch.bincount(slots.reshape(-1), minlength=8)
        for ex, replicas in ((0, [0, 3, 5]), (1, [1, 6])):
            got = per_slot[replicas]
            assert got.sum() == (ids == ex).sum() and got.max() - got.min() <= 1, (rank, ex, got)
    assert m.route(torch.zeros(0, 2, dtype=torch.long)).shape == (0, 2)  # an idle forward


def test_the_recorder_counts_per_step_in_a_ring():
    rec = ExpertLoad(n_layers=2, n_experts=4, n_slots=6, ep_size=2, window=3)
    for step in range(5):
        ids = torch.tensor([[step % 4, 1], [2, 3]])
        rec.record(0, ids, ids)
        rec.record(1, ids[:0], ids[:0])  # an idle forward: nothing
        rec.end_step()
    want = torch.zeros(4, dtype=torch.long)
    for step in (2, 3, 4):  # the window keeps the last 3 steps
        want += torch.bincount(torch.tensor([step % 4, 1, 2, 3]), minlength=4)
    assert torch.equal(rec.window_load()[0], want) and rec.window_load()[1].sum() == 0
    ranks = rec.window_rank_load()
    assert ranks.shape == (3, 2, 2) and ranks[:, 0].sum(-1).tolist() == [4, 4, 4]


@pytest.fixture(scope="module")
def recorded():
    """The built-in model's load on its tasks, recorded by EPLB's own recorder (one rank: the device window)."""
    from dsserve.distributed.eplb import Eplb, EplbConfig
    from dsserve.models.loader import load_model
    from dsserve.train.tasks import problem, prompt_ids

    lm = load_model("tiny-trained")
    model, tok = lm.model.eval(), lm.tokenizer
    model, eplb = Eplb.shard(model, 0, 1, None, EplbConfig(window_size=8, num_redundant_experts=0))
    count = lambda s: len(tok.encode(s, add_bos=False))  # noqa: E731
    rows = 0
    with torch.no_grad():
        for task in ("arithmetic", "retrieval", "chat"):
            p = problem(task, "train", 0, count, 64)
            seq = torch.tensor(prompt_ids(tok, p.prompt + p.completion)[:160])
            out = model(seq)
            rows += seq.shape[0]
            state = model.mtp.new_state()
            model.mtp.ingest(out.taps, out.positions, state)
            model.mtp.propose(int(seq[-1]), seq.shape[0] - 1, state, model.embed, model.head)
            eplb.step()
    eplb.close()
    target, draft = (m.load.window_load() for m in eplb.models)
    assert target.sum().item() == 12 * 2 * rows  # every layer, top-2, every row
    assert draft.sum().item() == 3 * 2 * 5 * 3  # 3 stages, top-2, a 5-row block a problem
    return target.tolist(), draft.tolist()


@pytest.mark.parametrize("which,ep,r", [("target", 2, 2), ("target", 4, 4), ("draft", 2, 2), ("draft", 4, 4)])
def test_recorded_loads_of_the_built_in_model(recorded, which, ep, r):
    load = recorded[0] if which == "target" else recorded[1]
    e = len(load[0])
    placed = place(load, ep, r)
    for row, p in zip(load, placed):
        check(p, e, e + r)
        got = bal(row, p, ep)
        assert got >= bal(row, initial_layer(e, 0, ep), ep) - 1e-12  # never worse than no redundancy
        assert got >= bal(row, place_layer(row, ep, e), ep) - 1e-12
        if e + r <= 10:  # small enough to search: >= 0.9 where the best placement reaches it, near the best always
            best = sum(row) / ep / _best_max(row, ep, e + r)
            assert got >= min(0.9, best) - 1e-9 and got >= 0.95 * best, (which, ep, r, row, got, best)
        else:
            assert got >= 0.9, (which, ep, r, row, got)


def test_the_simulation_routes_like_the_live_replica_map():
    from dsserve.distributed.eplb_sim import Routing, scale_experts, simulate, steps_of

    g = torch.Generator().manual_seed(0)
    ids = [torch.randint(0, 4, (3, n, 2), generator=g) for n in (30, 17)]
    r = scale_experts(Routing(4, ids, [torch.randint(0, 100, (x.shape[1],), generator=g) for x in ids]), 2)
    assert all(int(x.max()) < 8 for x in r.ids)
    steps = steps_of(r, slots=6, chunk=2, n_steps=5)
    phy2log = [place_layer([float(i + 1) for i in range(8)], 3, 12)] * 3
    got = simulate(steps, phy2log, 8, 3)
    maps = [ReplicaMap(p, 8) for p in phy2log]
    for i in range(5):
        for layer in range(3):
            want = torch.zeros(3, dtype=torch.long)
            for rank in range(3):  # each source rank's rows in stream order, routed as the live MoE routes them
                rows = [j for j in range(12) if int(steps.stream[j]) % 3 == rank]
                slots = maps[layer].route(steps.ids[layer, i, rows], rank)
                want += torch.bincount((slots // 4).reshape(-1), minlength=3)
            assert torch.equal(got[i, layer], want)
    assert got.sum() == 5 * 3 * 12 * 2


def test_the_report_follows_the_window_and_each_rebalance():
    """One rank, loads recorded by hand: the measured kinds from the first figures refresh; at a rebalance the
    window before it and both expectations; ``after`` once a full window ran the new placement, gone when the next
    rebalance starts; a model that ran nothing (the drafter here) reports no balance at all."""
    from tiny import tiny_model

    from dsserve.distributed.eplb import Eplb, EplbConfig

    cfg = EplbConfig(window_size=2, step_interval=6, figures_interval=1, min_gain=0.0)
    _, eplb = Eplb.shard(tiny_model("tiny"), 0, 1, None, cfg)
    target = eplb.models[0]
    gen = torch.Generator().manual_seed(0)
    seen, versions = {}, []
    for step in range(1, 14):
        for moe in target.moes:
            ids = torch.randint(0, target.n_experts, (6, 2), generator=gen)
            moe.load(ids, ids)  # no redundancy: slot = expert
        eplb.step()
        report = eplb.report()
        versions.append(report.version)
        seen[step] = dict(next(f for f in report.models if f.model == "target").balance)
        assert next(f for f in report.models if f.model == "draft").balance == {}
    assert versions == sorted(versions) and versions[-1] > versions[0]
    assert set(seen[1]) == {"step", "window"} and seen[1]["step"][0] == 1.0  # one rank: always even
    assert set(seen[6]) == {"step", "window", "before", "before_predicted"}  # the trigger
    assert set(seen[7]) == set(seen[6]) | {"after_predicted"}  # the policy's result taken
    assert "after" not in seen[8] and seen[9]["after"] == seen[9]["window"]  # window = steps 7, 8: all after
    assert "after" in seen[12] and "after" not in seen[13]  # the next rebalance's result: its after is to come
    assert len(seen[9]["window"][1]) == len(target.moes)
