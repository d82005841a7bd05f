"""The side-stream A/B behind side_mhc.json, RECONSTRUCTED from the recipe in README.md and side_mhc.json's "command".

The original (scratch_gpu/side_mhc.py) was never committed and is lost; this script follows the recorded recipe with
the current engine's names and has not been run (no GPU was lent when it was written), so it may need small changes.

    BS=1,8,32 OUT=DIR PYTHONPATH=. python benchmarks/results/side-stream-mhc-h200/side_mhc_script.py

Recipe: benchmarks/model_h200.build_core("proxy-h200-release", (40, 8192 + 16), release=True,
engram_tables="host-fp8"), then per case fresh DecodeGraphs + GraphCapture and
dsserve.bench.forward.bench_forward(core, B, 8192, 1, 4), with models.block.MHC_SIDE_STREAM_MAX_ROWS at 64 (mixes on
the side stream) or 0 (one stream), each setting measured twice, interleaved.
"""

import json
import os
import sys

sys.path[:0] = [os.getcwd(), os.path.join(os.getcwd(), "benchmarks")]

from model_h200 import build_core  # noqa: E402

import dsserve.models.block as block  # noqa: E402
from dsserve.bench.forward import bench_forward  # noqa: E402
from dsserve.bench.provenance import run_meta  # noqa: E402
from dsserve.engine import graph_scratch  # noqa: E402
from dsserve.engine.decode_graphs import DecodeGraphs  # noqa: E402
from dsserve.engine.graph_capture import GraphCapture  # noqa: E402

CONTEXT = 8192


def main() -> None:
    batches = [int(b) for b in os.environ.get("BS", "1,8,32").split(",")]
    core, info = build_core(
        "proxy-h200-release", (40, CONTEXT + 16), release=True, smoke=False, engram_tables="host-fp8"
    )
    rows = []
    for b in batches:
        for _ in range(2):  # each setting twice, interleaved
            for side_rows in (64, 0):
                block.MHC_SIDE_STREAM_MAX_ROWS = side_rows
                capture = GraphCapture(shared_pool=graph_scratch.shared_pool())
                bs = core.kv.layout.block_size
                min_context = -(-1024 // (2 * bs)) * 2 * bs  # as EngineCore builds its DecodeGraphs
                core.runner.decode_graphs = DecodeGraphs(
                    core.model, core.kv, max(batches), capture, min_context=min_context
                )
                r = bench_forward(core, b, CONTEXT, 1, 4)
                rows.append({"B": b, "side_rows": side_rows, "ms": r.seconds * 1e3})
                print(rows[-1], flush=True)
    out = os.environ.get("OUT", "/tmp")
    with open(os.path.join(out, "side_mhc.json"), "w") as f:
        json.dump({"meta": run_meta(model=info), "rows": rows}, f, indent=1, default=str)


if __name__ == "__main__":
    main()
