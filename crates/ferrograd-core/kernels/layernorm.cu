// layernorm.cu: layer norm over the last dim, forward and backward.
// CPU twins: src/cpu/norm.rs `layer_norm` (mean, biased variance by a second pass over the row,
// rstd = 1 / sqrt(var + eps), y = (x - mean) * rstd * w + b) and `layer_norm_backward`
// (dxhat = dy * w; dx = rstd * (dxhat - mean(dxhat) - xhat * mean(dxhat * xhat));
// dw = sum_r dy * xhat, db = sum_r dy).
//
// Both kernels: x (and dy, y, dx) contiguous [rows, cols], one block per row (grid-stride over
// rows), blockDim a multiple of 32 up to 1024, statistics in ACC (float for f32 / f16 / bf16,
// double for f64). Each thread only touches columns j = threadIdx.x (mod blockDim.x).

template <typename A> static __device__ __forceinline__ A fg_ln_rsqrt(A v);
template <> __device__ __forceinline__ float fg_ln_rsqrt<float>(float v) { return 1.0f / sqrtf(v); }
template <> __device__ __forceinline__ double fg_ln_rsqrt<double>(double v) { return 1.0 / sqrt(v); }

// ---------------------------------------------------------------------------------------------
// layernorm_fwd_{dt}(const T* x, const T* w, const T* b, T* y, ACC* mean, ACC* rstd, u64 rows,
//                    u64 cols, double eps, int has_w, int has_b)
// Two-pass statistics like the CPU (sum, then sum of squared deviations). With dynamic shared
// memory >= cols * sizeof(ACC) the row is cached on the first read, else x is re-read (from L2).
// ---------------------------------------------------------------------------------------------

template <typename T>
static __device__ __forceinline__ void fg_layernorm_fwd(const T* __restrict__ x, const T* __restrict__ w,
                                                        const T* __restrict__ b, T* __restrict__ y,
                                                        typename FgAcc<T>::type* __restrict__ mean,
                                                        typename FgAcc<T>::type* __restrict__ rstd, fg_u64 rows,
                                                        fg_u64 cols, double eps, int has_w, int has_b) {
  typedef typename FgAcc<T>::type A;
  __shared__ A sh[32];
  A* cache = fg_dynamic_smem_bytes() >= cols * sizeof(A) ? reinterpret_cast<A*>(fg_smem) : nullptr;
  for (fg_u64 r = blockIdx.x; r < rows; r += gridDim.x) {
    const T* xr = x + r * cols;
    T* yr = y + r * cols;
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
      yr[j] = fg_from_acc<T>(v);
    });
    if (threadIdx.x == 0) {
      mean[r] = mu;
      rstd[r] = rs;
    }
  }
}

#define FG_LN_FWD(SUF, T)                                                                      \
  FG_KERNEL layernorm_fwd_##SUF(const T* x, const T* w, const T* b, T* y, FgAcc<T>::type* mean,  \
                                FgAcc<T>::type* rstd, fg_u64 rows, fg_u64 cols, double eps, int has_w, \
                                int has_b) {                                                   \
    fg_layernorm_fwd<T>(x, w, b, y, mean, rstd, rows, cols, eps, has_w, has_b);                \
  }
FG_FOR_FLOAT(FG_LN_FWD)

// ---------------------------------------------------------------------------------------------
// layernorm_bwd_{dt}(const T* x, const T* w, const ACC* mean, const ACC* rstd, const T* dy, T* dx,
//                    ACC* dw, ACC* db, u64 rows, u64 cols, int has_w)
// dw / db are zeroed ACC buffers of length cols, accumulated with atomicAdd.
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

__device__ __forceinline__ unsigned int fg_nsmid() {
  unsigned int r;
  asm("mov.u32 %0, %%nsmid;" : "=r"(r));
  return r;
}

template <typename T>
static __device__ __forceinline__ void fg_layernorm_bwd(const T* __restrict__ x, const T* __restrict__ w,
                                                        const typename FgAcc<T>::type* __restrict__ mean,
                                                        const typename FgAcc<T>::type* __restrict__ rstd,
                                                        const T* __restrict__ dy, T* __restrict__ dx,
                                                        typename FgAcc<T>::type* __restrict__ dw,
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
    const T* gr = dy + r * cols;
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
      if (j < cols) dxr[j] = fg_from_acc<T>(rs * (dk[k] - m1 - hk[k] * m2));
    }
    for (fg_u64 j = threadIdx.x + kcols; j < cols; j += bs) {
      const A g = fg_to_acc(gr[j]);
      const A h = (fg_to_acc(xr[j]) - mu) * rs;
      const A d = has_w ? g * fg_to_acc(w[j]) : g;
      dxr[j] = fg_from_acc<T>(rs * (d - m1 - h * m2));
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

#define FG_LN_BWD(SUF, T)                                                                      \
  FG_KERNEL layernorm_bwd_##SUF(const T* x, const T* w, const FgAcc<T>::type* mean,              \
                                const FgAcc<T>::type* rstd, const T* dy, T* dx, FgAcc<T>::type* dw, \
                                FgAcc<T>::type* db, fg_u64 rows, fg_u64 cols, int has_w) {      \
    fg_layernorm_bwd<T>(x, w, mean, rstd, dy, dx, dw, db, rows, cols, has_w);                  \
  }
FG_FOR_FLOAT(FG_LN_BWD)
