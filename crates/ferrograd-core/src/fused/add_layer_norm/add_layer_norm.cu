// add_layer_norm.cu: h = x + residual, y = layer_norm(h), one kernel.
// CPU twin: src/fused/add_layer_norm/cpu.rs `add_layer_norm` (h in f64 rounded to T, then layer norm's
// reference on h: mean, biased variance by a second pass, rstd = 1 / sqrt(var + eps),
// y = (h - mean) * rstd * w + b). The backward is layer_norm_bwd_* on h (see mod.rs).
//
// add_layer_norm_fwd_{dt}(const T* x, const T* res, const T* w, const T* b, T* h, T* y, ACC* mean,
//                        ACC* rstd, u64 rows, u64 cols, double eps, int has_w, int has_b)
// x, res, h, y contiguous [rows, cols]; w, b [cols] or null (has_w / has_b 0). One block per row,
// grid-stride over rows; blockDim a multiple of 32 up to 1024. h is rounded to T before the
// statistics (as PyTorch's x + r then F.layer_norm). With dynamic shared memory >= cols * sizeof(ACC)
// the row of h is cached there, else re-read from h (the same thread's writes). When every pointer
// is 16-byte aligned and cols is a multiple of V = 16 / sizeof(T), rows move 16 bytes at a time.

#include "vec_load.cuh"

template <typename A> static __device__ __forceinline__ A fg_aln_rsqrt(A v);
template <> __device__ __forceinline__ float fg_aln_rsqrt<float>(float v) { return 1.0f / sqrtf(v); }
template <> __device__ __forceinline__ double fg_aln_rsqrt<double>(double v) { return 1.0 / sqrt(v); }

// V elements per access (1: scalar path).
template <typename T, int V>
static __device__ __forceinline__ void fg_add_layer_norm(const T* __restrict__ x, const T* __restrict__ res,
                                                        const T* __restrict__ w, const T* __restrict__ b, T* h,
                                                        T* __restrict__ y, typename FgAcc<T>::type* __restrict__ mean,
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
      fg_row_ld<T, V>(res + o + i * V, c);
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
      fg_row_st<T, V>(y + o + i * V, a);
    }
    if (threadIdx.x == 0) {
      mean[r] = mu;
      rstd[r] = rs;
    }
  }
}

#define FG_ADD_LN_FWD(SUF, T)                                                                         \
  FG_KERNEL add_layer_norm_fwd_##SUF(const T* x, const T* res, const T* w, const T* b, T* h, T* y,        \
                                    FgAcc<T>::type* mean, FgAcc<T>::type* rstd, fg_u64 rows, fg_u64 cols, \
                                    double eps, int has_w, int has_b) {                                \
    constexpr int V = 16 / (int)sizeof(T);                                                            \
    const bool vec = cols % V == 0 && fg_aligned(x, 16) && fg_aligned(res, 16) && fg_aligned(h, 16) &&  \
                     fg_aligned(y, 16) && (!has_w || fg_aligned(w, 16)) && (!has_b || fg_aligned(b, 16)); \
    if (vec) fg_add_layer_norm<T, V>(x, res, w, b, h, y, mean, rstd, rows, cols, eps, has_w, has_b);      \
    else fg_add_layer_norm<T, 1>(x, res, w, b, h, y, mean, rstd, rows, cols, eps, has_w, has_b);          \
  }
FG_FOR_FLOAT(FG_ADD_LN_FWD)
