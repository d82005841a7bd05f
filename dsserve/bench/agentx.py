"""``dsserve bench agentx``: closed-loop replay of a seeded AgentX-like trace on an OpenAI server (spec §3.3).

Per concurrency C: C lanes each play one session tree at a time (seeded shuffle sampler); a request with no
``after`` starts ``t`` s into its session, else ``think_time`` (capped at the per-tree idle cap) after its last
``after`` ends; subagents run in parallel without lanes; with nothing in flight, timers shift to fire within the
idle cap; nothing starts after warmup + duration (in-flight requests finish and count). Fresh cache-bust salt per
play; streaming, max_tokens = trace output, ignore_eos, include_usage, X-Session-ID = conversation id.
``--api chat``: growing message arrays of exactly ISL tokens under ``--tokenizer`` (``agentx_chat``). Warm-up
(t* points, ``--warmup-turns``, ``--fast``) and the 1 s /metrics series: ``agentx_warmup``. ``--scale`` < 1 keeps
round(64*scale) tokens per 64-token block (prefix sharing kept) and scales outputs (min 2), for tiny models.
Before each point the server's prefix cache is emptied (``--[no-]reset-cache``: POST /reset_prefix_cache, vLLM's
route too), the spec's fresh server or cache flush per point; ``cache_reset`` in the point's JSON says if it was.
``--dp-replay mirror|lag`` (a server with -dp D): the same replay runs once per DP rank, each copy pinned to its rank
(``X-data-parallel-rank``), all at once (mirror) or rank r's started r x ``--lag`` s later (lag), the seeds' way of
isolating DP imbalance; the point reports each rank's output tokens and their mean / max. Every point reports the
EP balance from the server's ``ep_expert_rows_total`` counters (per MoE layer, mean / max rows over the EP ranks).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import time
import uuid
from pathlib import Path

import httpx
from rich.console import Console
from rich.live import Live
from rich.table import Table

from . import metrics as M
from .agentx_chat import ChatBuilder, mismatches
from .agentx_presets import PRESETS, stream
from .agentx_trace import BLOCK, VERSION, generate, request_token_ids
from .agentx_warmup import (  # noqa
    _LABEL,
    _PROM,
    WarmupError,
    parse_prom,
    resumed,
    sample_metrics,
    scrape,
    warm_up,
    write_series,
)
from .eplb_figures import eplb_figures, eplb_lines
from .provenance import run_meta


def _table(title: str, cols) -> Table:
    return (t := Table(title=title), [t.add_column(c, justify="right") for c in cols])[0]


class Replayer:
    """One concurrency point: lanes, sampler, timers, records."""

    def __init__(self, a, trace, client, conc: int, tag: str, rank: int | None = None, delay: float = 0.0):
        """``rank``: every request pinned to that DP rank; ``delay``: seconds before the warm-up starts."""
        self.a, self.trace, self.client, self.conc, self.tag = a, trace, client, conc, tag
        self.rank, self.delay = rank, delay
        self.raw_before = self.raw_after = ""  # /metrics texts at the profile's start and end
        self.p = PRESETS[a.preset]
        self.reserved = tuple(sorted({0, 1, 2, *a.reserved_ids}))
        self.k = max(1, min(BLOCK, round(BLOCK * a.scale)))
        self.records, self.timers, self.plays, self.in_flight, self.sent, self.skipped = [], {}, 0, 0, 0, 0
        self.series, self.t_profile, self.deadline = [], math.inf, math.inf
        self.sampler = (
            i for ep in range(1 << 30) for i in stream(a.seed, "sampler", ep).permutation(len(trace.sessions)).tolist()
        )

    async def sleep(self, delay: float) -> None:
        self.timers[key := object()] = time.monotonic() + delay
        try:
            while (rem := self.timers[key] - time.monotonic()) > 0:
                await asyncio.sleep(min(rem, 0.05))
        finally:
            del self.timers[key]

    async def guard(self) -> None:
        while True:
            await asyncio.sleep(0.05)
            if (
                not self.in_flight
                and self.timers
                and (gap := min(self.timers.values()) - time.monotonic() - self.p.idle_cap_s) > 0
            ):
                self.timers.update({k: v - gap for k, v in self.timers.items()})

    def new_play(self) -> str:
        self.plays += 1
        return f"{self.tag}-c{self.conc}-p{self.plays}"

    async def lane(self, j: int, deadline: float, first: tuple) -> None:
        if first[2] is not None:  # the warmed-up trace, resumed after its warm-up turns
            await self.play(j, first[0], deadline, first[1], first[2])
        while time.monotonic() < deadline:
            await self.play(j, next(self.sampler), deadline)

    async def play(self, lane: int, s: int, deadline: float, play: str | None = None, start: int = 0) -> None:
        sess, play = self.trace.sessions[s], play or self.new_play()
        done = {r.idx: asyncio.Event() for r in sess.requests}
        keep = resumed(sess, start)
        [done[r.idx].set() for r in sess.requests if r.idx not in keep]

        async def one(r):
            try:
                for i in r.after:
                    await done[i].wait()
                delay = min(r.think_time, self.p.tree_idle_cap_s) if r.after else r.t
                delay = 0.0 if start and r.kind == "root" and r.turn == start else delay  # resumed: at once
                await self.sleep(min(delay, deadline - time.monotonic()))
                if time.monotonic() >= deadline:
                    self.skipped += 1
                    return
                conv = {"root": play, "subagent": f"{play}::sa:{r.agent_id[2:]}"}.get(r.kind, f"{play}::{r.agent_id}")
                await self.send(r, sess, conv, play, lane)
            finally:
                done[r.idx].set()

        await asyncio.gather(*(one(r) for r in sess.requests if r.idx in keep))

    def ids(self, r, salt: str) -> list[int]:  # the request's (block-scaled) trace ids
        ids = request_token_ids(self.trace, r, self.a.vocab_size, self.reserved, salt)
        return [t for j in range(0, len(ids), BLOCK) for t in ids[j : j + self.k]] if self.k < BLOCK else ids

    async def prompt(self, r, sess, salt: str, rec: dict):
        if self.a.api == "completions":
            return (ids := self.ids(r, salt)), {"prompt": ids}
        msgs, rec["isl_target"], rec["chat_isl"] = await asyncio.to_thread(
            self.a.chat.build, self.trace, sess, r, lambda q: self.ids(q, salt), self.k, salt
        )
        return range(rec["chat_isl"]), {"messages": msgs}

    async def send(self, r, sess, conv: str, play: str, lane: int, phase="profile", max_tokens=None) -> dict:
        self.in_flight, self.sent = self.in_flight + 1, self.sent + 1
        osl = max_tokens or (r.osl if self.a.scale >= 1 else max(2, round(r.osl * self.a.scale)))
        rec = dict(
            phase=phase,
            lane=lane,
            trace_id=sess.id,
            conversation_id=conv,
            root_id=play,
            depth=int(r.kind == "subagent"),
            turn_idx=r.turn,
            kind=r.kind,
            request_idx=r.idx,
            isl=None,
            osl=0,
            cached=None,
            hit_blocks=r.hit_blocks,
            total_blocks=r.blocks,
            max_tokens=osl,
            conc=self.conc,
            dp_rank=self.rank,
            error=None,
        )
        try:
            ids, body = await self.prompt(r, sess, play, rec)
            rec["isl"] = len(ids)
            body.update(
                model=self.a.model, max_tokens=osl, ignore_eos=True, stream=True, stream_options={"include_usage": True}
            )
            rec["start_ns"] = t0 = time.time_ns()
            ttft, chunks, url = None, 0, "/v1/completions" if self.a.api == "completions" else "/v1/chat/completions"
            headers = {"X-Session-ID": conv, "X-Correlation-ID": conv}
            if self.rank is not None:
                headers["X-data-parallel-rank"] = str(self.rank)
            async with self.client.stream("POST", url, json=body, headers=headers) as resp:
                if resp.status_code != 200:
                    rec["error"] = f"HTTP {resp.status_code}: {(await resp.aread())[:300].decode(errors='replace')}"
                async for line in resp.aiter_lines():
                    if rec["error"] or not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    d = json.loads(line[6:])
                    if "error" in d:
                        rec["error"] = str(d["error"])[:300]
                    for c in d.get("choices") or []:
                        if c.get("text") or (c.get("delta") or {}).get("content") or c.get("finish_reason"):
                            chunks += 1
                            ttft = ttft if ttft is not None else (time.time_ns() - t0) / 1e9
                    if u := d.get("usage"):
                        rec.update(
                            isl=u["prompt_tokens"],
                            osl=u["completion_tokens"],
                            cached=(u.get("prompt_tokens_details") or {}).get("cached_tokens"),
                        )
            rec["end_ns"] = time.time_ns()
            rec.update(e2el=(rec["end_ns"] - t0) / 1e9, ttft=(rec["end_ns"] - t0) / 1e9 if ttft is None else ttft)
            if not rec["osl"] and not rec["error"]:
                rec["osl"], rec["error"] = chunks, "no usage in the stream"
        except (httpx.HTTPError, ValueError, KeyError) as e:
            rec["error"] = rec["error"] or f"{type(e).__name__}: {e}"
            for k, v in (("start_ns", time.time_ns()), ("end_ns", time.time_ns()), ("ttft", None), ("e2el", None)):
                rec.setdefault(k, v)
        finally:
            self.in_flight -= 1
        self.records.append(rec)
        return rec

    def panel(self, left: float) -> Table:
        t = _table(
            f"agentx {self.a.preset} conc {self.conc}",
            ("phase", "left s", "plays", "sent", "done", "errors", "in flight", "timers"),
        )
        t.add_row(
            "warmup" if time.monotonic() < self.t_profile else "profile",
            "-" if math.isinf(left) else f"{max(left, 0):.0f}",
            *map(
                str,
                (
                    self.plays,
                    self.sent,
                    len(self.records),
                    sum(bool(r["error"]) for r in self.records),
                    self.in_flight,
                    len(self.timers),
                ),
            ),
        )
        return t

    async def run(self, con: Console, live_panel: bool = True):
        """Warm-up, then ``duration`` s of closed-loop profiling; returns (window ns, counters before, after).
        ``live_panel``: False for all but one of the replays run at once (rich shows one live display)."""
        await asyncio.sleep(self.delay)
        series = asyncio.create_task(sample_metrics(self, self.series))
        guard, lanes = None, []
        try:
            with (
                Live(self.panel(math.inf), console=con, refresh_per_second=4, transient=False)
                if live_panel
                else (contextlib.nullcontext(_NoLive())) as live
            ):

                async def watch(tasks):
                    while not all(t.done() for t in tasks):
                        await asyncio.wait(tasks, timeout=0.25)
                        live.update(self.panel(self.deadline - time.monotonic()))
                    return [t.result() for t in tasks]

                (firsts,) = await watch([asyncio.create_task(warm_up(self))])
                self.raw_before, now = await scrape(self.client, raw=True), time.time_ns()
                before = parse_prom(self.raw_before)
                self.t_profile = time.monotonic()
                self.deadline = self.t_profile + self.a.duration
                guard = asyncio.create_task(self.guard())
                lanes = [asyncio.create_task(self.lane(j, self.deadline, firsts[j])) for j in range(self.conc)]
                await watch(lanes)
        finally:
            [t.cancel() for t in (series, guard, *lanes) if t]
        self.raw_after = await scrape(self.client, raw=True)
        return (now, now + int(self.a.duration * 1e9)), before, parse_prom(self.raw_after)


class _NoLive:
    def update(self, _) -> None:
        pass


def ep_balance(before: str, after: str) -> dict | None:
    """The EP balance over a window from two /metrics texts: per MoE layer, mean over EP ranks / max over EP ranks
    of the rows their routed experts ran (``dsserve:ep_expert_rows_total{layer, rank}``); ``overall`` = sum over
    layers of the means / sum of the maxes; rows per rank per layer and step beside it (the figure depends on it).
    None: the server exports no EP rows (no expert parallelism) or none ran in the window."""

    def rows(text: str) -> dict:
        out = {}
        for m in _PROM.finditer(text):
            if m[1].endswith("ep_expert_rows_total"):
                lab = dict(_LABEL.findall(m[2] or ""))
                out[int(lab["layer"]), int(lab["rank"])] = float(m[3])
        return out

    r0, r1 = rows(before), rows(after)
    if not r1:
        return None
    layers = sorted({k[0] for k in r1})
    ranks = sorted({k[1] for k in r1})
    per = {layer: [r1.get((layer, r), 0.0) - r0.get((layer, r), 0.0) for r in ranks] for layer in layers}
    steps = (_delta(parse_prom(before), parse_prom(after), "ep_steps_total") or 0.0) if before else None
    total_max = sum(max(v) for v in per.values())
    if not total_max:
        return None
    return {
        "ep_ranks": len(ranks),
        "overall": sum(sum(v) / len(v) for v in per.values()) / total_max,
        "worst_layer": min(((sum(v) / len(v)) / max(v), layer) for layer, v in per.items() if max(v))[1],
        "per_layer": {str(layer): (sum(v) / len(v)) / max(v) if max(v) else 1.0 for layer, v in per.items()},
        "steps": steps,
        "rows_per_rank_per_layer_step": (sum(map(sum, per.values())) / len(layers) / len(ranks) / steps)
        if steps
        else None,
    }


def dp_ranks(raw: str) -> int:
    """The DP ranks a server exports (``dsserve:dp_rank_requests_routed{rank}``); 1 when none."""
    ranks = {
        dict(_LABEL.findall(m[2] or "")).get("rank") for m in _PROM.finditer(raw) if "dp_rank_requests_routed" in m[1]
    }
    return max(1, len(ranks - {None}))


def rank_tokens(records: list[dict]) -> dict | None:
    """Output tokens of the profiled requests per pinned DP rank, and mean / max over the ranks (1: even)."""
    per: dict = {}
    for r in records:
        if r["phase"] == "profile" and not r["error"] and r.get("dp_rank") is not None:
            per[r["dp_rank"]] = per.get(r["dp_rank"], 0) + r["osl"]
    if not per:
        return None
    v = list(per.values())
    return {
        "tokens": {str(k): n for k, n in sorted(per.items())},
        "imbalance": (sum(v) / len(v)) / max(v) if max(v) else 1.0,
    }


def _delta(before: dict, after: dict, name: str) -> float | None:
    """How much the server's counter ``name`` (any prefix: dsserve:, vllm:) moved over the profiling window; None
    when the server does not export it."""
    v0, v1 = (next((v for k, v in d.items() if k.split(":")[-1] == name), None) for d in (before, after))
    return None if None in (v0, v1) else v1 - v0


async def reset_cache(client: httpx.AsyncClient, err: Console, tries: int = 20) -> bool | None:
    """POST /reset_prefix_cache until the server takes it (409: requests of the last point still finishing);
    None when it has no such route."""
    for _ in range(tries):
        try:
            r = await client.post("/reset_prefix_cache")
        except httpx.HTTPError as e:
            err.print(f"dsserve: warning: /reset_prefix_cache failed ({e}); the point runs on a warm cache")
            return False
        if r.status_code in (404, 405):
            err.print("dsserve: warning: the server has no /reset_prefix_cache; the point runs on a warm cache")
            return None
        if r.status_code != 409:
            return r.is_success
        await asyncio.sleep(0.5)
    err.print("dsserve: warning: the server kept refusing /reset_prefix_cache (409); the point runs on a warm cache")
    return False


async def _main(a) -> int:
    con, err, trace = Console(width=140), Console(stderr=True), generate(a.preset, a.seed, a.num_sessions)
    out, tag, aggs, records, points, series, rc = Path(a.output_dir), uuid.uuid4().hex[:12], [], [], [], [], 0
    out.mkdir(parents=True, exist_ok=True)
    async with httpx.AsyncClient(
        base_url=a.base_url.rstrip("/"),
        timeout=httpx.Timeout(None),
        headers={"Authorization": f"Bearer {a.api_key}"} if a.api_key else {},
        limits=httpx.Limits(max_connections=None, max_keepalive_connections=None),
    ) as client:
        if a.model is None:
            a.model = (await client.get("/v1/models")).json()["data"][0]["id"]
        if a.api == "chat":
            try:
                a.chat = ChatBuilder(a.tokenizer or a.model)
            except (ValueError, OSError) as e:
                return print(f"dsserve: error: --api chat needs a tokenizer (--tokenizer): {e}") or 2
        ds = {
            "source_type": "synthetic",
            "generator": VERSION,
            "preset": a.preset,
            "seed": a.seed,
            "sha256": trace.sha256(),
            "entries": len(trace.sessions),
            "scale": a.scale,
        }
        n_dp = 1
        if a.dp_replay:
            n_dp = a.data_parallel_size or dp_ranks(await scrape(client, raw=True))
            if n_dp < 2:
                return print("dsserve: error: --dp-replay needs a server with -dp > 1 (none found in /metrics)") or 2
        for c in a.concurrency:
            cache_reset = await reset_cache(client, err) if a.reset_cache else None
            if a.dp_replay:
                lag = a.lag if a.dp_replay == "lag" else 0.0
                rps = [Replayer(a, trace, client, c, tag, rank=r, delay=r * lag) for r in range(n_dp)]  # the same ids
            else:
                rps = [Replayer(a, trace, client, c, tag)]
            try:
                runs = await asyncio.gather(*(rp.run(err, live_panel=i == 0) for i, rp in enumerate(rps)))
            except WarmupError as e:
                err.print(f"dsserve: error: aborting at concurrency {c}: {e}")
                rc = 1
                break
            finally:
                for rp in rps:
                    records.extend(rp.records), series.extend(rp.series)
            window = (min(w[0] for w, _, _ in runs), max(w[1] for w, _, _ in runs))
            before, after = runs[0][1], runs[-1][2]  # the first copy's start, the last one's end
            point_records = [rec for rp in rps for rec in rp.records]
            meta = {
                "config": a.config or f"{a.model}_{a.preset}",
                "conc": c,
                "model": a.model,
                "hw": a.hw,
                "framework": a.framework,
                "tp": a.num_gpus,
            }
            agg = M.aggregate(
                point_records,
                window,
                a.num_gpus,
                meta=meta,
                server={"before": before, "after": after},
                dataset=ds,
                price_per_gpu_hr=a.price_per_gpu_hr,
            )
            agg["provenance"] = run_meta()
            M.write_agg(out, agg), aggs.append(agg)
            points.append(
                {
                    "conc": c,
                    "cache_reset": cache_reset,
                    "requests": agg["num_requests_successful"],
                    "all_requests": len(point_records),
                    "errors": sum(bool(r["error"]) for r in point_records),
                    "skipped": sum(rp.skipped for rp in rps),
                    "dp_replay": a.dp_replay,
                    "dp_rank_tokens": rank_tokens(point_records),
                    "ep_balance": ep_balance(rps[0].raw_before, rps[-1].raw_after),
                    "eplb": eplb_figures(rps[0].raw_before, rps[-1].raw_after),
                    **{k: agg[k] for k in ("p90_ttft", "p90_intvty", "tput_per_gpu")},
                    "theoretical_hit": agg["request_metrics"]["cache"]["theoretical_cache_hit_rate"],
                    "server_hit": agg["server_metrics"]["cache"]["gpu_hit_rate"],
                    "warmup_requests": sum(r["phase"] == "warmup" for r in rp.records),
                    "usage_cached_tokens": sum(
                        r.get("cached") or 0
                        for r in point_records  # profiling phase
                        if r["phase"] == "profile"
                    ),
                    "server_hits_delta": _delta(before, after, "prefix_cache_hits_total"),
                    # first-use CUDA graph captures stall their steps; NaN logits would be a fault
                    "graph_captures_delta": _delta(before, after, "graph_captures_total"),
                    "graph_capture_seconds_delta": _delta(before, after, "graph_capture_seconds_total"),
                    "triton_compiles_delta": _delta(before, after, "triton_compiles_total"),
                    "triton_compile_seconds_delta": _delta(before, after, "triton_compile_seconds_total"),
                    "triton_cache_loads_delta": _delta(before, after, "triton_cache_loads_total"),
                    "nonfinite_logit_rows_delta": _delta(before, after, "nonfinite_logit_rows_total"),
                    "preemptions_delta": _delta(before, after, "num_preemptions_total"),
                    "chat_token_mismatch": mismatches(point_records) if a.api == "chat" else None,
                }
            )
    M.write_requests_jsonl(out / "requests.jsonl", records)
    write_series(out / "metrics_timeseries.csv", series)
    if not aggs:
        return rc
    M.write_points_csv(out / "points.csv", aggs)
    [M.plot_points(out / f"tput_vs_{x[4:]}.png", aggs, x, tier=a.tier_tok_s) for x in ("p90_intvty", "p90_ttft")]
    f = lambda v, s="{:.3f}": "-" if v is None else s.format(v)  # noqa: E731
    t = _table(
        f"bench agentx: {a.model}, preset {a.preset}, seed {a.seed}, {a.api}",
        (
            "conc",
            "requests",
            "errors",
            "TTFT p50 s",
            "TTFT p90 s",
            "ITL p90 ms",
            "P90 intvty",
            "tok/s/GPU",
            "theo hit",
            "server hit",
        ),
    )
    for g, p in zip(aggs, points):
        lat = g["request_metrics"]["latency"]
        t.add_row(
            str(g["conc"]),
            str(p["requests"]),
            str(p["errors"]),
            f(lat["ttft"]["p50"]),
            f(lat["ttft"]["p90"]),
            f(lat["itl"]["p90"] and lat["itl"]["p90"] * 1e3, "{:.1f}"),
            f(g["p90_intvty"], "{:.1f}"),
            f(g["tput_per_gpu"], "{:,.1f}"),
            f(p["theoretical_hit"]),
            f(p["server_hit"]),
        )
    con.print(t)
    for p in points:
        if p["dp_rank_tokens"]:
            d = p["dp_rank_tokens"]
            con.print(
                f"conc {p['conc']} DP replay {p['dp_replay']}: output tokens per rank {d['tokens']}, "
                f"mean/max {d['imbalance']:.3f}"
            )
        if p["ep_balance"]:
            e = p["ep_balance"]
            rows = e["rows_per_rank_per_layer_step"]
            con.print(
                f"conc {p['conc']} EP balance over {e['ep_ranks']} ranks: {e['overall']:.3f} (sum of layer means / "
                f"sum of maxes), worst layer {e['worst_layer']} at {e['per_layer'][str(e['worst_layer'])]:.3f}, "
                f"{'-' if rows is None else f'{rows:.1f}'} rows per rank, layer and step"
            )
        for line in eplb_lines(p["eplb"], f"conc {p['conc']} ") if p["eplb"] else ():
            con.print(line)
    tier = M.tier_summary(aggs, a.tier_tok_s)
    con.print(
        f"tier {a.tier_tok_s:g} tok/s/user (P90 interactivity): "
        + (
            f"best {tier['best_tput_per_gpu']:,.1f} tok/s/GPU at conc {tier['best_conc']}"
            if tier["best_conc"] is not None
            else "no point reaches it"
        )
        + f"; front read {tier['front_tput_per_gpu']:,.1f} ({tier['front_status']})"
    )
    summary = json.dumps(
        {
            "bench": "agentx",
            "preset": a.preset,
            "seed": a.seed,
            "model": a.model,
            "api": a.api,
            "output_dir": str(out),
            "points": points,
            "tier": tier,
        },
        default=str,
    )
    (out / "summary.json").write_text(summary + "\n")
    print(summary)
    return rc


def run_bench_agentx(a) -> int:
    a.concurrency = a.concurrency or list(PRESETS[a.preset].concurrency)
    dur = PRESETS[a.preset].duration_s
    a.duration = (min(dur, 1200.0) if a.fast else dur) if a.duration is None else a.duration
    return asyncio.run(_main(a))


def add_bench_agentx_args(p) -> None:
    p.add_argument("--preset", choices=sorted(PRESETS), default="small")
    p.add_argument(
        "--dp-replay",
        choices=("mirror", "lag"),
        default=None,
        help="replay the same requests once per DP rank of the server, pinned (X-data-parallel-rank): all at once "
        "(mirror) or rank r's copy r x --lag s later (lag)",
    )
    p.add_argument("--lag", type=float, default=5.0, help="--dp-replay lag: seconds between ranks' copies")
    p.add_argument(
        "--data-parallel-size", type=int, default=None, help="--dp-replay: DP ranks (default: from /metrics)"
    )
    p.add_argument("--api", choices=("completions", "chat"), default="completions")
    p.add_argument("--concurrency", type=int, nargs="+", default=None, help="points (default: the preset's)")
    p.add_argument("--fast", action="store_true", help="1 warm-up request per lane (default duration <= 1200 s)")
    p.add_argument("--reserved-ids", type=int, nargs="*", default=[], help="token ids never used (plus 0 1 2)")
    p.add_argument(
        "--reset-cache",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="empty the server's prefix cache before each point (POST /reset_prefix_cache, vLLM's and "
        "dsserve's): the spec's fresh server or cache flush per point",
    )
    for flag, kind, default, doc in (
        ("--base-url", str, "http://127.0.0.1:8000", ""),
        ("--seed", int, 42, "trace and sampler seed"),
        ("--duration", float, None, "profiling seconds per point (default: the preset's)"),
        ("--warmup-turns", int, 10, "root turns each lane sends after its t* turn (max_tokens 1, no think)"),
        ("--num-sessions", int, None, "trace sessions (default: the preset's)"),
        ("--model", str, None, "served model name (default: the first of /v1/models)"),
        ("--tokenizer", str, None, "--api chat: preset name or tokenizer dir (default: --model)"),
        ("--scale", float, 1.0, "< 1: shrink prompts block-wise and outputs (small test models)"),
        ("--config", str, None, "config label in agg file names (default: <model>_<preset>)"),
        ("--vocab-size", int, 8192, "token ids are drawn from [0, V) minus reserved ids"),
        ("--num-gpus", int, 1, "GPUs serving (throughput per GPU)"),
        ("--output-dir", str, "agentx_out", ""),
        ("--api-key", str, None, ""),
        ("--hw", str, None, ""),
        ("--framework", str, "dsserve", ""),
        ("--price-per-gpu-hr", float, None, ""),
        (
            "--tier-tok-s",
            float,
            150.0,
            "per-user speed (tok/s at P90 interactivity) whose tier is read: the "
            "best tok/s/GPU among points at or above it, and the front's value",
        ),
    ):
        p.add_argument(flag, type=kind, default=default, help=doc or None)
