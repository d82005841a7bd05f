"""benchmarks/model_h200.py --smoke: every section runs on the tiny models and writes finite numbers.

Runs the script in a subprocess (as the lead runs it on the H200) on the CPU; checks structure and finiteness of
the JSON it writes, never timings. About 20 s here.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _numbers(x):
    if isinstance(x, dict):
        for v in x.values():
            yield from _numbers(v)
    elif isinstance(x, (list, tuple)):
        for v in x:
            yield from _numbers(v)
    elif isinstance(x, (int, float)) and not isinstance(x, bool):
        yield float(x)


def test_smoke_writes_every_section(tmp_path):
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""} if "CUDA_VISIBLE_DEVICES" not in os.environ else dict(os.environ)
    p = subprocess.run(
        [sys.executable, "benchmarks/model_h200.py", "--smoke", "--out", str(tmp_path)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert p.returncode == 0, p.stderr[-3000:]
    last = json.loads(p.stdout.strip().splitlines()[-1])
    assert last["errors"] == {} and last["finite"], last
    res = json.loads((tmp_path / "model.json").read_text())
    assert (tmp_path / "model.png").stat().st_size > 0
    c = res["ceilings"]
    assert all(math.isfinite(c[k]) and c[k] > 0 for k in ("copy_GBps", "bf16_TFLOPs", "fp8_TFLOPs"))
    decode = [r for r in res["decode"] if "B" in r]
    assert {(r["B"], r["ctx"]) for r in decode} == {(1, 64), (2, 64), (1, 128), (2, 128)}
    for r in decode:
        assert r["ms"] > 0 and r["floor_ms"] > 0 and r["experts_touched"] > 0
        assert r["dense_weight_bytes"] > 0 and r["row_bytes"] > 0
    prefill = [r for r in res["decode"] if r.get("op") == "prefill"]
    assert [(r["new_tokens"], r["cached"]) for r in prefill] == [(32, 0), (64, 0), (32, 128)]
    for r in prefill:
        assert r["flops"] > 0 and 0 < r["matmul_fraction"]
    assert all(math.isfinite(v) for v in _numbers(res["decode"]))
    for name in ("router", "mhc", "grouped_moe"):  # these must run; Engram's needs CUDA (an error is recorded)
        assert "result" in res["kernels"][name], res["kernels"][name]
        assert all(math.isfinite(v) for v in _numbers(res["kernels"][name]["result"]))
    assert "engram" in res["kernels"]
    peer = res["peer"]
    if "skipped" not in peer:  # transformers without DeepseekV4ForCausalLM skips the peer cleanly
        for k in ("decode_B1_tokens_per_s", "decode_B16_tokens_per_s", "prefill_tokens_per_s"):
            assert math.isfinite(peer["dsserve"][k]) and peer["dsserve"][k] > 0
            assert math.isfinite(peer["transformers"][k]) and peer["transformers"][k] > 0
