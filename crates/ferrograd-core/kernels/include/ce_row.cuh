// ce_row.cuh: the row pass that cross entropy's kernels share (src/fused/cross_entropy/cross_entropy.cu
// and src/fused/classifier/classifier.cu): the online (max, sum of exp) pair, a 16-byte vector of it
// at a time, merged over the unit working on a row (a warp or the whole block); the row's
// log-sum-exp, re-summed against 0 when the max is not finite; the target's decoding and the loss.
// CPU twins: src/fused/cross_entropy/cpu.rs and src/fused/classifier/cpu.rs (each row in f64: the max
// first, then the sum; the results agree to rounding).

#pragma once

#include "online_softmax.cuh"

#if !defined(FG_CE_IGNORED)
#error "FG_CE_IGNORED comes from Rust (src/cuda/modules.rs, the CE_ROW header)"
#endif

// Add V elements to an online (m, s) pair: one max over them, at most one rescale, then V exps
// (fg_online_push per element may rescale at each). Same edge cases as fg_online_push: NaN is
// ignored by the max but makes s NaN; -inf adds nothing; +inf makes the max infinite (the caller's
// fg_ce_lse then re-sums the row).
template <typename A, int V>
static __device__ __forceinline__ void fg_online_push_vec(A& m, A& s, const A (&v)[V]) {
  A mv = v[0] > m ? v[0] : m;
#pragma unroll
  for (int i = 1; i < V; ++i) mv = v[i] > mv ? v[i] : mv;
  if (mv > m) {
    s *= fg_exp(m - mv);
    m = mv;
  }
#pragma unroll
  for (int i = 0; i < V; ++i) s += v[i] != -fg_inf<A>() ? fg_exp(v[i] - m) : (A)0;
}

// exp(a - b), with bl = b * log2(e) computed once by the caller. Float: one FFMA and the SFU's
// ex2.approx.ftz (2 ulp; a result below 2^-126 flushes to 0), where expf costs about four times
// the instructions: the fused classifier takes two exponentials per logit and is bound by them,
// not by memory, once its logits are read once. Double: exp.
static __device__ __forceinline__ float fg_exp_sub(float a, float, float bl) {
  float r;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(fmaf(a, 1.4426950408889634f, -bl)));
  return r;
}
static __device__ __forceinline__ double fg_exp_sub(double a, double b, double) { return exp(a - b); }
template <typename A>
static __device__ __forceinline__ A fg_log2e_times(A b) {
  return b * (A)1.4426950408889634;
}

// fg_online_push_vec with fg_exp_sub's exponentials: for the classifier's hot loop. A vector
// holding nothing above -inf adds nothing (a NaN in it still makes s NaN).
template <typename A, int V>
static __device__ __forceinline__ void fg_online_push_vec_fast(A& m, A& s, const A (&v)[V]) {
  A mv = m;
#pragma unroll
  for (int i = 0; i < V; ++i) mv = v[i] > mv ? v[i] : mv;
  if (mv == -fg_inf<A>()) {
#pragma unroll
    for (int i = 0; i < V; ++i) s = v[i] != v[i] ? v[i] : s;
    return;
  }
  if (mv > m) {
    s *= fg_exp_sub(m, mv, fg_log2e_times(mv));
    m = mv;
  }
  const A ml = fg_log2e_times(m);
#pragma unroll
  for (int i = 0; i < V; ++i) s += fg_exp_sub(v[i], m, ml);
}

// Merge every thread's (m, s) over its unit: the warp (xor shuffles), and for a block of several
// warps through shm / shs (32 A each; the first barrier keeps the previous row's readers safe).
// Every thread of the unit gets the row's pair.
template <typename A>
static __device__ __forceinline__ void fg_ce_unit_merge(A& m, A& s, bool block, A* shm, A* shs) {
  fg_online_warp_merge(m, s, FgGreater());
  const unsigned int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
  if (!block || nw <= 1) return;
  __syncthreads();
  if (lane == 0) {
    shm[warp] = m;
    shs[warp] = s;
  }
  __syncthreads();
  m = lane < nw ? shm[lane] : -fg_inf<A>();
  s = lane < nw ? shs[lane] : (A)0;
  fg_online_warp_merge(m, s, FgGreater());
}

// A row's log-sum-exp as mf + ls: mf = its max, or 0 when the max is not finite (all -inf, or +inf
// present), then ls = ln of the sum re-taken against 0 by `resum(mf)` (the unit's sum of
// exp(x - mf), called uniformly over the unit), as the CPU does.
template <typename A>
struct FgCeLse {
  A mf, ls;
  __device__ __forceinline__ A lse() const { return mf + ls; }
};

template <typename A, typename Resum>
static __device__ __forceinline__ FgCeLse<A> fg_ce_lse(A m, A s, Resum resum) {
  const bool finite = m > -fg_inf<A>() && m < fg_inf<A>();
  FgCeLse<A> l;
  l.mf = finite ? m : (A)0;
  l.ls = fg_log(finite ? s : resum(l.mf));
  return l;
}

// Whether an encoded target (a u32 class id, already checked on the device) counts in the loss.
static __device__ __forceinline__ bool fg_ce_kept(unsigned int c) { return c != FG_CE_IGNORED; }

// The target's logit of row xr (0 for an ignored row: its logit is never read).
template <typename T>
static __device__ __forceinline__ typename FgAcc<T>::type fg_ce_target_logit(const T* xr, unsigned int c) {
  typedef typename FgAcc<T>::type A;
  return fg_ce_kept(c) ? fg_to_acc(xr[c]) : (A)0;
}

// The row's loss, ln(s) - (x[t] - mf) (0 for an ignored row).
template <typename A>
static __device__ __forceinline__ A fg_ce_loss(unsigned int c, A xc, FgCeLse<A> l) {
  return fg_ce_kept(c) ? l.ls - (xc - l.mf) : (A)0;
}
