"""Where a CUDA-graph decode step's time goes on the release proxy (issue 9): per case, the host phases of a
steady-state step (bucket lookup, refilling the buffers, launching the replay, waiting for it, the host's
bookkeeping) and the replayed kernels' device time (torch.profiler): every kernel's total ms and launch count.

    python benchmarks/graph_step_profile.py --out benchmarks/results/model-h200-graphs

Needs a GPU. Prints a table, then one JSON line.
"""

import argparse
import json
import os
import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(HERE), HERE]

import dsserve.bench.forward as fwd  # noqa: E402
from dsserve.bench.provenance import run_meta  # noqa: E402
from dsserve.engine.request import Request  # noqa: E402
from dsserve.engine.sampling_params import SamplingParams  # noqa: E402
from dsserve.engine.scheduler import ScheduledChunk, StepOutput, StepPlan  # noqa: E402

CASES = [(1, 8192), (128, 8192), (32, 131072), (128, 131072)]


def profile_case(core, b: int, ctx: int, gen: torch.Generator, steps: int = 3) -> dict:
    graphs = core.runner.decode_graphs
    reqs = []
    for i in range(b):
        ids = torch.randint(3, core.cfg.vocab_size - 2, (ctx + 1,), generator=gen).tolist()
        r = Request(f"p-{b}-{ctx}-{i}", ids, SamplingParams(temperature=0, max_tokens=steps + 2))
        r.kv = core.kv.new_sequence()
        fwd._fill(core, r, ctx, steps + 2, gen)
        reqs.append(r)

    def plan():
        return StepPlan([ScheduledChunk(r, 1) for r in reqs], [])

    torch.cuda.synchronize()
    t = time.perf_counter()
    first = plan()
    core.runner.execute(first)  # captures this bucket pair's graph
    core.scheduler.update(first, StepOutput())
    torch.cuda.synchronize()
    first_s = time.perf_counter() - t
    phases = []
    for step in range(steps + 1):
        # a random token a row, as bench_forward draws them: one token in every row would route every row alike
        toks = torch.randint(3, core.cfg.vocab_size - 2, (len(reqs),), generator=gen).tolist()
        for r, tok in zip(reqs, toks):
            r.output_token_ids.append(tok)
        p = plan()
        seqs = [c.request.kv for c in p.chunks]
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        key = graphs.key(p)
        t1 = time.perf_counter()
        batch, graph = graphs._steps[key].batch, graphs._steps[key].graph
        core.model.fill_decode(batch, seqs, toks)
        t2 = time.perf_counter()
        if step < steps:
            graph.replay()
            t3 = time.perf_counter()
            torch.cuda.synchronize()
        else:  # the last step under the profiler: the replayed kernels' device time
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                t3 = time.perf_counter()
                graph.replay()
                torch.cuda.synchronize()
        t4 = time.perf_counter()
        core.model.commit_decode(seqs, toks)
        t5 = time.perf_counter()
        core.scheduler.update(p, StepOutput())
        if step < steps:
            phases.append({"key": t1 - t0, "fill": t2 - t1, "launch": t3 - t2, "wait": t4 - t3, "commit": t5 - t4})
    per, count = {}, {}
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            per[e.name[:70]] = per.get(e.name[:70], 0.0) + e.time_range.elapsed_us() / 1e3
            count[e.name[:70]] = count.get(e.name[:70], 0) + 1
    for r in reqs:
        core.kv.release(r.kv)
    med = {k: sorted(p[k] for p in phases)[len(phases) // 2] * 1e3 for k in phases[0]}
    return {
        "B": b,
        "ctx": ctx,
        "bucket": list(key),
        "capture_step_s": first_s,
        "phases_ms": med,
        "replay_kernels_ms": sum(per.values()),
        "kernels_launched": sum(count.values()),
        "top_kernels_ms": dict(sorted(per.items(), key=lambda kv: -kv[1])[:12]),
        "kernels": {n: {"ms": ms, "count": count[n]} for n, ms in sorted(per.items(), key=lambda kv: -kv[1])},
    }


def main() -> None:
    import model_h200 as M

    p = argparse.ArgumentParser()
    p.add_argument("--out", default="benchmarks/results/model-h200-graphs")
    p.add_argument(
        "--cases", default=",".join(f"{b}:{c}" for b, c in CASES), help="B:context,... (default: %(default)s)"
    )
    a = p.parse_args()
    cases = [tuple(int(v) for v in c.split(":")) for c in a.cases.split(",")]
    core, info = M.build_core(
        "proxy-h200-release",
        (max(b for b, _ in cases), max(c for _, c in cases) + 8192 + 1),
        release=True,
        smoke=False,
        engram_tables="host-fp8",
    )
    gen = torch.Generator().manual_seed(0)
    rows = [profile_case(core, b, ctx, gen) for b, ctx in cases]
    print(f"{'case':22s} {'key':>6s} {'fill':>6s} {'launch':>7s} {'wait':>7s} {'commit':>7s} {'kernels':>8s}")
    for r in rows:
        ph = r["phases_ms"]
        print(
            f"{'B=%d ctx=%d' % (r['B'], r['ctx']):22s} {ph['key']:6.2f} {ph['fill']:6.2f} {ph['launch']:7.2f} "
            f"{ph['wait']:7.2f} {ph['commit']:7.2f} {r['replay_kernels_ms']:8.2f}"
        )
    res = {
        "meta": run_meta(),
        "model": info,
        "cases": rows,
    }
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "graph_step_profile.json"), "w") as f:
        json.dump(res, f, indent=1, default=str)
    print(
        json.dumps(
            [
                {"B": r["B"], "ctx": r["ctx"], "replay_kernels_ms": r["replay_kernels_ms"], **r["phases_ms"]}
                for r in rows
            ]
        )
    )


if __name__ == "__main__":
    main()
