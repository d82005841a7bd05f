"""benchmarks/prefill_kernels_h200.py --smoke: every case runs on tiny shapes (the Triton interpreter) and agrees with
the path it replaces; checks structure and errors, never timings. About 25 s here."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_smoke_runs_every_case(tmp_path):
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    p = subprocess.run(
        [sys.executable, "benchmarks/prefill_kernels_h200.py", "--smoke", "--out", str(tmp_path)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert p.returncode == 0, p.stderr[-3000:]
    last = json.loads(p.stdout.strip().splitlines()[-1])
    res = json.loads((tmp_path / "prefill_kernels.json").read_text())
    assert (tmp_path / "prefill_kernels.png").stat().st_size > 0
    assert [r["case"] for r in last["rows"]] == [r["case"] for r in res["rows"]]
    assert {r["section"] for r in res["rows"]} == {"attention", "index", "topk", "mhc"}
    for r in res["rows"]:
        assert r["ms"] > 0 and math.isfinite(r["ms"])
        # every fast path against the path it replaces: bf16 rounding at most, top-k bit for bit
        assert r["rel_err"] < (1e-2 if r["section"] == "attention" else 1e-5), r
