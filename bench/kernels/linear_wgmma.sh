#!/usr/bin/env bash
# A prototype of the fused linear's forward (GELU, pre-activation kept) as a Hopper GEMM of our own,
# timed beside cuBLASLt's GELU_AUX_BIAS and checked against it (bench/kernels/linear_wgmma.cu says
# why). Run from the repository root on a GPU machine with nvcc: bash bench/kernels/linear_wgmma.sh
set -euo pipefail
nvcc -O3 -gencode arch=compute_90a,code=sm_90a -std=c++17 -I crates/ferrograd-core/src/fused/attention -o /tmp/linear_wgmma \
  bench/kernels/linear_wgmma.cu -lcublasLt -lcuda
/tmp/linear_wgmma
