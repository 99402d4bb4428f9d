// softmax.cu: softmax / log-softmax over the last dim.
// CPU twin: src/cpu/norm.rs `softmax_last` (row max ignoring NaN, a non-finite max replaced by 0,
// sum of exp(x - max); softmax = exp(x - max) / sum, log-softmax = x - max - ln(sum)).
//
// softmax_{f32,f64,f16,bf16}(const T* x, T* y, u64 rows, u64 cols, int log) and
// softmax_rows_{f32,f64,f16,bf16}(same): x, y contiguous [rows, cols], computed in ACC (float for
// f32 / f16 / bf16, double for f64), any grid, any blockDim that is a multiple of 32 up to 1024.
// Two entry points so that each keeps its own register count (occupancy): `softmax_*` always runs
// path 2 (fewer registers), `softmax_rows_*` runs path 1 where it applies, else path 2.
// The Rust side launches `softmax_rows_*` only where path 1 applies (src/cuda/storage.rs
// `cfg_norm_rows` mirrors the condition and picks the launch shape).
//
// 1. Row in registers, when x and y are 16-byte aligned, cols is a multiple of V = 16 / sizeof(T)
//    (so every row is) and 0 < cols <= blockDim.x * E (E = fg_row_cap: 32 elements per thread for
//    f32 / f16 / bf16, 8 for f64): x is read once with 16-byte loads into registers, then the max,
//    then e = exp(x - max) (kept for softmax) and its sum, then y is written with 16-byte stores:
//    one exp per element, one read of x, one write of y. Thread t of a row's group holds vectors
//    t, t + g, t + 2g, ... of the row.
//    a. cols <= 32 * E: a group of g threads within a warp per row (g = the power of two that
//       gives each thread at most E elements, 1..32), 32 / g rows per warp at a time: warp w of
//       block b takes rows (b * W + w) * (32 / g) + lane / g, W = blockDim.x / 32, and strides by
//       gridDim.x * W * (32 / g) rows. Reductions are xor shuffles within the group: no shared
//       memory, no barriers.
//    b. Longer rows: one block per row (grid-stride over rows), shuffles then one barrier per
//       reduction (two alternating shared buffers make a second barrier unnecessary).
// 2. One block per row (grid-stride over rows). With dynamic shared memory >= cols * sizeof(ACC)
//    the row is cached there on the first read (max, then exp and sum from the cache). Otherwise one
//    pass computes the max and the sum together (online softmax: each thread keeps (m, s) with
//    s = sum exp(x - m), rescaled when m grows; pairs combine as s1 e^(m1-M) + s2 e^(m2-M)), so x is
//    read twice (stats, output) instead of three times. Each thread only touches the columns
//    j = threadIdx.x (mod blockDim.x), in every pass, so the cache needs no barrier.
//
// If the row max is not finite (all -inf, or +inf present) the sum is taken against 0 exactly as the
// CPU does. Softmax multiplies by 1 / sum (the CPU divides in f64; both round to within an ulp of the
// f32 result).

#include "common.cuh"

static __device__ __forceinline__ float fg_sm_exp(float x) { return expf(x); }
static __device__ __forceinline__ double fg_sm_exp(double x) { return exp(x); }
static __device__ __forceinline__ float fg_sm_log(float x) { return logf(x); }
static __device__ __forceinline__ double fg_sm_log(double x) { return log(x); }
static __device__ __forceinline__ float fg_sm_max(float a, float b) { return fmaxf(a, b); }
static __device__ __forceinline__ double fg_sm_max(double a, double b) { return fmax(a, b); }

// ---------------------------------------------------------------------------------------------
// Row in registers: shared shape with layernorm.cu (each file is its own module, so the helpers are
// repeated there under the same names).
// ---------------------------------------------------------------------------------------------

// Elements of its row each thread keeps in registers (ACC): 32 floats (8 x 16 bytes of f32, 4 of
// f16 / bf16) or 8 doubles (double math needs more registers), within the 64 registers that a
// 1024-thread launch allows (ptxas -v, NVRTC 13.0: no spills in softmax_rows_*; layernorm_fwd_rows_*
// spills 16 bytes for f32 on sm_90, 8 / 24 bytes for f32 / f16 / bf16 on sm_80).
template <typename T>
static __device__ __forceinline__ constexpr int fg_row_cap() {
  return sizeof(typename FgAcc<T>::type) == 8 ? 8 : 32;
}

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

// Where this thread's rows are: a group of `g` threads per row (within a warp, or the whole block),
// `t` = the thread's index in its group, rows r0 + sub, r0 + sub + step, ... (r0 and step are uniform
// over the warp, or the block, so loops over r0 are too).
struct FgRowGeom {
  unsigned int g, t, sub;
  fg_u64 r0, step;
};

// nvec = vectors in a row, n = vector slots per thread, block: one row per block (else per group).
static __device__ __forceinline__ FgRowGeom fg_row_geom(unsigned int nvec, unsigned int n, bool block) {
  FgRowGeom q;
  if (block) {
    q.g = blockDim.x;
    q.t = threadIdx.x;
    q.sub = 0;
    q.r0 = blockIdx.x;
    q.step = gridDim.x;
  } else {
    const unsigned int need = (nvec + n - 1) / n;  // 1..32
    q.g = need <= 1 ? 1u : 1u << (32 - __clz(need - 1));
    const unsigned int lane = threadIdx.x & 31, per = 32 / q.g, wpb = blockDim.x >> 5;
    q.t = lane & (q.g - 1);
    q.sub = lane / q.g;
    q.r0 = ((fg_u64)blockIdx.x * wpb + (threadIdx.x >> 5)) * per;
    q.step = (fg_u64)gridDim.x * wpb * per;
  }
  return q;
}

// Reduce over the row's group: xor shuffles below min(g, 32) (a group within a warp is aligned), then
// for a block of several warps `sh` (32 A, not used by the previous reduction: callers alternate two
// buffers, so one barrier suffices: a thread writes a buffer only after the barrier of the reduction
// in between, which every reader of the buffer's previous contents passed after reading it).
template <typename A, typename Op>
static __device__ __forceinline__ A fg_row_reduce(A v, Op op, unsigned int g, A* sh) {
  for (unsigned int o = (g < 32 ? g : 32) >> 1; o > 0; o >>= 1) v = op(v, __shfl_xor_sync(0xffffffffu, v, o));
  if (g <= 32) return v;
  const unsigned int nw = g >> 5, lane = threadIdx.x & 31;
  if (lane == 0) sh[threadIdx.x >> 5] = v;
  __syncthreads();
  v = lane < nw ? sh[lane] : op.template identity<A>();
  return fg_warp_reduce(v, op);
}

template <typename T, int V>
static __device__ __forceinline__ void fg_softmax_regs(const T* __restrict__ x, T* __restrict__ y, fg_u64 rows,
                                                       unsigned int cols, int log, bool block,
                                                       typename FgAcc<T>::type* sh) {
  typedef typename FgAcc<T>::type A;
  constexpr int N = fg_row_cap<T>() / V;  // vector slots per thread
  const unsigned int nvec = cols / V;
  const FgRowGeom q = fg_row_geom(nvec, N, block);
  const unsigned int gs = q.g * V;  // elements between a thread's slots
  // In each row this thread's vectors are i = t + k * g for k < nkr (a prefix of its slots).
  const unsigned int nkr = q.t < nvec ? (nvec - q.t - 1) / q.g + 1 : 0;
  const A ninf = -fg_inf<A>();
  for (fg_u64 r0 = q.r0; r0 < rows; r0 += q.step) {
    const fg_u64 r = r0 + q.sub;
    const unsigned int nk = r < rows ? nkr : 0;
    const T* xr = x + r * cols + q.t * V;
    T* yr = y + r * cols + q.t * V;
    A v[N][V];
#pragma unroll
    for (int k = 0; k < N; ++k)
      if (k < nk) fg_row_ld<T, V>(xr + k * gs, v[k]);
    // Max (NaN ignored: `v > m` is false for NaN, like f64::max).
    A m = ninf;
#pragma unroll
    for (int k = 0; k < N; ++k) {
      if (k < nk) {
#pragma unroll
        for (int e = 0; e < V; ++e) m = v[k][e] > m ? v[k][e] : m;
      }
    }
    m = fg_row_reduce(m, FgFMax(), q.g, sh);
    const A mf = (m > ninf && m < fg_inf<A>()) ? m : (A)0;
    A s = (A)0;
#pragma unroll
    for (int k = 0; k < N; ++k) {
      if (k < nk) {
#pragma unroll
        for (int e = 0; e < V; ++e) {
          const A ex = fg_sm_exp(v[k][e] - mf);  // a NaN element makes s NaN, as on the CPU
          if (!log) v[k][e] = ex;
          s += ex;
        }
      }
    }
    s = fg_row_reduce(s, FgSum(), q.g, sh + 32);
    const A a = log ? fg_sm_log(s) : (A)1 / s;  // ln(sum) or 1 / sum
#pragma unroll
    for (int k = 0; k < N; ++k) {
      if (k < nk) {
        A o[V];
#pragma unroll
        for (int e = 0; e < V; ++e) o[e] = log ? v[k][e] - mf - a : v[k][e] * a;
        fg_row_st<T, V>(yr + k * gs, o);
      }
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Path 2: any row (softmax_*, and softmax_rows_* where path 1 does not apply)
// ---------------------------------------------------------------------------------------------

template <typename A>
static __device__ __forceinline__ void fg_online_merge(A& m, A& s, A m2, A s2) {
  const A M = fg_sm_max(m, m2);
  const A f1 = m == M ? (A)1 : fg_sm_exp(m - M);
  const A f2 = m2 == M ? (A)1 : fg_sm_exp(m2 - M);
  s = s * f1 + s2 * f2;
  m = M;
}

template <typename T>
static __device__ __forceinline__ void fg_softmax_long(const T* __restrict__ x, T* __restrict__ y, fg_u64 rows,
                                                       fg_u64 cols, int log) {
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

template <typename T>
static __device__ __forceinline__ void fg_softmax_rows(const T* __restrict__ x, T* __restrict__ y, fg_u64 rows,
                                                       fg_u64 cols, int log) {
  typedef typename FgAcc<T>::type A;
  constexpr int V = 16 / (int)sizeof(T);  // elements per 16-byte access
  __shared__ A sh[64];
  const bool vec = cols % V == 0 && fg_aligned(x, 16) && fg_aligned(y, 16);
  constexpr unsigned int E = fg_row_cap<T>();  // elements per thread
  if (vec && cols > 0 && cols <= (fg_u64)blockDim.x * E) {
    const unsigned int c = (unsigned int)cols;
    fg_softmax_regs<T, V>(x, y, rows, c, log, c > 32u * E, sh);
    return;
  }
  fg_softmax_long<T>(x, y, rows, cols, log);
}

#define FG_SOFTMAX(SUF, T)                                                                     \
  FG_KERNEL softmax_##SUF(const T* x, T* y, fg_u64 rows, fg_u64 cols, int log) {               \
    fg_softmax_long<T>(x, y, rows, cols, log);                                                 \
  }                                                                                            \
  FG_KERNEL softmax_rows_##SUF(const T* x, T* y, fg_u64 rows, fg_u64 cols, int log) {          \
    fg_softmax_rows<T>(x, y, rows, cols, log);                                                 \
  }
FG_FOR_FLOAT(FG_SOFTMAX)
