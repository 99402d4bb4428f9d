// col_sums.cuh: the second stage of a deterministic column sum. A first kernel leaves one row of
// ACC partial sums per block row (part[split * cols + column], no atomics; launch shape
// src/cuda/launch.rs `cfg_col_sums`); fg_col_sums adds the `splits` rows of each column and rounds
// the total once to T. Used by the fused linear's bias gradient (linear.cu) and bias_gelu.cu.

#pragma once

#include "common.cuh"

// Any grid and block: threadIdx.x picks the column (grid-stride over column groups of blockDim.x),
// threadIdx.y the splits it adds (ty, ty + blockDim.y, ...); with blockDim.y > 1 the blockDim.y
// partial sums of a column meet in shared memory and are added in y order, so the result does not
// depend on timing. blockDim.x * blockDim.y <= 1024. A 1-D launch (blockDim.y == 1) is one thread
// per column adding every split in turn: 1024 loads a column for GPT-2's 768-wide bias, where
// the linear's 32 x 32 blocks (src/fused/linear/cuda.rs) take 32.
template <typename T>
static __device__ __forceinline__ void fg_col_sums(const typename FgAcc<T>::type* __restrict__ part, T* __restrict__ out,
                                                   fg_u64 splits, fg_u64 cols) {
  typedef typename FgAcc<T>::type A;
  __shared__ A sh[1024];
  const unsigned int tx = threadIdx.x, ty = threadIdx.y, nx = blockDim.x, ny = blockDim.y;
  if (ny == 1) {
    // The 1-D loop as it was (unit stride over s: ptxas keeps several loads in flight; with a
    // runtime stride it did not, and bias_gelu fwd+bwd went from 103 to 152 µs on an H200).
    FG_GRID_STRIDE(c, cols) {
      A acc = (A)0;
      for (fg_u64 s = 0; s < splits; ++s) acc += part[s * cols + c];
      out[c] = fg_from_acc<T>(acc);
    }
    return;
  }
  // c0 is uniform over the block, so every thread meets the barriers below equally often.
  for (fg_u64 c0 = (fg_u64)blockIdx.x * nx; c0 < cols; c0 += (fg_u64)gridDim.x * nx) {
    const fg_u64 c = c0 + tx;
    A acc = (A)0;
    if (c < cols)
      for (fg_u64 s = ty; s < splits; s += ny) acc += part[s * cols + c];
    __syncthreads();  // the previous column group's readers are done with sh
    sh[ty * nx + tx] = acc;
    __syncthreads();
    if (ty == 0 && c < cols) {
      A t = (A)0;
      for (unsigned int k = 0; k < ny; ++k) t += sh[k * nx + tx];
      out[c] = fg_from_acc<T>(t);
    }
  }
}
