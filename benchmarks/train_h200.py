"""Issue 10's training run on a GPU within a time budget: probe a few data-parallel layouts for some steps each,
then train with the fastest for the rest of the budget (evaluation is `dsserve eval --model OUT/run`).

    python benchmarks/train_h200.py --budget 540 --layouts 4x2048x16,8x2048x16 --dense-share 0.5 --out $OUT

A layout is RANKSxPACKxBATCH: ``torchrun`` ranks (several share one GPU: the tiny model is launch-bound, so more
ranks keep it busier), tokens a training sequence packs problems up to, sequences a step. The training command it
ran is printed and stored (``train.json`` holds every setting), so a run can be repeated with a fixed ``--steps``
without the probes. Prints a table of the probes, then one JSON line.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import subprocess
import sys
import time


def _run(cmd: list[str], log: str, timeout: float) -> int:
    print("+", " ".join(cmd), flush=True)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [".", os.environ.get("PYTHONPATH")])))
    with open(log, "w") as f:
        try:
            return subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, timeout=timeout).returncode
        except subprocess.TimeoutExpired:
            return -9


def _train_cmd(ranks: int, pack: int, batch: int, steps: int, a, extra: list[str]) -> list[str]:
    return ["torchrun", "--nproc-per-node", str(ranks), "-m", "dsserve.train.train", "--device", a.device,
            "--steps", str(steps), "--batch", str(batch), "--pack", str(pack), "--mix", a.mix,
            *shlex.split(a.train_args), *extra]


def seconds_per_step(log: str) -> float | None:
    """From a training log's ``step N ... T s`` lines: the time a step takes after the first (warm-up) one."""
    pts = [(int(m.group(1)), float(m.group(2))) for m in re.finditer(r"step\s+(\d+) .* (\d+\.\d) s", open(log).read())]
    if len(pts) < 3:
        return None
    (s0, t0), (s1, t1) = pts[1], pts[-1]
    return (t1 - t0) / (s1 - s0)


def _probe(layout: str, a, tag: str) -> dict:
    """A few steps of ``layout``, half of them dense; the time a step is their mean plus 10% (the two kinds differ:
    sparse steps launch ~15% more ops, dense ones attend more entries)."""
    ranks, pack, batch = map(int, layout.split("x"))
    log = os.path.join(a.out, f"probe_{layout}{tag}.txt")
    _run(_train_cmd(ranks, pack, batch, a.probe_steps, a, ["--warmup", "1", "--log-every", "1",
                                                           "--dense-steps", str(a.probe_steps // 2)]), log, 180)
    tokens = re.findall(r'"tokens": (\d+), "seconds"', open(log).read())
    sps = seconds_per_step(log)
    return {"s_per_step": sps and 1.1 * sps, "tokens_per_step": int(tokens[-1]) / a.probe_steps if tokens else None}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--budget", type=float, default=540, help="seconds for probes + training + saving")
    p.add_argument("--layouts", default="4x2048x16,8x2048x16", help="RANKSxPACKxBATCH, comma list (dense steps "
                   "hold ~3 GB a 2048-token sequence: keep ranks x sequences a rank within the GPUs' memory)")
    p.add_argument("--probe-steps", type=int, default=6)
    p.add_argument("--dense-share", type=float, default=0.5, help="share of the steps with dense entries (warm-up)")
    p.add_argument("--mix", default="arithmetic=0.4,retrieval=0.3,chat=0.3")
    p.add_argument("--train-args", default="--drills 4", help="more options for dsserve.train.train")
    p.add_argument("--device", default="cuda")
    p.add_argument("--out", required=True)
    a = p.parse_args()
    t_start = time.time()
    os.makedirs(a.out, exist_ok=True)
    probes = {layout: _probe(layout, a, "") for layout in a.layouts.split(",")}
    ok = {k: v for k, v in probes.items() if v["s_per_step"] and v["tokens_per_step"]}
    if not ok and "--no-fused-sinkhorn" not in a.train_args:  # the fused Sinkhorn failed here: train without it
        print("no probe finished: again without the fused Sinkhorn", flush=True)
        a.train_args += " --no-fused-sinkhorn"
        layout = a.layouts.split(",")[0]
        probes[layout] = _probe(layout, a, "_unfused")
        ok = {k: v for k, v in probes.items() if v["s_per_step"] and v["tokens_per_step"]}
    if not ok:
        print("no probe finished", file=sys.stderr)
        return 1
    best = max(ok, key=lambda k: ok[k]["tokens_per_step"] / ok[k]["s_per_step"])
    print(f"{'layout':>14} {'s/step':>8} {'tokens/step':>12} {'tokens/s':>9}")
    for k, v in ok.items():
        print(f"{k:>14} {v['s_per_step']:8.2f} {v['tokens_per_step']:12.0f} {v['tokens_per_step'] / v['s_per_step']:9.0f}")
    left = a.budget - (time.time() - t_start) - 40  # start-up and saving
    ranks, pack, batch = map(int, best.split("x"))
    steps = max(1, int(left / ok[best]["s_per_step"]))
    cmd = _train_cmd(ranks, pack, batch, steps, a, ["--warmup", str(max(1, steps // 20)), "--log-every", "10",
                                                    "--dense-steps", str(int(steps * a.dense_share)),
                                                    "--out", os.path.join(a.out, "run")])
    rc = _run(cmd, os.path.join(a.out, "train_log.txt"), left + 60)
    summary = {"probes": probes, "layout": best, "steps": steps, "train_command": " ".join(cmd), "train_rc": rc,
               "seconds": time.time() - t_start}
    with open(os.path.join(a.out, "train_h200.json"), "w") as f:
        json.dump(summary, f, indent=1)
    print(json.dumps(summary))
    return rc


if __name__ == "__main__":
    raise SystemExit(main())
