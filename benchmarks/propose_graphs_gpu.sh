#!/usr/bin/env bash
# The drafter's proposal graphs on one GPU (issue 56), in one go, < 4 minutes:
# 1. the proposal paths on the release proxy (spec_verify_h200.py --propose-only: K = 5, B = 1, 8, 32: batched on the
#    torch ops, batched on the kernel ops, graph, one at a time; the graph's drafts against both batched ones);
# 2. the CUDA tests of tests/engine/test_propose_graphs.py (replay = eager fixed shapes bit for bit and no host sync
#    in a replay; then the engine builds and replays them), cut at 60 s (the engine test compiles the most).
#   OUT=/some/dir bash benchmarks/propose_graphs_gpu.sh  # $OUT/propose/spec_verify.json, propose.txt, tests.txt
set -u
PY=${PYTHON:-python}
OUT=${OUT:-/tmp/propose-graphs-gpu}
mkdir -p "$OUT"
timeout 170 "$PY" benchmarks/spec_verify_h200.py --propose-only --no-engine-check --out "$OUT/propose" \
    2>&1 | tee "$OUT/propose.txt"
DSSERVE_TESTS_GPU_ONLY=1 timeout 60 "$PY" -m pytest -v -p no:cacheprovider tests/engine/test_propose_graphs.py \
    2>&1 | tee "$OUT/tests.txt"
