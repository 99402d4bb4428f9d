# Shared by the 2-GPU device-call scripts (bench/dist_gpu.sh, bench/pipeline_gpu.sh): sourced after
# they set G (the bundle folder from ../shared/gpu/bundle) and out (their log folder). Unpacks the
# bundle and defines
#   ferro ARGS...            the bundled ferrograd
#   launch2 PORT ARGS...     ferrograd launch --nproc-per-node 2 --master-port PORT -- ferrograd ARGS
#   run_tests FILTER BIN...  bundled test binaries, one at a time, output not captured (the numbers
#                            the tests print reach the logs)
#   step NAME LIMIT_S CMD... CMD under `timeout` (a hang costs LIMIT_S, not the call), its log in
#                            $out/NAME.log, its status in the array `status` and $out/status.txt;
#                            skipped once BUDGET_S seconds of the script are spent
[ -f "$G/run" ] || { echo "no bundle at $G/run (make one with ../shared/gpu/bundle)" >&2; exit 2; }
mkdir -p "$out"
# NVLink multicast stays off (KINDS.md); our launcher sets it too, torchrun does not.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1
bash "$G/run" unpack || exit 2
bin=$(cd "$G" && pwd)/bin/ferrograd
tests=$(cd "$G" && pwd)/tests
# What .gpu/run sets up, for the test binaries run directly.
for dir in /usr/local/nvidia/lib64 /usr/local/cuda/lib64 /usr/local/cuda/targets/x86_64-linux/lib; do
  [ -d "$dir" ] && export LD_LIBRARY_PATH="$dir:${LD_LIBRARY_PATH:-}"
done
export FERROGRAD_CACHE_DIR=${FERROGRAD_CACHE_DIR:-/tmp/ferrograd-cache}
export FERROGRAD_BIN=$bin G tests   # FERROGRAD_BIN: what the 2-GPU tests start
ferro() { bash "$G/run" bin ferrograd "$@"; }
launch2() { local port=$1; shift; ferro launch --nproc-per-node 2 --master-port "$port" -- ferrograd "$@"; }
run_tests() { # run_tests FILTER BINARY...
  local filter=$1 rc=0; shift
  for t in "$@"; do
    [ -x "$tests/$t" ] || { echo "--- $t: not in the bundle"; rc=1; continue; }
    echo "--- $t $filter"
    "$tests/$t" --test-threads=1 --nocapture $filter || rc=1
  done
  return $rc
}
export -f ferro launch2 run_tests

status=()
BUDGET_S=${BUDGET_S:-380}
step() { # step NAME LIMIT_S COMMAND...
  local name=$1 limit=$2; shift 2
  local t0=$SECONDS left=$((BUDGET_S - SECONDS))
  if [ $left -lt 15 ]; then
    status+=("$name rc=skipped(time budget)"); echo "$name rc=skipped" >> "$out/status.txt"; return
  fi
  [ "$limit" -gt $left ] && limit=$left
  echo "=== $name: $*"
  timeout -k 10 "$limit" bash -c '"$@"' _ "$@" > "$out/$name.log" 2>&1
  local rc=$?
  tail -n 5 "$out/$name.log"
  status+=("$name rc=$rc $((SECONDS - t0))s")
  echo "$name rc=$rc $((SECONDS - t0))s" >> "$out/status.txt"
}
: > "$out/status.txt"
