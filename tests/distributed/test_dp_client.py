"""The DP front end (distributed.dp_client.DPClient) over two spawned DEP ranks (tiny, fp64, gloo): its outputs equal
a single-process engine's, a rank with nothing routed to it joins its peer's steps idle, aborts reach the request's
rank, a session's turns stay on one rank (its prefix cache hits, unlike random routing), and a rank stalled mid-run
fails the group with EngineDeadError once the collective times out, leaving no process behind."""

import os
import signal
import time

import pytest
from engines import PARAMS, prompt, run, same_outputs

from dsserve.distributed.dp_client import DPClient, EngineDeadError
from dsserve.distributed.dp_router import DPRouter
from dsserve.engine.args import EngineArgs
from dsserve.engine.core import EngineCore, RequestError
from dsserve.engine.sampling_params import SamplingParams

ARGS = dict(
    model="tiny",
    dtype="float64",
    device="cpu",
    max_num_seqs=8,
    max_num_batched_tokens=40,
    long_prefill_token_threshold=12,
    block_size=16,
    max_model_len=256,
    seed=0,
)
GROUP_TIMEOUT_S = 8


@pytest.fixture(scope="module")
def client():
    # a collective waiting longer than GROUP_TIMEOUT_S fails its rank (a step of this tiny model takes well under 1 s)
    c = DPClient(EngineArgs(**ARGS, data_parallel_size=2, enable_expert_parallel=True), group_timeout_s=GROUP_TIMEOUT_S)
    yield c
    c.close()


@pytest.fixture(scope="module")
def single():
    return EngineCore(EngineArgs(**ARGS))


def test_outputs_equal_the_single_engine(client, single):
    reqs = {f"r{i}": prompt(i, n) for i, n in enumerate((5, 40, 23, 64, 11, 30))}
    routed = list(client.router.routed)
    same_outputs(run(client, reqs), run(single, reqs), 1e-6)
    assert all(n > m for n, m in zip(client.router.routed, routed))  # both ranks served
    bal = client.ep_balance.summary()
    assert bal["steps"] > 0 and 0 < bal["window_balance"] <= 1 and len(bal["layer_balance"]) == len(single.model.layers)


def test_one_rank_idle_while_the_other_serves(client, single):
    reqs = {f"p{i}": prompt(50 + i, n) for i, n in enumerate((17, 33, 8))}
    idle = client.rank_loads[1].idle_steps
    same_outputs(run(client, reqs, rank=0), run(single, reqs), 1e-6)
    assert client.rank_loads[1].idle_steps > idle and client.rank_loads[1].running == 0


def test_a_text_prompt_is_tokenised_once_and_comes_back_as_text(client, single):
    got, want = run(client, {"t": "hello there"}), run(single, {"t": "hello there"})
    same_outputs(got, want, 1e-6)
    assert got["t"].prompt == "hello there" and got["t"].prompt_token_ids == want["t"].prompt_token_ids


def test_bad_requests_are_refused_before_any_rank_sees_them(client):
    with pytest.raises(RequestError, match="prompt token ids must be ints"):
        client.add_request("bad", [10**9], PARAMS)
    with pytest.raises(RequestError, match="rank 5 does not exist"):
        client.add_request("bad", [1, 2], PARAMS, rank=5)
    assert not client.has_unfinished_requests()


def test_abort_reaches_the_requests_rank(client):
    client.add_request("keep", prompt(7, 20), PARAMS)
    rank = client.add_request("drop", prompt(8, 60), SamplingParams(temperature=0, max_tokens=200, ignore_eos=True))
    client.step()
    client.abort_request("drop")
    done = {}
    while client.has_unfinished_requests():
        done.update({o.request_id: o for o in client.step() if o.finished})
    assert list(done) == ["keep"]
    deadline = time.monotonic() + 30
    while client.rank_loads[rank].running + client.rank_loads[rank].waiting and time.monotonic() < deadline:
        client.step()  # the rank's next report
    assert client.rank_loads[rank].running == client.rank_loads[rank].waiting == 0


def multi_turn(client, sessions: int = 4, turns: int = 3) -> tuple[float, dict]:
    """Each turn of every session at once, a turn's prompt extending the last one's with its reply and 8 new
    tokens; returns the prefix hit rate over the run (tokens) and each session's ranks."""
    assert client.reset_prefix_cache()
    q0 = sum(x.prefix_query_tokens for x in client.rank_loads)
    h0 = sum(x.prefix_hit_tokens for x in client.rank_loads)
    history = {s: prompt(100 + s, 40) for s in range(sessions)}
    ranks = {s: set() for s in range(sessions)}
    for t in range(turns):
        for s in range(sessions):
            ranks[s].add(client.add_request(f"s{s}t{t}", history[s], PARAMS, session_id=f"s{s}"))
        outs = run(client, {})
        for s in range(sessions):
            history[s] = history[s] + outs[f"s{s}t{t}"].outputs[0].token_ids + prompt(200 + 10 * s + t, 8)
    while client.rank_loads[0].running + client.rank_loads[1].running:
        client.step()
    q = sum(x.prefix_query_tokens for x in client.rank_loads) - q0
    h = sum(x.prefix_hit_tokens for x in client.rank_loads) - h0
    return h / q, ranks


def test_session_affinity_keeps_a_sessions_prefix_cache(client):
    hit, ranks = multi_turn(client)
    assert all(len(r) == 1 for r in ranks.values())  # every turn of a session on one rank
    assert len(set().union(*ranks.values())) == 2  # the sessions spread over both ranks
    balance = client.router
    client.router = DPRouter(2, 16, policy="random", seed=4)
    try:
        random_hit, random_ranks = multi_turn(client)
    finally:
        client.router = balance
    print(f"multi-turn prefix hit rate, 2 DP ranks: affinity {hit:.3f}, random {random_hit:.3f}")
    assert any(len(r) > 1 for r in random_ranks.values()) and random_hit < hit


def test_a_stalled_rank_times_out_and_fails_the_group_leaving_nothing(client):
    """Last in the module: it ends the client. Rank 1 stopped (SIGSTOP) mid-run: rank 0 waits in the next lockstep
    gather until the group timeout, fails, and the front end stops both (SIGKILL reaches the stopped one). A killed
    rank (no timeout to wait for) is test_dp_server.py's."""
    client.add_request("long", prompt(9, 30), SamplingParams(temperature=0, max_tokens=200, ignore_eos=True))
    client.step()
    pids = client.pids
    os.kill(pids[1], signal.SIGSTOP)
    t0 = time.monotonic()
    with pytest.raises(EngineDeadError, match="(?s)DP rank 0 failed.*Timed out"):
        while time.monotonic() - t0 < 4 * GROUP_TIMEOUT_S:
            client.step()
    assert time.monotonic() - t0 < GROUP_TIMEOUT_S + 10  # bounded: the group timeout, then the stop
    assert not client.has_unfinished_requests()
    for pid in pids:
        assert not os.path.exists(f"/proc/{pid}"), f"rank pid {pid} left behind"
    with pytest.raises(EngineDeadError):
        client.add_request("late", [1, 2, 3], PARAMS)
