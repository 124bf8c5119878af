#!/usr/bin/env bash
# Served speed of two commits of dpserve, side by side on this machine: each commit's
# `dpserve serve` (bfloat16, DP=1, default model) under the same load generator (this
# checkout's `dpserve bench serve`: W16 = 64 requests, 128 prompt / 64 output tokens,
# concurrency 16), alternating OLD, NEW for ROUNDS rounds; prints total and output tok/s,
# TTFT and ITL p50 per run and the NEW/OLD ratio of the mean total tok/s.
#   bench/ab_commits.sh OLD_REV [NEW_REV (default HEAD)] [ROUNDS (default 2)]
# Needs `make setup` (the .venv); run it on an otherwise idle machine.
set -euo pipefail
cd "$(dirname "$0")/.."
old=$1 new=${2:-HEAD} rounds=${3:-2}
py=$PWD/.venv/bin/python
work=$(mktemp -d)
trap 'kill -TERM "${pid:-}" 2>/dev/null || true; git worktree remove --force "$work/old" 2>/dev/null; git worktree remove --force "$work/new" 2>/dev/null; rm -rf "$work"' EXIT
git worktree add -q --detach "$work/old" "$old"
git worktree add -q --detach "$work/new" "$new"

one() {  # $1 = old|new, $2 = round
  local port log=$work/$1-$2
  port=$($py -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
  PYTHONPATH=$work/$1 $py -m dpserve.cli serve --host 127.0.0.1 --port "$port" \
    --dtype bfloat16 > "$log.log" 2>&1 &
  pid=$!
  for _ in $(seq 600); do  # the model loads in seconds; a dead server ends the wait
    curl -sf "http://127.0.0.1:$port/health" > /dev/null && break
    kill -0 "$pid" 2>/dev/null || { echo "$1 server died:"; tail "$log.log"; exit 1; }
    sleep 0.5
  done
  $py -m dpserve.cli bench serve --base-url "http://127.0.0.1:$port" --num-prompts 64 \
    --concurrency 16 --prompt-len 128 --output-len 64 --warmup 4 --json-out "$log.json" \
    > /dev/null
  kill -TERM "$pid"; wait "$pid" 2>/dev/null || true; pid=
}
for r in $(seq "$rounds"); do one old "$r"; one new "$r"; done
$py - "$work" "$rounds" <<'PY'
import json, statistics, sys
work, rounds = sys.argv[1], int(sys.argv[2])
means = {}
for side in ("old", "new"):
    runs = [json.load(open(f"{work}/{side}-{r}.json")) for r in range(1, rounds + 1)]
    for r, d in enumerate(runs, 1):
        print(f"{side} {r}: total {d['total_token_throughput']:.1f} tok/s, output "
              f"{d['output_throughput']:.1f}, TTFT p50 {d['ttft_ms']['p50']:.0f} ms, ITL p50 "
              f"{d['itl_ms']['p50']:.1f} ms, failed {d['failed']}")
    means[side] = statistics.mean(d["total_token_throughput"] for d in runs)
print(f"new / old (mean total tok/s): {means['new'] / means['old']:.3f}")
PY
