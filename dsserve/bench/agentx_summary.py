"""Several ``bench agentx`` runs side by side (e.g. bounded replay on and off): one frontier plot and, per
config, the tier read, from the ``agg_*.json`` files the runs wrote (one per finished concurrency point, so a run
cut short still counts its finished points).

    python -m dsserve.bench.agentx_summary --tier-tok-s 150 --out DIR RUN_DIR [RUN_DIR ...]

writes DIR/agentx-summary.json and DIR/agentx-frontier.png, and prints one line per config and the JSON.
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
    """Every agg_*.json directly under the given directories (or the files themselves), in name order."""
    files = []
    for d in map(Path, dirs):
        files += [d] if d.is_file() else sorted(d.glob("agg_*.json"))
    return [json.loads(f.read_text()) for f in files]


def summarise(aggs: list[dict], tier: float) -> dict:
    """{config: {"points": [...] by concurrency, "tier": metrics.tier_summary}}, configs in first-seen order."""
    out = {}
    for c in dict.fromkeys(a.get("config") for a in aggs):
        g = sorted((a for a in aggs if a.get("config") == c), key=lambda a: a.get("conc") or 0)
        out[str(c)] = {"points": [{k: a.get(k) for k in POINT_KEYS} for a in g], "tier": M.tier_summary(g, tier)}
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m dsserve.bench.agentx_summary", description=__doc__.split("\n")[0])
    p.add_argument("runs", nargs="+", help="output dirs of bench agentx (or agg_*.json files)")
    p.add_argument("--tier-tok-s", type=float, default=150.0, help="per-user speed whose tier is read")
    p.add_argument("--out", required=True, help="directory for agentx-summary.json and agentx-frontier.png")
    a = p.parse_args(argv)
    aggs = load_aggs(a.runs)
    if not aggs:
        print(f"agentx_summary: no agg_*.json under {a.runs}")
        return 1
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    res = {"meta": run_meta(), "tier_tok_s_per_user": a.tier_tok_s, "configs": summarise(aggs, a.tier_tok_s)}
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
    print(json.dumps(res, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
