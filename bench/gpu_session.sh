#!/usr/bin/env bash
# One GPU call that re-checks a build end to end (what the fourth session's call 1 ran; BENCHMARKS.md
# "fourth session"): cold kernel precompile, every example on `--device cuda`, the README's main job,
# the cuFile probe, GPT-2 decode beside transformers (with the per-kernel profile), then the CUDA
# test suite in whatever time is left. Usage, from the repository root on the GPU machine:
#   G=.gpu EX=DIR BUDGET=540 bash bench/gpu_session.sh
# G: the bundle of ../shared/gpu/bundle (unpacked: $G/bin, $G/tests); EX: a folder with the release
# examples (target/release/examples; skipped when unset); BUDGET: seconds before the suite is cut.
set -u
G=${G:-.gpu}; EX=${EX:-}; BUDGET=${BUDGET:-540}
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
t0=$(date +%s); lap() { echo "## [$(( $(date +%s) - t0 )) s] $*"; }
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
[ -d "$G/bin" ] || bash "$G/run" unpack >/dev/null || { echo "no bundle at $G"; exit 2; }
F="$G/bin/ferrograd"
for d in /usr/local/nvidia/lib64 /usr/local/cuda/lib64 /usr/local/cuda/targets/x86_64-linux/lib; do
  [ -d "$d" ] && export LD_LIBRARY_PATH="$d:${LD_LIBRARY_PATH:-}"; done
export FERROGRAD_CACHE_DIR=${FERROGRAD_CACHE_DIR:-/tmp/ferrograd-cache}
lap "precompile (cold)"; "$F" kernels --precompile 2>&1 | tail -2
if [ -n "$EX" ]; then
  lap examples
  run_ex() { echo "-- $*"; timeout 120 "$@" > "$OUT/ex.log" 2>&1; rc=$?; tail -4 "$OUT/ex.log"; echo "   exit $rc"; }
  run_ex "$EX/tensors" --device cuda
  run_ex "$EX/train_mlp" --device cuda --steps 200
  run_ex "$EX/train_mlp" --device cuda --steps 100 --amp bf16
  run_ex "$EX/custom_op" --device cuda
  run_ex "$EX/gpt2_sample" --device cuda --tiny --tokens 16
  run_ex "$EX/devices" --device cuda --mib 256
  run_ex "$EX/data_parallel" --device cuda --steps 20
  run_ex "$F" launch --nproc-per-node 1 -- "$EX/data_parallel" --steps 10
fi
lap "monster-walk (the README's main job)"; timeout 60 "$F" monster-walk 2>&1 | tail -6
lap "cufile probe"; timeout 60 python3 bench/cufile_probe.py /tmp "$PWD" /dev/shm 2>&1 | tail -20
lap "decode"
FERROGRAD="$F" timeout 200 python3 bench/gpt2_decode.py --tokens 128 --profile 2>&1 | grep -v "^\s*$\|Writing model" | head -60
lap suite
left=$(( BUDGET - ($(date +%s) - t0) )); [ "$left" -lt 30 ] && left=30
timeout "$left" bash "$G/run" tests > "$OUT/suite.txt" 2>&1; echo "suite exit $?"
grep -E "^=== |FAILED|panicked" "$OUT/suite.txt" | grep -v "^=== " | tail -20
tail -1 "$OUT/suite.txt"
lap end
