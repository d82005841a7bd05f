"""The cost of EPLB's replica choice on a GPU, and whether it captures in a CUDA graph: ``ReplicaMap.route`` (the exact
split: a stable sort and a scatter a layer and forward) against the row-index choice it replaced, at the release's
counts (384 experts top-6 on 384 + 32 slots; the drafter's 128 top-3 on 128 + 32), for decode and prefill row
counts; and the same call captured in a CUDA graph and replayed on new ids, equal to eager.

    python benchmarks/eplb_route_gpu.py --out $OUT/eplb-route

Prints a table, then one JSON line; writes eplb_route.json under --out. ~30 s on one GPU (runs on the CPU too,
without the graph check, for a smoke test).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(HERE)]

from dsserve.bench.provenance import run_meta  # noqa: E402
from dsserve.distributed.eplb_policy import initial_layer  # noqa: E402
from dsserve.distributed.eplb_replicas import ReplicaMap  # noqa: E402

CASES = (("target", 384, 6, 32), ("draft", 128, 3, 32))  # name, experts, top-k, redundant slots
ROWS = (8, 64, 512, 2048, 8192)


def row_index_route(m: ReplicaMap, ids: torch.Tensor, ep_rank: int) -> torch.Tensor:
    """The replaced choice: replica (row + k + rank) % replicas."""
    table, counts = m._tables(ids.device)
    t, k = ids.shape
    turn = torch.arange(t, device=ids.device)[:, None] + torch.arange(k, device=ids.device)[None, :] + ep_rank
    return table[ids, turn % counts[ids]]


def timed(fn, reps: int, cuda: bool) -> float:
    """Median seconds of one call."""
    import time

    for _ in range(3):
        fn()
    out = []
    for _ in range(reps):
        if cuda:
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            out.append(a.elapsed_time(b) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            out.append(time.perf_counter() - t0)
    return sorted(out)[len(out) // 2]


def graph_check(m: ReplicaMap, rows: int, k: int, n: int, device) -> bool:
    """Capture route on a static ids buffer, replay on fresh ids: equal to eager every time."""
    gen = torch.Generator(device=device).manual_seed(1)
    ids = torch.randint(0, n, (rows, k), device=device, generator=gen)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            m.route(ids, 3)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = m.route(ids, 3)
    ok = True
    for _ in range(5):
        ids.copy_(torch.randint(0, n, (rows, k), device=device, generator=gen))
        g.replay()
        ok &= bool(torch.equal(out, m.route(ids, 3)))
    return ok


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None)
    ap.add_argument("--reps", type=int, default=50)
    a = ap.parse_args()
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    results = []
    print(f"{'moe':7s} {'rows':>6s} {'exact us':>9s} {'row-index us':>13s} {'graph ok':>9s}")
    for name, n, k, r in CASES:
        ep = 32
        phy = initial_layer(n, r, ep)
        m = ReplicaMap(phy, n)
        for rows in ROWS:
            ids = torch.randint(0, n, (rows, k), device=device)
            exact = timed(lambda: m.route(ids, 3), a.reps, cuda)
            old = timed(lambda: row_index_route(m, ids, 3), a.reps, cuda)
            graph = graph_check(m, rows, k, n, device) if cuda else None
            results.append(
                {
                    "moe": name,
                    "experts": n,
                    "k": k,
                    "rows": rows,
                    "exact_s": exact,
                    "row_index_s": old,
                    "graph_ok": graph,
                }
            )
            print(f"{name:7s} {rows:6d} {exact * 1e6:9.1f} {old * 1e6:13.1f} {graph!s:>9s}", flush=True)
    out = {"bench": "eplb_route", "device": torch.cuda.get_device_name() if cuda else "cpu", "results": results}
    out["meta"] = run_meta()
    if a.out:
        os.makedirs(a.out, exist_ok=True)
        with open(os.path.join(a.out, "eplb_route.json"), "w") as f:
            json.dump(out, f, indent=1)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
