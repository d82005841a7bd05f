"""`dsserve serve -tp 2 -dp 2 --enable-expert-parallel` as a process: 2 DP ranks, each with its own TP worker (4 rank
processes under the server). A greedy request pinned to either rank gets the single-process engine's text; when the
TP worker of DP rank 1 is killed mid-request, the requests in flight on both ranks get a 503 within seconds, the
server exits non-zero and none of its processes is left (checked by pid)."""

import os
import signal
import sys
import threading
import time

import httpx

from dsserve.engine.llm import LLM
from dsserve.engine.sampling_params import SamplingParams

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from live_server import SERVER_ARGS, spawn  # noqa: E402
from test_dp_server import assert_none_left, cmdline, descendants  # noqa: E402

FAIL_WITHIN_S = 10.0  # generous on a shared 2-core host: gloo sees the dead peer's socket close in milliseconds


def _children(pid: int, among: list[int]) -> list[int]:
    out = []
    for p in among:
        try:
            with open(f"/proc/{p}/stat") as f:
                if int(f.read().rsplit(")", 1)[1].split()[1]) == pid:
                    out.append(p)
        except OSError:
            pass
    return sorted(out)


def test_tp2_dp2_server_serves_then_a_killed_tp_worker_ends_it_cleanly():
    proc, base = spawn("tiny", [*SERVER_ARGS, "-tp", "2", "-dp", "2", "--enable-expert-parallel"])
    try:
        one = LLM(model="tiny", device="cpu", dtype="float64", block_size=16, seed=0)
        for rank, prompt in ((0, "hello there"), (1, "pinned to one")):
            want = one.generate([prompt], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
            body = {"model": "tiny", "prompt": prompt, "max_tokens": 4, "temperature": 0}
            r = httpx.post(base + "/v1/completions", json=body, headers={"X-data-parallel-rank": str(rank)}, timeout=60)
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["text"] == want[0].outputs[0].text, rank

        procs = descendants(proc.pid)
        spawned = [p for p in procs if "spawn_main" in cmdline(p) and "resource_tracker" not in cmdline(p)]
        dp_ranks = [p for p in _children(proc.pid, spawned)]  # spawned in rank order
        assert len(dp_ranks) == 2 and len(spawned) == 4, [cmdline(p) for p in procs]
        (worker,) = _children(dp_ranks[1], spawned)  # DP rank 1's TP worker (global rank 3)

        replies = {}

        def long_request(rank: int):
            body = {"model": "tiny", "prompt": f"a long one {rank}", "max_tokens": 300, "ignore_eos": True}
            hdr = {"X-data-parallel-rank": str(rank)}
            r = httpx.post(base + "/v1/completions", json=body, headers=hdr, timeout=60)
            replies[rank] = (r.status_code, r.json())

        threads = [threading.Thread(target=long_request, args=(r,)) for r in (0, 1)]
        for t in threads:
            t.start()
        time.sleep(1.5)  # both are decoding
        killed = time.monotonic()
        os.kill(worker, signal.SIGKILL)
        for t in threads:
            t.join(30)
        assert time.monotonic() - killed < FAIL_WITHIN_S
        for rank in (0, 1):
            status, body = replies[rank]
            why = body["error"]["message"]
            assert status == 503 and "the engine stopped" in why, (rank, body)
            assert "DP rank 1" in why and f"TP worker rank 3 (pid {worker})" in why, why  # who failed, by its pid
        code = proc.wait(timeout=30)
        assert code != 0
        assert_none_left(procs)
    finally:
        if proc.poll() is None:
            proc.kill()
