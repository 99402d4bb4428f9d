// layer_norm_bwd.cu: layer norm's backward (the forward: layer_norm.cu, whose header comment gives
// the kernel families, dtypes and the CPU twins: src/fused/layer_norm/cpu.rs `layer_norm_backward`,
// dxhat = dy * w; dx = rstd * (dxhat - mean(dxhat) - xhat * mean(dxhat * xhat)) + dres;
// dw = sum_r dy * xhat, db = sum_r dy).
//
// dres (nullable) is a gradient of x from elsewhere, x's dtype, contiguous: the pending gradient the
// autograd walk folds into layer norm's (src/fused/mod.rs `FusedOp::folds_pending`; in a pre-LN
// transformer, the residual stream's gradient from the next block's residual add), added in the
// accumulation dtype as dx is stored, so that no separate pass reads both and writes their sum.
// The add is fg_ln_add_rn's: never fused with the multiply before it, so that for f32 and f64 dx
// is the rounded layer norm gradient plus dres, rounded, as the separate add gave.

#include "vec_load.cuh"

// ---------------------------------------------------------------------------------------------
// layer_norm_bwd_{dt}(const T* x, const T* w, const ACC* mean, const ACC* rstd, const T* dy,
//                    const T* dres, T* dx, ACC* dw, ACC* db, u64 rows, u64 cols, int has_w)
// dw / db are zeroed ACC buffers of length cols, accumulated with atomicAdd; dres may be null.
//
// Per thread, the first K column slots (j = threadIdx.x + k * blockDim.x, k < K) keep x-hat and
// dxhat in registers between the two passes, and accumulate dw / db in registers across all the
// rows the block handles; one atomicAdd per column per block flushes them at the end. Columns past
// K * blockDim.x (rows longer than the launch shape expects) are re-read and added atomically per
// row. To make the register accumulation pay, the kernel runs at most ~1024 threads' worth of
// blocks per SM (the grid the Rust side launches is one block per row): surplus blocks exit at
// once and the rest stride over the rows, which divides the number of atomics by the rows each
// block handles. The dynamic shared memory the launch passes is not needed here.
// ---------------------------------------------------------------------------------------------

static __device__ __forceinline__ float fg_ln_add_rn(float a, float b) { return __fadd_rn(a, b); }
static __device__ __forceinline__ double fg_ln_add_rn(double a, double b) { return __dadd_rn(a, b); }

__device__ __forceinline__ unsigned int fg_nsmid() {
  unsigned int r;
  asm("mov.u32 %0, %%nsmid;" : "=r"(r));
  return r;
}

template <typename T, typename G>
static __device__ __forceinline__ void fg_layer_norm_bwd(const T* __restrict__ x, const T* __restrict__ w,
                                                        const typename FgAcc<T>::type* __restrict__ mean,
                                                        const typename FgAcc<T>::type* __restrict__ rstd,
                                                        const G* __restrict__ dy, const T* __restrict__ dres,
                                                        T* __restrict__ dx, typename FgAcc<T>::type* __restrict__ dw,
                                                        typename FgAcc<T>::type* __restrict__ db, fg_u64 rows,
                                                        fg_u64 cols, int has_w) {
  typedef typename FgAcc<T>::type A;
  constexpr int K = 32 / sizeof(A);  // 8 slots for float, 4 for double
  __shared__ A sh[64];
  const unsigned int bs = blockDim.x;
  unsigned int per_sm = 1024 / bs;
  if (per_sm == 0) per_sm = 1;
  const unsigned int cap = fg_nsmid() * per_sm;
  const unsigned int nblocks = gridDim.x < cap ? gridDim.x : cap;
  if (blockIdx.x >= nblocks) return;  // whole block: no barrier is skipped by part of a block

  A dwr[K], dbr[K];
#pragma unroll
  for (int k = 0; k < K; ++k) {
    dwr[k] = (A)0;
    dbr[k] = (A)0;
  }
  const fg_u64 kcols = (fg_u64)K * bs;

  for (fg_u64 r = blockIdx.x; r < rows; r += nblocks) {
    const T* xr = x + r * cols;
    const G* gr = dy + r * cols;
    const T* rr = dres != nullptr ? dres + r * cols : nullptr;
    T* dxr = dx + r * cols;
    const A mu = mean[r], rs = rstd[r];
    A s1 = (A)0, s2 = (A)0;
    A hk[K], dk[K];
#pragma unroll
    for (int k = 0; k < K; ++k) {
      const fg_u64 j = threadIdx.x + (fg_u64)k * bs;
      hk[k] = (A)0;
      dk[k] = (A)0;
      if (j < cols) {
        const A g = fg_to_acc(gr[j]);
        const A h = (fg_to_acc(xr[j]) - mu) * rs;
        const A d = has_w ? g * fg_to_acc(w[j]) : g;
        hk[k] = h;
        dk[k] = d;
        s1 += d;
        s2 += d * h;
        dwr[k] += g * h;
        dbr[k] += g;
      }
    }
    for (fg_u64 j = threadIdx.x + kcols; j < cols; j += bs) {
      const A g = fg_to_acc(gr[j]);
      const A h = (fg_to_acc(xr[j]) - mu) * rs;
      const A d = has_w ? g * fg_to_acc(w[j]) : g;
      s1 += d;
      s2 += d * h;
      atomicAdd(dw + j, g * h);
      atomicAdd(db + j, g);
    }
    fg_block_sum2(s1, s2, sh);
    const A m1 = s1 / (A)cols, m2 = s2 / (A)cols;
#pragma unroll
    for (int k = 0; k < K; ++k) {
      const fg_u64 j = threadIdx.x + (fg_u64)k * bs;
      if (j < cols) {
        A v = rs * (dk[k] - m1 - hk[k] * m2);
        if (rr != nullptr) v = fg_ln_add_rn(v, fg_to_acc(rr[j]));
        dxr[j] = fg_from_acc<T>(v);
      }
    }
    for (fg_u64 j = threadIdx.x + kcols; j < cols; j += bs) {
      const A g = fg_to_acc(gr[j]);
      const A h = (fg_to_acc(xr[j]) - mu) * rs;
      const A d = has_w ? g * fg_to_acc(w[j]) : g;
      A v = rs * (d - m1 - h * m2);
      if (rr != nullptr) v = fg_ln_add_rn(v, fg_to_acc(rr[j]));
      dxr[j] = fg_from_acc<T>(v);
    }
  }

#pragma unroll
  for (int k = 0; k < K; ++k) {
    const fg_u64 j = threadIdx.x + (fg_u64)k * bs;
    if (j < cols) {
      atomicAdd(dw + j, dwr[k]);
      atomicAdd(db + j, dbr[k]);
    }
  }
}

// G: dy's dtype (T, or bf16 for an f32 x: the gradient arriving from a bf16 GEMM).
#define FG_LN_BWD2(SUF, T, G)                                                                          \
  FG_KERNEL layer_norm_bwd_##SUF(const T* x, const T* w, const FgAcc<T>::type* mean,                      \
                                const FgAcc<T>::type* rstd, const G* dy, const T* dres, T* dx,            \
                                FgAcc<T>::type* dw, FgAcc<T>::type* db, fg_u64 rows, fg_u64 cols,         \
                                int has_w) {                                                            \
    fg_layer_norm_bwd<T, G>(x, w, mean, rstd, dy, dres, dx, dw, db, rows, cols, has_w);                 \
  }
#define FG_LN_BWD(SUF, T) FG_LN_BWD2(SUF, T, T)
FG_FOR_FLOAT(FG_LN_BWD)
FG_LN_BWD2(f32_bf16, float, __nv_bfloat16)

// ---------------------------------------------------------------------------------------------
// layer_norm_bwd_rows_{f32,f32_bf16}(the arguments of layer_norm_bwd_*, x f32, dy f32 or bf16):
// rows that fit a warp's registers. The Rust side (src/fused/layer_norm/cuda.rs) launches it only
// when x, dy, dres, dx and w are 16-byte aligned, cols is a multiple of 4 and at most 32 * 4 *
// FG_LN_BWD_N, with FG_LN_BWD_THREADS threads a block, 2 * cols floats of dynamic shared memory
// and no more blocks than are resident at once (the warps stride over the rows).
// A warp per row, lane l on the 4-column groups l, l + 32, ...: x (16 bytes) and dy (16 or 8 bytes)
// read once and kept in registers between the two passes, the row's two sums by shuffles (no
// barrier per row: layer_norm_bwd_* spends a block and two barriers on each row); dres, where given,
// read 16 bytes at a time as dx is stored; dweight / dbias
// in registers across the warp's rows, summed over the block's warps in shared memory, then one
// atomicAdd per column per block.
// ---------------------------------------------------------------------------------------------

#define FG_LN_BWD_N 8
#define FG_LN_BWD_THREADS 128

template <typename G>
static __device__ __forceinline__ void fg_layer_norm_bwd_warp(const float* __restrict__ x,
                                                             const float* __restrict__ w,
                                                             const float* __restrict__ mean,
                                                             const float* __restrict__ rstd,
                                                             const G* __restrict__ dy,
                                                             const float* __restrict__ dres, float* __restrict__ dx,
                                                             float* __restrict__ dw, float* __restrict__ db,
                                                             fg_u64 rows, fg_u64 cols64, int has_w) {
  constexpr int V = 4, N = FG_LN_BWD_N;
  const unsigned int cols = (unsigned int)cols64;
  float* sdw = reinterpret_cast<float*>(fg_smem);
  float* sdb = sdw + cols;
  for (unsigned int j = threadIdx.x; j < 2 * cols; j += blockDim.x) sdw[j] = 0.0f;
  const unsigned int lane = threadIdx.x & 31u, nw = blockDim.x >> 5;
  const unsigned int nvec = cols / V;
  // This lane's groups are i = lane + 32 k for k < nk.
  const unsigned int nk = lane < nvec ? (nvec - lane - 1) / 32 + 1 : 0;
  float dwr[N][V], dbr[N][V];
#pragma unroll
  for (int k = 0; k < N; ++k) {
#pragma unroll
    for (int e = 0; e < V; ++e) {
      dwr[k][e] = 0.0f;
      dbr[k][e] = 0.0f;
    }
  }
  const float n = (float)cols;
  const fg_u64 step = (fg_u64)gridDim.x * nw;
  for (fg_u64 r = (fg_u64)blockIdx.x * nw + (threadIdx.x >> 5); r < rows; r += step) {
    const float* xr = x + r * cols + lane * V;
    const G* gr = dy + r * cols + lane * V;
    const float* rr = dres != nullptr ? dres + r * cols + lane * V : nullptr;
    float* dxr = dx + r * cols + lane * V;
    float h[N][V], d[N][V];
#pragma unroll
    for (int k = 0; k < N; ++k) {
      if (k < nk) {
        fg_row_ldcs<float, V>(xr + 32 * k * V, h[k]);
        if constexpr (sizeof(G) * V == 16) fg_row_ldcs<G, V>(gr + 32 * k * V, d[k]);
        else fg_row_ld<G, V>(gr + 32 * k * V, d[k]);
      }
    }
    const float mu = mean[r], rs = rstd[r];
    float s1 = 0.0f, s2 = 0.0f;
#pragma unroll
    for (int k = 0; k < N; ++k) {
      if (k < nk) {
        float wv[V];
        if (has_w) fg_row_ld<float, V>(w + (lane + 32 * k) * V, wv);
#pragma unroll
        for (int e = 0; e < V; ++e) {
          const float xh = (h[k][e] - mu) * rs, g = d[k][e];
          const float dd = has_w ? g * wv[e] : g;
          dwr[k][e] += g * xh;
          dbr[k][e] += g;
          h[k][e] = xh;
          d[k][e] = dd;
          s1 += dd;
          s2 += dd * xh;
        }
      }
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
      s1 += __shfl_xor_sync(0xffffffffu, s1, o);
      s2 += __shfl_xor_sync(0xffffffffu, s2, o);
    }
    const float m1 = s1 / n, m2 = s2 / n;
#pragma unroll
    for (int k = 0; k < N; ++k) {
      if (k < nk) {
        float o[V];
#pragma unroll
        for (int e = 0; e < V; ++e) o[e] = rs * (d[k][e] - m1 - h[k][e] * m2);
        if (rr != nullptr) {
          float q[V];
          fg_row_ldcs<float, V>(rr + 32 * k * V, q);
#pragma unroll
          for (int e = 0; e < V; ++e) o[e] = fg_ln_add_rn(o[e], q[e]);
        }
        fg_row_stcs<float, V>(dxr + 32 * k * V, o);
      }
    }
  }
  __syncthreads();  // sdw / sdb zeroed by every thread
#pragma unroll
  for (int k = 0; k < N; ++k) {
    if (k < nk) {
#pragma unroll
      for (int e = 0; e < V; ++e) {
        const unsigned int j = (lane + 32 * k) * V + e;
        atomicAdd(sdw + j, dwr[k][e]);
        atomicAdd(sdb + j, dbr[k][e]);
      }
    }
  }
  __syncthreads();
  for (unsigned int j = threadIdx.x; j < cols; j += blockDim.x) {
    atomicAdd(dw + j, sdw[j]);
    atomicAdd(db + j, sdb[j]);
  }
}

#define FG_LN_BWD_ROWS(SUF, G)                                                                            \
  extern "C" __global__ void __launch_bounds__(FG_LN_BWD_THREADS)                                        \
      layer_norm_bwd_rows_##SUF(const float* x, const float* w, const float* mean, const float* rstd,   \
                                const G* dy, const float* dres, float* dx, float* dw, float* db,        \
                                fg_u64 rows, fg_u64 cols, int has_w) {                                  \
    fg_layer_norm_bwd_warp<G>(x, w, mean, rstd, dy, dres, dx, dw, db, rows, cols, has_w);                 \
  }
FG_LN_BWD_ROWS(f32, float)
FG_LN_BWD_ROWS(f32_bf16, __nv_bfloat16)
