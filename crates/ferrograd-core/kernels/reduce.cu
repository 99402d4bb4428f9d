// reduce.cu: row reductions of a contiguous [rows, cols] matrix.
// CPU twins: src/cpu/reduce.rs `fold` (Sum / Max / Min, max and min propagate NaN, empty folds give
// 0 / -inf / +inf) and `arg_reduce_t` (ArgMax / ArgMin: first index wins ties, the first NaN wins).
//
// reduce_{dt}(const T* x, ACC* y, u64 rows, u64 cols, int op): y[r] = fold of row r in ACC.
// reduce_acc_{f32,f64}: the same code under a second name, for the second stage of big reductions
// (the Rust side may equally call reduce_f32 / reduce_f64 for it).
// argreduce_{dt}(const T* x, unsigned int* y, u64 rows, u64 cols, int op).
// One block per row, grid-stride over rows; blockDim any multiple of 32 up to 1024. Each thread
// folds a strided slice of the row (coalesced, 4 loads in flight), then warp shuffles, then one
// value per warp through shared memory.

#include "common.cuh"

// Op codes, equal to src/op.rs `ReduceOp` and `ArgReduceOp` (a test compares them).
enum FgReduceOp { FG_SUM = 0, FG_MAX = 1, FG_MIN = 2 };
enum FgArgReduceOp { FG_ARG_MAX = 0, FG_ARG_MIN = 1 };

template <typename T, typename Op>
static __device__ __forceinline__ void fg_reduce_rows(const T* __restrict__ x, typename FgAcc<T>::type* __restrict__ y,
                                                      fg_u64 rows, fg_u64 cols, Op op) {
  typedef typename FgAcc<T>::type A;
  __shared__ A sh[32];
  const unsigned int bs = blockDim.x;
  for (fg_u64 r = blockIdx.x; r < rows; r += gridDim.x) {
    const T* row = x + r * cols;
    A acc = op.template identity<A>();
    fg_u64 j = threadIdx.x;
    for (; j + 3 * bs < cols; j += 4 * bs) {
      const T v0 = row[j], v1 = row[j + bs], v2 = row[j + 2 * bs], v3 = row[j + 3 * bs];
      acc = op(acc, fg_to_acc(v0));
      acc = op(acc, fg_to_acc(v1));
      acc = op(acc, fg_to_acc(v2));
      acc = op(acc, fg_to_acc(v3));
    }
    for (; j < cols; j += bs) acc = op(acc, fg_to_acc(row[j]));
    acc = fg_block_reduce(acc, op, sh);
    if (threadIdx.x == 0) y[r] = acc;
  }
}

template <typename T>
static __device__ __forceinline__ void fg_reduce(const T* x, typename FgAcc<T>::type* y, fg_u64 rows, fg_u64 cols,
                                                 int op) {
  switch (op) {
    case FG_SUM: fg_reduce_rows<T>(x, y, rows, cols, FgSum()); break;
    case FG_MAX: fg_reduce_rows<T>(x, y, rows, cols, FgMax()); break;
    default: fg_reduce_rows<T>(x, y, rows, cols, FgMin()); break;
  }
}

#define FG_REDUCE(SUF, T)                                                                      \
  FG_KERNEL reduce_##SUF(const T* x, FgAcc<T>::type* y, fg_u64 rows, fg_u64 cols, int op) {     \
    fg_reduce<T>(x, y, rows, cols, op);                                                        \
  }
FG_FOR_ALL(FG_REDUCE)

FG_KERNEL reduce_acc_f32(const float* x, float* y, fg_u64 rows, fg_u64 cols, int op) {
  fg_reduce<float>(x, y, rows, cols, op);
}
FG_KERNEL reduce_acc_f64(const double* x, double* y, fg_u64 rows, fg_u64 cols, int op) {
  fg_reduce<double>(x, y, rows, cols, op);
}

// ---------------------------------------------------------------------------------------------
// argreduce: (value, index) pairs; index FG_NONE marks "no element seen" (empty rows give 0).
// ---------------------------------------------------------------------------------------------

#define FG_NONE 0xffffffffu

// Does candidate (v2, i2) beat the current (v1, i1)? NaN beats everything but an earlier NaN;
// otherwise the strictly better value wins, and equal values go to the lower index.
template <typename A>
static __device__ __forceinline__ bool fg_arg_better(bool is_max, A v1, unsigned int i1, A v2, unsigned int i2) {
  if (i2 == FG_NONE) return false;
  if (i1 == FG_NONE) return true;
  const bool n1 = v1 != v1, n2 = v2 != v2;
  if (n1 || n2) return n1 && n2 ? i2 < i1 : n2;
  if (v2 == v1) return i2 < i1;
  return is_max ? v2 > v1 : v2 < v1;
}

template <typename T>
static __device__ __forceinline__ void fg_argreduce(const T* __restrict__ x, unsigned int* __restrict__ y, fg_u64 rows,
                                                    fg_u64 cols, int op) {
  typedef typename FgAcc<T>::type A;
  __shared__ A shv[32];
  __shared__ unsigned int shi[32];
  const bool is_max = op == FG_ARG_MAX;
  const unsigned int bs = blockDim.x, lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = bs >> 5;
  for (fg_u64 r = blockIdx.x; r < rows; r += gridDim.x) {
    const T* row = x + r * cols;
    A bv = (A)0;
    unsigned int bi = FG_NONE;
    // Ascending j, so within a thread a tie keeps the earlier index and the first NaN stays.
    for (fg_u64 j = threadIdx.x; j < cols; j += bs) {
      const A v = fg_to_acc(row[j]);
      if (bi != FG_NONE && bv != bv) break;
      if (bi == FG_NONE || v != v || (is_max ? v > bv : v < bv)) {
        bv = v;
        bi = (unsigned int)j;
      }
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
      const A ov = __shfl_xor_sync(0xffffffffu, bv, o);
      const unsigned int oi = __shfl_xor_sync(0xffffffffu, bi, o);
      if (fg_arg_better(is_max, bv, bi, ov, oi)) {
        bv = ov;
        bi = oi;
      }
    }
    if (nw > 1) {
      __syncthreads();
      if (lane == 0) {
        shv[warp] = bv;
        shi[warp] = bi;
      }
      __syncthreads();
      bv = lane < nw ? shv[lane] : (A)0;
      bi = lane < nw ? shi[lane] : FG_NONE;
#pragma unroll
      for (int o = 16; o > 0; o >>= 1) {
        const A ov = __shfl_xor_sync(0xffffffffu, bv, o);
        const unsigned int oi = __shfl_xor_sync(0xffffffffu, bi, o);
        if (fg_arg_better(is_max, bv, bi, ov, oi)) {
          bv = ov;
          bi = oi;
        }
      }
    }
    if (threadIdx.x == 0) y[r] = bi == FG_NONE ? 0u : bi;
  }
}

#define FG_ARGREDUCE(SUF, T)                                                                   \
  FG_KERNEL argreduce_##SUF(const T* x, unsigned int* y, fg_u64 rows, fg_u64 cols, int op) {    \
    fg_argreduce<T>(x, y, rows, cols, op);                                                     \
  }
FG_FOR_ALL(FG_ARGREDUCE)
