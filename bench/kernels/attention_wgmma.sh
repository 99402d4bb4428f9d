#!/usr/bin/env bash
# The sm_90a (wgmma) attention kernels against the mma.sync ones, head dims 64 and 128, bf16:
# outputs compared, both timed (bench/kernels/attention_wgmma.cu). Run from the repository root on
# a Hopper GPU machine (needs nvcc): bash bench/kernels/attention_wgmma.sh
# EXTRA="-D..." passes a define (e.g. -DFG_WG_FWD_BKV=128 for another tile) to both builds.
set -uo pipefail
A=${ATTN_DIR:-crates/ferrograd-core/src/fused/attention}  # ATTN_DIR: a scratch copy to try a change
rc=0
for d in ${HEAD_DIMS:-64 128}; do
  nvcc -O3 -gencode arch=compute_90a,code=sm_90a -std=c++17 -I "$A" -I crates/ferrograd-core/kernels/include -DFG_MAX_DIMS=8 -DFG_ATTN_WG_FORCE ${EXTRA:-} \
    -DFG_ATTN_D="$d" -DFG_ATTN_DTYPE=0 -o "/tmp/attention_wgmma_d$d" bench/kernels/attention_wgmma.cu || exit 2
  "/tmp/attention_wgmma_d$d" || rc=1
done
exit $rc
