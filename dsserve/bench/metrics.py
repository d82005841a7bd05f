"""AgentX / InferenceX metric math and result files (agentx.md §1.5, §3.4, §3.7, §4); no networking.
Record = one dict per request (= a ``requests.jsonl`` row): ``phase`` (only "profile" counts), ``error``
(falsy = success), ``start_ns``/``end_ns`` (int ns), ``ttft``/``e2el`` (s), ``isl``/``osl`` (server usage;
isl includes cached), optional ``cached``, ``hit_blocks``/``total_blocks`` (theoretical), ``max_tokens``,
bookkeeping (lane, trace_id, ...). Percentiles: numpy method="linear" (k = (n-1)p/100, as AIPerf/InferenceX).
"""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path

import numpy as np

PCT_METHOD = "linear"
TIERS = (30, 50, 75, 100, 150, 200)
REQUEST_FIELDS = (
    "phase",
    "lane",
    "trace_id",
    "conversation_id",
    "root_id",
    "depth",
    "turn_idx",
    "isl",
    "osl",
    "cached",
    "hit_blocks",
    "total_blocks",
    "start_ns",
    "end_ns",
    "ttft",
    "e2el",
    "itl",
    "error",
)
META_KEYS = (
    "config",
    "hw",
    "conc",
    "model",
    "framework",
    "precision",
    "spec_decoding",
    "disagg",
    "tp",
    "ep",
    "dp_attention",
    "kv_offloading",
)
POINT_COLS = (
    "config",
    "conc",
    "tput_per_gpu",
    "input_tput_per_gpu",
    "output_tput_per_gpu",
    "p90_intvty",
    "median_intvty",
    "p90_ttft",
    "p90_e2el",
    "cost_per_mtok",
    "on_frontier",
)


def pct(values, p: float) -> float | None:
    """p-th percentile with numpy's "linear" method; None for an empty sample."""
    a = np.asarray(values, dtype=float)
    return float(np.percentile(a, p, method=PCT_METHOD)) if a.size else None


def request_itl(ttft: float, e2el: float, osl: int) -> float | None:
    """(E2EL - TTFT)/(OSL - 1); None for OSL <= 1 (spec: OSL >= 2): out of ITL stats, still in tokens/TTFT."""
    return (e2el - ttft) / (osl - 1) if osl is not None and osl >= 2 else None


def stats(values) -> dict:
    """mean, p50, p75, p90, p95, p99, std (population, numpy default); all None when empty."""
    a = np.asarray([v for v in values if v is not None], dtype=float)
    return {
        "mean": float(a.mean()) if a.size else None,
        **{f"p{p}": pct(a, p) for p in (50, 75, 90, 95, 99)},
        "std": float(a.std()) if a.size else None,
    }


def interactivity(itls) -> dict:
    """Inverted ITL stats: p90 = 1/P90(ITL) (the slow-tail user; NOT P10 of 1/ITL), mean = 1/mean(ITL)."""
    return {k: 1.0 / v if v is not None and v > 0 else None for k, v in stats(itls).items() if k != "std"}


def throughput(records, num_gpus: int, server_hit: float | None = None) -> dict:
    """total = (sum isl incl. cached + sum osl)/D, D = max(end) - min(start) (s); per GPU = /num_gpus (all serving
    GPUs). cached input = sum(cached)/D if any record reports it, else input * server_hit, else None."""
    d = (max(r["end_ns"] for r in records) - min(r["start_ns"] for r in records)) / 1e9 if records else 0.0
    rate = (lambda n: n / d) if d > 0 else (lambda n: 0.0)
    isl, osl = sum(r["isl"] for r in records), sum(r["osl"] for r in records)
    cached = (
        rate(sum(r.get("cached") or 0 for r in records))
        if any(r.get("cached") is not None for r in records)
        else None
        if server_hit is None
        else rate(isl) * server_hit
    )
    return {
        "input": rate(isl),
        "output": rate(osl),
        "total": rate(isl + osl),
        "duration_seconds": d,
        "cached_input": cached,
        "uncached_input": None if cached is None else rate(isl) - cached,
        "per_gpu": rate(isl + osl) / num_gpus,
        "input_per_gpu": rate(isl) / num_gpus,
        "output_per_gpu": rate(osl) / num_gpus,
    }


def theoretical_hit_rate(records) -> float | None:
    """sum(reused blocks) / sum(blocks) over profiled turns (trace-side, infinite cache)."""
    tot = sum(r.get("total_blocks") or 0 for r in records)
    return sum(r.get("hit_blocks") or 0 for r in records) / tot if tot else None


def server_hit_rate(before: dict, after: dict, kind: str = "", per: str | None = None) -> float | None:
    """delta <kind>prefix_cache_hits / delta <per or kind>prefix_cache_queries between two counter snapshots
    (kind "" = GPU, "external_", "cpu_"); keys may carry a vllm:/dsserve: prefix and a _total suffix."""

    def delta(name):
        v = [
            next((x for k, x in (d or {}).items() if k.split(":")[-1].removesuffix("_total") == name), None)
            for d in (before, after)
        ]
        return None if None in v else v[1] - v[0]

    h, q = delta(f"{kind}prefix_cache_hits"), delta(f"{kind if per is None else per}prefix_cache_queries")
    return h / q if h is not None and q else None


def qps(records, t0_ns: int | None = None, t1_ns: int | None = None) -> dict:
    """Completions per 1 s bucket from t0 (default min start) to t1 (default max end): mean/p50/p75/p90/p95."""
    if not records:
        return dict.fromkeys(("mean", "p50", "p75", "p90", "p95"))
    t0 = min(r["start_ns"] for r in records) if t0_ns is None else t0_ns
    t1 = max(r["end_ns"] for r in records) if t1_ns is None else t1_ns
    counts = np.bincount([max(0, (r["end_ns"] - t0) // 10**9) for r in records], minlength=math.ceil((t1 - t0) / 1e9))
    return {"mean": float(counts.mean()), **{f"p{p}": pct(counts, p) for p in (50, 75, 90, 95)}}


def pareto_frontier(points: list[dict], x="p90_intvty", y="tput_per_gpu") -> list[dict]:
    """Upper-left front (higher x and y better): drop p if another has >= x and >= y, one strictly. Duplicates
    keep the first, non-finite points are skipped; sorted by x."""
    ok = [p for p in points if all(p.get(k) is not None and math.isfinite(p[k]) for k in (x, y))]
    front = []
    for p in sorted(ok, key=lambda q: (-q[x], -q[y])):  # stable: duplicates keep their input order
        if not front or p[y] > front[-1][y]:
            front.append(p)
    return front[::-1]


def monotone_slopes(xs, ys, method: str = "steffen") -> np.ndarray:
    """Knot derivatives of a monotone cubic Hermite. "steffen" = d3 curveMonotoneX (Steffen 1990 interior,
    one-sided (3s - m)/2 ends; what InferenceX-app uses); "pchip" = Fritsch-Carlson/Butland as scipy PCHIP."""
    x, y = np.asarray(xs, float), np.asarray(ys, float)
    h, s = np.diff(x), np.diff(y) / np.diff(x)
    m = np.full(len(x), s[0] if len(s) else 0.0)
    if len(x) < 3:
        return m  # two knots: a straight line (as d3)
    h0, h1, s0, s1 = h[:-1], h[1:], s[:-1], s[1:]
    if method == "steffen":
        sg = np.where(s0 < 0, -1.0, 1.0) + np.where(s1 < 0, -1.0, 1.0)  # d3's sign(): 0 counts as +
        m[1:-1] = sg * np.minimum(np.minimum(abs(s0), abs(s1)), 0.5 * abs((s0 * h1 + s1 * h0) / (h0 + h1)))
        m[0], m[-1] = (3 * s[0] - m[1]) / 2, (3 * s[-1] - m[-2]) / 2
        return m
    assert method == "pchip", method
    w1, w2, same = 2 * h1 + h0, h1 + 2 * h0, s0 * s1 > 0
    with np.errstate(divide="ignore", invalid="ignore"):
        m[1:-1] = np.where(same, (w1 + w2) / (w1 / s0 + w2 / s1), 0.0)
    for i, a, b, ha, hb in ((0, s[0], s[1], h[0], h[1]), (-1, s[-1], s[-2], h[-1], h[-2])):
        d = ((2 * ha + hb) * a - ha * b) / (ha + hb)
        m[i] = 0.0 if np.sign(d) != np.sign(a) else 3 * a if np.sign(a) != np.sign(b) and abs(d) > 3 * abs(a) else d
    return m


def monotone_cubic(xs, ys, method: str = "steffen"):
    """Interpolant f(t) through strictly increasing knots; t outside [xs[0], xs[-1]] gives the end value."""
    x, y = np.asarray(xs, float), np.asarray(ys, float)
    if len(x) < 2 or np.any(np.diff(x) <= 0):
        raise ValueError("need >= 2 strictly increasing knots")
    m = monotone_slopes(x, y, method)

    def f(t):
        t = np.clip(np.asarray(t, float), x[0], x[-1])
        i = np.clip(np.searchsorted(x, t, side="right") - 1, 0, len(x) - 2)
        h = x[i + 1] - x[i]
        u = (t - x[i]) / h
        return (
            (2 * u**3 - 3 * u**2 + 1) * y[i]
            + (u**3 - 2 * u**2 + u) * h * m[i]
            + (3 * u**2 - 2 * u**3) * y[i + 1]
            + (u**3 - u**2) * h * m[i + 1]
        )

    return f


def tier_reads(front: list[dict], tiers=TIERS, x="p90_intvty", y="tput_per_gpu", method="steffen") -> list[dict]:
    """y read off the front at each tier (§1.5): above max-x knot "unreachable" (0, i.e. infinite cost); below the
    min-x knot "clamped" to its y; on a knot "exact"; else "estimated" = monotone cubic clipped to the y-range."""
    xs, ys = (np.array(v, float) for v in (zip(*sorted((p[x], p[y]) for p in front)) if front else ([], [])))
    f, out = monotone_cubic(xs, ys, method) if len(xs) > 1 else None, []
    for t in tiers:
        if not len(xs) or t > xs[-1]:
            v, st = 0.0, "unreachable"
        elif t in xs:
            v, st = float(ys[np.flatnonzero(xs == t)[0]]), "exact"
        elif t < xs[0]:
            v, st = float(ys[0]), "clamped"
        else:
            v, st = float(np.clip(f(t), ys.min(), ys.max())), "estimated"
        out.append({"tier": t, y: v, "status": st})
    return out


def tier_best(points: list[dict], tier: float, x="p90_intvty", y="tput_per_gpu") -> dict | None:
    """The measured point with the most y among those whose x (P90 interactivity) reaches the tier: the best
    throughput a deployment gets while its slow-tail user still sees `tier` tok/s; None if no point does. Unlike
    tier_reads, nothing is interpolated."""
    ok = [p for p in points if p.get(x) is not None and p.get(y) is not None and p[x] >= tier]
    return max(ok, key=lambda p: p[y]) if ok else None


def tier_summary(points: list[dict], tier: float, x="p90_intvty", y="tput_per_gpu") -> dict:
    """For one config: the best measured point at or above the tier (tier_best) and the front's read there
    (tier_reads: exact / estimated / clamped / unreachable)."""
    best = tier_best(points, tier, x, y)
    (read,) = tier_reads(pareto_frontier(points, x, y), (tier,), x, y)
    return {
        "tier_tok_s_per_user": tier,
        "best_" + y: None if best is None else best[y],
        "best_conc": None if best is None else best.get("conc"),
        "best_" + x: None if best is None else best[x],
        "front_" + y: read[y],
        "front_status": read["status"],
    }


# Rejections of a prompt longer than the server's context: dsserve's RequestError and vLLM's / OpenAI's wording.
CONTEXT_OVERFLOW_MARKS = ("max_model_len", "maximum context length", "context_length_exceeded", "context length")
MAX_OVERFLOW_RATE = 0.01  # agentx.md 1.3: more than 1% context-overflow responses make a run invalid


def is_context_overflow(record: dict) -> bool:
    """A response the server refused (or cut) because the prompt did not fit its context: the record's own
    ``context_overflow`` flag when the client set one, else its error text naming the context limit."""
    if "context_overflow" in record:
        return bool(record["context_overflow"])
    err = record.get("error")
    return bool(err) and any(m in str(err).lower() for m in CONTEXT_OVERFLOW_MARKS)


def aggregate(
    records: list[dict],
    window=None,
    num_gpus: int = 1,
    *,
    meta: dict | None = None,
    server: dict | None = None,
    dataset: dict | None = None,
    price_per_gpu_hr: float | None = None,
    min_duration_s: float = 900.0,
) -> dict:
    """InferenceX-like agg dict (§3.7) over successful phase=="profile" records; D = max(end) - min(start) over
    them. ``window`` = optional (start_ns, end_ns) profiling window, only for qps buckets and 98% coverage.
    ``server`` = {"before": counters, "after": counters, "gpu_usage_pct": .., "gpu_total_tokens": ..}."""
    meta, server, (t0, t1) = meta or {}, server or {}, window or (None, None)
    prof = [r for r in records if r.get("phase", "profile") == "profile"]
    ok = [r for r in prof if not r.get("error")]
    itls = [v for v in (request_itl(r["ttft"], r["e2el"], r["osl"]) for r in ok) if v is not None]
    b, a = server.get("before"), server.get("after")
    gpu, ext = server_hit_rate(b, a), server_hit_rate(b, a, "external_")
    overall = gpu if gpu is None else gpu + (server_hit_rate(b, a, "external_", "") or 0)  # (local+ext hits)/local q
    tp = throughput(ok, num_gpus, gpu)
    lat = {"ttft": stats([r["ttft"] for r in ok]), "e2el": stats([r["e2el"] for r in ok]), "itl": stats(itls)}
    lat.update(
        tpot=lat["itl"],
        intvty=interactivity(itls),
        e2e_norm_intvty=interactivity([r["e2el"] / r["osl"] for r in ok if r["osl"] >= 1]),
    )
    cov = (max(r["end_ns"] for r in ok) - t0) / (t1 - t0) if window and ok and t1 > t0 else None
    err, dur_ok = (len(prof) - len(ok)) / len(prof) if prof else None, tp["duration_seconds"] >= min_duration_s
    overflow = sum(map(is_context_overflow, prof)) / len(prof) if prof else None
    overflow_ok = (overflow or 0) <= MAX_OVERFLOW_RATE
    cost = price_per_gpu_hr * 1e6 / (3600 * tp["per_gpu"]) if price_per_gpu_hr and tp["per_gpu"] else None
    return {
        **{k: meta.get(k) for k in META_KEYS},
        "num_gpus": num_gpus,
        "num_requests_total": len(prof),
        "num_requests_successful": len(ok),
        "error_rate": err,
        "request_metrics": {
            "qps": qps(ok, t0, t1),
            "latency": lat,
            "throughput": tp,
            "tokens": {
                k: sum(r.get(f) or 0 for r in ok)
                for k, f in (
                    ("input", "isl"),
                    ("output_actual", "osl"),
                    ("output_expected", "max_tokens"),
                    ("cached_input", "cached"),
                )
            },
            "cache": {"theoretical_cache_hit_rate": theoretical_hit_rate(ok)},
        },
        "server_metrics": {
            "cache": {
                "gpu_hit_rate": gpu,
                "cpu_hit_rate": server_hit_rate(b, a, "cpu_"),
                "external_hit_rate": ext,
                "overall_hit_rate": overall,
            },
            "kv_cache": {k: server.get(k) for k in ("gpu_usage_pct", "gpu_total_tokens")},
        },
        "tput_per_gpu": tp["per_gpu"],
        "output_tput_per_gpu": tp["output_per_gpu"],
        "input_tput_per_gpu": tp["input_per_gpu"],
        "p90_intvty": lat["intvty"]["p90"],
        "median_intvty": lat["intvty"]["p50"],
        "mean_intvty": lat["intvty"]["mean"],
        "p90_e2e_norm_intvty": lat["e2e_norm_intvty"]["p90"],
        "p90_ttft": lat["ttft"]["p90"],
        "p90_e2el": lat["e2el"]["p90"],
        "cost_per_mtok": cost,
        "dataset": dataset or {},
        "validity": {
            "coverage": cov,
            "duration_ok": dur_ok,
            "error_rate_ok": (err or 0) <= 0.10,
            "context_overflow_rate": overflow,
            "context_overflow_ok": overflow_ok,
            "valid": dur_ok and (err or 0) <= 0.10 and overflow_ok and (cov is None or cov >= 0.98),
        },
    }


def write_agg(out_dir, agg: dict) -> Path:
    """agg_<config>_conc<C>.json (strict JSON: no NaN/inf)."""
    path = Path(out_dir) / f"agg_{agg.get('config') or 'run'}_conc{agg.get('conc')}.json"
    path.write_text(json.dumps(agg, indent=2, allow_nan=False, default=str) + "\n")
    return path


def write_requests_jsonl(path, records) -> Path:
    """One row per request: REQUEST_FIELDS first (itl computed when absent), then any extra keys."""
    with open(path, "w") as f:
        for r in records:
            row = {k: r.get(k) for k in REQUEST_FIELDS}
            if row["itl"] is None and None not in (r.get("ttft"), r.get("e2el")):
                row["itl"] = request_itl(r["ttft"], r["e2el"], r.get("osl"))
            f.write(json.dumps({**row, **{k: v for k, v in r.items() if k not in row}}, default=str) + "\n")
    return Path(path)


def write_points_csv(path, aggs: list[dict]) -> Path:
    """One row per agg (POINT_COLS); on_frontier = on its config's throughput-vs-P90-interactivity front."""
    front = {
        id(p)
        for c in {a.get("config") for a in aggs}
        for p in pareto_frontier([a for a in aggs if a.get("config") == c])
    }
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=POINT_COLS, extrasaction="ignore")
        w.writeheader()
        w.writerows({**a, "on_frontier": int(id(a) in front)} for a in aggs)
    return Path(path)


def plot_points(path, aggs: list[dict], x: str = "p90_intvty", tier: float | None = None) -> Path:
    """PNG of y = tok/s/GPU vs x ("p90_intvty", or "p90_ttft" for the companion plot): a marker per
    concurrency (C=..), a line per config and, for interactivity, the config's Pareto front and the tier
    (tok/s/user) as a dashed line."""
    from matplotlib.figure import Figure  # OO API: Agg canvas, no pyplot state

    fig = Figure(figsize=(8, 5.5))
    ax = fig.subplots()
    for c in dict.fromkeys(a.get("config") for a in aggs):
        g = sorted((a for a in aggs if a.get("config") == c and a.get(x) is not None), key=lambda a: a["conc"])
        (line,) = ax.plot([a[x] for a in g], [a["tput_per_gpu"] for a in g], "o-", alpha=0.6, label=str(c))
        for a in g:
            ax.annotate(f"C={a['conc']}", (a[x], a["tput_per_gpu"]), xytext=(4, 4), textcoords="offset points")
        fr = pareto_frontier(g, x) if x == "p90_intvty" else []
        if len(fr) > 1:  # the front, drawn as the monotone cubic the tier reads use
            xs = np.linspace(fr[0][x], fr[-1][x], 200)
            ax.plot(
                xs,
                monotone_cubic([p[x] for p in fr], [p["tput_per_gpu"] for p in fr])(xs),
                "-",
                lw=2.5,
                color=line.get_color(),
                label=f"{c} Pareto front",
            )
            ax.plot([p[x] for p in fr], [p["tput_per_gpu"] for p in fr], "*", ms=11, color=line.get_color())
    if tier is not None and x == "p90_intvty":
        ax.axvline(tier, ls="--", color="grey", lw=1, label=f"tier {tier:g} tok/s/user")
    ax.set(
        xlabel=(lbl := {"p90_intvty": "P90 interactivity (tok/s/user)", "p90_ttft": "P90 TTFT (s)"}.get(x, x)),
        ylabel="Throughput per GPU (tok/s/GPU, cached + uncached input + output)",
        title=f"Throughput vs {lbl}",
    )
    ax.grid(alpha=0.3), ax.legend(fontsize=8)
    fig.savefig(path, dpi=120, bbox_inches="tight")
    return Path(path)
