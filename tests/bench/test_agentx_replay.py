"""`dsserve bench agentx` against a live tiny server, and the in-process `bench latency` / `bench throughput`."""
import csv
import json
import os
import signal
import socket
import subprocess
import sys
import time

import httpx
import pytest

from dsserve.cli import main

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def tiny_server():
    port = _free_port()
    proc = subprocess.Popen([sys.executable, "-m", "dsserve", "serve", "tiny", "--port", str(port), "--dtype",
                             "float64", "--max-num-seqs", "16", "--max-num-batched-tokens", "256", "--block-size",
                             "16", "--seed", "0", "--shutdown-timeout", "5"], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    base = f"http://127.0.0.1:{port}"
    for _ in range(600):
        try:
            if httpx.get(base + "/health", timeout=1).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        if proc.poll() is not None:
            raise RuntimeError("server died:\n" + proc.stdout.read())
        time.sleep(0.1)
    else:
        proc.kill()
        raise RuntimeError("server did not come up")
    yield base
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()


def _last_json(out: str) -> dict:
    return json.loads(out.strip().splitlines()[-1])


def test_agentx_replay_small(tiny_server, tmp_path, capsys):
    out = tmp_path / "ax"
    rc = main(["bench", "agentx", "--base-url", tiny_server, "--preset", "small", "--seed", "1", "--concurrency",
               "2", "--duration", "5", "--warmup", "1", "--num-sessions", "3", "--scale", "0.02",
               "--output-dir", str(out)])
    text = capsys.readouterr().out
    assert rc == 0
    summary = _last_json(text)
    assert "bench agentx" in text and summary["bench"] == "agentx" and summary["model"] == "tiny"
    (pt,) = summary["points"]
    assert pt["conc"] == 2 and pt["all_requests"] > 0 and pt["errors"] == 0
    # the engine's cumulative hit counter moved by exactly the cached tokens the server reported in usage
    assert pt["usage_cached_tokens"] > 0
    assert pt["server_hits_delta"] == pt["usage_cached_tokens"]
    assert 0 < pt["server_hit"] <= 1 and 0 < pt["theoretical_hit"] <= 1

    agg = json.loads((out / "agg_tiny_small_conc2.json").read_text())
    assert agg["conc"] == 2 and agg["dataset"]["preset"] == "small" and agg["tput_per_gpu"] > 0
    assert agg["server_metrics"]["cache"]["gpu_hit_rate"] == pytest.approx(pt["server_hit"])
    rows = [json.loads(line) for line in (out / "requests.jsonl").read_text().splitlines()]
    assert len(rows) == pt["all_requests"]
    assert {r["phase"] for r in rows} <= {"warmup", "profile"} and any(r["phase"] == "profile" for r in rows)
    assert agg["num_requests_total"] == sum(r["phase"] == "profile" for r in rows)
    for r in rows:
        assert r["osl"] == r["max_tokens"] and r["isl"] > 0 and 0 <= r["ttft"] <= r["e2el"]
        assert r["end_ns"] >= r["start_ns"] and r["cached"] is not None and r["cached"] <= r["isl"]
        assert r["conversation_id"].startswith(r["root_id"])
    # a later turn of a conversation reuses at least its parent's prompt blocks that the server could cache
    assert any(r["cached"] > 0 and r["turn_idx"] > 0 for r in rows)
    with open(out / "points.csv") as f:
        (row,) = list(csv.DictReader(f))
    assert row["conc"] == "2" and float(row["tput_per_gpu"]) > 0
    for png in ("tput_vs_intvty.png", "tput_vs_ttft.png"):
        assert (out / png).read_bytes()[:4] == b"\x89PNG"


def test_bench_latency_and_throughput(capsys):
    assert main(["bench", "latency", "--model", "tiny", "--input-len", "8", "--output-len", "4", "--batch-size", "2",
                 "--num-iters", "1", "--num-iters-warmup", "0"]) == 0
    lat = _last_json(capsys.readouterr().out)
    assert lat["bench"] == "latency" and lat["output_tokens"] == 8 and lat["avg_latency_s"] > 0
    assert main(["bench", "throughput", "--model", "tiny", "--num-prompts", "4", "--input-len", "8",
                 "--output-len", "4"]) == 0
    tp = _last_json(capsys.readouterr().out)
    assert tp["bench"] == "throughput" and tp["output_tokens"] == 16 and tp["input_tokens"] == 32
    assert tp["tokens_per_s"] > 0 and tp["output_tokens_per_s"] > 0
