#!/usr/bin/env bash
# One GPU call for the attention backends (issue 12, cuDNN path): tests (cuDNN vs our kernels; the
# attention suite with FERROGRAD_ATTENTION unset / cudnn / flash), memcheck on a small cuDNN case,
# `ferrograd bench attention --backend cudnn` and `--backend flash` beside bench/torch_attention.py,
# then one table (bench/attention_backends_table.py). From the repository root, with a bundle that
# ../shared/gpu/bundle built (BUNDLE=.gpu-NAME for a copy; PYDIR where the Python scripts are when
# the device gets another checkout). STEPS="..." picks steps. Logs and JSON go to $OUT.
set -uo pipefail
G=${BUNDLE:-.gpu}
P=${PYDIR:-bench}
bash "$G/run" unpack >/dev/null || exit 2
for d in /usr/local/nvidia/lib64 /usr/local/cuda/lib64 /usr/local/cuda/targets/x86_64-linux/lib; do
  [ -d "$d" ] && export LD_LIBRARY_PATH="$d:${LD_LIBRARY_PATH:-}"
done
export CUDA_HOME=${CUDA_HOME:-/usr/local/cuda} FERROGRAD_CACHE_DIR=/tmp/ferrograd-cache
OUT=${OUT:-/tmp/cudnn-gpu}; mkdir -p "$OUT"
T=$G/tests
SUMMARY=""
step() {
  local name=$1 tmo=$2; shift 2
  local t0=$SECONDS
  timeout "$tmo" "$@" >"$OUT/$name.log" 2>&1
  local rc=$?
  echo "=== $name rc=$rc ($((SECONDS - t0)) s)"
  grep -E "^test .*(FAILED|ok)$|test result|panicked|failed|ferrograd: attention|skipping|cuDNN|Cudnn" "$OUT/$name.log" | grep -v "^test .* ok$" | head -${LINES_PER:-14}
  SUMMARY="$SUMMARY\n$name rc=$rc $((SECONDS - t0))s"
}
ldconfig -p | grep -i cudnn | head -3
S=${STEPS:-"cudnn_tests bench_cudnn bench_flash twin tests_auto memcheck tests_flash tests_cudnn"}
BA="--seqs 1024,2048,4096 --head-dims 64,128 --causal full,causal"
for s in $S; do
  case $s in
    cudnn_tests) CUDNN_LOGLEVEL_DBG=1 CUDNN_LOGDEST_DBG="$OUT/cudnn_errors.log" step cudnn_tests 90 "$T/core_suite-test" --nocapture attention_cudnn:: ;;
    bench_cudnn) step bench_cudnn 100 "$G/bin/ferrograd" bench attention $BA --backend cudnn --json "$OUT/fg_cudnn.json" ;;
    bench_flash) step bench_flash 80 "$G/bin/ferrograd" bench attention $BA --backend flash --json "$OUT/fg_flash.json" ;;
    twin) step twin 100 python3 "$P/torch_attention.py" $BA --json "$OUT/torch.json" ;;
    tests_auto) step tests_auto 70 "$T/core_suite-test" attention:: ;;
    memcheck) step memcheck 60 compute-sanitizer --tool memcheck --error-exitcode 97 "$T/core_suite-test" attention_cudnn::cuda_cudnn_sanitizer_smoke ;;
    tests_flash) FERROGRAD_ATTENTION=flash step tests_flash 60 "$T/core_suite-test" attention:: ;;
    tests_cudnn) FERROGRAD_ATTENTION=cudnn step tests_cudnn 60 "$T/core_suite-test" attention:: ;;
  esac
done
for b in cudnn flash; do
  echo "--- bench $b (TFLOP/s fwd | f+b | ran)"; grep -E "^bf16 d=" "$OUT/bench_$b.log" | awk -F'|' '{printf "%s|%s|%s|%s\n",$1,$3,$5,$8}'
done
echo "--- torch (default | forced flash | forced cudnn)"; grep -E "^bf16 d=|backend\]" "$OUT/twin.log" | awk -F'|' '{printf "%s|%s|%s\n",$1,$3,$5}'
python3 $P/attention_backends_table.py "$OUT" | tee "$OUT/table.md"
echo -e "=== summary$SUMMARY"
