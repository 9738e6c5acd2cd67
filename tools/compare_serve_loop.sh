#!/usr/bin/env bash
# The server's engine loop in a thread vs in its own process, back to back on one machine: output tok/s, TPOT
# and the loop counters (time per step inside engine.step(), handing outputs on, between steps) over a load of
# bench_serve.py. Usage: tools/compare_serve_loop.sh [MODEL_DIR] [REQUESTS] [CONCURRENCY] [MAX_TOKENS]
# (defaults: the demo model, 128, 64, 48). Talks to 127.0.0.1 only; each server is stopped with SIGTERM.
set -u
cd "$(dirname "$0")/.."
MODEL=${1:-graphrunner/demo_model}; N=${2:-128}; C=${3:-64}; T=${4:-48}; PORT=${PORT:-8811}
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
loop_counters() { curl -s "127.0.0.1:$PORT/metrics" | grep "^graphrunner:engine_loop"; }
for mode in --no-engine-process --engine-process; do
  python3 -m graphrunner serve --model "$MODEL" --host 127.0.0.1 --port "$PORT" --max-num-seqs "$C" $mode \
    > "/tmp/compare_serve_loop$mode.log" 2>&1 &
  pid=$!
  for _ in $(seq 1 300); do
    sleep 2
    curl -s -m 2 "127.0.0.1:$PORT/health" -o /dev/null -w "%{http_code}" | grep -q 200 && break
  done
  python3 tools/bench_serve.py --base-url "http://127.0.0.1:$PORT" --num-requests 16 --concurrency 16 \
    --max-tokens 8 --extra-body '{"ignore_eos": true}' > /dev/null 2>&1  # warm-up
  before=$(loop_counters)
  echo "== $mode"
  python3 tools/bench_serve.py --base-url "http://127.0.0.1:$PORT" --num-requests "$N" --concurrency "$C" \
    --max-tokens "$T" --extra-body '{"ignore_eos": true}' 2>&1 | grep -E "output throughput|TPOT|TTFT"
  after=$(loop_counters)
  python3 - "$before" "$after" <<'PY'
import sys
def parse(text): return {l.split()[0].split("engine_loop_")[1]: float(l.split()[1]) for l in text.splitlines() if l}
a, b = parse(sys.argv[1]), parse(sys.argv[2])
d = {k: b[k] - a[k] for k in b}
n = d["steps_total"] or 1
print(f"loop: {n:.0f} steps; per step: engine.step {d['step_seconds_total'] / n * 1e3:.2f} ms, deliver "
      f"{d['deliver_seconds_total'] / n * 1e3:.3f} ms, between {d['between_steps_seconds_total'] / n * 1e3:.3f} ms")
PY
  kill -TERM "$pid"; wait "$pid"
done
