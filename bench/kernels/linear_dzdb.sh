#!/usr/bin/env bash
# The fused linear's dz (+ db) kernels alone, bf16, at GPT-2's MLP widths (16384 rows x 3072, 4096,
# 768): the kernel as built under two launch shapes (8 blocks an SM; one wave at its occupancy),
# row-pipelined variants (R rows' loads first), and dz alone on two grids; GB/s over the bytes moved
# and the device's copy rate for reference. Run from the repository root on a GPU machine (needs
# nvcc): bash bench/kernels/linear_dzdb.sh
set -euo pipefail
nvcc -O3 -arch=sm_90 -std=c++17 -I crates/ferrograd-core/src/fused/linear -I crates/ferrograd-core/kernels/include \
  -DFG_MAX_DIMS=8 -DFG_LINEAR_DTYPE=3 -o /tmp/linear_dzdb bench/kernels/linear_dzdb.cu
/tmp/linear_dzdb
