"""Where a drafting step's time goes in the engine (issue 56): the host's time in each phase of
``EngineCore._step_speculative`` and its one wait for the device, per step, on the release proxy with drafts on.

    python benchmarks/spec_step_phases.py --out $OUT/phases          # one GPU: the proxy, B = 1 and 8, < 2 minutes
    python benchmarks/spec_step_phases.py --smoke --out /tmp/phases  # the CPU, tiny shapes

``proxy-h200-release`` (random weights, so its drafter accepts almost nothing: every step is a whole drafting step)
built as benchmarks/model_h200.py builds it, drafts on (K = 5), B requests of ``--prompt`` random tokens, greedy,
``--tokens`` new tokens each; each B runs twice (the first captures its graphs) and the second run's steps are timed
from the one after which every request has its first token (so no prefill step is counted). Each phase is timed on
the host by a wrapper around the engine's own method (the scheduler's plan, the forward as the host issues it, the
rejection sampler's decision, the drafter's before / ingest / inputs / propose / settle / hand_out, the scheduler's
update, the commits); nothing is synchronised but the step's own read ("read (wait)": the host waiting for the
verdict and the drafts), so a phase's time is what the host spends issuing it and the wait is the device's time the
host did not overlap. On a GPU, CUDA events also bracket the device's work (the forward; then the rejection,
ingestion and proposal): the step's time outside them is host time the device did not overlap, the most an
asynchronous pipeline could hide. Prints a table, then the JSON path; writes phases.json (run_meta provenance) and
phases.png.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections import defaultdict

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(HERE), HERE]

import dsserve.engine.core as core_module  # noqa: E402
from dsserve.bench.provenance import run_meta  # noqa: E402
from dsserve.engine.sampling_params import SamplingParams  # noqa: E402


def _sync(smoke: bool) -> None:
    if not smoke:
        torch.cuda.synchronize()


def timed_phases(core) -> tuple[dict, dict]:
    """Wraps the engine's phases in host timers; returns (seconds by phase, calls by phase), filled as it runs."""
    secs, calls = defaultdict(float), defaultdict(int)

    def wrap(obj, name: str, label: str) -> None:
        fn = getattr(obj, name)

        def timed(*a, **k):
            t = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                secs[label] += time.perf_counter() - t
                calls[label] += 1

        setattr(obj, name, timed)

    wrap(core.scheduler, "schedule", "schedule")
    wrap(core.executor, "execute", "forward (host)")
    wrap(core.rejection_sampler, "decide", "rejection decide")
    for name in ("before", "ingest", "inputs", "propose", "settle", "hand_out"):
        wrap(core.drafter, name, f"drafter.{name}")
    wrap(core.scheduler, "update", "scheduler.update")
    wrap(core, "_commit", "commit")
    wrap(core_module, "_read_together", "read (wait)")
    return secs, calls


def device_spans(core, spans: dict) -> None:
    """CUDA events around the step's device work: before the forward is issued, after it, and after the proposal;
    read once the step's own read has waited for them. ``spans`` gets "forward" and "after forward" (rejection,
    ingestion, inputs, proposal, with any gaps where the device waited for the host to issue them) in ms. The step's
    time outside these spans is host time the device did not overlap: what an asynchronous pipeline could hide."""
    marks: list = []

    def around(obj, name: str, before: bool, after: bool, then=None) -> None:
        fn = getattr(obj, name)

        def marked(*a, **k):
            if before:
                marks.append(torch.cuda.Event(enable_timing=True))
                marks[-1].record()
            out = fn(*a, **k)
            if after:
                marks.append(torch.cuda.Event(enable_timing=True))
                marks[-1].record()
            if then is not None:
                then()
            return out

        setattr(obj, name, marked)

    def read_marks() -> None:
        if len(marks) == 3:  # the read waited for the proposal, so every mark has completed
            spans["forward"] += marks[0].elapsed_time(marks[1])
            spans["after forward"] += marks[1].elapsed_time(marks[2])
        marks.clear()

    around(core.executor, "execute", True, True)
    around(core.drafter, "propose", False, True)
    around(core_module, "_read_together", False, False, then=read_marks)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    p.add_argument("--smoke", action="store_true", help="tiny on the CPU")
    p.add_argument("--batches", default="1,8")
    p.add_argument("--prompt", type=int, default=1024)
    p.add_argument("--tokens", type=int, default=48)
    p.add_argument("--k", type=int, default=5)
    p.add_argument("--replot", metavar="JSON", help="draw phases.png into --out from a phases.json; run nothing")
    a = p.parse_args()
    if a.replot:
        with open(a.replot) as f:
            plot(json.load(f), os.path.join(a.out, "phases.png"))
        return
    if a.smoke:
        a.prompt, a.tokens = 32, 12
    from model_h200 import build_core, free_core

    os.makedirs(a.out, exist_ok=True)
    batches = [int(x) for x in a.batches.split(",")]
    spec = {"method": "dspark", "num_speculative_tokens": a.k}
    kv_tokens = (max(batches), a.prompt + a.tokens + 2 * a.k + 8)
    model = "tiny" if a.smoke else "proxy-h200-release"
    core, info = build_core(model, kv_tokens, release=not a.smoke, smoke=a.smoke, speculative_config=spec)
    res = {"meta": run_meta(smoke=a.smoke), "model": info, "k": a.k, "prompt": a.prompt, "tokens": a.tokens}
    res["rows"] = []
    secs, calls = timed_phases(core)
    spans = defaultdict(float)
    if not a.smoke:
        device_spans(core, spans)
    gen = torch.Generator().manual_seed(7)
    try:
        for b in batches:
            for rep in range(2):
                for i in range(b):
                    ids = torch.randint(10, core.cfg.vocab_size - 10, (a.prompt,), generator=gen).tolist()
                    params = SamplingParams(temperature=0.0, max_tokens=a.tokens, ignore_eos=True)
                    core.add_request(f"{b}-{rep}-{i}", ids, params)
                n, t0, started = 0, None, set()
                while core.has_unfinished_requests():
                    if t0 is not None:
                        n += 1
                    for o in core.step():
                        started.add(o.request_id)
                    if t0 is None and len(started) == b:  # every prompt is in: the drafting steps start
                        _sync(a.smoke)
                        secs.clear()
                        calls.clear()
                        spans.clear()
                        t0 = time.perf_counter()
                _sync(a.smoke)
                wall = time.perf_counter() - t0
            phases = {k: v / n * 1e3 for k, v in secs.items()}
            row = {"B": b, "steps": n, "step_ms": wall / n * 1e3, "phases_ms": phases}
            row["unaccounted_ms"] = row["step_ms"] - sum(row["phases_ms"].values())
            if spans:
                row["device_span_ms"] = {k: v / n for k, v in spans.items()}
                row["host_outside_device_ms"] = row["step_ms"] - sum(row["device_span_ms"].values())
            res["rows"].append(row)
            print(f"B={b}: {row['step_ms']:.2f} ms a step over {n} steps", flush=True)
    finally:
        free_core(core)
    labels = list(res["rows"][0]["phases_ms"])
    print(f"{'phase (host ms a step)':<24}" + "".join(f"{'B=' + str(r['B']):>10}" for r in res["rows"]))
    for label in labels + ["unaccounted_ms"]:
        vals = [r["phases_ms"].get(label, r.get(label, 0.0)) for r in res["rows"]]
        print(f"{label:<24}" + "".join(f"{v:>10.2f}" for v in vals))
    if "device_span_ms" in res["rows"][0]:
        print(f"{'device span (ms a step)':<24}")
        for label in res["rows"][0]["device_span_ms"]:
            print(f"{'  ' + label:<24}" + "".join(f"{r['device_span_ms'][label]:>10.2f}" for r in res["rows"]))
        vals = [r["host_outside_device_ms"] for r in res["rows"]]
        print(f"{'host outside the spans':<24}" + "".join(f"{v:>10.2f}" for v in vals))
    path = os.path.join(a.out, "phases.json")
    with open(path, "w") as f:
        json.dump(res, f, indent=1, default=str)
    plot(res, os.path.join(a.out, "phases.png"))
    print(path)
    last = {"step_ms": {r["B"]: r["step_ms"] for r in res["rows"]}}
    if "host_outside_device_ms" in res["rows"][0]:
        last["host_outside_device_ms"] = {r["B"]: r["host_outside_device_ms"] for r in res["rows"]}
    print(json.dumps(last))


def plot(res: dict, png: str) -> None:
    """Per B, a stacked bar of the host's ms a step in each phase (the wait on top) and, where CUDA events ran, a bar
    beside it of the device's spans and the host time outside them."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = res["rows"]
    spans = "device_span_ms" in rows[0]
    labels = sorted({k for r in rows for k in r["phases_ms"]}, key=lambda k: k == "read (wait)")
    colours = plt.get_cmap("tab20").colors
    fig, ax = plt.subplots(figsize=(8, 4.8))
    width = 0.38 if spans else 0.6
    host_x = [i - width / 2 if spans else i for i in range(len(rows))]
    bottom = [0.0] * len(rows)
    for n, label in enumerate(labels):
        vals = [r["phases_ms"].get(label, 0.0) for r in rows]
        ax.bar(host_x, vals, width, bottom=bottom, label=f"host: {label}", color=colours[n % 20])
        bottom = [b + v for b, v in zip(bottom, vals)]
    if spans:
        dev_x = [i + width / 2 for i in range(len(rows))]
        bottom = [0.0] * len(rows)
        parts = [(f"device: {k}", [r["device_span_ms"][k] for r in rows]) for k in rows[0]["device_span_ms"]]
        parts.append(("host outside the device spans", [r["host_outside_device_ms"] for r in rows]))
        for n, (label, vals) in enumerate(parts):
            ax.bar(dev_x, vals, width, bottom=bottom, label=label, color=colours[(len(labels) + n) % 20], hatch="//")
            bottom = [b + v for b, v in zip(bottom, vals)]
    ticks = [f"B = {r['B']}" + ("\n(host phases | device spans)" if spans else "") for r in rows]
    ax.set_xticks(range(len(rows)), ticks)
    ax.set(ylabel="ms a drafting step", title=f"the drafting step's phases ({res['meta'].get('device', '')})")
    ax.legend(fontsize=6.5, loc="upper left", ncol=2)
    fig.tight_layout()
    fig.savefig(png, dpi=110)


if __name__ == "__main__":
    main()
