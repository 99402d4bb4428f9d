// mse_loss.cu: mean((pred - target)^2) and its backward (src/fused/mse_loss/).
// CPU twin: src/fused/mse_loss/cpu.rs (d = pred - target and d * d rounded to T, as the composite
// sub and sqr round them; summed, divided by n, rounded once).
//
// mse_part_{dt}(const T* p, const T* t, ACC* part, u64 n)
//   p, t contiguous [n]; block b grid-strides over the elements and writes the sum of its squared
//   differences (in ACC) to part[b]. Any grid, blockDim a multiple of 32 up to 1024.
// mse_final_{dt}(const ACC* part, T* y, u64 parts, u64 n)
//   one block: y[0] = (the sum of part[0..parts) in a fixed order) / n, rounded to T.
// mse_bwd_{dt}(const T* g, const T* p, const T* t, T* dp, T* dt, u64 n, double scale)
//   dp[i] = g[0] * scale * (p[i] - t[i]) (scale = 2 / n; the difference rounded to T), in ACC,
//   rounded once; dt[i] = -dp[i] when dt is not null. g is one element on the device (the graph
//   replays it as written).

#include "common.cuh"

template <typename T>
static __device__ __forceinline__ typename FgAcc<T>::type mse_diff(T p, T t) {
  return fg_to_acc(fg_from_acc<T>(fg_to_acc(p) - fg_to_acc(t)));
}

template <typename T>
static __device__ __forceinline__ void mse_part(const T* __restrict__ p, const T* __restrict__ t,
                                                typename FgAcc<T>::type* __restrict__ part, fg_u64 n) {
  typedef typename FgAcc<T>::type A;
  __shared__ A sh[32];
  A acc = (A)0;
  fg_unrolled(n, [&](fg_u64 i) { return FgPack<T, 2>{{p[i], t[i]}}; }, [&](fg_u64, const FgPack<T, 2>& v) {
    const A d = mse_diff(v.v[0], v.v[1]);
    acc += fg_to_acc(fg_from_acc<T>(d * d));
  });
  acc = fg_block_reduce(acc, FgSum(), sh);
  if (threadIdx.x == 0) part[blockIdx.x] = acc;
}

template <typename T>
static __device__ __forceinline__ void mse_final(const typename FgAcc<T>::type* __restrict__ part, T* __restrict__ y,
                                                 fg_u64 parts, fg_u64 n) {
  typedef typename FgAcc<T>::type A;
  __shared__ A sh[32];
  A acc = (A)0;
  for (fg_u64 i = threadIdx.x; i < parts; i += blockDim.x) acc += part[i];
  acc = fg_block_reduce(acc, FgSum(), sh);
  if (threadIdx.x == 0) y[0] = fg_from_acc<T>((A)((double)acc / (double)n));
}

template <typename T>
static __device__ __forceinline__ void mse_bwd(const T* __restrict__ g, const T* __restrict__ p,
                                               const T* __restrict__ t, T* __restrict__ dp, T* __restrict__ dt,
                                               fg_u64 n, double scale) {
  typedef typename FgAcc<T>::type A;
  const A s = fg_to_acc(g[0]) * (A)scale;
  FG_GRID_STRIDE(i, n) {
    const T v = fg_from_acc<T>(s * mse_diff(p[i], t[i]));
    dp[i] = v;
    if (dt) dt[i] = fg_from_acc<T>(-fg_to_acc(v));
  }
}

#define FG_MSE(SUF, T)                                                                                     \
  FG_KERNEL mse_part_##SUF(const T* p, const T* t, FgAcc<T>::type* part, fg_u64 n) { mse_part<T>(p, t, part, n); } \
  FG_KERNEL mse_final_##SUF(const FgAcc<T>::type* part, T* y, fg_u64 parts, fg_u64 n) {                   \
    mse_final<T>(part, y, parts, n);                                                                       \
  }                                                                                                        \
  FG_KERNEL mse_bwd_##SUF(const T* g, const T* p, const T* t, T* dp, T* dt, fg_u64 n, double scale) {      \
    mse_bwd<T>(g, p, t, dp, dt, n, scale);                                                                 \
  }
FG_FOR_FLOAT(FG_MSE)
