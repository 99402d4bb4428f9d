#!/usr/bin/env bash
# Issue 16 (pipeline parallelism) on a 2-GPU machine in one device call (kind nvidia-h200-x2;
# about 4 minutes), from the repository root, with the bundle folder made by ../shared/gpu/bundle:
#
#   bash bench/pipeline_gpu.sh [BUNDLE]        BUNDLE: default .gpu (e.g. .gpu-pipeline)
#
# 1. the pipeline tests: crates/ferrograd-cli/tests/pipeline_gpu.rs (monster-walk --pipeline 4 on
#    2 GPUs = on 1 GPU for the same micro-batches, GPipe = 1F1B, a failing stage stopping every
#    rank) and the CPU pipeline tests (schedules, thread-communicator equivalence);
# 2. Monster Walk, the design document's four stage groups, COPIES copies x EPOCHS epochs:
#    --pipeline 4 on 1 GPU (all groups one stage), on 2 GPUs (two groups per GPU) under GPipe and
#    1F1B, a micro-batch sweep (bubble against (p-1)/(m+p-1)), data parallel on 2 GPUs (fused
#    step) and the 1-GPU default (persistent kernel) for reference: samples/s, bubble measured and
#    theoretical, step memory per stage;
# 3. the twin, bench/monster_walk_pipeline_torch.py under torchrun (torch.distributed.pipelining,
#    the same four groups on 2 GPUs, GPipe and 1F1B, same rows and steps): samples/s.
#
# Full logs and JSON go to $OUT (else /tmp/pipeline_gpu); the summary is printed last. A step that
# fails is reported in the summary and the others still run; the exit status is 1 if any failed.
set -uo pipefail
G=${1:-.gpu}
[ -f "$G/run" ] || { echo "no bundle at $G/run (make one with ../shared/gpu/bundle)" >&2; exit 2; }
PY_DIR=${PY_DIR:-$(cd "$(dirname "$0")" && pwd)}
COPIES=${COPIES:-113}
EPOCHS=${EPOCHS:-8}
MICRO=${MICRO:-8}
out=${OUT:-/tmp/pipeline_gpu}
mkdir -p "$out"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
bash "$G/run" unpack || exit 2
bin=$(cd "$G" && pwd)/bin/ferrograd
tests=$(cd "$G" && pwd)/tests
for dir in /usr/local/nvidia/lib64 /usr/local/cuda/lib64 /usr/local/cuda/targets/x86_64-linux/lib; do
  [ -d "$dir" ] && export LD_LIBRARY_PATH="$dir:${LD_LIBRARY_PATH:-}"
done
export FERROGRAD_CACHE_DIR=${FERROGRAD_CACHE_DIR:-/tmp/ferrograd-cache}
export FERROGRAD_BIN=$bin G tests
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
BUDGET_S=${BUDGET_S:-330}
step() { # step NAME LIMIT_S COMMAND...
  local name=$1 limit=$2; shift 2
  local t0=$SECONDS left=$((BUDGET_S - SECONDS))
  if [ $left -lt 10 ]; then
    status+=("$name rc=skipped(time budget)"); return
  fi
  [ "$limit" -gt $left ] && limit=$left
  echo "=== $name: $*"
  timeout -k 10 "$limit" bash -c '"$@"' _ "$@" > "$out/$name.log" 2>&1
  local rc=$?
  tail -n 3 "$out/$name.log"
  status+=("$name rc=$rc $((SECONDS - t0))s")
}

{ nvidia-smi -L; nvidia-smi topo -m; } > "$out/gpus.log" 2>&1
step precompile 90 ferro kernels --precompile
step tests 120 bash -c 'run_tests "" pipeline_gpu-test pipeline-test; a=$?; run_tests pipeline ferrograd_dist-lib ferrograd_cli-lib && exit $a' 
W="--copies $COPIES --epochs $EPOCHS"
step pipe1_1f1b 60 ferro monster-walk --pipeline 4 --device cuda:0 $W --micro-batches "$MICRO" --schedule 1f1b --report "$out/pipe1_1f1b.json"
step pipe2_gpipe 60 launch2 29611 monster-walk --pipeline 4 $W --micro-batches "$MICRO" --schedule gpipe --report "$out/pipe2_gpipe.json"
step pipe2_1f1b 60 launch2 29613 monster-walk --pipeline 4 $W --micro-batches "$MICRO" --schedule 1f1b --report "$out/pipe2_1f1b.json"
for m in 2 4 16; do
  step "pipe2_gpipe_m$m" 40 launch2 $((29620 + m)) monster-walk --pipeline 4 $W --micro-batches "$m" --schedule gpipe --report "$out/pipe2_gpipe_m$m.json"
done
step dp2_fused 60 launch2 29641 monster-walk --step fused $W --report "$out/dp2_fused.json"
step one_default 60 ferro monster-walk --device cuda:0 $W --report "$out/one_default.json"
for s in gpipe 1f1b; do
  step "torch_pipe2_$s" 90 torchrun --nproc-per-node 2 --master-port $((29650 + ${#s})) "$PY_DIR/monster_walk_pipeline_torch.py" \
    --copies "$COPIES" --epochs "$EPOCHS" --micro-batches "$MICRO" --schedule "$s" --json "$out/torch_pipe2_$s.json"
done

python3 - "$out" <<'PY' | tee "$out/summary.txt"
import json, os, sys
d = sys.argv[1]
print(f"{'run':<18}{'samples/s':>12}{'bubble':>9}{'theory':>9}  {'step memory per stage':<28}{'final loss':>12}")
for name in ["pipe1_1f1b", "pipe2_gpipe", "pipe2_1f1b", "pipe2_gpipe_m2", "pipe2_gpipe_m4", "pipe2_gpipe_m16", "dp2_fused", "one_default", "torch_pipe2_gpipe", "torch_pipe2_1f1b"]:
    p = os.path.join(d, name + ".json")
    if not os.path.exists(p):
        print(f"{name:<18}  (no report)"); continue
    r = json.load(open(p))
    b = r.get("bubble_measured"); t = r.get("bubble_theory")
    mem = r.get("step_memory_bytes")
    mem = ", ".join(f"{x/2**20:.1f} MiB" for x in mem) if mem else "-"
    bs = f"{100*b:.1f}%" if b is not None else "-"
    ts = f"{100*t:.1f}%" if t is not None else "-"
    print(f"{name:<18}{r['samples_per_s']:>12.0f}{bs:>9}{ts:>9}  {mem:<28}{r['final_loss']:>12.6f}")
PY
echo "=== status"
printf '%s\n' "${status[@]}"
printf '%s\n' "${status[@]}" | grep -qv 'rc=0 ' && exit 1
exit 0
