"""Asynchronous scheduling on the release proxy (issue 9): decode steps through the engine's whole ``step()``
(scheduling, refill, graph replay, sampling, the copy back, detokenising and stop checks) with async scheduling
off and on, against the device's own time for the step (the same CUDA graph replayed back to back, nothing on
the host in between). Exposed host time = step - device step; the goal is under 5% of the step at B = 1.

    python benchmarks/async_steps_h200.py --out benchmarks/results/async-steps-h200

Needs a GPU. Requests are injected with synthetic caches at the context (no prefill), Engram tables in pinned
host memory (FP8). Prints a table, then one JSON line.
"""

import argparse
import json
import os
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(HERE), HERE]

import dsserve.bench.forward as fwd  # noqa: E402
from dsserve.bench.provenance import run_meta  # noqa: E402
from dsserve.engine.core import _Tracked  # noqa: E402
from dsserve.engine.detokenizer import StopChecker  # noqa: E402
from dsserve.engine.request import Request, RequestStatus  # noqa: E402
from dsserve.engine.sampling_params import SamplingParams  # noqa: E402


def inject(core, tag: str, b: int, ctx: int, tokens: int, gen: torch.Generator) -> list[Request]:
    """B running requests whose caches hold ``ctx`` synthetic tokens; each decodes its prompt's last token next."""
    reqs = []
    for i in range(b):
        ids = torch.randint(3, core.cfg.vocab_size - 2, (ctx + 1,), generator=gen).tolist()
        params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
        r = Request(f"{tag}-{i}", ids, params)
        r.kv = core.kv.new_sequence()
        fwd._fill(core, r, ctx, tokens + 1, gen)
        r.status = RequestStatus.RUNNING
        core.scheduler.requests[r.request_id] = r
        core.scheduler.running.append(r)
        stops = StopChecker(
            core.tokenizer, ids, params, eos_token_id=core.tokenizer.eos_id, max_model_len=core.max_model_len
        )
        core._tracked[r.request_id] = _Tracked(r, stops, None, None)
        reqs.append(r)
    return reqs


def run_mode(core, async_on: bool, b: int, ctx: int, steps: int, gen: torch.Generator) -> dict:
    core.async_scheduling = async_on
    reqs = inject(core, f"{'a' if async_on else 's'}{b}", b, ctx, steps + 8, gen)
    for _ in range(4):  # the first step captures the bucket's graph; then the pipeline fills
        core.step()
    torch.cuda.synchronize()
    st = core.stats
    h0, w0, n0, a0 = st.step_host_seconds, st.step_wait_seconds, st.steps, st.ahead_steps
    t = time.perf_counter()
    for _ in range(steps):
        core.step()
    wall = time.perf_counter() - t
    n = st.steps - n0
    out = {
        "step_ms": wall / steps * 1e3,
        "host_ms_per_step": (st.step_host_seconds - h0) / n * 1e3,
        "wait_ms_per_step": (st.step_wait_seconds - w0) / n * 1e3,
        "ahead_steps": st.ahead_steps - a0,
    }
    for r in reqs:
        core.abort_request(r.request_id)
    while core.has_unfinished_requests():
        core.step()
    torch.cuda.synchronize()
    return out


def device_step_ms(core, b: int, ctx: int, gen: torch.Generator, reps: int = 20) -> float:
    """The captured graph of this bucket replayed back to back: the step's device time with no host gaps."""
    reqs = inject(core, f"d{b}", b, ctx, 16, gen)
    core.async_scheduling = False
    core.step()  # fills the graph's buffers for these rows
    graphs = core.runner.decode_graphs
    key = graphs.key(core.scheduler.schedule())  # (the plan is not run: only its key)
    graph = graphs._steps[key].graph
    torch.cuda.synchronize()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    for _ in range(reps):
        graph.replay()  # the same inputs again: the same work, its KV writes land on the same rows
    e.record()
    torch.cuda.synchronize()
    for r in reqs:
        core.abort_request(r.request_id)
    while core.has_unfinished_requests():
        core.step()
    return s.elapsed_time(e) / reps


def plot(res: dict, path: str) -> None:
    """Step ms per batch size: sync, async, and the device's own step (graph replays back to back)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = res["cases"]
    fig, ax = plt.subplots(figsize=(6.4, 3.6))
    xs = range(len(rows))
    for k, (label, get) in enumerate(
        (
            ("synchronous", lambda r: r["sync"]["step_ms"]),
            ("async scheduling", lambda r: r["async"]["step_ms"]),
            ("device step (replays back to back)", lambda r: r["device_step_ms"]),
        )
    ):
        ax.bar([x + (k - 1) * 0.27 for x in xs], [get(r) for r in rows], 0.27, label=label)
    ax.set_xticks(list(xs), [f"B = {r['B']}" for r in rows])
    ax.set_ylabel(f"decode step ms (context {rows[0]['ctx']})")
    ax.set_title("Engine decode step, release proxy, H200")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default="benchmarks/results/async-steps-h200")
    p.add_argument("--batches", default="1,8,32")
    p.add_argument("--context", type=int, default=8192)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--plot-only", action="store_true", help="redraw async_steps.png from --out's JSON (CPU)")
    a = p.parse_args()
    if a.plot_only:
        with open(os.path.join(a.out, "async_steps.json")) as f:
            plot(json.load(f), os.path.join(a.out, "async_steps.png"))
        return
    import model_h200 as M

    batches = [int(x) for x in a.batches.split(",")]
    core, info = M.build_core(
        "proxy-h200-release",
        (max(batches) * 3, a.context + a.steps + 64),
        release=True,
        smoke=False,
        engram_tables="host-fp8",
    )
    gen = torch.Generator().manual_seed(0)
    rows = []
    for b in batches:
        sync = run_mode(core, False, b, a.context, a.steps, gen)
        asyn = run_mode(core, True, b, a.context, a.steps, gen)
        dev = device_step_ms(core, b, a.context, gen)
        rows.append(
            {
                "B": b,
                "ctx": a.context,
                "device_step_ms": dev,
                "sync": sync,
                "async": asyn,
                "exposed_host_ms": {"sync": sync["step_ms"] - dev, "async": asyn["step_ms"] - dev},
                "exposed_fraction": {"sync": 1 - dev / sync["step_ms"], "async": 1 - dev / asyn["step_ms"]},
                "speedup": sync["step_ms"] / asyn["step_ms"],
            }
        )
        print(json.dumps(rows[-1]), flush=True)
    print(
        f"{'B':>4s} {'device ms':>10s} {'sync ms':>9s} {'async ms':>9s} {'exposed sync':>13s} "
        f"{'exposed async':>14s} {'host busy sync/async ms':>24s}"
    )
    for r in rows:
        print(
            f"{r['B']:4d} {r['device_step_ms']:10.2f} {r['sync']['step_ms']:9.2f} {r['async']['step_ms']:9.2f} "
            f"{r['exposed_fraction']['sync']:12.1%} {r['exposed_fraction']['async']:13.1%} "
            f"{r['sync']['host_ms_per_step']:11.2f} / {r['async']['host_ms_per_step']:.2f}"
        )
    res = {
        "meta": run_meta(),
        "model": info,
        "cases": rows,
    }
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "async_steps.json"), "w") as f:
        json.dump(res, f, indent=1, default=str)
    plot(res, os.path.join(a.out, "async_steps.png"))
    print(json.dumps([{"B": r["B"], "speedup": r["speedup"], **r["exposed_fraction"]} for r in rows]))


if __name__ == "__main__":
    main()
