#!/usr/bin/env bash
# The sm_90a (wgmma) attention kernels against the mma.sync ones, head dims 64 and 128, bf16:
# outputs compared, both timed (bench/kernels/attention_wgmma.cu). Run from the repository root on
# a Hopper GPU machine (needs nvcc): bash bench/kernels/attention_wgmma.sh
# EXTRA="-D..." passes a define (e.g. -DFG_WG_FWD_BKV=128 for another tile) to both builds.
# VARIANTS="name:d:-DX=1,-DY=2 other:128:" builds each variant (name, head dim, comma-separated
# defines) in parallel and prints one line per timed size: the way to compare several changes of
# the kernels in one device call (the 2026-11-24 sessions' experiments ran through it).
set -uo pipefail
A=${ATTN_DIR:-crates/ferrograd-core/src/fused/attention}  # ATTN_DIR: a scratch copy to try a change
build() {  # build NAME D [defines...]
  local name=$1 d=$2
  shift 2
  nvcc -O3 -gencode arch=compute_90a,code=sm_90a -std=c++17 -I "$A" -I crates/ferrograd-core/kernels/include -DFG_MAX_DIMS=8 -DFG_ATTN_WG_FORCE ${EXTRA:-} \
    "$@" -DFG_ATTN_D="$d" -DFG_ATTN_DTYPE=0 -o "/tmp/attention_wgmma_$name" bench/kernels/attention_wgmma.cu -lcuda
}
rc=0
if [ -n "${VARIANTS:-}" ]; then
  for v in $VARIANTS; do
    IFS=: read -r name d defs <<< "$v"
    # shellcheck disable=SC2086  # the defines split on commas on purpose
    build "$name" "$d" ${defs//,/ } > "/tmp/attention_wgmma_$name.build" 2>&1 &
  done
  wait
  for v in $VARIANTS; do
    name=${v%%:*}
    if [ ! -x "/tmp/attention_wgmma_$name" ]; then echo "== $name: build failed"; head -20 "/tmp/attention_wgmma_$name.build"; rc=2; continue; fi
    echo "== $name"
    "/tmp/attention_wgmma_$name" > "/tmp/attention_wgmma_$name.out" 2>&1 || rc=1
    grep -E "FAIL|NaN" "/tmp/attention_wgmma_$name.out" | head -5
    grep -E "^B=4|TIME wgmma" "/tmp/attention_wgmma_$name.out" | paste - - | sed 's/TFLOP\/s/TF/g; s/  */ /g; s/TIME wgmma //'
  done
  exit $rc
fi
for d in ${HEAD_DIMS:-64 128}; do
  rm -f "/tmp/attention_wgmma_d$d"
  build "d$d" "$d" || exit 2
  "/tmp/attention_wgmma_d$d" || rc=1
done
exit $rc
