"""`dsserve bench agentx` against a live tiny server, and the in-process `bench latency` / `bench throughput`."""

import asyncio
import csv
import json
import os
import sys

import httpx
import pytest
from rich.console import Console

from dsserve.bench.agentx import reset_cache
from dsserve.cli import main

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from live_server import live_server  # noqa: E402


def test_reset_cache_retries_while_busy_and_says_when_the_server_lacks_it():
    async def reset(codes):
        answers = iter(codes)
        transport = httpx.MockTransport(lambda request: httpx.Response(next(answers)))
        async with httpx.AsyncClient(transport=transport, base_url="http://server") as client:
            return await reset_cache(client, Console(stderr=True, quiet=True), tries=3)

    assert asyncio.run(reset([409, 409, 200])) is True
    assert asyncio.run(reset([409, 409, 409])) is False
    assert asyncio.run(reset([404])) is None  # another engine without the route: the point runs warm


@pytest.fixture(scope="module")
def tiny_server():
    with live_server() as base:
        yield base


def _last_json(out: str) -> dict:
    return json.loads(out.strip().splitlines()[-1])


def test_agentx_replay_small(tiny_server, tmp_path, capsys):
    out = tmp_path / "ax"
    rc = main(
        [
            "bench",
            "agentx",
            "--base-url",
            tiny_server,
            "--preset",
            "small",
            "--seed",
            "1",
            "--concurrency",
            "2",
            "--duration",
            "5",
            "--fast",
            "--num-sessions",
            "3",
            "--scale",
            "0.02",
            "--output-dir",
            str(out),
        ]
    )
    text = capsys.readouterr().out
    assert rc == 0
    summary = _last_json(text)
    assert "bench agentx" in text and summary["bench"] == "agentx" and summary["model"] == "tiny"
    (pt,) = summary["points"]
    assert pt["conc"] == 2 and pt["all_requests"] > 0 and pt["errors"] == 0 and pt["warmup_requests"] == 2
    assert pt["cache_reset"] is True  # the point started on an empty prefix cache (POST /reset_prefix_cache)
    # over the profiling window the engine's cumulative hit counter moved by exactly the cached tokens the server
    # reported in usage
    assert pt["usage_cached_tokens"] > 0
    assert pt["server_hits_delta"] == pt["usage_cached_tokens"]
    # the CPU engine captures no graphs; no row's logits were NaN; nothing was preempted
    assert pt["graph_captures_delta"] == 0 and pt["graph_capture_seconds_delta"] == 0
    assert pt["nonfinite_logit_rows_delta"] == 0 and pt["preemptions_delta"] == 0
    assert 0 < pt["server_hit"] <= 1 and 0 < pt["theoretical_hit"] <= 1
    # the tier read at --tier-tok-s (default 150 tok/s/user): the tiny CPU server is far slower, so no point
    # reaches it; the same JSON is written as summary.json
    assert summary["tier"]["tier_tok_s_per_user"] == 150 and summary["tier"]["front_status"] in (
        "unreachable",
        "exact",
        "estimated",
        "clamped",
    )
    assert (summary["tier"]["best_conc"] is None) == (pt["p90_intvty"] < 150)
    assert "tier 150 tok/s/user" in text and json.loads((out / "summary.json").read_text()) == summary

    agg = json.loads((out / "agg_tiny_small_conc2.json").read_text())
    assert agg["conc"] == 2 and agg["dataset"]["preset"] == "small" and agg["tput_per_gpu"] > 0
    assert agg["server_metrics"]["cache"]["gpu_hit_rate"] == pytest.approx(pt["server_hit"])
    rows = [json.loads(line) for line in (out / "requests.jsonl").read_text().splitlines()]
    assert len(rows) == pt["all_requests"]
    assert {r["phase"] for r in rows} <= {"warmup", "profile"} and any(r["phase"] == "profile" for r in rows)
    assert agg["num_requests_total"] == sum(r["phase"] == "profile" for r in rows)
    # --fast: one root warm-up turn per lane (the turn before t*), max_tokens 1, sent before any profiled request
    warm = [r for r in rows if r["phase"] == "warmup"]
    assert len(warm) == 2 and {r["lane"] for r in warm} == {0, 1}
    assert all(r["max_tokens"] == 1 and r["kind"] == "root" and r["turn_idx"] >= 0 for r in warm)
    assert max(r["end_ns"] for r in warm) <= min(r["start_ns"] for r in rows if r["phase"] == "profile")
    # each warmed-up trace resumes (same conversation, cache reused) right after its t* turn
    for w in warm:
        nxt = [r for r in rows if r["phase"] == "profile" and r["conversation_id"] == w["conversation_id"]]
        assert nxt and min(r["turn_idx"] for r in nxt) == w["turn_idx"] + 1
    with open(out / "metrics_timeseries.csv") as f:
        series = list(csv.DictReader(f))
    assert len(series) >= 1 and all(s["conc"] == "2" for s in series)
    assert float(series[-1]["prefix_cache_queries"]) > 0 and series[-1]["running"] != ""
    assert float(series[-1]["graph_captures"]) == 0  # dsserve's counter, sampled like the others
    assert float(series[-1]["graph_capture_seconds"]) == 0
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


def test_agentx_chat_exact_isl(tiny_server, tmp_path, capsys):
    """--api chat: growing message arrays whose (the server's) chat encoding has exactly the trace's ISL."""
    out = tmp_path / "chat"
    rc = main(
        [
            "bench",
            "agentx",
            "--base-url",
            tiny_server,
            "--api",
            "chat",
            "--preset",
            "small",
            "--seed",
            "1",
            "--concurrency",
            "3",
            "--duration",
            "5",
            "--fast",
            "--num-sessions",
            "4",
            "--scale",
            "0.25",
            "--output-dir",
            str(out),
        ]
    )
    text = capsys.readouterr().out
    assert rc == 0
    (pt,) = _last_json(text)["points"]
    rows = [json.loads(line) for line in (out / "requests.jsonl").read_text().splitlines()]
    prof = [r for r in rows if r["phase"] == "profile"]
    assert prof and pt["errors"] == 0 and not any(r["error"] for r in rows)
    # the server's usage.prompt_tokens is the local chat count; a miss of the ISL is counted in chat_token_mismatch
    assert all(r["isl"] == r["chat_isl"] for r in rows)
    bad = [r for r in prof if r["isl"] != r["isl_target"]]
    print(f"chat ISL mismatch: {len(bad)}/{len(prof)} profiled, {pt['chat_token_mismatch']}/{len(rows)} all")
    assert len(bad) <= 0.05 * len(prof) and pt["chat_token_mismatch"] <= 0.05 * len(rows)
    # later turns reuse the conversation's earlier messages verbatim: the server caches the shared prefix
    later = [r for j, r in enumerate(rows) if any(q["conversation_id"] == r["conversation_id"] for q in rows[:j])]
    assert later and all(r["cached"] > 0 for r in later)


def test_agentx_aborts_on_failed_root_warmup(tiny_server, tmp_path, capsys):
    out = tmp_path / "bad"  # an unknown model name makes every request, so the root warm-up, fail (HTTP 404)
    rc = main(
        [
            "bench",
            "agentx",
            "--base-url",
            tiny_server,
            "--model",
            "nope",
            "--preset",
            "small",
            "--concurrency",
            "2",
            "--duration",
            "5",
            "--num-sessions",
            "3",
            "--scale",
            "0.02",
            "--output-dir",
            str(out),
        ]
    )
    assert rc == 1 and "root warm-up request failed" in capsys.readouterr().err
    assert not (out / "points.csv").exists() and not list(out.glob("agg_*.json"))
    rows = [json.loads(line) for line in (out / "requests.jsonl").read_text().splitlines()]
    assert rows and all(r["phase"] == "warmup" and r["max_tokens"] == 1 and r["error"] for r in rows)


def test_bench_latency_and_throughput(capsys):
    assert (
        main(
            [
                "bench",
                "latency",
                "--model",
                "tiny",
                "--input-len",
                "8",
                "--output-len",
                "4",
                "--batch-size",
                "2",
                "--num-iters",
                "1",
                "--num-iters-warmup",
                "0",
            ]
        )
        == 0
    )
    lat = _last_json(capsys.readouterr().out)
    assert lat["bench"] == "latency" and lat["output_tokens"] == 8 and lat["avg_latency_s"] > 0
    assert (
        main(["bench", "throughput", "--model", "tiny", "--num-prompts", "4", "--input-len", "8", "--output-len", "4"])
        == 0
    )
    tp = _last_json(capsys.readouterr().out)
    assert tp["bench"] == "throughput" and tp["output_tokens"] == 16 and tp["input_tokens"] == 32
    assert tp["tokens_per_s"] > 0 and tp["output_tokens_per_s"] > 0


def test_agentx_chat_builder_exact_and_prefix():
    """Offline: every request of a trace encodes to exactly its (scaled) ISL; each turn reuses its parent's messages
    verbatim (all but the last, which an append too short for a chat turn may extend)."""
    from dsserve.bench.agentx_chat import ChatBuilder
    from dsserve.bench.agentx_trace import generate, request_token_ids

    b, tr, k = ChatBuilder("tiny"), generate("small", 2, 2), 16

    def ids_of(q):
        ids = request_token_ids(tr, q, 8192, (0, 1, 2), "salt")
        return [t for j in range(0, len(ids), 64) for t in ids[j : j + k]]

    built, n = {}, 0
    for s in tr.sessions:
        for r in sorted(s.requests, key=lambda r: r.idx):
            msgs, target, got = built[r.idx] = b.build(tr, s, r, ids_of, k, "salt")
            n += got != target
            if r.parent is not None and not r.compacted:
                head = built[r.parent][0]
                assert msgs[: len(head) - 1] == head[:-1] and msgs[len(head) - 1]["content"].startswith(
                    head[-1]["content"]
                )
    assert n == 0
