#!/usr/bin/env bash
# The roofline and profile on a CPU with AMX, where the development machine has
# none: the device machine's host CPU (a server CPU; the GPU is not used), pinned to
# two cores to match the 2-core development machine, so its figures sit beside those.
#
#   bash bench/gpu/amx.sh          # on the GPU machine, ~7 min
#   bash bench/gpu/amx.sh --cpu    # the dry run here: same parts, tiny sizes
#
# Carries what bench/gpu/run.sh carries (.whl/ with py-spy, .gpu-model/; see
# bench/gpu/fetch_wheels.sh). The parts, each under its own `timeout` and all pinned
# with `taskset -c $AMX_CPUS` (default 0,1) and two torch threads:
#
#   install      the carried wheels (bench/gpu/install.sh)
#   env          the CPU's model and ISA flags (AMX tiles, bf16, int8; AVX-512), torch's
#                own view of them, whether dpserve's C kernels build there
#   roofline-*   bench/roofline.py for bfloat16 and float32: GEMM GFLOP/s of the model's
#                shapes at 1/16/256/2,048 rows (oneDNN uses AMX where the CPU has it),
#                read bandwidth, one-row streamed GB/s, the W1/W16 limits
#   int8         bench/int8_kernels.py: dpserve's VNNI kernel against oneDNN's int8
#                (AMX-INT8 where present) and fbgemm
#   model        random weights with the default model's exact config (its GGUF cannot
#                travel): timings match, tokens do not matter (ignore_eos)
#   serve-*      `dpserve serve --device cpu` per dtype (bfloat16; float32 + int8):
#                W1 (8 requests one at a time) and W16 (64 requests, 128 in / 64 out,
#                16 at a time), unprofiled, with `dpserve bench serve`
#   profile-*    bench/profile_serve.py W1 and W16 in bfloat16: py-spy over every
#                process, time per category (linears, attention, ..., IPC, HTTP)
#
# AMX_SKIP="roofline int8" leaves those parts out (a rerun that has their figures).
#
# Results under $OUT: amx.log (everything), figures.json (each part's JSON lines).
set -uo pipefail

MODE=device
for arg in "$@"; do
  case $arg in
    --cpu) MODE=cpu ;;
    -h|--help) sed -n '2,/^set -uo/p' "$0" | sed '$d'; exit 0 ;;
    *) echo "amx.sh: unknown option $arg (only --cpu)" >&2; exit 2 ;;
  esac
done
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
cd "$ROOT" || exit 1
PY=${PYTHON:-python3}
CPUS=${AMX_CPUS:-0,1}
WORK=$(mktemp -d /tmp/dpserve-amx.XXXXXX)
OUT=${OUT:-$(mktemp -d /tmp/dpserve-amx-out.XXXXXX)}
mkdir -p "$OUT"
trap 'rm -rf "$WORK"' EXIT
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1 OMP_NUM_THREADS=2
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
LOG=$OUT/amx.log
PIN=(taskset -c "$CPUS")

part() {  # part NAME LIMIT_S CMD...: run CMD pinned, under timeout; never exits
  local name=$1 limit=$2 t0 rc
  shift 2
  if [[ " ${AMX_SKIP:-} " == *" ${name%%-*} "* ]]; then
    echo "== $name: skipped (AMX_SKIP)" | tee -a "$LOG"
    return
  fi
  echo "== $name (limit ${limit}s)" | tee -a "$LOG"
  t0=$(date +%s)
  timeout -k 20 "$limit" "${PIN[@]}" "$@" >>"$LOG" 2>&1
  rc=$?
  echo "== $name: rc $rc in $(($(date +%s) - t0)) s" | tee -a "$LOG"
}

source bench/gpu/install.sh
export -f install
part install 90 bash -c install
if [ -d "$WORK/site" ]; then
  export PYTHONPATH="$ROOT:$WORK/site" PATH="$WORK/site/bin:$PATH"
fi

part env 60 bash -c 'lscpu | grep -E "Model name|^CPU\(s\)|NUMA node0"; \
  grep -o -w -E "amx_tile|amx_bf16|amx_int8|avx512f|avx512_bf16|avx512_vnni|avx2" \
    /proc/cpuinfo | sort | uniq -c; \
  "$PY" -c "import torch; print(\"torch\", torch.__version__, \"capability\", \
torch.backends.cpu.get_cpu_capability(), \"threads\", torch.get_num_threads()); \
from dpserve.model import cpu_kernels; print(\"dpserve kernels:\", cpu_kernels.available(), \
\"int8 vnni:\", cpu_kernels.int8_available())"'

if [ "$MODE" = cpu ]; then
  part roofline-bfloat16 300 "$PY" bench/roofline.py --dtype bfloat16 --threads 2
  part int8 300 "$PY" bench/int8_kernels.py --threads 2 --rows 1 16 --shapes qkv --repeat 2
else
  part roofline-bfloat16 150 "$PY" bench/roofline.py --dtype bfloat16 --threads 2
  part roofline-float32 120 "$PY" bench/roofline.py --dtype float32 --threads 2
  part int8 120 "$PY" bench/int8_kernels.py --threads 2 --rows 1 16 256
fi

CPU_FLAG=(); [ "$MODE" = cpu ] && CPU_FLAG=(--cpu)
part model 120 "$PY" bench/gpu/parts.py models --out "$WORK/models" --fig "$WORK/models.json" \
  "${CPU_FLAG[@]}"
MODEL=$("$PY" -c 'import json,sys; print(json.load(open(sys.argv[1]))["default"])' \
  "$WORK/models.json" 2>/dev/null)
VOCAB=$("$PY" -c 'import json,sys; print(json.load(open(sys.argv[1]+"/config.json"))["vocab_size"])' \
  "$MODEL" 2>/dev/null)
W1=(--num-prompts 8 --concurrency 1 --prompt-len 128 --output-len 64)
W16=(--num-prompts 64 --concurrency 16 --prompt-len 128 --output-len 64)
[ "$MODE" = cpu ] && W1=(--num-prompts 2 --concurrency 1 --prompt-len 16 --output-len 8) \
  && W16=(--num-prompts 4 --concurrency 2 --prompt-len 16 --output-len 8)

serve_and_load() {  # NAME SERVE_OPTIONS...: start a server, run W1 and W16, stop it
  local name=$1 port=18$((RANDOM % 900 + 100)) pid deadline
  shift
  "$PY" -m dpserve.cli serve "$MODEL" --device cpu --port "$port" --host 127.0.0.1 "$@" \
    >"$WORK/serve-$name.log" 2>&1 &
  pid=$!
  deadline=$(($(date +%s) + 150))
  until "$PY" -c "import urllib.request as u; u.urlopen('http://127.0.0.1:$port/health', timeout=2)" \
      2>/dev/null; do
    if ! kill -0 $pid 2>/dev/null || (($(date +%s) > deadline)); then
      echo "server $name did not come up"; tail -20 "$WORK/serve-$name.log"
      kill -TERM $pid 2>/dev/null; wait $pid; return 1
    fi
    sleep 1
  done
  for load in W1 W16; do
    local -n args=$load
    echo "-- $name $load"
    "$PY" -m dpserve.cli bench serve --base-url "http://127.0.0.1:$port" "${args[@]}" \
      --vocab-size "$VOCAB" \
      --json-out "$WORK/$name-$load.json" | tail -n 12
    echo "FIGURES $name $load $(cat "$WORK/$name-$load.json")" >>"$OUT/figures.json"
  done
  kill -TERM $pid; wait $pid
  echo "server $name exited $?"
}
export -f serve_and_load
export MODEL VOCAB WORK OUT PY
export W1_S="${W1[*]}" W16_S="${W16[*]}"
run_serve() { W1=($W1_S) W16=($W16_S); serve_and_load "$@"; }
export -f run_serve
part serve-bfloat16 240 bash -c 'run_serve bfloat16 --dtype bfloat16'
part serve-float32 200 bash -c 'run_serve float32 --dtype float32'
part serve-int8 200 bash -c 'run_serve int8 --dtype float32 --quantization int8'

SECONDS_PROFILE=15; [ "$MODE" = cpu ] && SECONDS_PROFILE=4
for w in W1 W16; do
  part "profile-$w" 150 "$PY" bench/profile_serve.py --workload $w --model "$MODEL" \
    --seconds $SECONDS_PROFILE --serve-options "--device cpu --dtype bfloat16"
done
echo "results: $(ls "$OUT")"
