#!/usr/bin/env bash
# One fused op on a GPU machine, from the repository root, with a bundle that ../shared/gpu/bundle
# built (default .gpu; BUNDLE=.gpu-NAME for a copy): the op's test binary (CPU <-> CUDA parity,
# poisoned outputs), compute-sanitizer memcheck and racecheck on it, and its `ferrograd bench`
# beside the PyTorch twin, then the paired table.
#
#   bash bench/op_gpu.sh OP [steps...]   OP: attention, selective_scan, bias_gelu, add_layer_norm
#                                        steps: tests memcheck racecheck bench twin (default: all)
#   BENCH_ARGS="--seqs 1024,4096" bash bench/op_gpu.sh attention bench twin
#
# What OP picks (each overridable from the environment): TEST, the test binary
# (.gpu/tests/core_suite-test, where the op's tests are the module OP); MOD, the filter prefix that
# selects that module ("OP::"); MEMCHECK, the test filter run under memcheck after MOD ("cuda": the
# CUDA tests); RACECHECK, the filter run under racecheck after MOD (a small test that reaches every kernel with shared memory); BENCH, the
# `ferrograd bench` subcommand; TWIN, its bench/ script. Logs and JSON go to $OUT (default
# /tmp/OP-gpu); the last lines summarise every step.
set -uo pipefail
OP=${1:?usage: bash bench/op_gpu.sh OP [steps...]}
shift
case $OP in
  attention) bench=attention twin=torch_attention.py race=cuda_sanitizer_smoke ;;
  selective_scan) bench=selective-scan twin=torch_selective_scan.py race=cuda_sscan_sanitizer_smoke ;;
  bias_gelu) bench=fused twin=torch_fused.py race=cuda_three_dims_and_empty ;;
  add_layer_norm) bench=fused twin=torch_fused.py race=cuda_long_rows_and_empty ;;
  *) bench=${BENCH:?unknown op $OP: set BENCH, TWIN and RACECHECK} twin=${TWIN:?} race=${RACECHECK:?} ;;
esac
BENCH=${BENCH:-$bench} TWIN=${TWIN:-$twin} RACECHECK=${RACECHECK:-$race} MEMCHECK=${MEMCHECK:-cuda}
G=${BUNDLE:-.gpu}
bash "$G/run" unpack || exit 2
for d in /usr/local/nvidia/lib64 /usr/local/cuda/lib64 /usr/local/cuda/targets/x86_64-linux/lib; do
  [ -d "$d" ] && export LD_LIBRARY_PATH="$d:${LD_LIBRARY_PATH:-}"
done
export CUDA_HOME=${CUDA_HOME:-/usr/local/cuda} FERROGRAD_CACHE_DIR=${FERROGRAD_CACHE_DIR:-/tmp/ferrograd-cache}
OUT=${OUT:-/tmp/$OP-gpu}
mkdir -p "$OUT"
T=${TEST:-$G/tests/core_suite-test}
MOD=${MOD-$OP::}
OURS=$OUT/ferrograd_$OP.json
THEIRS=$OUT/pytorch_$OP.json
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
    tests) step tests 300 "$T" --test-threads=1 --nocapture "$MOD" ;;
    memcheck) step memcheck 300 compute-sanitizer --tool memcheck --error-exitcode 97 "$T" --test-threads=1 "$MOD$MEMCHECK" ;;
    racecheck) step racecheck 200 compute-sanitizer --tool racecheck --error-exitcode 97 "$T" --test-threads=1 "$MOD$RACECHECK" ;;
    bench) step bench 300 "$G/bin/ferrograd" bench "$BENCH" --json "$OURS" ${BENCH_ARGS:-} ;;
    twin) step twin 300 python3 "bench/$TWIN" --json "$THEIRS" ${BENCH_ARGS:-} ;;
    *) echo "unknown step $s" >&2 ;;
  esac
done
echo -e "=== summary$SUMMARY"
if [ -f "$OURS" ] && [ -f "$THEIRS" ]; then
  python3 - "$OURS" "$THEIRS" <<'PY' | tee "$OUT/pair.txt"
import sys
from pathlib import Path
sys.path.insert(0, "bench")
from compare import load_report, md_table, pair_rows
ours, _ = load_report(Path(sys.argv[1]))
torch, _ = load_report(Path(sys.argv[2]))
print(md_table(pair_rows(ours, torch)))
PY
fi
