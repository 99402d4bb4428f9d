// online_softmax.cuh: one pass over a row keeping the running pair (max m, s = sum exp(x - m)),
// rescaled when m grows (one exp per element), and the merge of two pairs, s1 e^(m1-M) + s2 e^(m2-M).
// Used by softmax's any-row path (src/fused/softmax/softmax.cu) and cross entropy's forward
// (src/fused/cross_entropy/cross_entropy.cu).
// CPU twins: src/fused/softmax/cpu.rs and src/fused/cross_entropy/cpu.rs, which take the max first
// and then the sum (in f64; the results agree to rounding).

#pragma once

#include "acc_math.cuh"

// Add one element to an online (m, s) pair. NaN is ignored by the max (`v > m` is false), as
// f64::max does, but it makes s NaN, as on the CPU; -inf adds nothing.
template <typename A>
static __device__ __forceinline__ void fg_online_push(A& m, A& s, A v) {
  if (v > m) {
    s = s * fg_exp(m - v) + (A)1;
    m = v;
  } else if (v != -fg_inf<A>()) {
    s += fg_exp(v - m);
  }
}

// The larger of two maxima that are never NaN (fg_online_push never stores one): `a > b ? a : b`.
struct FgGreater {
  template <typename A> __device__ __forceinline__ A operator()(A a, A b) const { return a > b ? a : b; }
};

// Merge (m2, s2) into (m, s). `Max` picks the larger maximum: with no NaN possible, FgFMax (fmax)
// and FgGreater give the same value and differ only in the instructions ptxas emits (fmax is one
// instruction for float, several for double); each kernel keeps the one it was measured with
// (softmax.cu: FgFMax, cross_entropy.cu: FgGreater).
template <typename A, typename Max>
static __device__ __forceinline__ void fg_online_merge(A& m, A& s, A m2, A s2, Max max) {
  const A M = max(m, m2);
  const A f1 = m == M ? (A)1 : fg_exp(m - M);
  const A f2 = m2 == M ? (A)1 : fg_exp(m2 - M);
  s = s * f1 + s2 * f2;
  m = M;
}

// Merge (m, s) over the 32 lanes of a warp; every lane gets the same result (each step is symmetric).
template <typename A, typename Max>
static __device__ __forceinline__ void fg_online_warp_merge(A& m, A& s, Max max) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    const A m2 = __shfl_xor_sync(0xffffffffu, m, o), s2 = __shfl_xor_sync(0xffffffffu, s, o);
    fg_online_merge(m, s, m2, s2, max);
  }
}
