"""Issue 10's training run on GPUs within a time budget (evaluation is `dsserve eval --model OUT/run`).

    python benchmarks/train_h200.py --budget 540 --layout 2x2048x16 --dense-share 0.5 --out $OUT

A layout is RANKSxPACKxBATCH: ``torchrun`` ranks (spread over the GPUs), tokens a training sequence packs problems up
to, sequences a step. The run stops on its clock (``--time-limit``: the learning-rate schedule and the dense share
follow the clock, so it ends with a full schedule and a checkpoint whatever its speed). Each step is captured as a
CUDA graph after two eager ones (train.step); if the run fails early (a kernel that does not compile there), it is
run again without the fused Sinkhorn and graphs for the time left. The training command is printed and stored
(``train.json`` holds every setting). Prints the run's last log lines, then one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import time

from dsserve.bench.provenance import run_meta  # noqa: E402

SAVE_S = 45  # start-up (imports, the data workers) and saving the checkpoint, outside the training clock


def _run(cmd: list[str], log: str, timeout: float) -> int:
    print("+", " ".join(cmd), flush=True)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [".", os.environ.get("PYTHONPATH")])))
    with open(log, "w") as f:
        try:
            return subprocess.run(
                cmd, stdout=f, stderr=subprocess.STDOUT, env=env, timeout=timeout, check=False
            ).returncode
        except subprocess.TimeoutExpired:
            return -9


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--budget", type=float, default=540, help="seconds for the whole run incl. start-up and saving")
    p.add_argument("--layout", default="2x2048x16", help="RANKSxPACKxBATCH (default %(default)s)")
    p.add_argument("--dense-share", type=float, default=0.5, help="share of the time with dense entries (warm-up)")
    p.add_argument("--mix", default="arithmetic=0.4,retrieval=0.4,chat=0.2")
    p.add_argument(
        "--train-args", default="--drills 8 --prompt-weight 0.5", help="more options for dsserve.train.train"
    )
    p.add_argument("--device", default="cuda")
    p.add_argument("--out", required=True)
    a = p.parse_args()
    t_start = time.time()
    os.makedirs(a.out, exist_ok=True)
    ranks, pack, batch = map(int, a.layout.split("x"))
    extra, runs = [], []
    while True:
        left = a.budget - (time.time() - t_start)
        cmd = [
            "torchrun",
            "--nproc-per-node",
            str(ranks),
            "-m",
            "dsserve.train.train",
            "--device",
            a.device,
            "--steps",
            "1000000",
            "--time-limit",
            str(int(left - SAVE_S)),
            "--batch",
            str(batch),
            "--pack",
            str(pack),
            "--mix",
            a.mix,
            "--dense-share",
            str(a.dense_share),
            "--warmup",
            "20",
            "--log-every",
            "20",
            *shlex.split(a.train_args),
            *extra,
            "--out",
            os.path.join(a.out, "run"),
        ]
        log = os.path.join(a.out, f"train_log{len(runs)}.txt")
        t0 = time.time()
        rc = _run(cmd, log, left)
        runs.append({"train_command": " ".join(cmd), "rc": rc, "seconds": time.time() - t0})
        if rc == 0 or extra or time.time() - t_start > a.budget / 3:
            break
        print(f"rc {rc} after {time.time() - t0:.0f} s: again without the fused Sinkhorn and graphs", flush=True)
        extra = ["--no-fused-sinkhorn", "--no-cuda-graph"]
    with open(log) as f:
        print("".join(f.readlines()[-8:]))
    summary = {"meta": run_meta(), "layout": a.layout, "runs": runs, "seconds": time.time() - t_start}
    with open(os.path.join(a.out, "train_h200.json"), "w") as f:
        json.dump(summary, f, indent=1)
    print(json.dumps(summary))
    return rc


if __name__ == "__main__":
    raise SystemExit(main())
