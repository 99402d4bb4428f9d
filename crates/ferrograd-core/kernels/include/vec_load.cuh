// vec_load.cuh: 16-byte row accesses of V elements, widened to / narrowed from ACC. Used by the
// row-in-registers kernels (src/fused/softmax/softmax.cu, src/fused/layer_norm/layer_norm.cu).
// CPU twin: none needed (a load and a store; the conversions are common.cuh's fg_to_acc /
// fg_from_acc).

#pragma once

#include "common.cuh"

// V consecutive elements of T at p (aligned to V * sizeof(T) bytes) widened to ACC.
template <typename T, int V>
static __device__ __forceinline__ void fg_row_ld(const T* __restrict__ p, typename FgAcc<T>::type (&o)[V]) {
  const FgPack<T, V> q = *reinterpret_cast<const FgPack<T, V>*>(p);
#pragma unroll
  for (int i = 0; i < V; ++i) o[i] = fg_to_acc(q.v[i]);
}

template <typename T, int V>
static __device__ __forceinline__ void fg_row_st(T* __restrict__ p, const typename FgAcc<T>::type (&a)[V]) {
  FgPack<T, V> q;
#pragma unroll
  for (int i = 0; i < V; ++i) q.v[i] = fg_from_acc<T>(a[i]);
  *reinterpret_cast<FgPack<T, V>*>(p) = q;
}

// The same with cache-streaming hints (evict first): for data touched once, so that what is reused
// (layer norm's w and b) stays cached. 16-byte accesses only.
template <typename T, int V>
static __device__ __forceinline__ void fg_row_ldcs(const T* __restrict__ p, typename FgAcc<T>::type (&o)[V]) {
  static_assert(sizeof(T) * V == 16, "16-byte accesses only");
  const uint4 b = __ldcs(reinterpret_cast<const uint4*>(p));
  FgPack<T, V> q;
  memcpy(&q, &b, 16);
#pragma unroll
  for (int i = 0; i < V; ++i) o[i] = fg_to_acc(q.v[i]);
}

template <typename T, int V>
static __device__ __forceinline__ void fg_row_stcs(T* __restrict__ p, const typename FgAcc<T>::type (&a)[V]) {
  FgPack<T, V> q;
#pragma unroll
  for (int i = 0; i < V; ++i) q.v[i] = fg_from_acc<T>(a[i]);
  uint4 b;
  memcpy(&b, &q, 16);
  __stcs(reinterpret_cast<uint4*>(p), b);
}

// Where this thread's rows are: a group of `g` threads per row (within a warp, or the whole block),
