"""The CUDA graphs' shared memory pool after the warm-up, on the release proxy as `agentx_h200.sh` serves it: what
each capture grew the pool by, how much of the pool live tensors hold at the end, and (with ``--history``) which
allocation sites hold it, from PyTorch's allocator history (the first dsserve frame of each live block's stack).

    python benchmarks/graph_pool_h200.py --history --out $OUT/graph-pool

Needs a GPU. Prints a table, then one JSON line; writes captures.csv and summary.json under --out.
"""

import argparse
import csv
import json
import os
import shlex
import sys
import time
from collections import defaultdict

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(HERE)]

from dsserve.bench.provenance import run_meta  # noqa: E402
from dsserve.engine import graph_scratch, kernel_manifest, warmup  # noqa: E402
from dsserve.engine.args import EngineArgs  # noqa: E402
from dsserve.engine.core import EngineCore, log_to_stderr  # noqa: E402
from dsserve.server.serve import add_serve_args  # noqa: E402

SERVE_ARGS = (
    "proxy-h200-release --load-format dummy --dtype bfloat16 --quantization fp8 --expert-format mxfp4 "
    "--engram-tables host-fp8 --max-num-seqs 32 --max-model-len 40000 --max-num-batched-tokens 8192 "
    f"--kv-cache-memory {8 << 30}"
)
MIB = 2**20


class Recorder:
    """Wraps the engine's GraphCapture: per capture, its shape, time, the pool's growth, and what live tensors hold."""

    def __init__(self, capture):
        self.capture, self.rows = capture, []

    def __call__(self, run, what="", release=None, outputs=None):
        before = self.capture.pool_bytes
        t0 = time.perf_counter()
        graph, out = self.capture(run, what, release, outputs)
        live, size = graph_scratch.pool_usage(self.capture.pool) if self.capture.pool is not None else (0, 0)
        self.rows.append(
            {
                "n": len(self.rows) + 1,
                "what": what,
                "seconds": round(time.perf_counter() - t0, 3),
                "grew_mib": round((self.capture.pool_bytes - before) / MIB, 1),
                "pool_mib": round(size / MIB, 1),
                "live_mib": round(live / MIB, 1),
            }
        )
        return graph, out


def holders(pool: tuple) -> tuple[list[dict], dict]:
    """Live blocks of the pool grouped by the first dsserve frame of their allocation stack, largest first; and the
    pool's segments (count, sizes, largest free block)."""
    snap = torch.cuda.memory._snapshot()
    by_site, free, sizes = defaultdict(lambda: [0, 0]), [], []
    for seg in snap["segments"]:
        if tuple(seg["segment_pool_id"]) != pool:
            continue
        sizes.append(seg["total_size"])
        for b in seg["blocks"]:
            if b["state"] == "inactive":
                free.append(b["size"])
                continue
            frames = b.get("frames") or []
            site = next(
                (
                    f"{f['filename'].split('dsserve/')[-1]}:{f['line']} {f['name']}"
                    for f in frames
                    if "/dsserve/" in f["filename"] and "graph_capture" not in f["filename"]
                ),
                "?",
            )
            by_site[site][0] += b["size"]
            by_site[site][1] += 1
    sites = sorted(
        ({"site": k, "mib": round(v[0] / MIB, 1), "blocks": v[1]} for k, v in by_site.items()), key=lambda d: -d["mib"]
    )
    return sites, {
        "segments": len(sizes),
        "largest_segments_mib": [round(s / MIB, 1) for s in sorted(sizes)[-8:]],
        "free_mib": round(sum(free) / MIB, 1),
        "largest_free_mib": round(max(free, default=0) / MIB, 1),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--serve-args", default=SERVE_ARGS, help="what follows `dsserve serve` [the release proxy]")
    ap.add_argument("--history", action="store_true", help="record allocation stacks (slower warm-up)")
    ap.add_argument("--out", default="graph-pool")
    a = ap.parse_args()
    p = argparse.ArgumentParser()
    add_serve_args(p)
    ns = p.parse_args(shlex.split(a.serve_args))
    ns.model = ns.served_model or ns.model
    log_to_stderr()
    if ns.kernel_manifest and os.path.exists(ns.kernel_manifest):
        kernel_manifest.precompile(ns.kernel_manifest, kernel_manifest.default_workers())
    core = EngineCore(EngineArgs.from_cli(ns))
    rec = Recorder(core.graph_capture)
    for g in (core.runner.decode_graphs, core.runner.decoder_row_graphs, core.runner.encoder_graphs):
        if g is not None:
            g.capture = rec
    if a.history:
        torch.cuda.memory._record_memory_history("state", context="state", stacks="python")  # live blocks only
    report = warmup.warm_up(core)
    pool = core.graph_capture.pool
    sites, segs = holders(tuple(pool)) if pool is not None else ([], {})
    live, size = graph_scratch.pool_usage(pool) if pool is not None else (0, 0)
    if ns.kernel_manifest:
        kernel_manifest.save(ns.kernel_manifest)
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "captures.csv"), "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rec.rows[0]) if rec.rows else ["n"])
        w.writeheader()
        w.writerows(rec.rows)
    kinds = defaultdict(lambda: [0, 0.0])
    for r in rec.rows:
        k = r["what"].split(":")[0]
        kinds[k][0] += 1
        kinds[k][1] += r["grew_mib"]
    print(f"{'kind':<14}{'graphs':>8}{'grew MiB':>10}")
    for k, (n, grew) in sorted(kinds.items()):
        print(f"{k:<14}{n:>8}{grew:>10.1f}")
    print("largest growths:")
    for r in sorted(rec.rows, key=lambda r: -r["grew_mib"])[:12]:
        print(
            f"  #{r['n']:<4} {r['what']:<44} grew {r['grew_mib']:>7.1f} MiB, pool {r['pool_mib']:>7.1f}, "
            f"live {r['live_mib']:>7.1f}"
        )
    print("live pool memory by allocation site:")
    for s in sites[:20]:
        print(f"  {s['mib']:>8.1f} MiB in {s['blocks']:>5} blocks  {s['site']}")
    summary = {
        "meta": run_meta(),
        "graphs": len(rec.rows),
        "pool_gib": round(size / 2**30, 3),
        "grown_gib": round(core.graph_capture.pool_bytes / 2**30, 3),
        "live_gib": round(live / 2**30, 3),
        "warmup_s": round(report.seconds, 1),
        "capture_s": round(report.capture_seconds, 1),
        "history": a.history,
        "segments": segs,
        "by_kind": {k: {"graphs": n, "grew_mib": round(g, 1)} for k, (n, g) in kinds.items()},
        "holders": sites[:40],
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
    }
    with open(os.path.join(a.out, "summary.json"), "w") as f:
        json.dump(summary, f, indent=1)
    print(json.dumps({k: v for k, v in summary.items() if k != "holders"}))


if __name__ == "__main__":
    main()
