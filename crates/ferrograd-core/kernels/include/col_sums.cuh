// col_sums.cuh: the second stage of a deterministic column sum. A first kernel leaves one row of
// ACC partial sums per block row (part[split * cols + column], no atomics; launch shape
// src/cuda/launch.rs `cfg_col_sums`); fg_col_sums adds the `splits` rows of each column and rounds
// the total once to T. Used by the fused linear's bias gradient (linear.cu) and bias_gelu.cu.

#pragma once

#include "common.cuh"

template <typename T>
static __device__ __forceinline__ void fg_col_sums(const typename FgAcc<T>::type* __restrict__ part, T* __restrict__ out,
                                                   fg_u64 splits, fg_u64 cols) {
  typedef typename FgAcc<T>::type A;
  FG_GRID_STRIDE(c, cols) {
    A acc = (A)0;
    for (fg_u64 s = 0; s < splits; ++s) acc += part[s * cols + c];
    out[c] = fg_from_acc<T>(acc);
  }
}
