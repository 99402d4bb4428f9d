// layer_norm.cu: layer norm over the last dim, the forward (the backward: layer_norm_bwd.cu, a module
// of its own so that the two compile in parallel).
// CPU twins: src/fused/layer_norm/cpu.rs `layer_norm` (mean, biased variance by a second pass over the row,
// rstd = 1 / sqrt(var + eps), y = (x - mean) * rstd * w + b) and `layer_norm_backward`
// (dxhat = dy * w; dx = rstd * (dxhat - mean(dxhat) - xhat * mean(dxhat * xhat));
// dw = sum_r dy * xhat, db = sum_r dy).
//
// Both kernels: x (and dy, y, dx) contiguous [rows, cols], blockDim a multiple of 32 up to 1024,
// statistics in ACC (float for f32 / f16 / bf16, double for f64). Each kernel comes per float dtype
// `{dt}` and once more as `{dt}` = `f32_bf16`: x, w, b, dx f32 with y (forward) or dy (backward) in
// bf16, the autocast layer norm whose output feeds a bf16 GEMM (no cast kernels either way).

#include "row_reduce.cuh"
#include "vec_load.cuh"

template <typename A> static __device__ __forceinline__ A fg_ln_rsqrt(A v);
template <> __device__ __forceinline__ float fg_ln_rsqrt<float>(float v) { return 1.0f / sqrtf(v); }
template <> __device__ __forceinline__ double fg_ln_rsqrt<double>(double v) { return 1.0 / sqrt(v); }

// ---------------------------------------------------------------------------------------------
// layer_norm_fwd_{dt}(const T* x, const T* w, const T* b, T* y, ACC* mean, ACC* rstd, u64 rows,
//                    u64 cols, double eps, int has_w, int has_b) and layer_norm_fwd_rows_{dt}(same)
// Two-pass statistics like the CPU (sum, then sum of squared deviations). Any grid, any blockDim that
// is a multiple of 32 up to 1024. As in softmax.cu, two entry points that keep their own register
// counts: `layer_norm_fwd_*` always runs path 2, `layer_norm_fwd_rows_*` path 1 only; the Rust side
// (src/fused/layer_norm/cuda.rs) launches the latter only where path 1 applies (src/cuda/launch.rs
// `cfg_row_regs`), and elsewhere it traps (no second copy of path 2: see softmax.cu).
// 1. Row in registers, when x, y (and w, b where given) are 16-byte aligned, cols is a multiple of
//    V = 16 / sizeof(T) and 0 < cols <= blockDim.x * E (E = fg_row_cap): x is read once with 16-byte
//    loads, both passes of the statistics run on registers, then y = (x - mean) * rstd * w + b is
//    written with 16-byte stores; w and b are read (16 bytes at a time) per row where they are used
//    (they stay in L1 / L2). cols <= 32 * E: a group of g threads within a warp per row, 32 / g rows
//    per warp (row_reduce.cuh, the same geometry as softmax.cu), shuffles only; longer rows: a block per row
//    (grid-stride over rows), one barrier per reduction.
// 2. One block per row (grid-stride over rows), each thread on the columns j = threadIdx.x
//    (mod blockDim.x); with dynamic shared memory >= cols * sizeof(ACC) the row is cached on the
//    first read, else x is re-read (from L2). cols == 0 gives mean = rstd = 0.
// ---------------------------------------------------------------------------------------------

// x and y are touched once: cache-streaming hints (vec_load.cuh's fg_row_ldcs / fg_row_stcs, evict
// first) keep w and b cached across rows. Used for f32 only (fg_ln_stream), where they were measured
// (H200, % of copy: 94 against 88 at 8192 x 8192, 94 against 90 at 65536 x 1024); with f16 / bf16
// they make ptxas spill, f64 was not measured with them.
template <typename T> constexpr bool fg_ln_stream = sizeof(T) == 4;

template <typename T, typename Y, int V>
static __device__ __forceinline__ void fg_layer_norm_regs(const T* __restrict__ x, const T* __restrict__ w,
                                                         const T* __restrict__ b, Y* __restrict__ y,
                                                         typename FgAcc<T>::type* __restrict__ mean,
                                                         typename FgAcc<T>::type* __restrict__ rstd, fg_u64 rows,
                                                         unsigned int cols, double eps, int has_w, int has_b,
                                                         bool block, typename FgAcc<T>::type* sh) {
  typedef typename FgAcc<T>::type A;
  constexpr int N = fg_row_cap<T>() / V;  // vector slots per thread
  const unsigned int nvec = cols / V;
  const FgRowGeom q = fg_row_geom(nvec, N, block);
  const unsigned int gs = q.g * V;  // elements between a thread's slots
  const A n = (A)cols;
  for (fg_u64 r0 = q.r0; r0 < rows; r0 += q.step) {
    const fg_u64 r = r0 + q.sub;
    // This thread's vectors are i = t + k * g for k < nk (a prefix of its slots).
    const unsigned int nk = (r < rows && q.t < nvec) ? (nvec - q.t - 1) / q.g + 1 : 0;
    const T* xr = x + r * cols + q.t * V;
    Y* yr = y + r * cols + q.t * V;
    A v[N][V];
#pragma unroll
    for (int k = 0; k < N; ++k)
      if (k < nk) {
        if constexpr (fg_ln_stream<T>) fg_row_ldcs<T, V>(xr + k * gs, v[k]);
        else fg_row_ld<T, V>(xr + k * gs, v[k]);
      }
    A t = (A)0;
#pragma unroll
    for (int k = 0; k < N; ++k) {
      if (k < nk) {
#pragma unroll
        for (int e = 0; e < V; ++e) t += v[k][e];
      }
    }
    const A mu = fg_row_reduce(t, FgSum(), q.g, sh) / n;
    A d2 = (A)0;
#pragma unroll
    for (int k = 0; k < N; ++k) {
      if (k < nk) {
#pragma unroll
        for (int e = 0; e < V; ++e) d2 += (v[k][e] - mu) * (v[k][e] - mu);
      }
    }
    const A var = fg_row_reduce(d2, FgSum(), q.g, sh + 32) / n;
    const A rs = fg_ln_rsqrt<A>(var + (A)eps);
#pragma unroll
    for (int k = 0; k < N; ++k) {
      if (k < nk) {
        const unsigned int j = q.t * V + k * gs;  // column
        A wv[V], bv[V], o[V];
        if (has_w) fg_row_ld<T, V>(w + j, wv);
        if (has_b) fg_row_ld<T, V>(b + j, bv);
#pragma unroll
        for (int e = 0; e < V; ++e) {
          A u = (v[k][e] - mu) * rs;
          if (has_w) u *= wv[e];
          if (has_b) u += bv[e];
          o[e] = u;
        }
        if constexpr (fg_ln_stream<Y>) fg_row_stcs<Y, V>(yr + k * gs, o);
        else fg_row_st<Y, V>(yr + k * gs, o);
      }
    }
    if (q.t == 0 && r < rows) {
      mean[r] = mu;
      rstd[r] = rs;
    }
  }
}

template <typename T, typename Y>
static __device__ __forceinline__ void fg_layer_norm_long(const T* __restrict__ x, const T* __restrict__ w,
                                                         const T* __restrict__ b, Y* __restrict__ y,
                                                         typename FgAcc<T>::type* __restrict__ mean,
                                                         typename FgAcc<T>::type* __restrict__ rstd, fg_u64 rows,
                                                         fg_u64 cols, double eps, int has_w, int has_b) {
  typedef typename FgAcc<T>::type A;
  __shared__ A sh[32];
  A* cache = fg_dynamic_smem_bytes() >= cols * sizeof(A) ? reinterpret_cast<A*>(fg_smem) : nullptr;
  for (fg_u64 r = blockIdx.x; r < rows; r += gridDim.x) {
    const T* xr = x + r * cols;
    Y* yr = y + r * cols;
    if (cols == 0) {
      if (threadIdx.x == 0) {
        mean[r] = (A)0;
        rstd[r] = (A)0;
      }
      continue;
    }
    A t = (A)0;
    fg_row_unrolled(cols, [&](fg_u64 j) { return fg_to_acc(xr[j]); }, [&](fg_u64 j, A v) {
      if (cache) cache[j] = v;
      t += v;
    });
    const A mu = fg_block_reduce(t, FgSum(), sh) / (A)cols;
    auto load = [&](fg_u64 j) { return cache ? cache[j] : fg_to_acc(xr[j]); };
    A q = (A)0;
    fg_row_unrolled(cols, load, [&](fg_u64, A v) { q += (v - mu) * (v - mu); });
    const A var = fg_block_reduce(q, FgSum(), sh) / (A)cols;
    const A rs = fg_ln_rsqrt<A>(var + (A)eps);
    fg_row_unrolled(cols, load, [&](fg_u64 j, A x) {
      A v = (x - mu) * rs;
      if (has_w) v *= fg_to_acc(w[j]);
      if (has_b) v += fg_to_acc(b[j]);
      yr[j] = fg_from_acc<Y>(v);
    });
    if (threadIdx.x == 0) {
      mean[r] = mu;
      rstd[r] = rs;
    }
  }
}

template <typename T, typename Y>
static __device__ __forceinline__ void fg_layer_norm_rows(const T* __restrict__ x, const T* __restrict__ w,
                                                         const T* __restrict__ b, Y* __restrict__ y,
                                                         typename FgAcc<T>::type* __restrict__ mean,
                                                         typename FgAcc<T>::type* __restrict__ rstd, fg_u64 rows,
                                                         fg_u64 cols, double eps, int has_w, int has_b) {
  typedef typename FgAcc<T>::type A;
  constexpr int V = 16 / (int)sizeof(T);  // elements per 16-byte access
  __shared__ A sh[64];
  const bool vec = cols % V == 0 && fg_aligned(x, 16) && fg_aligned(y, 16) && (!has_w || fg_aligned(w, 16)) &&
                   (!has_b || fg_aligned(b, 16));
  constexpr unsigned int E = fg_row_cap<T>();  // elements per thread
  if (vec && cols > 0 && cols <= (fg_u64)blockDim.x * E) {
    const unsigned int c = (unsigned int)cols;
    fg_layer_norm_regs<T, Y, V>(x, w, b, y, mean, rstd, rows, c, eps, has_w, has_b, c > 32u * E, sh);
    return;
  }
  __trap();  // outside path 1's conditions: a launch-site bug (cfg_row_regs disagrees), never a result
}

// Y: the output's dtype (T, or bf16 for an f32 x: the autocast layer norm that feeds a GEMM).
#define FG_LN_FWD2(SUF, T, Y)                                                                  \
  FG_KERNEL layer_norm_fwd_##SUF(const T* x, const T* w, const T* b, Y* y, FgAcc<T>::type* mean,  \
                                FgAcc<T>::type* rstd, fg_u64 rows, fg_u64 cols, double eps, int has_w, \
                                int has_b) {                                                   \
    fg_layer_norm_long<T, Y>(x, w, b, y, mean, rstd, rows, cols, eps, has_w, has_b);            \
  }                                                                                            \
  FG_KERNEL layer_norm_fwd_rows_##SUF(const T* x, const T* w, const T* b, Y* y, FgAcc<T>::type* mean, \
                                     FgAcc<T>::type* rstd, fg_u64 rows, fg_u64 cols, double eps,  \
                                     int has_w, int has_b) {                                   \
    fg_layer_norm_rows<T, Y>(x, w, b, y, mean, rstd, rows, cols, eps, has_w, has_b);            \
  }
#define FG_LN_FWD(SUF, T) FG_LN_FWD2(SUF, T, T)
FG_FOR_FLOAT(FG_LN_FWD)
FG_LN_FWD2(f32_bf16, float, __nv_bfloat16)
