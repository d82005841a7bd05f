"""The EP balance figures on fixed numbers: the front end's per-step gathering (dp_client.EPBalance) and the bench's
window from two /metrics texts (bench.agentx.ep_balance)."""

import pytest

from dsserve.bench.agentx import ep_balance, rank_tokens
from dsserve.distributed.dp_client import EPBalance


def test_ep_balance_waits_for_every_rank_then_sums_the_window():
    b = EPBalance(2)
    b.add(0, 1, (4, 0))  # step 1, rank 0: 4 rows in layer 0, none in layer 1
    assert b.steps == 0  # rank 1 has not reported step 1
    b.add(1, 1, (4, 6))
    b.add(1, 2, (2, 2))  # ranks may report a step in either order
    b.add(0, 2, (6, 2))
    assert b.steps == 2 and b.window == [[10, 6], [2, 8]]
    assert b.layer_balance() == [pytest.approx(8 / 10), pytest.approx(5 / 8)]
    assert b.step_ratios == [pytest.approx((4 + 3) / (4 + 6)), pytest.approx((4 + 2) / (6 + 2))]
    s = b.summary()
    assert s["window_balance"] == pytest.approx(5 / 8) and s["rows_per_rank_per_step"] == pytest.approx(26 / 2 / 2 / 2)


def metrics(rows: dict, steps: float) -> str:
    lines = [
        f'dsserve:ep_expert_rows_total{{layer="{layer}",model_name="t",rank="{r}"}} {n}'
        for (layer, r), n in rows.items()
    ]
    return "\n".join([*lines, f'dsserve:ep_steps_total{{model_name="t"}} {steps}']) + "\n"


def test_bench_ep_balance_from_two_scrapes():
    before = metrics({(0, 0): 10, (0, 1): 10, (1, 0): 5, (1, 1): 0}, 3)
    after = metrics({(0, 0): 30, (0, 1): 20, (1, 0): 5, (1, 1): 10}, 8)
    e = ep_balance(before, after)  # window: layer 0 rows 20 / 10, layer 1 rows 0 / 10
    assert e["ep_ranks"] == 2 and e["steps"] == 5
    assert e["per_layer"] == {"0": pytest.approx(15 / 20), "1": pytest.approx(5 / 10)}
    assert e["overall"] == pytest.approx((15 + 5) / (20 + 10)) and e["worst_layer"] == 1
    assert e["rows_per_rank_per_layer_step"] == pytest.approx(40 / 2 / 2 / 5)
    assert ep_balance("", "") is None  # a server without expert parallelism


def test_rank_tokens_counts_profiled_requests_per_pinned_rank():
    recs = [
        dict(phase="profile", error=None, dp_rank=0, osl=6),
        dict(phase="profile", error=None, dp_rank=1, osl=3),
        dict(phase="warmup", error=None, dp_rank=1, osl=50),
        dict(phase="profile", error="HTTP 503", dp_rank=1, osl=0),
    ]
    assert rank_tokens(recs) == {"tokens": {"0": 6, "1": 3}, "imbalance": pytest.approx(4.5 / 6)}
    assert rank_tokens([dict(phase="profile", error=None, dp_rank=None, osl=4)]) is None
