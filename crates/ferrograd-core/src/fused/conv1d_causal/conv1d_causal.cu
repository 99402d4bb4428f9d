// conv1d_causal.cu: the causal depthwise conv1d of Mamba (src/fused/conv1d_causal/), forward and
// backward. CPU twin (the reference): src/fused/conv1d_causal/cpu.rs; launches: cuda.rs there.
//
// x, y, dy, dx contiguous [rows = batch * channels, len]; w, dw [channels, k]; b, db [channels]
// (b may be null when has_bias is 0; db is then not written). Channel of row r: r % channels.
//   y[r, l]  = b[c] + sum_{j<k} w[c, j] x[r, l - (k-1) + j]          (x at negative steps is 0)
//   dx[r, l] = sum_{j<k, l+(k-1)-j < len} w[c, j] dy[r, l + (k-1) - j]
//   dw[c, j] = sum_{batch, l} dy[r, l] x[r, l - (k-1) + j],  db[c] = sum_{batch, l} dy[r, l]
// ACC (FgAcc<T>) is float for f32 / f16 / bf16 and double for f64; each output rounded once to T.
//
// conv1d_causal_fwd_{sfx}(const T* x, const T* w, const T* b, T* y, u64 rows, u32 channels, u32 len,
//     u32 k, u32 has_bias): grid-stride over the elements of y (cfg_1d).
// conv1d_causal_bwd_dx_{sfx}(const T* dy, const T* w, T* dx, u64 rows, u32 channels, u32 len, u32 k):
//     grid-stride over the elements of dx.
// conv1d_causal_bwd_dw_{sfx}(const T* dy, const T* x, T* dw, T* db, u32 batch, u32 channels, u32 len,
//     u32 k, u32 has_bias): grid-stride over channels, one block a channel (blockDim a multiple of 32);
//     thread t sums the (batch, step) pairs t, t + blockDim, ... (consecutive threads read
//     consecutive steps: coalesced), then one block reduction per tap: deterministic, no atomics.
//     k <= FG_CONV1D_MAX_K (from Rust, mod.rs MAX_CUDA_K: the per-thread sums live in registers).

#include "common.cuh"

#ifndef FG_CONV1D_MAX_K
#error "FG_CONV1D_MAX_K comes from Rust (src/fused/conv1d_causal/mod.rs MAX_CUDA_K)"
#endif

template <typename T>
static __device__ __forceinline__ void cc_fwd(const T* __restrict__ x, const T* __restrict__ w,
                                              const T* __restrict__ b, T* __restrict__ y, fg_u64 rows,
                                              unsigned int channels, unsigned int len, unsigned int k,
                                              unsigned int has_bias) {
  typedef typename FgAcc<T>::type A;
  FG_GRID_STRIDE(i, rows * len) {
    const fg_u64 r = i / len;
    const long long l = (long long)(i - r * len);
    const unsigned int c = (unsigned int)(r % channels);
    const T* xr = x + r * len;
    const T* wc = w + (fg_u64)c * k;
    A acc = has_bias ? fg_to_acc(b[c]) : (A)0;
    const long long first = l - (long long)(k - 1);
    for (unsigned int j = 0; j < k; ++j) {
      const long long s = first + j;
      if (s >= 0) acc += fg_to_acc(wc[j]) * fg_to_acc(xr[s]);
    }
    y[i] = fg_from_acc<T>(acc);
  }
}

template <typename T>
static __device__ __forceinline__ void cc_bwd_dx(const T* __restrict__ dy, const T* __restrict__ w,
                                                 T* __restrict__ dx, fg_u64 rows, unsigned int channels,
                                                 unsigned int len, unsigned int k) {
  typedef typename FgAcc<T>::type A;
  FG_GRID_STRIDE(i, rows * len) {
    const fg_u64 r = i / len;
    const fg_u64 l = i - r * len;
    const unsigned int c = (unsigned int)(r % channels);
    const T* gr = dy + r * len;
    const T* wc = w + (fg_u64)c * k;
    A acc = (A)0;
    for (unsigned int j = 0; j < k; ++j) {
      const fg_u64 s = l + (k - 1 - j);
      if (s < len) acc += fg_to_acc(wc[j]) * fg_to_acc(gr[s]);
    }
    dx[i] = fg_from_acc<T>(acc);
  }
}

template <typename T>
static __device__ __forceinline__ void cc_bwd_dw(const T* __restrict__ dy, const T* __restrict__ x,
                                                 T* __restrict__ dw, T* __restrict__ db, unsigned int batch,
                                                 unsigned int channels, unsigned int len, unsigned int k,
                                                 unsigned int has_bias) {
  typedef typename FgAcc<T>::type A;
  __shared__ A sh[32];
  const fg_u64 n = (fg_u64)batch * len;
  for (unsigned int c = blockIdx.x; c < channels; c += gridDim.x) {
    A acc[FG_CONV1D_MAX_K];
#pragma unroll
    for (int j = 0; j < FG_CONV1D_MAX_K; ++j) acc[j] = (A)0;
    A accb = (A)0;
    for (fg_u64 p = threadIdx.x; p < n; p += blockDim.x) {
      const fg_u64 bb = p / len;
      const long long l = (long long)(p - bb * len);
      const fg_u64 r = bb * channels + c;
      const A g = fg_to_acc(dy[r * len + l]);
      const T* xr = x + r * len;
      accb += g;
      const long long first = l - (long long)(k - 1);
#pragma unroll
      for (int j = 0; j < FG_CONV1D_MAX_K; ++j) {
        const long long s = first + j;
        if (j < (int)k && s >= 0) acc[j] += g * fg_to_acc(xr[s]);
      }
    }
#pragma unroll
    for (int j = 0; j < FG_CONV1D_MAX_K; ++j) {
      if (j < (int)k) {
        const A v = fg_block_reduce(acc[j], FgSum(), sh);
        if (threadIdx.x == 0) dw[(fg_u64)c * k + j] = fg_from_acc<T>(v);
      }
    }
    if (has_bias) {
      const A v = fg_block_reduce(accb, FgSum(), sh);
      if (threadIdx.x == 0) db[c] = fg_from_acc<T>(v);
    }
    __syncthreads();  // sh is free for the next channel
  }
}

#define FG_CONV1D_CAUSAL(SUF, T)                                                                             \
  FG_KERNEL conv1d_causal_fwd_##SUF(const T* x, const T* w, const T* b, T* y, fg_u64 rows,                   \
                                    unsigned int channels, unsigned int len, unsigned int k,                  \
                                    unsigned int has_bias) {                                                  \
    cc_fwd<T>(x, w, b, y, rows, channels, len, k, has_bias);                                                 \
  }                                                                                                           \
  FG_KERNEL conv1d_causal_bwd_dx_##SUF(const T* dy, const T* w, T* dx, fg_u64 rows, unsigned int channels,    \
                                       unsigned int len, unsigned int k) {                                    \
    cc_bwd_dx<T>(dy, w, dx, rows, channels, len, k);                                                         \
  }                                                                                                           \
  FG_KERNEL conv1d_causal_bwd_dw_##SUF(const T* dy, const T* x, T* dw, T* db, unsigned int batch,            \
                                       unsigned int channels, unsigned int len, unsigned int k,               \
                                       unsigned int has_bias) {                                               \
    cc_bwd_dw<T>(dy, x, dw, db, batch, channels, len, k, has_bias);                                          \
  }
FG_FOR_FLOAT(FG_CONV1D_CAUSAL)
