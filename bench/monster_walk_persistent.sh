#!/usr/bin/env bash
# Issue 14 in one GPU call (from the repository root, after ../shared/gpu/bundle; GPU_DIR=.gpu-NAME
# for a copied bundle, BENCH_DIR=.gpu-NAME/py where the device's checkout lacks these scripts).
# In order of what matters most, each step time-boxed against BUDGET seconds (default 400):
#   1. compute-sanitizer racecheck and memcheck on `monster-walk --copies 2 --epochs 1` (Monster
#      Walk's own layout: 132 blocks, 40 rows each) and the `persistent_mlp` tests;
#   2. the `persistent_mlp` and `monster_walk` tests;
#   3. the timed 113 x 71 run in three precisions beside PyTorch with CUDA graphs, same init and data;
#   4. what time is left: racecheck of tf32/bf16 on Monster Walk, Nsight Compute metrics, the seed
#      spread (STEPS="sanitize tests compare ncu seeds" picks steps).
# Logs go to $OUT (also tarred to $OUT/logs.tgz); a summary is printed last.
set -u
T0=$SECONDS
G=${GPU_DIR:-.gpu}
B=${BENCH_DIR:-bench}
OUT=${OUT:-/tmp/out}
BUDGET=${BUDGET:-400}
STEPS=${STEPS:-"sanitize tests compare ncu"}
mkdir -p "$OUT"
bash $G/run unpack > /dev/null
for d in /usr/local/nvidia/lib64 /usr/local/cuda/lib64 /usr/local/cuda/targets/x86_64-linux/lib; do
  [ -d "$d" ] && export LD_LIBRARY_PATH="$d:${LD_LIBRARY_PATH:-}"
done
[ -d /usr/local/cuda ] && export CUDA_HOME=${CUDA_HOME:-/usr/local/cuda}
export FERROGRAD_CACHE_DIR=/tmp/ferrograd-cache PYTHONUNBUFFERED=1
FG=$G/bin/ferrograd
PT=$G/tests/models_suite-test  # with the filter persistent_mlp:: (the module of that file)
log() { echo "[$((SECONDS - T0)) s] $*" | tee -a "$OUT/summary.txt"; }
left() { echo $((BUDGET - (SECONDS - T0))); }
# timeout of at most $1 seconds, less if the budget is shorter (0: skip)
tmo() { local l; l=$(left); (( l > $1 )) && echo "$1" || echo $(( l > 10 ? l - 5 : 0 )); }
want() { [[ " $STEPS " == *" $1 "* ]]; }
nvidia-smi --query-gpu=name,clocks.max.sm,clocks.sm,driver_version --format=csv,noheader > "$OUT/device.txt" 2>&1
log "device: $(cat "$OUT/device.txt")"
CS=$(command -v compute-sanitizer || ls /usr/local/cuda/bin/compute-sanitizer 2>/dev/null | head -1)
NCU=$(command -v ncu || ls /usr/local/cuda/bin/ncu /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
log "compute-sanitizer: ${CS:-none} $([ -n "$CS" ] && "$CS" --version | tail -1); ncu: ${NCU:-none}"
sanit() {  # tool, name, seconds, command...
  local tool=$1 name=$2 t; t=$(tmo "$3"); shift 3
  if (( t == 0 )); then log "$tool $name: skipped (no time left)"; return; fi
  timeout "$t" "$CS" --tool "$tool" --error-exitcode 97 "$@" > "$OUT/${tool}_$name.log" 2>&1
  log "$tool $name rc=$? $(grep -E 'RACECHECK SUMMARY|ERROR SUMMARY|^test result' "$OUT/${tool}_$name.log" | tr '\n' ';')"
}

# 1. sanitizers: Monster Walk's own layout first, then the tests
if want sanitize && [ -n "$CS" ]; then
  $FG monster-walk --device cuda --copies 2 --epochs 1 > "$OUT/warmup.log" 2>&1  # fills the kernel cache
  sanit racecheck mw "110" $FG monster-walk --device cuda --copies 2 --epochs 1
  sanit memcheck mw "70" $FG monster-walk --device cuda --copies 2 --epochs 1
  # racecheck of the 20-step Monster Walk test (autograd and all) takes minutes: it comes last
  sanit racecheck tests "100" $PT --test-threads=1 persistent_mlp:: --skip monster_walk
  sanit memcheck tests "90" $PT --test-threads=1 persistent_mlp::
fi

# 2. the tests, unsanitized
if want tests; then
  timeout "$(tmo 90)" $PT --test-threads=1 --nocapture persistent_mlp:: > "$OUT/tests_persistent.log" 2>&1
  log "persistent_mlp tests rc=$? $(grep -E '^test result' "$OUT/tests_persistent.log")"
  timeout "$(tmo 90)" $PT --test-threads=1 monster_walk:: > "$OUT/tests_monster.log" 2>&1
  log "monster_walk tests rc=$? $(grep -E '^test result' "$OUT/tests_monster.log")"
fi

# 3. the timed 113 x 71 run beside PyTorch with CUDA graphs (eager was measured before: 17.6 s)
if want compare; then
  FERROGRAD=$FG TORCH_VARIANTS=graph timeout "$(tmo 150)" bash $B/monster_walk_compare.sh 113 71 "$OUT/mw" > "$OUT/compare.log" 2>&1
  log "compare rc=$?"
  timeout "$(tmo 30)" $FG monster-walk --device cuda --copies 113 --epochs 71 --init "$OUT/mw/init.safetensors" --report "$OUT/mw/ferrograd_again.json" > "$OUT/again.log" 2>&1
  log "second persistent f32 run rc=$? $(grep -E 'training time|final loss' "$OUT/again.log" | tr -s ' ' | tr '\n' ';')"
fi

# 4. the rest, as time allows
if want ncu && [ -n "$NCU" ] && (( $(left) > 60 )); then
  timeout "$(tmo 70)" "$NCU" --clock-control none -k regex:mlp_persistent -c 1 --metrics \
gpu__time_duration.sum,sm__inst_executed_pipe_tensor_op_hmma.sum,smsp__inst_executed.sum,sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active,l1tex__data_pipe_lsu_wavefronts_mem_shared.sum,l1tex__data_bank_conflicts_pipe_lsu_mem_shared.sum,lts__t_bytes.sum,dram__bytes_read.sum,sm__warps_active.avg.pct_of_peak_sustained_active,smsp__cycles_active.avg,sm__cycles_elapsed.avg.per_second,smsp__issue_active.avg.pct_of_peak_sustained_active,smsp__average_warp_latency_issue_stalled_barrier.ratio,smsp__average_warp_latency_issue_stalled_long_scoreboard.ratio,smsp__average_warp_latency_issue_stalled_short_scoreboard.ratio,smsp__average_warp_latency_issue_stalled_wait.ratio,smsp__average_warp_latency_issue_stalled_math_pipe_throttle.ratio,launch__registers_per_thread,launch__occupancy_limit_shared_mem \
    $FG monster-walk --device cuda --copies 113 --epochs 8 > "$OUT/ncu_metrics.txt" 2>&1
  log "ncu metrics (113 x 8 = 904 steps) rc=$?"
fi
if want sanitize && [ -n "$CS" ] && (( $(left) > 150 )); then
  sanit racecheck mw_bf16 "100" $FG monster-walk --device cuda --copies 2 --epochs 1 --precision bf16
  sanit racecheck mw_tf32 "100" $FG monster-walk --device cuda --copies 2 --epochs 1 --precision tf32
fi
if want seeds && (( $(left) > 120 )); then
  FERROGRAD=$FG timeout "$(tmo 300)" bash $B/monster_walk_seeds.sh "${SEEDS:-0 1 2}" 113 71 "$OUT/seeds" > "$OUT/seeds.log" 2>&1
  log "seeds rc=$?"
fi

tar czf "$OUT/logs.tgz" -C "$OUT" --exclude logs.tgz --exclude '*.safetensors' . 2>/dev/null
echo "===== racecheck hazards (first lines)"
grep -h -m3 -E "Race reported|hazard|Error: " "$OUT"/racecheck_*.log 2>/dev/null | head -8
echo "===== persistent tests"
grep -h -E "worst|layer .: kern|panicked|FAILED" "$OUT/tests_persistent.log" 2>/dev/null | tail -12
grep -h -E "FAILED|panicked" "$OUT/tests_monster.log" 2>/dev/null | head -4
echo "===== ncu"
grep -E "duration|hmma|inst_executed|lts__t_bytes|dram__bytes|wavefronts|bank_conflicts|warps_active|per_second|cycles_active|issue_active|stalled|registers|occupancy" "$OUT/ncu_metrics.txt" 2>/dev/null | tr -s ' ' | head -24
echo "===== seeds"; tail -5 "$OUT/seeds.log" 2>/dev/null
echo "===== compare"; tail -24 "$OUT/compare.log" 2>/dev/null
echo "===== summary"; cat "$OUT/summary.txt"
