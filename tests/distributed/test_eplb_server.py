"""`dsserve serve -dp 2 --enable-expert-parallel --enable-eplb` as a process (tiny, a rebalance due every few steps):
the ranks' EPLB figures reach the front end's /metrics (balance per layer and over all layers, per step and over the
window, before and after a rebalance, for the target; rebalances, bytes moved, steps that waited for a transfer
chunk, the transfer buffer) and the `dsserve bench serve` / `bench agentx` outputs; a rebalance moves the counters."""

import json
import os
import re
import sys

import httpx
import pytest

from dsserve.bench.eplb_figures import eplb_figures
from dsserve.cli import main
from dsserve.models.presets import preset

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from live_server import SERVER_ARGS, live_server  # noqa: E402

EPLB_ARGS = [
    *SERVER_ARGS,
    *("-dp", "2", "--enable-expert-parallel", "--enable-eplb", "--num-redundant-experts", "2"),
    *("--eplb-window-size", "4", "--eplb-step-interval", "8", "--eplb-min-gain", "0", "--eplb-transfer-chunk", "4"),
    *("--eplb-figures-interval", "2"),
]
LAYERS = preset("tiny").num_hidden_layers
SAMPLE = re.compile(r"^dsserve:(eplb_\w+)\{([^}]*)\} (\S+)$", re.M)


@pytest.fixture(scope="module")
def server():
    with live_server("tiny", EPLB_ARGS) as base:
        yield base


def samples(base: str) -> dict:
    """{(name, labels without model_name): value} of the eplb_* samples in /metrics."""
    text = httpx.get(base + "/metrics", timeout=10).text
    out = {}
    for name, labels, v in SAMPLE.findall(text):
        lab = tuple(sorted((k, x) for k, x in re.findall(r'(\w+)="([^"]*)"', labels) if k != "model_name"))
        out[name, lab] = float(v)
    return out


def bench_serve(base: str, capsys, prompts: int) -> dict:
    argv = ["bench", "serve", "--base-url", base, "--model", "tiny", "--num-prompts", str(prompts)]
    argv += ["--random-input-len", "24", "--random-output-len", "12", "--max-concurrency", "4", "--seed", "0"]
    capsys.readouterr()
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "EPLB target: balance per step" in out
    return json.loads(out.strip().splitlines()[-1])


def test_eplb_figures_reach_metrics_and_bench_outputs(server, capsys, tmp_path):
    res = bench_serve(server, capsys, 8)
    assert res["completed"] == 8
    m = samples(server)
    target = (("model", "target"),)
    assert m["eplb_rebalances_total", target] >= 1  # a rebalance is due every 8 steps: this run had dozens
    assert m["eplb_bytes_moved_total", target] >= m["eplb_bytes_moved_last_rebalance", target] > 0
    assert m["eplb_steps_waited_total", ()] >= 1
    peak = m["eplb_transfer_buffer_bytes", (("kind", "peak"), ("model", "target"))]
    assert 0 < peak <= m["eplb_transfer_buffer_bytes", (("kind", "bound"), ("model", "target"))]
    for kind in ("step", "window", "before", "before_predicted", "after_predicted"):
        for layer in ["all", *map(str, range(LAYERS))]:
            b = m[f"eplb_balance_{kind}", (("layer", layer), ("model", "target"))]
            assert 0.5 <= b <= 1, (kind, layer, b)  # 2 ranks: 1/2 is all rows on one rank
    for layer in ["all", *map(str, range(LAYERS))]:  # measured once a full window ran the last placement
        assert 0.5 <= m.get(("eplb_balance_after", (("layer", layer), ("model", "target"))), 1.0) <= 1
    # the JSON line carries the same figures, and the rebalances of its own window
    e = res["eplb"]["models"]["target"]
    assert e["rebalances"] >= 1 and e["bytes_moved"] > 0 and res["eplb"]["steps_waited"] >= 1
    assert len(e["balance"]["step"]["layers"]) == LAYERS and 0.5 <= e["balance"]["window"]["all"] <= 1

    # a second run: the counters only grow, and rebalance again
    before = httpx.get(server + "/metrics", timeout=10).text
    bench_serve(server, capsys, 4)
    after = httpx.get(server + "/metrics", timeout=10).text
    grew = eplb_figures(before, after)
    assert grew["models"]["target"]["rebalances"] >= 1
    assert grew["models"]["target"]["rebalances_total"] > m["eplb_rebalances_total", target]

    # bench agentx: the same figures in its summary and printed under its table
    argv = ["bench", "agentx", "--base-url", server, "--preset", "small", "--seed", "1", "--concurrency", "1"]
    argv += ["--duration", "3", "--fast", "--num-sessions", "2", "--scale", "0.02", "--output-dir", str(tmp_path)]
    assert main(argv) == 0
    assert "EPLB target: balance per step" in capsys.readouterr().out
    (pt,) = json.loads((tmp_path / "summary.json").read_text())["points"]
    e = pt["eplb"]["models"]["target"]
    assert 0.5 <= e["balance"]["step"]["all"] <= 1 and e["rebalances_total"] >= 2
