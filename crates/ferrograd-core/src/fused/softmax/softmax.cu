// softmax.cu: softmax / log-softmax over the last dim.
// CPU twin: src/fused/softmax/cpu.rs `softmax_last` (row max ignoring NaN, a non-finite max replaced by 0,
// sum of exp(x - max); softmax = exp(x - max) / sum, log-softmax = x - max - ln(sum)).
//
// softmax_{f32,f64,f16,bf16}(const T* x, T* y, u64 rows, u64 cols, int log) and
// softmax_rows_{f32,f64,f16,bf16}(same): x, y contiguous [rows, cols], computed in ACC (float for
// f32 / f16 / bf16, double for f64), any grid, any blockDim that is a multiple of 32 up to 1024.
// Two entry points so that each keeps its own register count (occupancy): `softmax_*` always runs
// path 2 (fewer registers), `softmax_rows_*` runs path 1 only. The Rust side
// (src/fused/softmax/cuda.rs) launches `softmax_rows_*` only where path 1 applies (src/cuda/launch.rs
// `cfg_row_regs` mirrors the condition and picks the launch shape); launched elsewhere it traps
// (a device-side assert). It used to fall back to path 2, which compiled path 2 a second time per
// dtype for a branch no launch takes: 40% of the module's NVRTC time.
//
// 1. Row in registers, when x and y are 16-byte aligned, cols is a multiple of V = 16 / sizeof(T)
//    (so every row is) and 0 < cols <= blockDim.x * E (E = fg_row_cap: FG_ROW_CAP_FLOAT = 32 elements per
//    thread for f32 / f16 / bf16, FG_ROW_CAP_DOUBLE = 8 for f64): x is read once with 16-byte loads into registers, then the max,
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

#include "online_softmax.cuh"
#include "row_reduce.cuh"
#include "vec_load.cuh"

// ---------------------------------------------------------------------------------------------
// Path 1: the row in registers (row_reduce.cuh's geometry, vec_load.cuh's 16-byte accesses)
// ---------------------------------------------------------------------------------------------

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
          const A ex = fg_exp(v[k][e] - mf);  // a NaN element makes s NaN, as on the CPU
          if (!log) v[k][e] = ex;
          s += ex;
        }
      }
    }
    s = fg_row_reduce(s, FgSum(), q.g, sh + 32);
    const A a = log ? fg_log(s) : (A)1 / s;  // ln(sum) or 1 / sum
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
// Path 2: any row (softmax_*)
// ---------------------------------------------------------------------------------------------

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
        const A e = fg_exp(cache[j] - mf);
        if (!log) cache[j] = e;
        t += e;
      }
      s = fg_block_reduce(t, FgSum(), shs);
      if (log) {
        const A lse = fg_log(s);
        for (fg_u64 j = threadIdx.x; j < cols; j += bs) yr[j] = fg_from_acc<T>(cache[j] - mf - lse);
      } else {
        const A inv = (A)1 / s;
        for (fg_u64 j = threadIdx.x; j < cols; j += bs) yr[j] = fg_from_acc<T>(cache[j] * inv);
      }
      continue;
    }

    // Not cached: (max, sum of exp(x - max)) in one read (online_softmax.cuh).
    A m = ninf;
    s = (A)0;
    fg_row_unrolled(cols, [&](fg_u64 j) { return fg_to_acc(xr[j]); }, [&](fg_u64, A v) { fg_online_push(m, s, v); });
    fg_online_warp_merge(m, s, FgFMax());
    if (nw > 1) {
      __syncthreads();
      if (lane == 0) {
        shm[warp] = m;
        shs[warp] = s;
      }
      __syncthreads();
      m = lane < nw ? shm[lane] : ninf;
      s = lane < nw ? shs[lane] : (A)0;
      fg_online_warp_merge(m, s, FgFMax());
    }
    // An all -inf row (or one holding +inf) has no finite max: subtract 0 instead (block-uniform).
    const bool finite = m > ninf && m < fg_inf<A>();
    mf = finite ? m : (A)0;
    if (!finite) {
      A t = (A)0;
      fg_row_unrolled(cols, [&](fg_u64 j) { return fg_to_acc(xr[j]); }, [&](fg_u64, A v) { t += fg_exp(v - mf); });
      s = fg_block_reduce(t, FgSum(), shs);
    }
    auto load = [&](fg_u64 j) { return fg_to_acc(xr[j]); };
    if (log) {
      const A lse = fg_log(s);
      fg_row_unrolled(cols, load, [&](fg_u64 j, A v) { yr[j] = fg_from_acc<T>(v - mf - lse); });
    } else {
      const A inv = (A)1 / s;
      fg_row_unrolled(cols, load, [&](fg_u64 j, A v) { yr[j] = fg_from_acc<T>(fg_exp(v - mf) * inv); });
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
  __trap();  // outside path 1's conditions: a launch-site bug (cfg_row_regs disagrees), never a result
}

#define FG_SOFTMAX(SUF, T)                                                                     \
  FG_KERNEL softmax_##SUF(const T* x, T* y, fg_u64 rows, fg_u64 cols, int log) {               \
    fg_softmax_long<T>(x, y, rows, cols, log);                                                 \
  }                                                                                            \
  FG_KERNEL softmax_rows_##SUF(const T* x, T* y, fg_u64 rows, fg_u64 cols, int log) {          \
    fg_softmax_rows<T>(x, y, rows, cols, log);                                                 \
  }
FG_FOR_FLOAT(FG_SOFTMAX)
