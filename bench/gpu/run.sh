#!/usr/bin/env bash
# dpserve's CUDA paths, run for real on a bare GPU machine with no network, in one go.
#
#   bash bench/gpu/run.sh          # on the GPU machine, under ~9 min
#   bash bench/gpu/run.sh --cpu    # the dry run, here: same parts, tiny sizes, on the CPU
#
# Before (on a networked machine): bash bench/gpu/fetch_wheels.sh, which fills .whl/
# (the wheels the GPU image lacks) and .gpu-model/ (the default model's config and
# tokenizer); the device call carries both. The parts, each under its own `timeout`
# (and all under GPU_RUN_BUDGET_S, default 540 s: a part that would start with under
# 20 s left is skipped), a failing one not stopping the rest:
#
#   install      the carried wheels into a private folder, unless everything imports
#   env          torch, CUDA, nvidia-smi
#   build        dpserve's CPU kernels (--cpu only: they are CPU-only, unused on CUDA)
#   models       the checkpoints (parts.py models: the default model or its stand-in)
#   tests        tests/model/test_cuda.py: greedy tokens against transformers on CUDA in
#                float32 and bfloat16, preemption, prefix hits, sleep level 1 and 2,
#                served DP=2 and expert parallelism on one GPU
#   bandwidth    copy bandwidth and bf16 TFLOP/s (the roofline's ceilings)
#   hf-floor-*   transformers' batched generate (the floor), per model
#   serve-*      dpserve serve under W16 and a larger load, per model
#   dp2          --data-parallel-size 2 on one GPU: as a user starts it (the memory
#                split, or why it fails), then capped (W16 and the memory split)
#   tp           tensor parallelism: its CUDA tests are in tests/model/test_cuda.py
#
# Results under $OUT (set by the caller; else a new temporary folder, printed at the
# end), at most 8 files: summary.json (each part's status, seconds and figures),
# run.log, tests.log, logs.tar.gz (every part's and server's log, junit XML).
set -uo pipefail

MODE=cuda
for arg in "$@"; do
  case $arg in
    --cpu) MODE=cpu ;;
    -h|--help) sed -n '2,/^set -uo/p' "$0" | sed '$d'; exit 0 ;;
    *) echo "run.sh: unknown option $arg (only --cpu)" >&2; exit 2 ;;
  esac
done
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
cd "$ROOT" || exit 1
PY=${PYTHON:-python3}
BUDGET=${GPU_RUN_BUDGET_S:-540}
START=$(date +%s)
WORK=$(mktemp -d /tmp/dpserve-gpu.XXXXXX)
OUT=${OUT:-$(mktemp -d /tmp/dpserve-gpu-out.XXXXXX)}
FIG=$WORK/fig LOGS=$WORK/logs
mkdir -p "$OUT" "$FIG" "$LOGS"
trap 'rm -rf "$WORK"' EXIT
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
CPU_FLAG=(); [ "$MODE" = cpu ] && CPU_FLAG=(--cpu)
NOTES=()

log() { echo "$*" | tee -a "$WORK/run.log"; }
note() { NOTES+=(--note "$*"); log "note: $*"; }
record() {  # record NAME STATUS RC SECONDS LIMIT
  printf '{"name": "%s", "status": "%s", "rc": %d, "seconds": %.1f, "limit_s": %d}\n' \
    "$@" >>"$WORK/parts.jsonl"
}

part() {  # part NAME LIMIT_S CMD...: run CMD under timeout, log, record; never exits
  local name=$1 limit=$2 rc status t0 ms left
  shift 2
  left=$((BUDGET - ($(date +%s) - START)))
  if ((left < 20)); then
    log "== $name: skipped, ${left}s of the ${BUDGET}s budget left"
    record "$name" skipped_budget -1 0 0
    return
  fi
  ((limit > left)) && limit=$left
  log "== $name (limit ${limit}s)"
  t0=$(date +%s%N)
  timeout -k 40 "$limit" "$@" >"$LOGS/$name.log" 2>&1
  rc=$?
  ms=$((($(date +%s%N) - t0) / 1000000))
  case $rc in 0) status=ok ;; 124 | 137) status=timeout ;; *) status=failed ;; esac
  record "$name" "$status" "$rc" "$((ms / 1000)).$((ms % 1000 / 100))" "$limit"
  tail -n 4 "$LOGS/$name.log" | sed 's/^/   | /' | tee -a "$WORK/run.log"
  log "   $status (rc $rc)"
  summarize >/dev/null 2>&1  # so far: what comes back if the whole run is cut off
}

summarize() {  # summary.json and run.log under $OUT from what is recorded so far
  "$PY" bench/gpu/parts.py summary --work "$WORK" --out "$OUT/summary.json" --mode "$MODE" \
    --total-seconds $(($(date +%s) - START)) "${NOTES[@]}"
  cp "$WORK/run.log" "$OUT/run.log"
}

field() { "$PY" -c 'import json,sys; print(json.load(open(sys.argv[1]))[sys.argv[2]])' "$@"; }

# ---------------------------------------------------------------- install
source bench/gpu/install.sh  # install(): the carried wheels
export -f install
part install 90 bash -c install
if [ -d "$WORK/site" ]; then
  export PYTHONPATH="$ROOT:$WORK/site${PYTHONPATH#"$ROOT"}"
  note "installed $(ls .whl/*.whl | wc -l) carried wheels into a private folder"
fi

part env 60 "$PY" bench/gpu/parts.py env
if [ "$MODE" = cpu ]; then
  part build 120 "$PY" -c "from dpserve.model import cpu_kernels; print('CPU kernels:', cpu_kernels.available())"
else
  note "build: nothing to build for CUDA (dpserve's C kernels are CPU-only)"
fi

# ---------------------------------------------------------------- models, tests
part models 180 "$PY" bench/gpu/parts.py models --out "$WORK/models" --fig "$FIG/models.json" "${CPU_FLAG[@]}"
if [ -f "$FIG/models.json" ]; then
  DEFAULT=$(field "$FIG/models.json" default) LARGE=$(field "$FIG/models.json" large)
  note "default model: $(field "$FIG/models.json" default_kind)"
  note "large model: $(field "$FIG/models.json" large_kind)"
else
  DEFAULT="" LARGE=""
  note "no models: the parts that need one fail"
fi

export DPSERVE_CUDA_DEFAULT_MODEL=$DEFAULT DPSERVE_CUDA_FIGURES=$FIG/tests.jsonl
part tests 300 "$PY" -m pytest tests/model/test_cuda.py -p no:randomly -p no:cacheprovider -q \
  -rs --timeout 150 --junitxml "$FIG/tests.xml"
cp "$LOGS/tests.log" "$OUT/tests.log" 2>/dev/null

# ---------------------------------------------------------------- throughput
part bandwidth 60 "$PY" bench/gpu/parts.py bandwidth --fig "$FIG/bandwidth.json" "${CPU_FLAG[@]}"
for name in default large; do
  model=$DEFAULT; [ $name = large ] && model=$LARGE
  part "hf-floor-$name" 120 "$PY" bench/gpu/parts.py hf-floor --model "$model" \
    --fig "$FIG/hf-floor-$name.json" "${CPU_FLAG[@]}"
  part "serve-$name" 180 "$PY" bench/gpu/serve_bench.py serve --name $name --model "$model" \
    --bandwidth "$FIG/bandwidth.json" --hf-floor "$FIG/hf-floor-$name.json" \
    --fig "$FIG/serve-$name.json" --logs "$LOGS" "${CPU_FLAG[@]}"
  if [ $name = default ]; then
    part dp2 240 "$PY" bench/gpu/serve_bench.py dp2 --model "$DEFAULT" --fig "$FIG/dp2.json" \
      --logs "$LOGS" "${CPU_FLAG[@]}"
  fi
done

record tp in_tests 0 0 0
note "tp: tests/model/test_cuda.py: TP=2 over NCCL needs a GPU per worker (skipped on one GPU, where -tp 2 is refused before anything starts: that refusal is tested); the executor's NCCL group calls were checked alone on an H200"
note "expert parallelism: over the lockstep DP group's gloo collectives (CUDA tensors staged through host memory), not NCCL; tests/model/test_cuda.py runs EP=2 on one GPU"
note "CUDA graphs: not built in dpserve; decode steps run eagerly"

# ---------------------------------------------------------------- results
summarize 2>&1 | tee -a "$WORK/run.log"
cp "$WORK/run.log" "$OUT/run.log"
tar -czf "$OUT/logs.tar.gz" -C "$WORK" logs fig parts.jsonl run.log 2>/dev/null
log "results in $OUT: $(ls "$OUT" | tr '\n' ' ')"
