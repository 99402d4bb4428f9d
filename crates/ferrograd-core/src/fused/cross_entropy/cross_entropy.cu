// cross_entropy.cu: fused cross entropy over the rows of [rows, cols] logits, forward and backward.
// CPU twin: src/fused/cross_entropy/cpu.rs (each row in f64; here in ACC: float for f32 / f16 /
// bf16, double for f64).
//
// Targets arrive encoded (src/fused/cross_entropy/mod.rs `encode_targets`): a u32 class id per row,
// already checked against cols, or FG_CE_IGNORED (0xffffffff) for a row whose target is the ignore
// index. The row pass's pieces (merge, log-sum-exp, target decoding, loss) are ce_row.cuh's, shared
// with the fused classifier (src/fused/classifier/classifier.cu).
//
// cross_entropy_fwd_{f32,f64,f16,bf16}(const T* x, const unsigned int* t, ACC* loss, ACC* lse,
//                                      ACC* kept, u64 rows, u64 cols)
//   x contiguous [rows, cols]; loss, lse, kept [rows]. One read of each row: every thread keeps an
//   online (max m, s = sum exp(x - m)) pair over its columns (s rescaled when m grows: one exp per
//   element), pairs merge as s1 e^(m1-M) + s2 e^(m2-M) with xor shuffles, then across warps through
//   shared memory. If the row max is not finite (all -inf, or +inf present) the sum is re-taken
//   against 0 as the CPU does (a second read of that row only). lse = mf + ln(s),
//   loss = ln(s) - (x[t] - mf) (mf = the max, or 0), kept = 1; an ignored row gets loss = 0,
//   kept = 0 (and its lse, which may be -inf: never NaN).
// cross_entropy_bwd_{f32,f64,f16,bf16}(const T* x, const unsigned int* t, const ACC* lse,
//                                      const ACC* scale, T* dx, u64 rows, u64 cols)
//   dx[r][j] = scale[0] * (exp(x[r][j] - lse[r]) - (j == t[r])), 0 on ignored rows. One read of x,
//   one write of dx, no reductions. `scale` is one ACC element on the device (upstream gradient /
//   kept count), so the launch needs no host read.
//
// Both kernels take any grid and any blockDim that is a multiple of 32 up to 1024. Rows of
// cols <= FG_CE_WARP_COLS go one warp per row (warp w of block b takes rows b * W + w, strided by
// gridDim.x * W, W = blockDim.x / 32; no shared memory, no barriers); longer rows one block per row
// (grid-stride over rows). The choice depends on cols only, so it is uniform over the grid; the Rust
// side (src/fused/cross_entropy/cuda.rs `ce_cfg`) picks the launch shape that suits it.

#include "ce_row.cuh"

#if !defined(FG_CE_WARP_COLS)
#error "FG_CE_WARP_COLS comes from Rust (src/fused/cross_entropy/mod.rs)"
#endif

// The rows this thread works on: a unit (a warp, or the whole block) per row.
struct FgCeGeom {
  unsigned int g, t;  // threads in the unit, this thread's index in it
  fg_u64 r0, step;
  bool block;
};

static __device__ __forceinline__ FgCeGeom fg_ce_geom(fg_u64 cols) {
  FgCeGeom q;
  q.block = cols > FG_CE_WARP_COLS;
  if (q.block) {
    q.g = blockDim.x;
    q.t = threadIdx.x;
    q.r0 = blockIdx.x;
    q.step = gridDim.x;
  } else {
    const unsigned int wpb = blockDim.x >> 5;
    q.g = 32;
    q.t = threadIdx.x & 31;
    q.r0 = (fg_u64)blockIdx.x * wpb + (threadIdx.x >> 5);
    q.step = (fg_u64)gridDim.x * wpb;
  }
  return q;
}

template <typename T>
static __device__ __forceinline__ void fg_ce_fwd(const T* __restrict__ x, const unsigned int* __restrict__ t,
                                                 typename FgAcc<T>::type* __restrict__ loss,
                                                 typename FgAcc<T>::type* __restrict__ lse,
                                                 typename FgAcc<T>::type* __restrict__ kept, fg_u64 rows,
                                                 fg_u64 cols) {
  typedef typename FgAcc<T>::type A;
  __shared__ A shm[32], shs[32];
  const FgCeGeom q = fg_ce_geom(cols);
  for (fg_u64 r = q.r0; r < rows; r += q.step) {
    const T* xr = x + r * cols;
    A m = -fg_inf<A>(), s = (A)0;
    fg_u64 j = q.t;
    // Four loads in flight per thread, then the remainder.
    for (; j + 3 * (fg_u64)q.g < cols; j += 4 * (fg_u64)q.g) {
      const A a = fg_to_acc(xr[j]), b = fg_to_acc(xr[j + q.g]);
      const A c = fg_to_acc(xr[j + 2 * (fg_u64)q.g]), d = fg_to_acc(xr[j + 3 * (fg_u64)q.g]);
      fg_online_push(m, s, a);
      fg_online_push(m, s, b);
      fg_online_push(m, s, c);
      fg_online_push(m, s, d);
    }
    for (; j < cols; j += q.g) fg_online_push(m, s, fg_to_acc(xr[j]));
    fg_ce_unit_merge(m, s, q.block, shm, shs);
    const FgCeLse<A> l = fg_ce_lse(m, s, [&](A mf) {
      A u = (A)0;
      for (fg_u64 k = q.t; k < cols; k += q.g) u += fg_exp(fg_to_acc(xr[k]) - mf);
      return q.block ? fg_block_reduce(u, FgSum(), shs) : fg_warp_reduce(u, FgSum());
    });
    if (q.t == 0) {
      const unsigned int c = t[r];
      lse[r] = l.lse();
      loss[r] = fg_ce_loss(c, fg_ce_target_logit(xr, c), l);
      kept[r] = fg_ce_kept(c) ? (A)1 : (A)0;
    }
  }
}

template <typename T>
static __device__ __forceinline__ void fg_ce_bwd(const T* __restrict__ x, const unsigned int* __restrict__ t,
                                                 const typename FgAcc<T>::type* __restrict__ lse,
                                                 const typename FgAcc<T>::type* __restrict__ scale,
                                                 T* __restrict__ dx, fg_u64 rows, fg_u64 cols) {
  typedef typename FgAcc<T>::type A;
  const FgCeGeom q = fg_ce_geom(cols);
  const A sc = scale[0];
  for (fg_u64 r = q.r0; r < rows; r += q.step) {
    const T* xr = x + r * cols;
    T* dr = dx + r * cols;
    const unsigned int c = t[r];
    if (!fg_ce_kept(c)) {
      for (fg_u64 j = q.t; j < cols; j += q.g) dr[j] = fg_from_acc<T>((A)0);
      continue;
    }
    const A l = lse[r];
    fg_u64 j = q.t;
    for (; j + 3 * (fg_u64)q.g < cols; j += 4 * (fg_u64)q.g) {
      A v[4];
#pragma unroll
      for (int k = 0; k < 4; ++k) v[k] = fg_to_acc(xr[j + k * (fg_u64)q.g]);
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        const fg_u64 jj = j + k * (fg_u64)q.g;
        const A p = fg_exp(v[k] - l);
        dr[jj] = fg_from_acc<T>(sc * (jj == c ? p - (A)1 : p));
      }
    }
    for (; j < cols; j += q.g) {
      const A p = fg_exp(fg_to_acc(xr[j]) - l);
      dr[j] = fg_from_acc<T>(sc * (j == c ? p - (A)1 : p));
    }
  }
}

#define FG_CROSS_ENTROPY(SUF, T)                                                                      \
  FG_KERNEL cross_entropy_fwd_##SUF(const T* x, const unsigned int* t, FgAcc<T>::type* loss,         \
                                    FgAcc<T>::type* lse, FgAcc<T>::type* kept, fg_u64 rows,           \
                                    fg_u64 cols) {                                                    \
    fg_ce_fwd<T>(x, t, loss, lse, kept, rows, cols);                                                  \
  }                                                                                                   \
  FG_KERNEL cross_entropy_bwd_##SUF(const T* x, const unsigned int* t, const FgAcc<T>::type* lse,    \
                                    const FgAcc<T>::type* scale, T* dx, fg_u64 rows, fg_u64 cols) {   \
    fg_ce_bwd<T>(x, t, lse, scale, dx, rows, cols);                                                   \
  }
FG_FOR_FLOAT(FG_CROSS_ENTROPY)
