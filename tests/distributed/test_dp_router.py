"""The DP front end's rank choice (distributed.dp_router) on its own: least loaded, session and first-block
affinity, the overload guard, pinning, and the random reference."""

import pytest

from dsserve.distributed.dp_router import DPRouter

BLOCK = 4


def test_least_loaded_without_a_key():
    r = DPRouter(3, BLOCK)
    assert [r.choose([1, 2]) for _ in range(3)] == [0, 1, 2]  # prompts shorter than a block carry no key
    r.finished(1)
    assert r.choose([7]) == 1 and r.load == [1, 1, 1]


def test_a_sessions_turns_stay_on_one_rank_while_others_arrive():
    r = DPRouter(2, BLOCK)
    first = r.choose([1, 2, 3, 4, 5], session_id="s1")
    other = r.choose([9, 9, 9, 9, 9], session_id="s2")
    assert other != first  # the least loaded rank for a new session
    for turn in range(5):
        assert r.choose([1, 2, 3, 4, 5, 6 + turn], session_id="s1") == first
        r.finished(first)
    assert r.affine == 5


def test_without_a_session_the_first_block_is_the_key_and_the_salt_separates():
    r = DPRouter(2, BLOCK)
    a = r.choose([1, 2, 3, 4, 10])
    r.choose([5, 5, 5, 5])  # another conversation: the other rank
    assert r.choose([1, 2, 3, 4, 11, 12]) == a  # the same first block: the same rank, though it is busier
    assert r.key([1, 2, 3, 4], cache_salt="x") != r.key([1, 2, 3, 4])


def test_overload_guard_lets_a_busy_affine_rank_go():
    r = DPRouter(2, BLOCK, slack=2)
    a = r.choose([0], session_id="hot")
    for _ in range(2):
        assert r.choose([0], session_id="hot") == a  # load 2, 3 against 0: within the slack
    moved = r.choose([0], session_id="hot")  # load 3 > 0 + 2: the least loaded takes it, and the key follows
    assert moved != a and r.choose([0], session_id="hot") == moved


def test_pinning_and_its_bounds():
    r = DPRouter(2, BLOCK)
    assert r.choose([1, 2, 3, 4], rank=1) == 1 and r.load == [0, 1]
    with pytest.raises(ValueError, match="rank 2 does not exist: ranks are 0..1"):
        r.choose([1], rank=2)


def test_random_policy_ignores_affinity_and_bad_policies_are_named():
    r = DPRouter(2, BLOCK, policy="random", seed=1)
    picks = {r.choose([1, 2, 3, 4], session_id="s") for _ in range(20)}
    assert picks == {0, 1}
    with pytest.raises(ValueError, match="policy 'fast'"):
        DPRouter(2, BLOCK, policy="fast")
