#!/usr/bin/env bash
# The drafter's proposal graphs on one GPU (issue 56), in one go, < 4 minutes: the CUDA tests of
# tests/engine/test_propose_graphs.py (replay = eager fixed shapes bit for bit, no host sync in a replay, the engine
# builds and replays them), then the proposal paths on the release proxy (spec_verify_h200.py --propose-only: K = 5,
# B = 1, 8, 32: batched on the torch ops, batched on the kernel ops, graph, one at a time; drafts compared).
#   OUT=/some/dir bash benchmarks/propose_graphs_gpu.sh     # results: $OUT/tests.txt, $OUT/propose/spec_verify.json
set -u
PY=${PYTHON:-python}
OUT=${OUT:-/tmp/propose-graphs-gpu}
mkdir -p "$OUT"
DSSERVE_TESTS_GPU_ONLY=1 timeout 100 "$PY" -m pytest -q -p no:cacheprovider tests/engine/test_propose_graphs.py \
    2>&1 | tee "$OUT/tests.txt"
timeout 200 "$PY" benchmarks/spec_verify_h200.py --propose-only --no-engine-check --out "$OUT/propose" \
    2>&1 | tee "$OUT/propose.txt"
