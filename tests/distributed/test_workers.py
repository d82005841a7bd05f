"""The rank-process harness itself: results come back in rank order, and a rank that raises fails the call with
its traceback (not a hang), after which the torn-down workers refuse further calls at once."""

import pytest

WORLD = 2


def _rank_and_arg(rank: int, arg: str) -> tuple[int, str]:
    return rank, arg


def _raise_on_rank_1(rank: int) -> int:
    if rank == 1:
        raise ValueError("rank 1 is broken on purpose")
    return rank


def test_results_in_rank_order_then_a_failure_is_reported(workers):
    assert workers.run(_rank_and_arg, "x") == [(0, "x"), (1, "x")]
    with pytest.raises(RuntimeError, match="(?s)failed on rank 1.*broken on purpose"):
        workers.run(_raise_on_rank_1)
    with pytest.raises(RuntimeError, match="torn down by an earlier failure"):
        workers.run(_rank_and_arg, "y")
    assert not any(p.is_alive() for p in workers.procs)
