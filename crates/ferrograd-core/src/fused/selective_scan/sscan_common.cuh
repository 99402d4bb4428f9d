// sscan_common.cuh: what the selective-scan kernels share (selective_scan.cu documents the entry
// points; sscan_fwd.cuh is the forward): the parameter block, the warp scans of the recurrence's
// (a, b) pairs, and each thread's direct access to its K consecutive steps of a row.

#pragma once

#include "common.cuh"

#ifndef FG_SSCAN_MAX_STATE
#error "FG_SSCAN_MAX_STATE comes from Rust (src/fused/selective_scan/mod.rs MAX_CUDA_STATE)"
#endif
#define FG_SSCAN_LOG2E 1.4426950408889634f
#define FG_SSCAN_FULL 0xffffffffu

struct FgScanParams {
  unsigned int batch, dim, len, state, groups, dim_per_group, chunks, has_d, has_z, has_bias, softplus, pad;
};

// 2^x on the special-function unit: ex2.approx.ftz (2 ulp; a result below 2^-126 flushes to 0).
// exp2f is the same instruction wrapped in a denormal fix-up of about four more; the scan takes
// one exponential per (channel, step, state) and is bound by them (as is src/fused/classifier).
static __device__ __forceinline__ float fg_sscan_ex2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// softplus (PyTorch's, threshold 20) and the logistic function, exponentials on the SFU. log1pf
// stays accurate: log(1 + e) with a rounded 1 + e loses e's relative precision when e is small.
static __device__ __forceinline__ float fg_sscan_softplus_fast(float x) {
  return x <= 20.f ? log1pf(fg_sscan_ex2(x * FG_SSCAN_LOG2E)) : x;
}
static __device__ __forceinline__ float fg_sscan_sigmoid_fast(float x) {
  return __fdividef(1.f, 1.f + fg_sscan_ex2(-x * FG_SSCAN_LOG2E));
}

// Inclusive scan over the lanes of a warp of the maps x -> a x + b, lane order (earlier lanes
// applied first).
static __device__ __forceinline__ void fg_sscan_warp_fwd(float& a, float& b, int lane) {
#pragma unroll
  for (int off = 1; off < 32; off <<= 1) {
    const float pa = __shfl_up_sync(FG_SSCAN_FULL, a, off), pb = __shfl_up_sync(FG_SSCAN_FULL, b, off);
    if (lane >= off) {
      b = a * pb + b;
      a = a * pa;
    }
  }
}

// The same in reverse lane order (later lanes applied first).
static __device__ __forceinline__ void fg_sscan_warp_rev(float& a, float& b, int lane) {
#pragma unroll
  for (int off = 1; off < 32; off <<= 1) {
    const float pa = __shfl_down_sync(FG_SSCAN_FULL, a, off), pb = __shfl_down_sync(FG_SSCAN_FULL, b, off);
    if (lane + off < 32) {
      b = a * pb + b;
      a = a * pa;
    }
  }
}

static __device__ __forceinline__ float fg_sscan_warp_sum(float v) {
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) v += __shfl_xor_sync(FG_SSCAN_FULL, v, off);
  return v;
}

// ---------------------------------------------------------------------------------------------
// A thread's K consecutive steps of a row, straight between global memory and registers (no
// shared-memory tile, no barrier): 16-byte vectors (8-byte for 4 bf16) when all K steps are in
// the sequence and the address is aligned, else element by element with zeros past the end. A
// warp's vector loads cover one contiguous span; the L1 cache serves the sectors that the first
// of a thread's vectors brings for the next. bf16 stays packed (two a word) until it is used, so
// the bf16 path moves half the bytes and holds half the registers.
// ---------------------------------------------------------------------------------------------

template <typename T, int K>
struct FgSscanRow {
  static constexpr int W = K * (int)sizeof(T) / 4;  // 32-bit words
  static constexpr int VB = W % 4 == 0 ? 16 : 8;    // bytes a vector access
  static_assert(W % 2 == 0, "K * sizeof(T) is a multiple of 8");
  unsigned int w[W];
};

// Step i (a compile-time index after unrolling) widened to f32: a bf16 is the high half of an f32.
template <int K>
static __device__ __forceinline__ float fg_sscan_at(const FgSscanRow<float, K>& r, int i) {
  return __uint_as_float(r.w[i]);
}
template <int K>
static __device__ __forceinline__ float fg_sscan_at(const FgSscanRow<__nv_bfloat16, K>& r, int i) {
  return __uint_as_float((i & 1) ? (r.w[i >> 1] & 0xffff0000u) : (r.w[i >> 1] << 16));
}

static __device__ __forceinline__ unsigned int fg_sscan_bits(float x) { return __float_as_uint(x); }
static __device__ __forceinline__ unsigned int fg_sscan_bits(__nv_bfloat16 x) { return __bfloat16_as_ushort(x); }

// Steps [0, K) at p, of which the first `rem` (any int) are in the sequence; zero past them.
template <typename T, int K>
static __device__ __forceinline__ void fg_sscan_ld(const T* __restrict__ p, int rem, FgSscanRow<T, K>& r) {
  using R = FgSscanRow<T, K>;
  if (rem >= K && (reinterpret_cast<size_t>(p) & (R::VB - 1)) == 0) {
    if constexpr (R::VB == 16) {
#pragma unroll
      for (int j = 0; j < R::W / 4; ++j) {
        const uint4 v = reinterpret_cast<const uint4*>(p)[j];
        r.w[4 * j] = v.x;
        r.w[4 * j + 1] = v.y;
        r.w[4 * j + 2] = v.z;
        r.w[4 * j + 3] = v.w;
      }
    } else {
#pragma unroll
      for (int j = 0; j < R::W / 2; ++j) {
        const uint2 v = reinterpret_cast<const uint2*>(p)[j];
        r.w[2 * j] = v.x;
        r.w[2 * j + 1] = v.y;
      }
    }
  } else {
    constexpr int PER = 4 / (int)sizeof(T);  // elements a word
#pragma unroll
    for (int j = 0; j < R::W; ++j) {
      unsigned int w = 0;
#pragma unroll
      for (int e = 0; e < PER; ++e)
        if (j * PER + e < rem) w |= fg_sscan_bits(p[j * PER + e]) << (32 / PER * e);
      r.w[j] = w;
    }
  }
}

// The same widened to f32.
template <typename T, int K>
static __device__ __forceinline__ void fg_sscan_ldf(const T* __restrict__ p, int rem, float (&v)[K]) {
  FgSscanRow<T, K> r;
  fg_sscan_ld<T, K>(p, rem, r);
#pragma unroll
  for (int i = 0; i < K; ++i) v[i] = fg_sscan_at<K>(r, i);
}

// v[0, K) to p, the first `rem` steps only (rounded to nearest for bf16).
template <typename T, int K>
static __device__ __forceinline__ void fg_sscan_st(T* __restrict__ p, int rem, const float (&v)[K]) {
  using R = FgSscanRow<T, K>;
  if (rem >= K && (reinterpret_cast<size_t>(p) & (R::VB - 1)) == 0) {
    R r;
    if constexpr (sizeof(T) == 4) {
#pragma unroll
      for (int i = 0; i < K; ++i) r.w[i] = __float_as_uint(v[i]);
    } else {
#pragma unroll
      for (int j = 0; j < R::W; ++j)
        r.w[j] = (unsigned int)__bfloat16_as_ushort(__float2bfloat16_rn(v[2 * j])) |
                 ((unsigned int)__bfloat16_as_ushort(__float2bfloat16_rn(v[2 * j + 1])) << 16);
    }
    if constexpr (R::VB == 16) {
#pragma unroll
      for (int j = 0; j < R::W / 4; ++j)
        reinterpret_cast<uint4*>(p)[j] = make_uint4(r.w[4 * j], r.w[4 * j + 1], r.w[4 * j + 2], r.w[4 * j + 3]);
    } else {
#pragma unroll
      for (int j = 0; j < R::W / 2; ++j) reinterpret_cast<uint2*>(p)[j] = make_uint2(r.w[2 * j], r.w[2 * j + 1]);
    }
  } else {
#pragma unroll
    for (int i = 0; i < K; ++i)
      if (i < rem) p[i] = fg_from_acc<T>(v[i]);
  }
}
