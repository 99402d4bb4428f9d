// unary.cu: elementwise maps.
// CPU twins: src/op.rs `UnaryOp::eval_f32` (f32 / f16 / bf16, computed in f32) and
// `UnaryOp::eval_f64` (f64, and the integer dtypes through `T::from_f64(eval_f64(x.to_f64()))`),
// called from src/cpu/mod.rs `CpuStorage::float_unary`.
//
// Op codes: the enum below, equal to src/op.rs `UnaryCode` (a test compares them); Affine takes
// p0 = mul, p1 = add, Powf p0 = the exponent, Clamp p0 = min, p1 = max.
//
// The op is a kernel argument, uniform over the launch: it is switched on once per pack of
// elements, not templated, so that each dtype is one kernel (NVRTC time grows with every
// instantiation). Expressions keep the CPU's evaluation order; where the CPU result is exactly
// reproducible (Sqr, Rsqrt, Recip, Sqrt, Affine, Clamp, Relu, Sign, Neg, Abs) it is reproduced
// bit for bit (Affine with explicitly unfused double multiply and add, as the CPU computes it).

#include "acc_math.cuh"

enum FgUnaryOp {
  FG_NEG = 0, FG_ABS = 1, FG_SQR = 2, FG_SIGN = 3, FG_RELU = 4, FG_EXP = 5, FG_LOG = 6, FG_SQRT = 7,
  FG_RSQRT = 8, FG_RECIP = 9, FG_TANH = 10, FG_SIGMOID = 11, FG_GELU_TANH = 12, FG_GELU_ERF = 13,
  FG_SILU = 14, FG_SIN = 15, FG_COS = 16, FG_AFFINE = 17, FG_POWF = 18, FG_CLAMP = 19,
  FG_GELU_TANH_GRAD = 20, FG_GELU_ERF_GRAD = 21, FG_SILU_GRAD = 22
};

// sin, cos and pow are large (argument reduction) and rarely hot, so they stay out of line: one copy
// per kernel instead of one per unrolled element, which keeps NVRTC time down. The rest of the math
// per accumulation type is acc_math.cuh's.
static __device__ __noinline__ float fg_sin(float x) { return sinf(x); }
static __device__ __noinline__ double fg_sin(double x) { return sin(x); }
static __device__ __noinline__ float fg_cos(float x) { return cosf(x); }
static __device__ __noinline__ double fg_cos(double x) { return cos(x); }
static __device__ __noinline__ float fg_pow(float x, float e) { return powf(x, e); }
static __device__ __noinline__ double fg_pow(double x, double e) { return pow(x, e); }

// The transcendental ops (exp, log, tanh, erf and what is built on them) are out of line: one copy
// per accumulation type instead of one per unrolled element and loop of every dtype's kernel.
// Inlined, they made this module the slowest of a cold precompile (3.1 s of NVRTC on the dev
// machine, 1.3 s out of line). The cheap ops and, in f32, the exp-based activations (the hot
// ones of elementwise traffic) stay inline.
template <typename A>
static __device__ __noinline__ A fg_unary_eval_math(int op, A x) {
  typedef FgK<A> K;
  const A one = (A)1, half = (A)0.5;
  switch (op) {
    case FG_EXP: return fg_exp(x);
    case FG_LOG: return fg_log(x);
    case FG_TANH: return fg_tanh(x);
    case FG_SIGMOID: return one / (one + fg_exp(-x));
    case FG_GELU_TANH: return fg_gelu_tanh(x);
    case FG_GELU_ERF: return half * x * (one + fg_erf(x / K::sqrt_2()));
    case FG_SILU: return x / (one + fg_exp(-x));
    case FG_SIN: return fg_sin(x);
    case FG_COS: return fg_cos(x);
    case FG_GELU_TANH_GRAD: return fg_gelu_tanh_grad(x);
    case FG_GELU_ERF_GRAD: {
      const A pdf = fg_exp(-half * x * x) * K::frac_2_sqrt_pi() / ((A)2 * K::sqrt_2());
      return half * (one + fg_erf(x / K::sqrt_2())) + x * pdf;
    }
    case FG_SILU_GRAD: {
      const A s = one / (one + fg_exp(-x));
      return s * (one + x * (one - s));
    }
    default: return x;
  }
}

template <typename A>
static __device__ __forceinline__ A fg_unary_eval(int op, A x, double p0, double p1) {
  const A one = (A)1;
  switch (op) {
    case FG_NEG: return -x;
    case FG_ABS: return fg_fabs(x);
    case FG_SQR: return x * x;
    case FG_SIGN: return x > (A)0 ? one : (x < (A)0 ? -one : (A)0);
    case FG_RELU: return (x > (A)0 || x != x) ? x : (A)0;  // NaN propagates (PyTorch)
    case FG_SQRT: return fg_sqrt(x);
    case FG_RSQRT: return one / fg_sqrt(x);
    case FG_RECIP: return one / x;
    // `(x as f64 * mul + add) as T`: two roundings in f64, never fused.
    case FG_AFFINE: return (A)__dadd_rn(__dmul_rn((double)x, p0), p1);
    case FG_POWF: return fg_pow(x, (A)p0);
    case FG_CLAMP: return x != x ? x : fg_fmin(fg_fmax(x, (A)p0), (A)p1);  // NaN propagates
    default:
      // The exp-based activations in f32 (and f16/bf16, computed in f32) stay inline, the same
      // expressions as below: out of line, sigmoid f32 fell from 3688 to 3027 GB/s on an H200 (the
      // call per element breaks up the unrolled loop's batched loads). f64 and the rest, rarely
      // hot, keep the one out-of-line copy.
      if constexpr (sizeof(A) == 4) {
        switch (op) {
          case FG_EXP: return fg_exp(x);
          case FG_SIGMOID: return one / (one + fg_exp(-x));
          case FG_SILU: return x / (one + fg_exp(-x));
          case FG_TANH: return fg_tanh(x);
          default: break;
        }
      }
      return fg_unary_eval_math<A>(op, x);
  }
}

// Integer tensors: only Neg Abs Sqr Sign Relu Affine Clamp are sent (UnaryOp::int_ok); computed in
// f64 like eval_f64, then saturated by fg_from_acc.
static __device__ __forceinline__ double fg_unary_eval_int(int op, double x, double p0, double p1) {
  switch (op) {
    case FG_NEG: return -x;
    case FG_ABS: return fabs(x);
    case FG_SQR: return x * x;
    case FG_SIGN: return x > 0.0 ? 1.0 : (x < 0.0 ? -1.0 : 0.0);
    case FG_RELU: return x > 0.0 ? x : 0.0;
    case FG_AFFINE: return __dadd_rn(__dmul_rn(x, p0), p1);
    case FG_CLAMP: return fmin(fmax(x, p0), p1);
    default: return x;  // not sent by the Rust side
  }
}

template <typename T, bool INT>
struct FgUnary {
  typedef typename FgAcc<T>::type A;
  static __device__ __forceinline__ T apply(int op, T x, double p0, double p1) {
    if (INT) return fg_from_acc<T>((A)fg_unary_eval_int(op, (double)fg_to_acc(x), p0, p1));
    return fg_from_acc<T>(fg_unary_eval<A>(op, fg_to_acc(x), p0, p1));
  }
};

template <typename T, bool INT>
static __device__ __forceinline__ void fg_unary(const Layout& xl, const T* __restrict__ x, T* __restrict__ y,
                                                fg_u64 n, int op, double p0, double p1) {
  const int mode = fg_mode(xl);
  if (mode == FG_CONTIG) {
    const T* xp = x + xl.offset;
    // A contiguous, 16-byte-aligned float tensor gets here only for sin, cos and powf: every
    // other op runs `unary_vec_*` / `unary_vec_math_*` below (PyTorch's traversal).
    if constexpr (INT) {  // rare: one loop (NVRTC time grows with every inlined copy)
      FG_GRID_STRIDE(i, n) y[i] = FgUnary<T, INT>::apply(op, xp[i], p0, p1);
    } else {
      fg_unrolled(n, [&](fg_u64 i) { return xp[i]; },
                  [&](fg_u64 i, T v) { y[i] = FgUnary<T, INT>::apply(op, v, p0, p1); });
    }
    return;
  }
  FG_GRID_STRIDE(i, n) y[i] = FgUnary<T, INT>::apply(op, x[fg_offset_m(xl, mode, i)], p0, p1);
}

// ---- unary_vec_*: the hot activations of contiguous, aligned f32 / f16 / bf16 tensors, alone ----
//
// V = 16 / sizeof(T) elements per access (LDG.E.128 / STG.E.128) in PyTorch's traversal
// (`vectorized_elementwise_kernel`): 128-thread blocks, each owning 2 x 128 consecutive vectors; a
// thread loads its two (t and t + 128) before it computes. The op is a template argument (one
// loop per op). A kernel of its own, apart from `unary_*` (which walks strided layouts and runs
// every op): inside that kernel, with its 60 registers, the same traversal ran at half occupancy,
// where the exp-based ops could not hide their math (sigmoid f32 at 92% of a device copy on an
// H200), and its own traversal (four vectors a grid apart, then the only vector path) held
// relu / sigmoid / x * 2 at 97% against PyTorch's 99%. Alone it takes 34 registers (f32) and
// moves 99-100% of a copy on an H200 and an H100 (BENCHMARKS.md, 2026-11-25 twentieth session).
// With scalar loads these ops had reached 0.87-0.92x of PyTorch's GB/s. The n % V tail goes
// element by element to the first threads. Results are bitwise those of `unary_*` (the same
// FgUnary::apply per element; test unary_paths). Launched by src/cuda/ops/unary.rs
// (`VEC_THREADS`, `VEC_PER` mirror the two defines).
#define FG_VEC_THREADS 128
#define FG_VEC_PER 2

template <typename T, int OP>
static __device__ __forceinline__ void fg_unary_tile(const T* __restrict__ x, T* __restrict__ y, fg_u64 n, double p0,
                                                     double p1) {
  constexpr int V = 16 / (int)sizeof(T);
  typedef FgPack<T, V> P;
  const P* xv = reinterpret_cast<const P*>(x);
  P* yv = reinterpret_cast<P*>(y);
  const fg_u64 nv = n / V, tile = (fg_u64)FG_VEC_THREADS * FG_VEC_PER;
  const fg_u64 stride = (fg_u64)gridDim.x * tile;
  for (fg_u64 base = (fg_u64)blockIdx.x * tile + threadIdx.x; base < nv; base += stride) {
    P v[FG_VEC_PER];
#pragma unroll
    for (int j = 0; j < FG_VEC_PER; ++j)
      if (base + j * FG_VEC_THREADS < nv) v[j] = xv[base + j * FG_VEC_THREADS];
#pragma unroll
    for (int j = 0; j < FG_VEC_PER; ++j) {
      if (base + j * FG_VEC_THREADS < nv) {
        P o;
#pragma unroll
        for (int e = 0; e < V; ++e) o.v[e] = FgUnary<T, false>::apply(OP, v[j].v[e], p0, p1);
        yv[base + j * FG_VEC_THREADS] = o;
      }
    }
  }
  for (fg_u64 i = nv * V + fg_tid(); i < n; i += fg_nthreads()) y[i] = FgUnary<T, false>::apply(OP, x[i], p0, p1);
}

#define FG_UNARY_VEC(SUF, T)                                                                             \
  extern "C" __global__ void __launch_bounds__(FG_VEC_THREADS)                                          \
      unary_vec_##SUF(const T* x, T* y, fg_u64 n, int op, double p0, double p1) {                       \
    switch (op) {                                                                                        \
      case FG_RELU: fg_unary_tile<T, FG_RELU>(x, y, n, p0, p1); break;                                   \
      case FG_SIGMOID: fg_unary_tile<T, FG_SIGMOID>(x, y, n, p0, p1); break;                             \
      case FG_SILU: fg_unary_tile<T, FG_SILU>(x, y, n, p0, p1); break;                                   \
      case FG_AFFINE: fg_unary_tile<T, FG_AFFINE>(x, y, n, p0, p1); break;                               \
      default: break; /* not sent: src/cuda/ops/unary.rs `vec_kernel` */                                  \
    }                                                                                                    \
  }
FG_UNARY_VEC(f32, float)
FG_UNARY_VEC(f16, __half)
FG_UNARY_VEC(bf16, __nv_bfloat16)

// The other float ops of the same tensors (all but sin, cos and pow, rare and large), in a second
// kernel so that their larger register count (tanh and the out-of-line math: 38 against 34 for
// f32) does not lower the occupancy of the four above. In `unary_*`'s scalar loop tanh f32 moved
// 66% of a device copy on an H200 (89% once that kernel lost its vector path's registers).
#define FG_VEC_CASE(T, OPC) \
  case OPC:                 \
    fg_unary_tile<T, OPC>(x, y, n, p0, p1); \
    break;
#define FG_UNARY_VEC_MATH(SUF, T)                                                                 \
  extern "C" __global__ void __launch_bounds__(FG_VEC_THREADS)                                   \
      unary_vec_math_##SUF(const T* x, T* y, fg_u64 n, int op, double p0, double p1) {           \
    switch (op) {                                                                                 \
      FG_VEC_CASE(T, FG_NEG) FG_VEC_CASE(T, FG_ABS) FG_VEC_CASE(T, FG_SQR) FG_VEC_CASE(T, FG_SIGN) \
      FG_VEC_CASE(T, FG_EXP) FG_VEC_CASE(T, FG_LOG) FG_VEC_CASE(T, FG_SQRT)                       \
      FG_VEC_CASE(T, FG_RSQRT) FG_VEC_CASE(T, FG_RECIP) FG_VEC_CASE(T, FG_TANH)                   \
      FG_VEC_CASE(T, FG_GELU_TANH) FG_VEC_CASE(T, FG_GELU_ERF) FG_VEC_CASE(T, FG_CLAMP)           \
      FG_VEC_CASE(T, FG_GELU_TANH_GRAD) FG_VEC_CASE(T, FG_GELU_ERF_GRAD)                          \
      FG_VEC_CASE(T, FG_SILU_GRAD)                                                                \
      default: break; /* not sent: src/cuda/ops/unary.rs `vec_kernel` */                          \
    }                                                                                             \
  }
FG_UNARY_VEC_MATH(f32, float)
FG_UNARY_VEC_MATH(f16, __half)
FG_UNARY_VEC_MATH(bf16, __nv_bfloat16)

#define FG_UNARY_F(SUF, T)                                                                     \
  FG_KERNEL unary_##SUF(Layout xl, const T* x, T* y, fg_u64 n, int op, double p0, double p1) {  \
    fg_unary<T, false>(xl, x, y, n, op, p0, p1);                                               \
  }
#define FG_UNARY_I(SUF, T)                                                                     \
  FG_KERNEL unary_##SUF(Layout xl, const T* x, T* y, fg_u64 n, int op, double p0, double p1) {  \
    fg_unary<T, true>(xl, x, y, n, op, p0, p1);                                                \
  }
FG_FOR_FLOAT(FG_UNARY_F)
FG_FOR_INT(FG_UNARY_I)
