#!/usr/bin/env bash
# A prototype of the fused linear's input gradient with the GELU derivative folded into the GEMM's
# operand load, timed beside today's dz pass + cuBLASLt dx and checked against them
# (bench/kernels/linear_dgrad_wgmma.cu says why). Run from the repository root on a GPU machine with
# nvcc: bash bench/kernels/linear_dgrad_wgmma.sh [shape index; 3 = a small one for compute-sanitizer]
set -euo pipefail
nvcc -O3 -gencode arch=compute_90a,code=sm_90a -std=c++17 -I crates/ferrograd-core/src/fused/attention \
  -o /tmp/linear_dgrad_wgmma bench/kernels/linear_dgrad_wgmma.cu -lcublasLt -lcuda
/tmp/linear_dgrad_wgmma "$@"
