"""``dsserve bench forward`` over spawned ranks (gloo on the CPU, tiny fp32): DEP2, TP2 and TP2 x DEP2 finish and
report one time per rank, the slowest rank's as the step; a rank that cannot build fails the run with its reason."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BASE = ["--model", "tiny", "--dtype", "float32", "--device", "cpu", "--batch", "2", "--context", "40"]


def bench(*extra: str) -> subprocess.CompletedProcess:
    argv = [sys.executable, "-m", "dsserve", "bench", "forward", *BASE, *extra]
    return subprocess.run(argv, capture_output=True, text=True, cwd=ROOT, timeout=300)


@pytest.mark.parametrize(
    "flags, tp, dp, ep",
    [
        (("-dp", "2", "--enable-expert-parallel"), 1, 2, True),
        (("-tp", "2"), 2, 1, False),
        (("-tp", "2", "-dp", "2", "--enable-expert-parallel"), 2, 2, True),
    ],
    ids=["dep2", "tp2", "tp2xdep2"],
)
def test_every_rank_times_the_same_batch(flags, tp, dp, ep):
    r = bench(*flags, "--new-tokens", "1", "--repeats", "2")
    assert r.returncode == 0, r.stderr[-3000:]
    assert "rank 1" in r.stdout and "max ms" in r.stdout
    last = json.loads(r.stdout.strip().splitlines()[-1])
    (res,) = last["results"]
    assert (res["tensor_parallel_size"], res["data_parallel_size"], res["expert_parallel"]) == (tp, dp, ep)
    assert len(res["rank_seconds"]) == len(res["ranks"]) == tp * dp and all(s > 0 for s in res["rank_seconds"])
    for rank in res["ranks"]:
        assert (rank["batch"], rank["context"], rank["new_tokens"]) == (2, 40, 1) and len(rank["times"]) == 2
    # the step is the slowest rank's: per repeat the max over ranks, then the median (of 2: the larger)
    slowest = sorted(max(rk["times"][i] for rk in res["ranks"]) for i in range(2))
    assert res["seconds"] == slowest[1] >= max(min(rk["times"]) for rk in res["ranks"])
    assert res["tokens_per_s"] == pytest.approx(dp * 2 * 1 / res["seconds"])


def test_a_rank_that_cannot_build_fails_the_run():
    r = bench("-tp", "3", "--repeats", "1")  # tiny's 4 heads do not split 3 ways
    assert r.returncode == 1
    assert "tensor parallel size 3 must divide" in r.stderr and "bench forward: rank" in r.stdout
