#!/usr/bin/env bash
# Issue 14 in one GPU call (from the repository root, after ../shared/gpu/bundle; GPU_DIR=.gpu-NAME
# for a copied bundle): persistent-kernel tests, the timed 113 x 71 comparison beside PyTorch with
# CUDA graphs, Nsight Compute, compute-sanitizer memcheck and racecheck, the seed spread.
# Every step is time-boxed and logs to $OUT; a summary is printed last.
set -u
T0=$SECONDS
G=${GPU_DIR:-.gpu}
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
bash $G/run unpack
for d in /usr/local/nvidia/lib64 /usr/local/cuda/lib64 /usr/local/cuda/targets/x86_64-linux/lib; do
  [ -d "$d" ] && export LD_LIBRARY_PATH="$d:${LD_LIBRARY_PATH:-}"
done
[ -d /usr/local/cuda ] && export CUDA_HOME=${CUDA_HOME:-/usr/local/cuda}
export FERROGRAD_CACHE_DIR=/tmp/ferrograd-cache PYTHONUNBUFFERED=1
FG=$G/bin/ferrograd
log() { echo "[$((SECONDS - T0)) s] $*" | tee -a "$OUT/summary.txt"; }
nvidia-smi --query-gpu=name,clocks.max.sm,clocks.sm,driver_version --format=csv > "$OUT/device.txt" 2>&1
cat "$OUT/device.txt" | tee -a "$OUT/summary.txt"

# 1. correctness
timeout 200 $G/tests/persistent_mlp-test --test-threads=1 --nocapture > "$OUT/tests_persistent.log" 2>&1
log "persistent_mlp tests rc=$? $(grep -E '^test result' "$OUT/tests_persistent.log")"
timeout 120 $G/tests/monster_walk-test --test-threads=1 --nocapture > "$OUT/tests_monster.log" 2>&1
log "monster_walk tests rc=$? $(grep -E '^test result' "$OUT/tests_monster.log")"
timeout 60 $G/tests/kernels_compile-test --test-threads=1 > "$OUT/tests_compile.log" 2>&1
log "kernels_compile rc=$?"

# 2. the timed 113 x 71 run beside PyTorch with CUDA graphs (eager was measured before: 17.6 s)
FERROGRAD=$FG TORCH_VARIANTS=graph timeout 150 bash bench/monster_walk_compare.sh 113 71 "$OUT/mw" > "$OUT/compare.log" 2>&1
log "compare rc=$?"
timeout 30 $FG monster-walk --device cuda --copies 113 --epochs 71 --init "$OUT/mw/init.safetensors" --report "$OUT/mw/ferrograd_again.json" > "$OUT/again.log" 2>&1
log "second persistent run rc=$? $(grep -E 'training time|loss' "$OUT/again.log" | tr -s ' ' | tr '\n' ';')"

# 3. Nsight Compute on the persistent kernel (8 epochs: 904 steps)
NCU=$(command -v ncu || ls /usr/local/cuda/bin/ncu /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
if [ -n "$NCU" ]; then
  timeout 90 "$NCU" --clock-control none --section SpeedOfLight --section Occupancy --section LaunchStats \
    --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis --section InstructionStats \
    --section WarpStateStats --section SchedulerStats -k regex:mlp_persistent -c 1 \
    $FG monster-walk --device cuda --copies 113 --epochs 8 > "$OUT/ncu.txt" 2>&1
  log "ncu sections rc=$?"
  timeout 60 "$NCU" --clock-control none -k regex:mlp_persistent -c 1 --metrics \
gpu__time_duration.sum,sm__inst_executed_pipe_tensor_op_hmma.sum,smsp__inst_executed.sum,sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active,l1tex__data_pipe_lsu_wavefronts_mem_shared.sum,l1tex__data_bank_conflicts_pipe_lsu_mem_shared.sum,lts__t_bytes.sum,dram__bytes_read.sum,sm__warps_active.avg.pct_of_peak_sustained_active,smsp__cycles_active.avg,sm__cycles_elapsed.avg.per_second \
    $FG monster-walk --device cuda --copies 113 --epochs 8 > "$OUT/ncu_metrics.txt" 2>&1
  log "ncu metrics rc=$?"
else
  log "no ncu on this machine"
fi

# 4. compute-sanitizer: memcheck and racecheck on the small test and on Monster Walk's layout
CS=$(command -v compute-sanitizer || ls /usr/local/cuda/bin/compute-sanitizer 2>/dev/null | head -1)
if [ -n "$CS" ]; then
  for tool in memcheck racecheck; do
    timeout 60 "$CS" --tool $tool --error-exitcode 97 $G/tests/persistent_mlp-test --test-threads=1 sanitizer_smoke > "$OUT/${tool}_smoke.log" 2>&1
    log "$tool smoke rc=$? $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY|hazard' "$OUT/${tool}_smoke.log" | head -2 | tr '\n' ';')"
  done
  timeout 90 "$CS" --tool memcheck --error-exitcode 97 $FG monster-walk --device cuda --copies 2 --epochs 2 > "$OUT/memcheck_mw.log" 2>&1
  log "memcheck monster-walk 2x2 rc=$? $(grep -E 'ERROR SUMMARY' "$OUT/memcheck_mw.log" | head -1)"
  timeout 100 "$CS" --tool racecheck --error-exitcode 97 $FG monster-walk --device cuda --copies 2 --epochs 1 > "$OUT/racecheck_mw.log" 2>&1
  log "racecheck monster-walk 2x1 rc=$? $(grep -E 'RACECHECK SUMMARY|ERROR SUMMARY' "$OUT/racecheck_mw.log" | head -1)"
else
  log "no compute-sanitizer on this machine"
fi

# 5. the seed spread (PyTorch fused vs foreach Adam) with the persistent kernel, if time is left
if (( SECONDS - T0 < 250 )); then
  FERROGRAD=$FG timeout $((395 - (SECONDS - T0))) bash bench/monster_walk_seeds.sh "0 1 2" 113 71 "$OUT/seeds" > "$OUT/seeds.log" 2>&1
  log "seeds rc=$?"
else
  for s in 1 2; do
    python3 bench/monster_walk_torch.py --write-init "$OUT/init$s.safetensors" --seed $s > /dev/null 2>&1
    timeout 20 $FG monster-walk --device cuda --copies 113 --epochs 71 --init "$OUT/init$s.safetensors" --report "$OUT/seed$s.json" > /dev/null 2>&1
    log "seed $s persistent: $(python3 -c "import json;r=json.load(open('$OUT/seed$s.json'));print(r['final_loss'], r['training_time_s'])" 2>&1)"
  done
fi

echo "===== summary"; cat "$OUT/summary.txt"
echo "===== compare"; tail -22 "$OUT/compare.log"
echo "===== seeds"; tail -5 "$OUT/seeds.log" 2>/dev/null
echo "===== persistent tests (tail)"; grep -E "worst|layer .: kern|panicked|FAILED|^test " "$OUT/tests_persistent.log" | tail -24
grep -E "FAILED|panicked" "$OUT/tests_monster.log" | head -5
echo "===== ncu"; grep -E "Duration|Compute \(SM\) Throughput|Memory Throughput|Achieved Occupancy|Theoretical Occupancy|Registers Per|Executed Ipc A|Issue Slots Busy|No Eligible|hmma|inst_executed.sum|lts__t_bytes|dram__bytes|wavefronts|bank_conflicts|warps_active|per_second|cycles_active" "$OUT/ncu.txt" "$OUT/ncu_metrics.txt" 2>/dev/null | head -40
