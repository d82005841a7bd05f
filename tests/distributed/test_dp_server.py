"""`dsserve serve -dp 2 --enable-expert-parallel` as a process: it serves, pins a request by X-data-parallel-rank,
exports each rank's load with a `rank` label, and when a DP rank is killed mid-request the request gets a 503 within
seconds, /health is unhealthy, the server exits non-zero and none of its processes is left (checked by pid)."""

import json
import os
import signal
import sys
import threading
import time

import httpx

from dsserve.cli import main
from dsserve.models.presets import preset

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from live_server import SERVER_ARGS, spawn  # noqa: E402


def descendants(pid: int) -> list[int]:
    """Every live process below ``pid``, from /proc."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        for c in children.get(todo.pop(), []):
            out.append(c)
            todo.append(c)
    return out


def running(pid: int) -> bool:
    """Alive and not a zombie (a dead child whose new parent, init, has not reaped it yet)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def assert_none_left(pids: list[int], within_s: float = 5.0) -> None:
    """Every process of ``pids`` gone within ``within_s`` (multiprocessing's resource tracker leaves when its pipe
    closes); the ones left are named by their command lines."""
    deadline = time.monotonic() + within_s
    while any(running(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    left = [p for p in pids if running(p)]
    assert not left, [cmdline(p) for p in left]


def cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def bench_replay(base: str, tmp_path) -> None:
    """`dsserve bench agentx --dp-replay lag`: the same requests on both ranks, rank 1's a second later; each rank's
    output tokens, and the EP balance of the window from the server's per-layer, per-rank expert rows."""
    argv = ["bench", "agentx", "--base-url", base, "--preset", "small", "--seed", "1", "--concurrency", "1"]
    argv += ["--duration", "3", "--fast", "--num-sessions", "2", "--scale", "0.02", "--output-dir", str(tmp_path)]
    assert main([*argv, "--dp-replay", "lag", "--lag", "1"]) == 0
    (pt,) = json.loads((tmp_path / "summary.json").read_text())["points"]
    assert pt["errors"] == 0 and pt["dp_replay"] == "lag"
    tokens = pt["dp_rank_tokens"]["tokens"]
    assert set(tokens) == {"0", "1"} and 0 < pt["dp_rank_tokens"]["imbalance"] <= 1
    ep = pt["ep_balance"]
    assert ep["ep_ranks"] == 2 and 0.5 <= ep["overall"] <= 1 and ep["steps"] > 0
    assert ep["rows_per_rank_per_layer_step"] > 0 and len(ep["per_layer"]) == preset("tiny").num_hidden_layers


def test_dp_server_serves_then_a_killed_rank_ends_it_cleanly(tmp_path):
    proc, base = spawn("tiny", [*SERVER_ARGS, "-dp", "2", "--enable-expert-parallel"])
    try:
        ok = httpx.post(
            base + "/v1/completions", json={"model": "tiny", "prompt": "hello", "max_tokens": 3}, timeout=60
        )
        assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 3
        pinned = {"model": "tiny", "prompt": "pinned", "max_tokens": 2}
        r = httpx.post(base + "/v1/completions", json=pinned, headers={"X-data-parallel-rank": "1"}, timeout=60)
        assert r.status_code == 200
        bad = httpx.post(base + "/v1/completions", json=pinned, headers={"X-data-parallel-rank": "2"}, timeout=60)
        assert bad.status_code == 400 and "ranks are 0..1" in bad.json()["error"]["message"]
        metrics = httpx.get(base + "/metrics", timeout=10).text
        assert 'dsserve:dp_rank_requests_routed{model_name="tiny",rank="1"} 1.0' in metrics
        assert 'dsserve:dp_rank_requests_routed{model_name="tiny",rank="0"}' in metrics
        assert 'rank="1"' in metrics and "dsserve:dp_rank_prefix_cache_hit_rate" in metrics
        bench_replay(base, tmp_path)
        procs = descendants(proc.pid)
        ranks = [p for p in procs if "spawn_main" in cmdline(p) and "resource_tracker" not in cmdline(p)]
        assert len(ranks) == 2, [cmdline(p) for p in procs]

        reply = {}

        def long_request():
            body = {"model": "tiny", "prompt": "a long one", "max_tokens": 200, "ignore_eos": True}
            t0 = time.monotonic()
            r = httpx.post(base + "/v1/completions", json=body, timeout=60)
            reply.update(status=r.status_code, body=r.json(), seconds=time.monotonic() - t0)

        t = threading.Thread(target=long_request)
        t.start()
        time.sleep(1.0)  # the request is decoding
        killed = time.monotonic()
        os.kill(ranks[-1], signal.SIGKILL)
        t.join(30)
        assert reply["status"] == 503 and "the engine stopped" in reply["body"]["error"]["message"]
        assert time.monotonic() - killed < 10
        try:  # unhealthy at once: 503 while the server stops, refused once it has
            assert httpx.get(base + "/health", timeout=5).status_code == 503
        except httpx.TransportError:
            pass
        code = proc.wait(timeout=30)
        assert code != 0
        assert_none_left(procs)
    finally:
        if proc.poll() is None:
            proc.kill()
