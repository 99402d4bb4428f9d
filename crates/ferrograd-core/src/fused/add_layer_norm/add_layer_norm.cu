// add_layer_norm.cu: h = x + residual, y = layer_norm(h), one kernel.
// CPU twin: src/fused/add_layer_norm/cpu.rs `add_layer_norm` (h in f64 rounded to T, then layer norm's
// reference on h: mean, biased variance by a second pass, rstd = 1 / sqrt(var + eps),
// y = (h - mean) * rstd * w + b). The backward is layer_norm_bwd_* on h, h's other
// gradient (from the next residual add) folded in as its dres (see mod.rs).
//
// add_layer_norm_fwd_{dt}(const T* x, const T* res, const T* w, const T* b, T* h, T* y, ACC* mean,
//                        ACC* rstd, u64 rows, u64 cols, double eps, int has_w, int has_b)
// x, res, h, y contiguous [rows, cols]; w, b [cols] or null (has_w / has_b 0).
// add_layer_norm_fwd_f32_bf16: the same with res and y bf16 (x, w, b, h f32): the autocast residual
// stream, f32, plus a bf16 branch, normalized into a bf16 GEMM input (no cast kernels).
//
// add_layer_norm_fwd_rows_{f32,f32_bf16}(same arguments): the row in registers, a power-of-two
// group of lanes within a warp per row (row_reduce.cuh's geometry, as layer_norm_fwd_rows_*), shuffle
// reductions only, no shared memory and no barrier. The Rust side (src/fused/add_layer_norm/cuda.rs)
// launches it only when every pointer is 16-byte aligned, cols is a multiple of 4 and at most
// 32 * FG_ROW_CAP_FLOAT, with 128 threads a block (`cfg_row_regs`). One block per row,
// grid-stride over rows; blockDim a multiple of 32 up to 1024. h is rounded to T before the
// statistics (as PyTorch's x + r then F.layer_norm). With dynamic shared memory >= cols * sizeof(ACC)
// the row of h is cached there, else re-read from h (the same thread's writes). When every pointer
// is 16-byte aligned and cols is a multiple of V = 16 / sizeof(T), rows move 16 bytes at a time.

#include "row_reduce.cuh"
#include "vec_load.cuh"

template <typename A> static __device__ __forceinline__ A fg_aln_rsqrt(A v);
template <> __device__ __forceinline__ float fg_aln_rsqrt<float>(float v) { return 1.0f / sqrtf(v); }
template <> __device__ __forceinline__ double fg_aln_rsqrt<double>(double v) { return 1.0 / sqrt(v); }

// V elements per access (1: scalar path); R the residual's dtype and Y the output's (both T, or
// both bf16 with an f32 x: see the kernel list at the top).
template <typename T, typename R, typename Y, int V>
static __device__ __forceinline__ void fg_add_layer_norm(const T* __restrict__ x, const R* __restrict__ res,
                                                        const T* __restrict__ w, const T* __restrict__ b, T* h,
                                                        Y* __restrict__ y, typename FgAcc<T>::type* __restrict__ mean,
                                                        typename FgAcc<T>::type* __restrict__ rstd, fg_u64 rows,
                                                        fg_u64 cols, double eps, int has_w, int has_b) {
  typedef typename FgAcc<T>::type A;
  __shared__ A sh[32];
  A* cache = fg_dynamic_smem_bytes() >= cols * sizeof(A) ? reinterpret_cast<A*>(fg_smem) : nullptr;
  const fg_u64 nv = cols / V;
  const unsigned int bs = blockDim.x;
  for (fg_u64 r = blockIdx.x; r < rows; r += gridDim.x) {
    const fg_u64 o = r * cols;
    if (cols == 0) {
      if (threadIdx.x == 0) {
        mean[r] = (A)0;
        rstd[r] = (A)0;
      }
      continue;
    }
    // Pass 1: h = x + res (rounded to T), written out and cached, summed.
    A t = (A)0;
    for (fg_u64 i = threadIdx.x; i < nv; i += bs) {
      A a[V], c[V];
      fg_row_ld<T, V>(x + o + i * V, a);
      fg_row_ld<R, V>(res + o + i * V, c);
#pragma unroll
      for (int e = 0; e < V; ++e) a[e] = fg_to_acc(fg_from_acc<T>(a[e] + c[e]));
      fg_row_st<T, V>(h + o + i * V, a);
#pragma unroll
      for (int e = 0; e < V; ++e) {
        if (cache) cache[i * V + e] = a[e];
        t += a[e];
      }
    }
    const A mu = fg_block_reduce(t, FgSum(), sh) / (A)cols;
    // The row of h again, from the cache or from h (written by this thread above).
    auto load = [&](fg_u64 i, A (&a)[V]) {
      if (cache) {
#pragma unroll
        for (int e = 0; e < V; ++e) a[e] = cache[i * V + e];
      } else {
        fg_row_ld<T, V>(h + o + i * V, a);
      }
    };
    A q = (A)0;
    for (fg_u64 i = threadIdx.x; i < nv; i += bs) {
      A a[V];
      load(i, a);
#pragma unroll
      for (int e = 0; e < V; ++e) q += (a[e] - mu) * (a[e] - mu);
    }
    const A var = fg_block_reduce(q, FgSum(), sh) / (A)cols;
    const A rs = fg_aln_rsqrt<A>(var + (A)eps);
    for (fg_u64 i = threadIdx.x; i < nv; i += bs) {
      A a[V], wv[V], bv[V];
      load(i, a);
      if (has_w) fg_row_ld<T, V>(w + i * V, wv);
      if (has_b) fg_row_ld<T, V>(b + i * V, bv);
#pragma unroll
      for (int e = 0; e < V; ++e) {
        A u = (a[e] - mu) * rs;
        if (has_w) u *= wv[e];
        if (has_b) u += bv[e];
        a[e] = u;
      }
      fg_row_st<Y, V>(y + o + i * V, a);
    }
    if (threadIdx.x == 0) {
      mean[r] = mu;
      rstd[r] = rs;
    }
  }
}

#define FG_ADD_LN_FWD3(SUF, T, R, Y)                                                                  \
  FG_KERNEL add_layer_norm_fwd_##SUF(const T* x, const R* res, const T* w, const T* b, T* h, Y* y,        \
                                    FgAcc<T>::type* mean, FgAcc<T>::type* rstd, fg_u64 rows, fg_u64 cols, \
                                    double eps, int has_w, int has_b) {                                \
    constexpr int V = 16 / (int)sizeof(T);                                                            \
    const bool vec = cols % V == 0 && fg_aligned(x, 16) && fg_aligned(res, 16) && fg_aligned(h, 16) &&  \
                     fg_aligned(y, 16) && (!has_w || fg_aligned(w, 16)) && (!has_b || fg_aligned(b, 16)); \
    if (vec) fg_add_layer_norm<T, R, Y, V>(x, res, w, b, h, y, mean, rstd, rows, cols, eps, has_w, has_b); \
    else fg_add_layer_norm<T, R, Y, 1>(x, res, w, b, h, y, mean, rstd, rows, cols, eps, has_w, has_b);     \
  }
#define FG_ADD_LN_FWD(SUF, T) FG_ADD_LN_FWD3(SUF, T, T, T)
FG_FOR_FLOAT(FG_ADD_LN_FWD)
FG_ADD_LN_FWD3(f32_bf16, float, __nv_bfloat16, __nv_bfloat16)

template <typename R, typename Y>
static __device__ __forceinline__ void fg_add_layer_norm_regs(const float* __restrict__ x, const R* __restrict__ res,
                                                             const float* __restrict__ w, const float* __restrict__ b,
                                                             float* __restrict__ h, Y* __restrict__ y,
                                                             float* __restrict__ mean, float* __restrict__ rstd,
                                                             fg_u64 rows, unsigned int cols, double eps, int has_w,
                                                             int has_b) {
  constexpr int V = 4;                           // 16 bytes of f32
  constexpr int N = fg_row_cap<float>() / V;     // vector slots per thread
  const unsigned int nvec = cols / V;
  const FgRowGeom q = fg_row_geom(nvec, N, false);
  const unsigned int gs = q.g * V;  // elements between a thread's slots
  const float n = (float)cols;
  for (fg_u64 r0 = q.r0; r0 < rows; r0 += q.step) {
    const fg_u64 r = r0 + q.sub;
    const unsigned int nk = (r < rows && q.t < nvec) ? (nvec - q.t - 1) / q.g + 1 : 0;
    const fg_u64 o = r * cols + q.t * V;
    float v[N][V];
    float t = 0.0f;
#pragma unroll
    for (int k = 0; k < N; ++k) {
      if (k < nk) {
        float c[V];
        fg_row_ldcs<float, V>(x + o + k * gs, v[k]);
        if constexpr (sizeof(R) == 4) fg_row_ldcs<R, V>(res + o + k * gs, c);
        else fg_row_ld<R, V>(res + o + k * gs, c);
#pragma unroll
        for (int e = 0; e < V; ++e) {
          v[k][e] += c[e];
          t += v[k][e];
        }
        fg_row_st<float, V>(h + o + k * gs, v[k]);
      }
    }
    const float mu = fg_row_reduce(t, FgSum(), q.g, (float*)nullptr) / n;
    float d2 = 0.0f;
#pragma unroll
    for (int k = 0; k < N; ++k) {
      if (k < nk) {
#pragma unroll
        for (int e = 0; e < V; ++e) d2 += (v[k][e] - mu) * (v[k][e] - mu);
      }
    }
    const float var = fg_row_reduce(d2, FgSum(), q.g, (float*)nullptr) / n;
    const float rs = 1.0f / sqrtf(var + (float)eps);
#pragma unroll
    for (int k = 0; k < N; ++k) {
      if (k < nk) {
        const unsigned int j = q.t * V + k * gs;  // column
        float wv[V], bv[V], out[V];
        if (has_w) fg_row_ld<float, V>(w + j, wv);
        if (has_b) fg_row_ld<float, V>(b + j, bv);
#pragma unroll
        for (int e = 0; e < V; ++e) {
          float u = (v[k][e] - mu) * rs;
          if (has_w) u *= wv[e];
          if (has_b) u += bv[e];
          out[e] = u;
        }
        fg_row_st<Y, V>(y + o + k * gs, out);
      }
    }
    if (q.t == 0 && r < rows) {
      mean[r] = mu;
      rstd[r] = rs;
    }
  }
}

#define FG_ADD_LN_FWD_ROWS(SUF, R, Y)                                                                      \
  extern "C" __global__ void __launch_bounds__(128)                                                       \
      add_layer_norm_fwd_rows_##SUF(const float* x, const R* res, const float* w, const float* b, float* h,  \
                                    Y* y, float* mean, float* rstd, fg_u64 rows, fg_u64 cols, double eps,   \
                                    int has_w, int has_b) {                                               \
    fg_add_layer_norm_regs<R, Y>(x, res, w, b, h, y, mean, rstd, rows, (unsigned int)cols, eps, has_w, has_b); \
  }
FG_ADD_LN_FWD_ROWS(f32, float, float)
FG_ADD_LN_FWD_ROWS(f32_bf16, __nv_bfloat16, __nv_bfloat16)
