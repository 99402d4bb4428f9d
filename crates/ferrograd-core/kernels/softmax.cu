// softmax.cu: softmax / log-softmax over the last dim.
// CPU twin: src/cpu/norm.rs `softmax_last` (row max ignoring NaN, a non-finite max replaced by 0,
// sum of exp(x - max); softmax = exp(x - max) / sum, log-softmax = x - max - ln(sum)).
//
// softmax_{f32,f64,f16,bf16}(const T* x, T* y, u64 rows, u64 cols, int log): x, y contiguous
// [rows, cols]; one block per row (grid-stride over rows), computed in ACC (float for f32 / f16 /
// bf16, double for f64).
//
// Row cached (the launch gives dynamic shared memory >= cols * sizeof(ACC)): x is read from
// memory once into shared memory, then max, then e = exp(x - max) (kept in the cache for softmax)
// and its sum, then the output: one exp per element and only cheap dependency chains.
// Row not cached (long rows): one pass computes the max and the sum together (online softmax:
// each thread keeps (m, s) with s = sum exp(x - m), rescaled when m grows; pairs combine as
// s1 e^(m1-M) + s2 e^(m2-M)), so x is read twice (stats, output) instead of three times.
// Each thread only touches the columns j = threadIdx.x (mod blockDim.x), in every pass, so the cache
// needs no barrier. If the row max is not finite (all -inf, or +inf present) the sum is taken
// against 0 exactly as the CPU does. Softmax multiplies by 1 / sum (the CPU divides in f64; both
// round to within an ulp of the f32 result).

static __device__ __forceinline__ float fg_sm_exp(float x) { return expf(x); }
static __device__ __forceinline__ double fg_sm_exp(double x) { return exp(x); }
static __device__ __forceinline__ float fg_sm_log(float x) { return logf(x); }
static __device__ __forceinline__ double fg_sm_log(double x) { return log(x); }
static __device__ __forceinline__ float fg_sm_max(float a, float b) { return fmaxf(a, b); }
static __device__ __forceinline__ double fg_sm_max(double a, double b) { return fmax(a, b); }

template <typename A>
static __device__ __forceinline__ void fg_online_merge(A& m, A& s, A m2, A s2) {
  const A M = fg_sm_max(m, m2);
  const A f1 = m == M ? (A)1 : fg_sm_exp(m - M);
  const A f2 = m2 == M ? (A)1 : fg_sm_exp(m2 - M);
  s = s * f1 + s2 * f2;
  m = M;
}

template <typename T>
static __device__ __forceinline__ void fg_softmax(const T* __restrict__ x, T* __restrict__ y, fg_u64 rows, fg_u64 cols,
                                                  int log) {
  typedef typename FgAcc<T>::type A;
  __shared__ A shm[32], shs[32];
  A* cache = fg_dynamic_smem_bytes() >= cols * sizeof(A) ? reinterpret_cast<A*>(fg_smem) : nullptr;
  const unsigned int bs = blockDim.x, lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = bs >> 5;
  const A ninf = -fg_inf<A>();
  for (fg_u64 r = blockIdx.x; r < rows; r += gridDim.x) {
    const T* xr = x + r * cols;
    T* yr = y + r * cols;
    A mf, s;
    if (cache) {
      // Max (NaN ignored: `v > m` is false for NaN, like f64::max).
      A m = ninf;
      fg_row_unrolled(cols, [&](fg_u64 j) { return fg_to_acc(xr[j]); }, [&](fg_u64 j, A v) {
        cache[j] = v;
        m = v > m ? v : m;
      });
      m = fg_block_reduce(m, FgFMax(), shm);
      mf = (m > ninf && m < fg_inf<A>()) ? m : (A)0;
      A t = (A)0;
      for (fg_u64 j = threadIdx.x; j < cols; j += bs) {
        const A e = fg_sm_exp(cache[j] - mf);
        if (!log) cache[j] = e;
        t += e;
      }
      s = fg_block_reduce(t, FgSum(), shs);
      if (log) {
        const A lse = fg_sm_log(s);
        for (fg_u64 j = threadIdx.x; j < cols; j += bs) yr[j] = fg_from_acc<T>(cache[j] - mf - lse);
      } else {
        const A inv = (A)1 / s;
        for (fg_u64 j = threadIdx.x; j < cols; j += bs) yr[j] = fg_from_acc<T>(cache[j] * inv);
      }
      continue;
    }

    // Not cached: (max, sum of exp(x - max)) in one read.
    A m = ninf;
    s = (A)0;
    fg_row_unrolled(cols, [&](fg_u64 j) { return fg_to_acc(xr[j]); }, [&](fg_u64, A v) {
      if (v > m) {
        s = s * fg_sm_exp(m - v) + (A)1;
        m = v;
      } else if (v != ninf) {
        s += fg_sm_exp(v - m);  // NaN v makes s NaN, as on the CPU
      }
    });
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
      const A m2 = __shfl_xor_sync(0xffffffffu, m, o), s2 = __shfl_xor_sync(0xffffffffu, s, o);
      fg_online_merge(m, s, m2, s2);
    }
    if (nw > 1) {
      __syncthreads();
      if (lane == 0) {
        shm[warp] = m;
        shs[warp] = s;
      }
      __syncthreads();
      m = lane < nw ? shm[lane] : ninf;
      s = lane < nw ? shs[lane] : (A)0;
#pragma unroll
      for (int o = 16; o > 0; o >>= 1) {
        const A m2 = __shfl_xor_sync(0xffffffffu, m, o), s2 = __shfl_xor_sync(0xffffffffu, s, o);
        fg_online_merge(m, s, m2, s2);
      }
    }
    // An all -inf row (or one holding +inf) has no finite max: subtract 0 instead (block-uniform).
    const bool finite = m > ninf && m < fg_inf<A>();
    mf = finite ? m : (A)0;
    if (!finite) {
      A t = (A)0;
      fg_row_unrolled(cols, [&](fg_u64 j) { return fg_to_acc(xr[j]); }, [&](fg_u64, A v) { t += fg_sm_exp(v - mf); });
      s = fg_block_reduce(t, FgSum(), shs);
    }
    auto load = [&](fg_u64 j) { return fg_to_acc(xr[j]); };
    if (log) {
      const A lse = fg_sm_log(s);
      fg_row_unrolled(cols, load, [&](fg_u64 j, A v) { yr[j] = fg_from_acc<T>(v - mf - lse); });
    } else {
      const A inv = (A)1 / s;
      fg_row_unrolled(cols, load, [&](fg_u64 j, A v) { yr[j] = fg_from_acc<T>(fg_sm_exp(v - mf) * inv); });
    }
  }
}

#define FG_SOFTMAX(SUF, T)                                                                     \
  FG_KERNEL softmax_##SUF(const T* x, T* y, fg_u64 rows, fg_u64 cols, int log) {               \
    fg_softmax<T>(x, y, rows, cols, log);                                                      \
  }
FG_FOR_FLOAT(FG_SOFTMAX)
