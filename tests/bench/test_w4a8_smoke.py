"""benchmarks/w4a8_h200.py --smoke: the one-shot H200 script runs end to end on tiny shapes (the Triton interpreter),
its checks pass and every timing row is written; checks structure and errors, never timings. About 15 s here."""

from __future__ import annotations

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_smoke_runs_every_part(tmp_path):
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    p = subprocess.run(
        [sys.executable, "benchmarks/w4a8_h200.py", "--smoke", "--out", str(tmp_path)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert p.returncode == 0, p.stderr[-3000:]
    last = json.loads(p.stdout.strip().splitlines()[-1])
    res = json.loads((tmp_path / "w4a8.json").read_text())
    assert last["errors"] == 0 and res["errors"] == [], res["errors"]
    assert last["checks_ok"] == "6/6"
    for t in ("T=1", "T=8"):
        row = res["moe"]["rows"][t]
        assert {"weight_only", "w4a8", "w4a8_BN64", "w4a8_BN128"} <= set(row), row
        assert res["moe"]["checks"][t]["rel_err"] < 1e-2 and res["moe"]["checks"][t]["rounding_visible"] > 1e-3
    assert {"w8a16", "w8a8"} <= set(res["dense"]["rows"]["tiny_grouped M=8"])
    assert {"command", "commit", "device", "date", "ceilings"} <= set(res["meta"])
