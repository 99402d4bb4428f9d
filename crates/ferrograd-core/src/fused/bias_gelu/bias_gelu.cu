// bias_gelu.cu: y = gelu_tanh(x + b) and its backward (src/fused/bias_gelu/).
// CPU twin: src/fused/bias_gelu/cpu.rs (z = x + b rounded to T, then UnaryOp::GeluTanh /
// GeluTanhGrad of src/op.rs; on the device acc_math.cuh's fg_gelu_tanh / fg_gelu_tanh_grad, the
// ones unary.cu uses).
//
// bias_gelu_fwd_{dt}(const T* x, const T* b, T* y, u64 rows, u64 cols)
//   x, y contiguous [rows, cols], b [cols]; grid-stride over the elements.
// bias_gelu_bwd_{dt}(const T* dy, const T* x, const T* b, T* dx, ACC* part, u64 rows, u64 cols,
//                    u64 rps)
//   dx = dy * gelu'(x + b), rounded to T. Block (bx, by) owns columns [bx * blockDim.x, ...) and rows
//   [by * rps, (by + 1) * rps): neighbouring threads read neighbouring columns of a row (coalesced)
//   and each keeps the sum of its column's dx values as stored (rounded to T) in ACC, written to
//   part[by * cols + column]: deterministic, no atomics.
// bias_gelu_colsum_{dt}(const ACC* part, T* db, u64 splits, u64 cols)
//   db[c] = the sum of the `splits` partial rows of column c, rounded once to T.

#include "acc_math.cuh"
#include "col_sums.cuh"

// z = x + b rounded to T (PyTorch's x + b), in ACC.
template <typename T>
static __device__ __forceinline__ typename FgAcc<T>::type bg_pre(T x, T b) {
  return fg_to_acc(fg_from_acc<T>(fg_to_acc(x) + fg_to_acc(b)));
}

template <typename T>
static __device__ __forceinline__ void bg_fwd(const T* __restrict__ x, const T* __restrict__ b, T* __restrict__ y,
                                              fg_u64 rows, fg_u64 cols) {
  typedef typename FgAcc<T>::type A;
  FG_GRID_STRIDE(i, rows * cols) {
    fg_u64 r, c;
    fg_divmod(i, cols, r, c);
    y[i] = fg_from_acc<T>(fg_gelu_tanh<A>(bg_pre(x[i], b[c])));
  }
}

template <typename T>
static __device__ __forceinline__ void bg_bwd(const T* __restrict__ dy, const T* __restrict__ x,
                                              const T* __restrict__ b, T* __restrict__ dx,
                                              typename FgAcc<T>::type* __restrict__ part, fg_u64 rows, fg_u64 cols,
                                              fg_u64 rps) {
  typedef typename FgAcc<T>::type A;
  const fg_u64 c = (fg_u64)blockIdx.x * blockDim.x + threadIdx.x;
  if (c >= cols) return;
  const fg_u64 r0 = (fg_u64)blockIdx.y * rps;
  const fg_u64 r1 = r0 + rps < rows ? r0 + rps : rows;
  const T bc = b[c];
  A acc = (A)0;
  for (fg_u64 r = r0; r < r1; ++r) {
    const fg_u64 i = r * cols + c;
    const T d = fg_from_acc<T>(fg_to_acc(dy[i]) * fg_gelu_tanh_grad<A>(bg_pre(x[i], bc)));
    dx[i] = d;
    acc += fg_to_acc(d);
  }
  part[(fg_u64)blockIdx.y * cols + c] = acc;
}

#define FG_BIAS_GELU(SUF, T)                                                                                  \
  FG_KERNEL bias_gelu_fwd_##SUF(const T* x, const T* b, T* y, fg_u64 rows, fg_u64 cols) {                     \
    bg_fwd<T>(x, b, y, rows, cols);                                                                           \
  }                                                                                                           \
  FG_KERNEL bias_gelu_bwd_##SUF(const T* dy, const T* x, const T* b, T* dx, FgAcc<T>::type* part, fg_u64 rows, \
                                fg_u64 cols, fg_u64 rps) {                                                    \
    bg_bwd<T>(dy, x, b, dx, part, rows, cols, rps);                                                           \
  }                                                                                                           \
  FG_KERNEL bias_gelu_colsum_##SUF(const FgAcc<T>::type* part, T* db, fg_u64 splits, fg_u64 cols) {          \
    fg_col_sums<T>(part, db, splits, cols);                                                                     \
  }
FG_FOR_FLOAT(FG_BIAS_GELU)
