"""Load time and peak host memory of a generated release-format checkpoint (>= 2 GB): today's path against the
release loader (issue 53.3 / 53.6).

The checkpoint: the tiny model's layers with a 1.2 M vocabulary (BF16 embed/head 1.2 GB), 32 MXFP4 experts of width
2048 (0.3 GB) and FP8 Engram tables of 0.5 GB: 2.1 GB on disk, 6.9 GB as today's fp32 dense model (a mix that
today's path can still load on a 24 GB machine; the release's experts would need 8x their bytes). Random bytes
(checkpoint.write_random_release): this measures loading, not a model.

Each path runs in its own subprocess, both into the GPU form on the CPU (bf16 plain weights, FP8 linears, packed
MXFP4 experts and no dense copies, FP8 host tables): today's = dense fp32 build + load_checkpoint (dequantise) +
quantize_experts + cast + move_table_to_host + quantize_dense_fp8; new = release_loader.load_release. Peak RSS is
VmHWM after resetting it (/proc/self/clear_refs) once the imports are done. The read rate is a plain sequential
read of the shards just after writing them (so from the page cache unless memory is short): the rate the loader
can reach here, not the disk's cold rate.

    python benchmarks/load_release_cpu.py --out benchmarks/results/load-release-cpu
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time

_CHILD = r"""
import json, sys, time, torch
from dsserve.models.config import ModelConfig
from dsserve.models.model import DeepseekForCausalLM
from dsserve.models.presets import preset

def status(key):
    for line in open("/proc/self/status"):
        if line.startswith(key):
            return int(line.split()[1]) * 1024

path, which, threads = sys.argv[1], sys.argv[2], int(sys.argv[3])
with torch.device("meta"):
    DeepseekForCausalLM(preset("tiny"))
cfg = ModelConfig.from_json(path)
from dsserve.models.checkpoint import load_checkpoint
from dsserve.models.quantize import quantize_dense_fp8, quantize_experts
from dsserve.models.release_loader import load_release
open("/proc/self/clear_refs", "w").write("5")
base = status("VmRSS")
t0 = time.perf_counter()
if which == "today":
    net = DeepseekForCausalLM(cfg).eval()
    load_checkpoint(net, cfg, path)
    quantize_experts(net, "mxfp4", keep_dense=False)
    net = net.to(torch.bfloat16)
    for block in net.layers:
        if block.engram is not None:
            block.engram.move_table_to_host("fp8")
    quantize_dense_fp8(net, cfg.weight_block_size)
else:
    kw = {"threads": threads} if threads else {}
    net, report = load_release(cfg, path, dtype=torch.bfloat16, quantization="fp8", expert_format="mxfp4",
                               engram_tables="host-fp8", keep_dense=False, **kw)
seconds = time.perf_counter() - t0
print(json.dumps({"path": which, "threads": threads, "seconds": seconds, "peak_rss_over_base": status("VmHWM") - base,
                  "rss_after_over_base": status("VmRSS") - base}))
"""


def read_rate(path: str) -> tuple[int, float]:
    total, t0 = 0, time.perf_counter()
    for fn in sorted(os.listdir(path)):
        if fn.endswith(".safetensors"):
            with open(os.path.join(path, fn), "rb", buffering=0) as f:
                while chunk := f.read(64 << 20):
                    total += len(chunk)
    return total, time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=None, help="results directory (README.md + results.json)")
    ap.add_argument("--dir", default=None, help="where to write the checkpoint (default: a temporary directory)")
    ap.add_argument("--paths", default="today,new", help="comma list of today, new, new-threads")
    ap.add_argument("--threads", type=int, default=4, help="reader threads of new-threads")
    args = ap.parse_args()
    from dsserve.models.checkpoint import write_random_release
    from dsserve.models.checkpoint_layout import model_shapes
    from dsserve.models.presets import preset

    cfg = preset("tiny").with_options(
        vocab_size=1_200_000,
        n_routed_experts=32,
        moe_intermediate_size=2048,
        engram_vocab_size=700_000,
        name="bench-2g",
    )
    tmp = args.dir or tempfile.mkdtemp(prefix="dsserve-load-bench-")
    t0 = time.perf_counter()
    total = write_random_release(cfg, tmp, max_shard_bytes=512 << 20)
    write_s = time.perf_counter() - t0
    read_bytes, read_s = read_rate(tmp)
    dense = sum(4 * int(math.prod(s)) for s, _ in model_shapes(cfg).values())
    rows = []
    for which in args.paths.split(","):
        threads = args.threads if which == "new-threads" else 0
        out = subprocess.run(
            [sys.executable, "-c", _CHILD, tmp, "today" if which == "today" else "new", str(threads)],
            capture_output=True,
            text=True,
        )
        if out.returncode:
            print(out.stderr[-3000:], file=sys.stderr)
            raise SystemExit(out.returncode)
        row = json.loads(out.stdout.strip().splitlines()[-1])
        row["path"] = which
        row["rate_MBps"] = total / row["seconds"] / 1e6
        rows.append(row)
        print(json.dumps(row), flush=True)
    result = {
        "checkpoint_bytes": total,
        "dense_fp32_model_bytes": dense,
        "write_seconds": write_s,
        "sequential_read_MBps": read_bytes / read_s / 1e6,
        "runs": rows,
    }
    print(json.dumps(result, indent=2))
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
        meta = {
            "command": "python " + " ".join(sys.argv),
            "commit": commit,
            "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "device": f"CPU: {platform.processor() or platform.machine()}, {os.cpu_count()} cores (shared), "
            f"{os.sysconf('SC_PHYS_PAGES') * os.sysconf('SC_PAGE_SIZE') / 2**30:.0f} GiB RAM",
        }
        with open(os.path.join(args.out, "results.json"), "w") as f:
            json.dump({**meta, **result}, f, indent=2)
    if not args.dir:
        shutil.rmtree(tmp)


if __name__ == "__main__":
    main()
