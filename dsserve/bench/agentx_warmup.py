"""Warm-up and the 1 s ``/metrics`` series of ``dsserve bench agentx`` (spec agentx.md §3.3, §3.7).

Warm-up (per concurrency point): initial lane j draws its first trace from the sampler and a t* ratio
~ U[0.25, 0.75] from stream ``lane/j``; t* = root turn max(1, min(T - 1, int(ratio * T))) of its T root turns.
All lanes send the root turn before t* (full prompt, max_tokens 1) together and wait for each other (aligned
t*), then each lane sends its next ``warmup_turns`` root turns back to back (max_tokens 1, no think time).
Profiling resumes each initial lane's tree from the root turn after those (sent at once, subagents spawned
from then on included); recycled traces start at turn 0. ``fast``: only the turn before t*. Any failed
root warm-up request raises ``WarmupError`` (the point is aborted).
"""

from __future__ import annotations

import asyncio
import csv
import re
import time
from pathlib import Path

from .agentx_presets import stream

_PROM = re.compile(r"^([A-Za-z_:][\w:]*)(?:\{(.*)\})?\s+(\S+)\s*$", re.M)
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')
# column -> metric base name (vllm:/dsserve: prefix and _total suffix dropped), summed over label sets
SERIES = {
    "prefix_cache_hits": "prefix_cache_hits",
    "prefix_cache_queries": "prefix_cache_queries",
    "running": "num_requests_running",
    "waiting": "num_requests_waiting",
    "prompt_tokens": "prompt_tokens",
    "generation_tokens": "generation_tokens",
    # dsserve's: when first-use CUDA graph captures and Triton compiles stalled steps, and for how long
    "graph_captures": "graph_captures",
    "graph_capture_seconds": "graph_capture_seconds",
    "triton_compiles": "triton_compiles",
    "triton_compile_seconds": "triton_compile_seconds",
    "triton_cache_loads": "triton_cache_loads",
}
KV_USAGE = ("kv_cache_usage_perc", "gpu_cache_usage_perc")  # vLLM v1 / v0 names
COLS = ("time_unix", "t_s", "conc", "phase", *SERIES, "hit_rate", "input_tps", "output_tps")


class WarmupError(RuntimeError):
    pass


def parse_prom(text: str) -> dict:
    """Prometheus text -> {metric name: value summed over label sets}."""
    out: dict[str, float] = {}
    for m in _PROM.finditer(text):
        out[m[1]] = out.get(m[1], 0.0) + float(m[3])
    return out


async def scrape(client, raw: bool = False):
    try:
        r = await client.get("/metrics")
    except Exception:  # noqa: BLE001 - a missing/broken endpoint gives empty cells, never a failed point
        return "" if raw else {}
    text = r.text if r.status_code == 200 else ""
    return text if raw else parse_prom(text)


def series_row(text: str) -> dict:
    """One time-series sample: the SERIES columns plus ``kv_usage[_<kind>]`` (absent names are left out)."""
    row: dict = {}
    for m in _PROM.finditer(text):
        base = m[1].split(":")[-1].removesuffix("_total")
        col = next((c for c, n in SERIES.items() if n == base), None)
        if base in KV_USAGE:
            kind = dict(_LABEL.findall(m[2] or "")).get("kind")
            col = f"kv_usage_{kind}" if kind else "kv_usage"
        if col is not None:
            row[col] = row.get(col, 0.0) + float(m[3])
    return row


async def sample_metrics(rp, rows: list, period: float = 1.0) -> None:
    """Append a row every ``period`` s (first one at once) until cancelled; rates are over the last interval."""
    t0, prev, i = time.monotonic(), None, 0
    while True:
        row = {
            "time_unix": round(time.time(), 3),
            "t_s": round(time.monotonic() - t0, 3),
            "conc": rp.conc,
            "phase": "warmup" if time.monotonic() < rp.t_profile else "profile",
            **series_row(await scrape(rp.client, raw=True)),
        }
        if prev is not None and (dt := row["time_unix"] - prev["time_unix"]) > 0:
            d = {c: row[c] - prev[c] if c in row and c in prev else None for c in SERIES}
            if d["prefix_cache_queries"]:
                row["hit_rate"] = d["prefix_cache_hits"] / d["prefix_cache_queries"]
            for c, k in (("input_tps", "prompt_tokens"), ("output_tps", "generation_tokens")):
                if d[k] is not None:
                    row[c] = d[k] / dt
        rows.append(row)
        prev, i = row, i + 1
        await asyncio.sleep(max(0.0, t0 + i * period - time.monotonic()))


def write_series(path, rows: list) -> Path:
    kv = sorted({k for r in rows for k in r if k.startswith("kv_usage")})
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=[*COLS, *kv], restval="", extrasaction="ignore")
        w.writeheader()
        w.writerows(rows)
    return Path(path)


def resumed(sess, start: int) -> set:
    """Request idxs a play from root turn ``start`` sends: root turns >= start and the subagent turns they
    (transitively) gate on or spawn; helpers and earlier subagents are skipped (all of them for start 0)."""
    keep: set = set()
    for r in sorted(sess.requests, key=lambda r: r.idx):
        if r.turn >= start if r.kind == "root" else not start or any(i in keep for i in r.after):
            keep.add(r.idx)
    return keep


def t_star(seed: int, lane: int, n_roots: int) -> int:
    """Index of lane's t* root turn (>= 1 so that a turn before it exists; < n_roots)."""
    ratio = float(stream(seed, "lane", lane).uniform(0.25, 0.75))
    return max(1, min(n_roots - 1, int(ratio * n_roots)))


async def warm_up(rp) -> list[tuple]:
    """Run the warm-up of ``rp`` (a Replayer); return per lane (session idx, play id, first profiled root turn)."""
    plans = []
    for j in range(rp.conc):
        s = next(rp.sampler)
        sess = rp.trace.sessions[s]
        roots = sorted((r for r in sess.requests if r.kind == "root"), key=lambda r: r.turn)
        plans.append((j, s, sess, rp.new_play(), roots, t_star(rp.a.seed, j, len(roots))))
    n = 0 if rp.a.fast else max(0, rp.a.warmup_turns)

    def check(recs):
        bad = [r for r in recs if r["error"] and r["kind"] == "root"]
        if bad:
            r = bad[0]
            raise WarmupError(
                f"root warm-up request failed (conc {rp.conc}, lane {r['lane']}, trace {r['trace_id']}, "
                f"turn {r['turn_idx']}): {r['error']}"
            )

    async def advance(j, s, sess, play, roots, k):
        return [await rp.send(r, sess, play, play, j, phase="warmup", max_tokens=1) for r in roots[k : k + n]]

    check(
        await asyncio.gather(
            *(
                rp.send(roots[k - 1], sess, play, play, j, phase="warmup", max_tokens=1)
                for j, s, sess, play, roots, k in plans
            )
        )
    )  # aligned t*
    check([r for recs in await asyncio.gather(*(advance(*p) for p in plans)) for r in recs])
    return [(s, play, roots[k + n].turn if k + n < len(roots) else None) for j, s, sess, play, roots, k in plans]
