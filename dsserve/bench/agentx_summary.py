"""Several ``bench agentx`` runs side by side (e.g. bounded replay on and off): one frontier plot and, per
config, the tier read, from the ``agg_*.json`` files the runs wrote (one per finished concurrency point, so a run
cut short still counts its finished points).

    python -m dsserve.bench.agentx_summary --tier-tok-s 150 --out DIR RUN_DIR [RUN_DIR ...]

writes DIR/agentx-summary.json and DIR/agentx-frontier.png, and prints one line per config and the JSON.

TTFT at matched throughput (issue 59.5: the seed's "TTFT falls ~70% at ~100K tok/s per GPU" is a point on the
TTFT-vs-throughput curve, not a TTFT at one prompt length): each config's P90 TTFT is interpolated linearly along its
rising throughput curve and read at every throughput of the baseline's and its own points that both curves reach;
the reduction against the baseline (``--baseline``, default the first config) is given at each, and at the highest
throughput both reach.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from . import metrics as M
from .provenance import run_meta

POINT_KEYS = (
    "conc",
    "num_requests_successful",
    "error_rate",
    "p90_intvty",
    "median_intvty",
    "p90_ttft",
    "tput_per_gpu",
    "output_tput_per_gpu",
)


def load_aggs(dirs) -> list[dict]:
    """Every agg_*.json directly under the given directories (or the files themselves), in name order; an earlier
    agentx-summary.json given as a file stands for its configs' points (the fields POINT_KEYS keeps)."""
    files = []
    for d in map(Path, dirs):
        files += [d] if d.is_file() else sorted(d.glob("agg_*.json"))
    aggs = []
    for f in files:
        a = json.loads(f.read_text())
        if "configs" in a and "points" in next(iter(a["configs"].values()), {}):
            aggs += [{**q, "config": c} for c, r in a["configs"].items() for q in r["points"]]
        else:
            aggs.append(a)
    return aggs


def summarise(aggs: list[dict], tier: float) -> dict:
    """{config: {"points": [...] by concurrency, "tier": metrics.tier_summary}}, configs in first-seen order."""
    out = {}
    for c in dict.fromkeys(a.get("config") for a in aggs):
        g = sorted((a for a in aggs if a.get("config") == c), key=lambda a: a.get("conc") or 0)
        out[str(c)] = {"points": [{k: a.get(k) for k in POINT_KEYS} for a in g], "tier": M.tier_summary(g, tier)}
    return out


def rising_curve(points: list[dict]) -> list[tuple[float, float]]:
    """(throughput per GPU, P90 TTFT) of the points in concurrency order up to where throughput stops rising: the
    part of the curve on which a throughput names one operating point."""
    curve = []
    for q in sorted(points, key=lambda q: q.get("conc") or 0):
        x, y = q.get("tput_per_gpu"), q.get("p90_ttft")
        if x is None or y is None:
            continue
        if curve and x <= curve[-1][0]:
            break
        curve.append((float(x), float(y)))
    return curve


def ttft_at(curve: list[tuple[float, float]], x: float) -> float | None:
    """P90 TTFT interpolated linearly at throughput x; None outside the measured range (no extrapolation)."""
    for (x0, y0), (x1, y1) in zip(curve, curve[1:]):
        if x0 <= x <= x1:
            return y0 + (y1 - y0) * (x - x0) / (x1 - x0)
    if curve and x == curve[0][0]:
        return curve[0][1]
    return None


def matched_ttft(configs: dict, baseline: str) -> dict:
    """{config: {"at": [{tput_per_gpu, p90_ttft, baseline_p90_ttft, reduction}], "at_highest_common": {...} | None}}
    for every config other than ``baseline``; reduction = 1 - TTFT / baseline TTFT at the same throughput."""
    base = rising_curve(configs[baseline]["points"])
    out = {}
    for c, r in configs.items():
        if c == baseline:
            continue
        mine = rising_curve(r["points"])
        at = []
        if base and mine:
            lo, hi = max(base[0][0], mine[0][0]), min(base[-1][0], mine[-1][0])
            for x in sorted({x for x, _ in base + mine if lo <= x <= hi} | ({hi} if lo <= hi else set())):
                y, yb = ttft_at(mine, x), ttft_at(base, x)
                if y is not None and yb:
                    at.append({"tput_per_gpu": x, "p90_ttft": y, "baseline_p90_ttft": yb, "reduction": 1 - y / yb})
        out[c] = {"baseline": baseline, "at": at, "at_highest_common": at[-1] if at else None}
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m dsserve.bench.agentx_summary", description=__doc__.split("\n")[0])
    p.add_argument("runs", nargs="+", help="output dirs of bench agentx (or agg_*.json files)")
    p.add_argument("--tier-tok-s", type=float, default=150.0, help="per-user speed whose tier is read")
    p.add_argument("--out", required=True, help="directory for agentx-summary.json and agentx-frontier.png")
    p.add_argument("--baseline", default=None, help="config the others' TTFT is compared to (default: the first)")
    a = p.parse_args(argv)
    aggs = load_aggs(a.runs)
    if not aggs:
        print(f"agentx_summary: no agg_*.json under {a.runs}")
        return 1
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    configs = summarise(aggs, a.tier_tok_s)
    baseline = a.baseline or next(iter(configs))
    if baseline not in configs:
        print(f"agentx_summary: --baseline {baseline!r} is not one of the runs' configs {list(configs)}")
        return 2
    res = {
        "meta": run_meta(),
        "tier_tok_s_per_user": a.tier_tok_s,
        "configs": configs,
        "ttft_at_matched_throughput": matched_ttft(configs, baseline),
    }
    (out / "agentx-summary.json").write_text(json.dumps(res, indent=2, default=str) + "\n")
    M.plot_points(out / "agentx-frontier.png", aggs, "p90_intvty", tier=a.tier_tok_s)
    f = lambda v, s="{:,.1f}": "-" if v is None else s.format(v)  # noqa: E731
    for c, r in res["configs"].items():
        t = r["tier"]
        print(
            f"{c}: "
            + ", ".join(
                f"C={q['conc']} {f(q['tput_per_gpu'])} tok/s/GPU @ P90 {f(q['p90_intvty'])} tok/s/user"
                for q in r["points"]
            )
            + f" | tier {a.tier_tok_s:g}: best {f(t['best_tput_per_gpu'])} (C={t['best_conc']}), front "
            f"{f(t['front_tput_per_gpu'])} ({t['front_status']})"
        )
    for c, m in res["ttft_at_matched_throughput"].items():
        h = m["at_highest_common"]
        print(
            f"{c} vs {m['baseline']}: "
            + (
                "no throughput both reach"
                if h is None
                else f"P90 TTFT {h['p90_ttft']:.3f} s vs {h['baseline_p90_ttft']:.3f} s at {h['tput_per_gpu']:,.0f} "
                f"tok/s/GPU (reduction {h['reduction']:.0%}), the highest throughput both reach"
            )
        )
    print(json.dumps(res, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
