"""The collectives of dsserve.distributed on two gloo ranks, each against its single-process reference."""

import pytest
import torch

from dsserve.distributed.all_gather import all_gather_dim, all_gather_dim_ref
from dsserve.distributed.all_reduce import all_reduce_sum, all_reduce_sum_ref
from dsserve.distributed.all_to_all import (
    all_to_all_counts,
    all_to_all_counts_ref,
    all_to_all_rows,
    all_to_all_rows_ref,
)
from dsserve.distributed.groups import ParallelConfigError, ParallelGroups, new_groups

WORLD = 2


def _inputs(rank: int) -> dict:
    g = torch.Generator().manual_seed(100 + rank)
    counts = torch.randint(0, 4, (WORLD, 3), generator=g)
    if rank == 1:
        counts[:] = 0  # an idle rank: sends nothing, still joins
    return {
        "dense": torch.randn(5, 7, generator=g, dtype=torch.float64),
        "shard": torch.randn(3, 2 + rank, generator=g, dtype=torch.float64),  # uneven along dim 1
        "counts": counts,
        "rows": torch.randn(int(counts.sum()), 4, generator=g, dtype=torch.float64),
    }


def _collectives(rank: int) -> dict:
    import torch.distributed as dist

    x = _inputs(rank)
    recv = all_to_all_counts(x["counts"], dist.group.WORLD)
    send, back = x["counts"].sum(1).tolist(), recv.sum(1).tolist()
    rows = all_to_all_rows(x["rows"], send, back, dist.group.WORLD)
    as_bytes = all_to_all_rows(x["rows"].view(torch.uint8), send, back, dist.group.WORLD).view(torch.float64)
    return {
        "sum": all_reduce_sum(x["dense"].clone(), dist.group.WORLD),
        "gather": all_gather_dim(x["dense"], 0, dist.group.WORLD),
        "gather_uneven": all_gather_dim(x["shard"], -1, dist.group.WORLD, sizes=[2, 3]),
        "recv_counts": recv,
        "rows": rows,
        "bytes": as_bytes,
        # the combine's direction: the received rows go back where they came from
        "returned": all_to_all_rows(rows, back, send, dist.group.WORLD),
    }


def test_each_collective_equals_its_reference(workers):
    out = workers.run(_collectives)
    x = [_inputs(r) for r in range(WORLD)]
    sums = all_reduce_sum_ref([i["dense"] for i in x])
    recv = all_to_all_counts_ref([i["counts"] for i in x])
    rows = all_to_all_rows_ref([i["rows"] for i in x], [i["counts"].sum(1).tolist() for i in x])
    for r, o in enumerate(out):
        assert torch.equal(o["sum"], sums)  # two ranks: the same number (addition commutes)
        assert torch.equal(o["gather"], all_gather_dim_ref([i["dense"] for i in x], 0))
        assert torch.equal(o["gather_uneven"], all_gather_dim_ref([i["shard"] for i in x], 1))
        assert torch.equal(o["recv_counts"], recv[r])
        assert torch.equal(o["rows"], rows[r]) and torch.equal(o["bytes"], rows[r])
        assert torch.equal(o["returned"], x[r]["rows"])
    assert out[1]["rows"].shape[0] == int(x[0]["counts"][1].sum()) > 0  # the idle rank received rows


def _groups(rank: int, tp: int, dp: int):
    import torch.distributed as dist

    g = new_groups(tp, dp)
    seen = {}
    for name in ("tp", "ep"):
        group = getattr(g, name)
        t = torch.tensor([float(rank)])
        seen[name] = None if group is None else all_reduce_sum(t, group).item()
    seen["world"] = all_reduce_sum(torch.tensor([1.0]), dist.group.WORLD).item()
    return g.tp_rank, g.dp_rank, seen


def test_groups_of_a_two_rank_world(workers):
    tp2 = workers.run(_groups, 2, 1)
    assert [t[:2] for t in tp2] == [(0, 0), (1, 0)]
    assert all(t[2] == {"tp": 1.0, "ep": None, "world": 2.0} for t in tp2)
    dep2 = workers.run(_groups, 1, 2)
    assert [t[:2] for t in dep2] == [(0, 0), (0, 1)]
    assert all(t[2] == {"tp": None, "ep": 1.0, "world": 2.0} for t in dep2)


def _agree(rank: int, same: bool) -> str:
    from dsserve.distributed.handshake import agree

    try:
        agree("the test value", "a" if same or rank == 0 else "b", torch.distributed.group.WORLD)
        return "agreed"
    except ParallelConfigError as e:
        return str(e)


def test_ranks_that_disagree_all_fail_fast(workers):
    assert workers.run(_agree, True) == ["agreed", "agreed"]
    assert workers.run(_agree, False) == ["the ranks disagree on the test value: ranks [1] differ from rank 0"] * 2


def test_group_layout_and_bad_sizes():
    tp, ep = ParallelGroups.ranks(2, 2)
    assert tp == [[0, 1], [2, 3]] and ep == [[0, 2], [1, 3]]
    with pytest.raises(ParallelConfigError, match="must equal the world size 1"):
        new_groups(2, 1)


def test_one_rank_needs_no_communication():
    x = torch.randn(3, 4)
    assert all_reduce_sum(x, None) is x and all_gather_dim(x, 0, None) is x
    c = torch.tensor([[2, 1]])
    assert torch.equal(all_to_all_counts(c, None), c)
    assert torch.equal(all_to_all_rows(x, [3], [3], None), x)
    with pytest.raises(ValueError, match="one row per rank"):
        all_to_all_counts(torch.zeros(2, 1, dtype=torch.long), None)


def test_init_world_names_what_is_missing(monkeypatch):
    from dsserve.distributed.groups import init_world

    for var in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(var, raising=False)
    with pytest.raises(ParallelConfigError, match="MASTER_ADDR"):
        init_world("gloo")
    with pytest.raises(ParallelConfigError, match="backend 'mpi'"):
        init_world("mpi")


# Last in the module: it tears the module's workers down on purpose (the harness itself under test: results come back
# in rank order, and a rank that raises fails the call with its traceback, not a hang; the torn-down workers refuse
# further calls at once).
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
