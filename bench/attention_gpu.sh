#!/usr/bin/env bash
# The attention op on a GPU machine, from the repository root, with a bundle that
# ../shared/gpu/bundle built (default .gpu; BUNDLE=.gpu-NAME for a copy): its tests (CPU <-> CUDA
# parity, poisoned outputs), compute-sanitizer memcheck and racecheck on them, and
# `ferrograd bench attention` beside its twin bench/torch_attention.py, then the paired table.
#
#   bash bench/attention_gpu.sh [steps...]   steps: tests memcheck racecheck bench twin (default: all)
#   BENCH_ARGS="--seqs 1024,4096" bash bench/attention_gpu.sh bench twin
#
# Logs and JSON go to $OUT (default /tmp/attention-gpu); the last lines summarise every step.
set -uo pipefail
G=${BUNDLE:-.gpu}
bash "$G/run" unpack || exit 2
for d in /usr/local/nvidia/lib64 /usr/local/cuda/lib64 /usr/local/cuda/targets/x86_64-linux/lib; do
  [ -d "$d" ] && export LD_LIBRARY_PATH="$d:${LD_LIBRARY_PATH:-}"
done
export CUDA_HOME=${CUDA_HOME:-/usr/local/cuda} FERROGRAD_CACHE_DIR=${FERROGRAD_CACHE_DIR:-/tmp/ferrograd-cache}
OUT=${OUT:-/tmp/attention-gpu}
mkdir -p "$OUT"
T=$G/tests/attention-test
SUMMARY=""
step() {
  local name=$1 tmo=$2
  shift 2
  echo "=== $name: $*"
  local t0=$SECONDS
  timeout "$tmo" "$@" >"$OUT/$name.log" 2>&1
  local rc=$?
  echo "--- $name rc=$rc ($((SECONDS - t0)) s)"
  tail -n "${TAIL:-12}" "$OUT/$name.log"
  SUMMARY="$SUMMARY\n$name rc=$rc $((SECONDS - t0))s"
}
# shellcheck disable=SC2086  # BENCH_ARGS is a list of flags
for s in ${*:-tests memcheck racecheck bench twin}; do
  case $s in
    tests) step tests 300 "$T" --test-threads=1 --nocapture ;;
    memcheck) step memcheck 300 compute-sanitizer --tool memcheck --error-exitcode 97 "$T" --test-threads=1 cuda_ ;;
    racecheck) step racecheck 200 compute-sanitizer --tool racecheck --error-exitcode 97 "$T" --test-threads=1 cuda_sanitizer_smoke ;;
    bench) step bench 300 "$G/bin/ferrograd" bench attention --json "$OUT/ferrograd_attention.json" ${BENCH_ARGS:-} ;;
    twin) step twin 300 python3 bench/torch_attention.py --json "$OUT/pytorch_attention.json" ${BENCH_ARGS:-} ;;
    *) echo "unknown step $s" >&2 ;;
  esac
done
echo -e "=== summary$SUMMARY"
if [ -f "$OUT/ferrograd_attention.json" ] && [ -f "$OUT/pytorch_attention.json" ]; then
  python3 - "$OUT/ferrograd_attention.json" "$OUT/pytorch_attention.json" <<'PY' | tee "$OUT/pair.txt"
import sys
from pathlib import Path
sys.path.insert(0, "bench")
from compare import load_report, md_table, pair_rows
ours, _ = load_report(Path(sys.argv[1]))
torch, _ = load_report(Path(sys.argv[2]))
print(md_table(pair_rows(ours, torch)))
PY
fi
