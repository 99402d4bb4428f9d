// quant.cu: int8 inference kernels (src/quant/). CPU twin: src/quant/cpu.rs (each step rounded as
// here: ACC = float for f32 / f16 / bf16, double for f64).
//
// quant_rows_i8_{dt}(const T* x, signed char* q, float* scale, u64 rows, u64 cols)
//   symmetric per-row int8: a = max |x| of the row, s = a > 0 ? (float)a / 127 : 1,
//   q = clamp(rint(x * (1 / s)), -127, 127) (round half to even; what fake_quantize(x, s, 0,
//   -127, 127) rounds to). One block per row, grid-stride over rows.
// dequant_rows_i8_{dt}(const signed char* q, const float* scale, T* y, u64 rows, u64 cols)
//   y = q * scale[row], in ACC, rounded to T. Grid-stride.
// int8_scale_{dt}(const int* acc, const float* sa, const float* sb, const T* bias, T* y, u64 m,
//                 u64 n, int has_bias)
//   y[i, j] = (ACC)acc[i, j] * sa[i] * sb[j] (+ bias[j]), products rounded one by one. Grid-stride.
// int8_gemm_nt(const signed char* a, const signed char* b, int* c, u64 m, u64 n, u64 k)
//   c = a [m, k] b [n, k]^T with int32 accumulation, for the shapes cuBLASLt's IMMA kernels do not
//   take (k or a row stride not a multiple of 4). 16 x 16 tiles of c per block of 16 x 16 threads.

#include "common.cuh"

static __device__ __forceinline__ float q_mul(float a, float b) { return __fmul_rn(a, b); }
static __device__ __forceinline__ double q_mul(double a, double b) { return __dmul_rn(a, b); }
static __device__ __forceinline__ float q_rint(float v) { return rintf(v); }
static __device__ __forceinline__ double q_rint(double v) { return rint(v); }

template <typename T>
static __device__ __forceinline__ void q_rows(const T* __restrict__ x, signed char* __restrict__ q,
                                              float* __restrict__ scale, fg_u64 rows, fg_u64 cols) {
  typedef typename FgAcc<T>::type A;
  __shared__ A sh[32];
  for (fg_u64 r = blockIdx.x; r < rows; r += gridDim.x) {
    const T* xr = x + r * cols;
    A m = (A)0;
    for (fg_u64 c = threadIdx.x; c < cols; c += blockDim.x) m = fmax(m, fabs(fg_to_acc(xr[c])));
    m = fg_block_reduce(m, FgFMax(), sh);
    const float s = m > (A)0 ? (float)m / 127.0f : 1.0f;
    const A inv = (A)(1.0f / s);
    for (fg_u64 c = threadIdx.x; c < cols; c += blockDim.x) {
      const A v = fmin(fmax(q_rint(q_mul(fg_to_acc(xr[c]), inv)), (A)-127), (A)127);
      q[r * cols + c] = (signed char)(int)v;
    }
    if (threadIdx.x == 0) scale[r] = s;
  }
}

template <typename T>
static __device__ __forceinline__ void dq_rows(const signed char* __restrict__ q, const float* __restrict__ scale,
                                               T* __restrict__ y, fg_u64 rows, fg_u64 cols) {
  typedef typename FgAcc<T>::type A;
  FG_GRID_STRIDE(i, rows * cols) {
    fg_u64 r, c;
    fg_divmod(i, cols, r, c);
    y[i] = fg_from_acc<T>(q_mul((A)q[i], (A)scale[r]));
  }
}

template <typename T>
static __device__ __forceinline__ void i8_scale(const int* __restrict__ acc, const float* __restrict__ sa,
                                                const float* __restrict__ sb, const T* __restrict__ bias,
                                                T* __restrict__ y, fg_u64 m, fg_u64 n, int has_bias) {
  typedef typename FgAcc<T>::type A;
  FG_GRID_STRIDE(i, m * n) {
    fg_u64 r, c;
    fg_divmod(i, n, r, c);
    A v = q_mul(q_mul((A)acc[i], (A)sa[r]), (A)sb[c]);
    if (has_bias) v += fg_to_acc(bias[c]);
    y[i] = fg_from_acc<T>(v);
  }
}

FG_KERNEL int8_gemm_nt(const signed char* a, const signed char* b, int* c, fg_u64 m, fg_u64 n, fg_u64 k) {
  __shared__ int ta[16][17], tb[16][17];
  const fg_u64 row = (fg_u64)blockIdx.y * 16 + threadIdx.y, col = (fg_u64)blockIdx.x * 16 + threadIdx.x;
  const fg_u64 brow = (fg_u64)blockIdx.x * 16 + threadIdx.y;  // the row of b this thread loads
  int acc = 0;
  for (fg_u64 k0 = 0; k0 < k; k0 += 16) {
    const fg_u64 kk = k0 + threadIdx.x;
    ta[threadIdx.y][threadIdx.x] = (row < m && kk < k) ? (int)a[row * k + kk] : 0;
    tb[threadIdx.y][threadIdx.x] = (brow < n && kk < k) ? (int)b[brow * k + kk] : 0;
    __syncthreads();
#pragma unroll
    for (int j = 0; j < 16; ++j) acc += ta[threadIdx.y][j] * tb[threadIdx.x][j];
    __syncthreads();
  }
  if (row < m && col < n) c[row * n + col] = acc;
}

#define FG_QUANT(SUF, T)                                                                                      \
  FG_KERNEL quant_rows_i8_##SUF(const T* x, signed char* q, float* scale, fg_u64 rows, fg_u64 cols) {          \
    q_rows<T>(x, q, scale, rows, cols);                                                                       \
  }                                                                                                           \
  FG_KERNEL dequant_rows_i8_##SUF(const signed char* q, const float* scale, T* y, fg_u64 rows, fg_u64 cols) {  \
    dq_rows<T>(q, scale, y, rows, cols);                                                                      \
  }                                                                                                           \
  FG_KERNEL int8_scale_##SUF(const int* acc, const float* sa, const float* sb, const T* bias, T* y, fg_u64 m,  \
                             fg_u64 n, int has_bias) {                                                        \
    i8_scale<T>(acc, sa, sb, bias, y, m, n, has_bias);                                                        \
  }
FG_FOR_FLOAT(FG_QUANT)
