// binary.cu: elementwise binary ops, comparisons and where.
// CPU twins: src/cpu/mod.rs `bin_f32` / `bin_f64` (BackendStorage::binary: floats in f32 for
// f32 / f16 / bf16, f64 for f64; integers in f64, `Div` truncated, then `T::from_f64` saturating),
// `cmp_f64` (BackendStorage::cmp) and `BackendStorage::where_cond`.
//
// Op codes: the enums below, equal to src/op.rs `BinaryOp` and `CmpOp` (a test compares them):
// Rem is floored (the sign of the divisor, as Python's % and torch.remainder), MaskPositive is
// `a where b > 0, else 0` (ReLU's backward in one kernel). The op is uniform over a launch and
// switched on per element (one kernel per dtype keeps NVRTC time down; the branch costs nothing
// next to the memory traffic).

#include "common.cuh"

enum FgBinaryOp { FG_ADD = 0, FG_SUB = 1, FG_MUL = 2, FG_DIV = 3, FG_MAXIMUM = 4, FG_MINIMUM = 5, FG_REM = 6, FG_MASK_POSITIVE = 7 };
enum FgCmpOp { FG_EQ = 0, FG_NE = 1, FG_LT = 2, FG_LE = 3, FG_GT = 4, FG_GE = 5 };

// bin_f64 / bin_f32 in ACC; maximum / minimum: a if a is NaN or a >= b (<=) else b.
// Floored remainder out of line: fmod is a long loop, and inlined into every unrolled element of
// every dtype it was most of this module's NVRTC time; Rem is rare.
template <typename A>
static __device__ __noinline__ A fg_rem(A a, A b) {
  A r = fmod(a, b);
  return (r != A(0) && ((r < A(0)) != (b < A(0)))) ? r + b : r;
}

template <typename A>
static __device__ __forceinline__ A fg_binary_eval(int op, A a, A b) {
  switch (op) {
    case FG_ADD: return a + b;
    case FG_SUB: return a - b;
    case FG_MUL: return a * b;
    case FG_DIV: return a / b;
    case FG_MAXIMUM: return (a != a || a >= b) ? a : b;
    case FG_MINIMUM: return (a != a || a <= b) ? a : b;
    case FG_MASK_POSITIVE: return (b > A(0) || b != b) ? a : A(0);  // NaN x passes g, as PyTorch
    default: return fg_rem(a, b);  // FG_REM
  }
}

template <typename T>
struct FgBinary {
  typedef typename FgAcc<T>::type A;
  // Integers: the f64 result is saturated by fg_from_acc, which also truncates toward zero (so
  // integer Div truncates, x/0 saturates to the type's max/min and 0/0 gives 0, as on the CPU).
  static __device__ __forceinline__ T apply(int op, T a, T b) {
    return fg_from_acc<T>(fg_binary_eval<A>(op, fg_to_acc(a), fg_to_acc(b)));
  }
};

// Both operands and the output contiguous and 16-byte aligned, a floating dtype and a common op:
// V = 16 / sizeof(T) elements per access (8 for f16 / bf16, 4 for f32, 2 for f64), LDG.E.128 /
// STG.E.128, four vectors in flight per thread; the n % V tail element by element. Each element
// is computed exactly as in the scalar path, so the results are bitwise the same. The op is a
// template argument here (one loop per op): switching per element inside the unrolled vector loop
// made NVRTC inline the whole switch V x 4 times per dtype (binary took 18 s to compile, 4x the
// CUBIN); Rem and the integer dtypes keep the scalar loop (rare, or their own cost dominates).
template <typename T> struct FgVecBinary { static constexpr bool ok = false; };
template <> struct FgVecBinary<float> { static constexpr bool ok = true; };
template <> struct FgVecBinary<double> { static constexpr bool ok = true; };
template <> struct FgVecBinary<__half> { static constexpr bool ok = true; };
template <> struct FgVecBinary<__nv_bfloat16> { static constexpr bool ok = true; };

template <typename T, int OP>
static __device__ __forceinline__ void fg_binary_vec_op(const T* __restrict__ a, const T* __restrict__ b,
                                                        T* __restrict__ y, fg_u64 n) {
  constexpr int V = 16 / (int)sizeof(T);
  typedef FgPack<T, V> P;
  const P* av = reinterpret_cast<const P*>(a);
  const P* bv = reinterpret_cast<const P*>(b);
  P* yv = reinterpret_cast<P*>(y);
  const fg_u64 nv = n / V;
  fg_unrolled(nv, [&](fg_u64 i) { return FgPack<P, 2>{{av[i], bv[i]}}; },
              [&](fg_u64 i, const FgPack<P, 2>& v) {
                P o;
#pragma unroll
                for (int e = 0; e < V; ++e) o.v[e] = FgBinary<T>::apply(OP, v.v[0].v[e], v.v[1].v[e]);
                yv[i] = o;
              });
  FG_GRID_STRIDE(k, n - nv * V) {
    const fg_u64 i = nv * V + k;
    y[i] = FgBinary<T>::apply(OP, a[i], b[i]);
  }
}

// Whether the vector path took the op (false: the caller runs the scalar loop).
template <typename T>
static __device__ __forceinline__ bool fg_binary_vec(const T* __restrict__ a, const T* __restrict__ b,
                                                     T* __restrict__ y, fg_u64 n, int op) {
  if constexpr (!FgVecBinary<T>::ok) {
    return false;
  } else {
    switch (op) {
      case FG_ADD: fg_binary_vec_op<T, FG_ADD>(a, b, y, n); return true;
      case FG_SUB: fg_binary_vec_op<T, FG_SUB>(a, b, y, n); return true;
      case FG_MUL: fg_binary_vec_op<T, FG_MUL>(a, b, y, n); return true;
      case FG_DIV: fg_binary_vec_op<T, FG_DIV>(a, b, y, n); return true;
      case FG_MAXIMUM: fg_binary_vec_op<T, FG_MAXIMUM>(a, b, y, n); return true;
      case FG_MINIMUM: fg_binary_vec_op<T, FG_MINIMUM>(a, b, y, n); return true;
      case FG_MASK_POSITIVE: fg_binary_vec_op<T, FG_MASK_POSITIVE>(a, b, y, n); return true;
      default: return false;
    }
  }
}

template <typename T>
static __device__ __forceinline__ void fg_binary(const Layout& al, const T* __restrict__ a, const Layout& bl,
                                                 const T* __restrict__ b, T* __restrict__ y, fg_u64 n, int op) {
  const int am = fg_mode(al), bm = fg_mode(bl);
  if (am == FG_CONTIG && bm == FG_CONTIG) {
    const T* ap = a + al.offset;
    const T* bp = b + bl.offset;
    if (fg_aligned(ap, 16) && fg_aligned(bp, 16) && fg_aligned(y, 16) && fg_binary_vec<T>(ap, bp, y, n, op)) return;
    if constexpr (FgVecBinary<T>::ok) {
      fg_unrolled(n, [&](fg_u64 i) { return FgPack<T, 2>{{ap[i], bp[i]}}; },
                  [&](fg_u64 i, const FgPack<T, 2>& v) { y[i] = FgBinary<T>::apply(op, v.v[0], v.v[1]); });
    } else {  // integers, rare: one loop (NVRTC time grows with every inlined copy)
      FG_GRID_STRIDE(i, n) y[i] = FgBinary<T>::apply(op, ap[i], bp[i]);
    }
    return;
  }
  FG_GRID_STRIDE(i, n) y[i] = FgBinary<T>::apply(op, a[fg_offset_m(al, am, i)], b[fg_offset_m(bl, bm, i)]);
}

#define FG_BINARY(SUF, T)                                                                      \
  FG_KERNEL binary_##SUF(Layout al, const T* a, Layout bl, const T* b, T* y, fg_u64 n, int op) { \
    fg_binary<T>(al, a, bl, b, y, n, op);                                                      \
  }
// Which kernels this module holds (`-D FG_BINARY_PART=<n>`, cuda/modules.rs BINARY*): one module
// of all 20 took 5 s of NVRTC; three parts (binary f32 / f64, binary f16 / bf16, the integer
// binaries with every cmp and where) compile in parallel, and a run compiles only what it
// launches. cuda/ops/binary.rs `module` picks the part.
#if !defined(FG_BINARY_PART)
#error "FG_BINARY_PART comes from Rust (src/cuda/modules.rs)"
#elif FG_BINARY_PART == 0
FG_BINARY(f32, float)
FG_BINARY(f64, double)
#elif FG_BINARY_PART == 1
FG_BINARY(f16, __half)
FG_BINARY(bf16, __nv_bfloat16)
#elif FG_BINARY_PART == 2
FG_FOR_INT(FG_BINARY)
#else
#error "FG_BINARY_PART is 0..2"
#endif

// ---------------------------------------------------------------------------------------------
// cmp_{dt}: y = (a op b) as u8. The CPU compares the exact f64 values; comparing in the native
// type (f16 / bf16 widened to f32) is the same relation.
// ---------------------------------------------------------------------------------------------

template <typename T> struct FgCmpType { typedef T type; };
template <> struct FgCmpType<__half> { typedef float type; };
template <> struct FgCmpType<__nv_bfloat16> { typedef float type; };

static __device__ __forceinline__ float fg_cmp_widen(__half x) { return __half2float(x); }
static __device__ __forceinline__ float fg_cmp_widen(__nv_bfloat16 x) { return __bfloat162float(x); }
template <typename T> static __device__ __forceinline__ T fg_cmp_widen(T x) { return x; }

template <typename C>
static __device__ __forceinline__ unsigned char fg_cmp_eval(int op, C a, C b) {
  bool r;
  switch (op) {
    case FG_EQ: r = a == b; break;
    case FG_NE: r = a != b; break;
    case FG_LT: r = a < b; break;
    case FG_LE: r = a <= b; break;
    case FG_GT: r = a > b; break;
    default: r = a >= b; break;  // FG_GE
  }
  return (unsigned char)r;
}

template <typename T>
static __device__ __forceinline__ void fg_cmp(const Layout& al, const T* __restrict__ a, const Layout& bl,
                                              const T* __restrict__ b, unsigned char* __restrict__ y, fg_u64 n,
                                              int op) {
  typedef typename FgCmpType<T>::type C;
  const int am = fg_mode(al), bm = fg_mode(bl);
  if (am == FG_CONTIG && bm == FG_CONTIG) {
    const T* ap = a + al.offset;
    const T* bp = b + bl.offset;
    fg_unrolled(n, [&](fg_u64 i) { return FgPack<T, 2>{{ap[i], bp[i]}}; },
                [&](fg_u64 i, const FgPack<T, 2>& v) {
                  y[i] = fg_cmp_eval<C>(op, fg_cmp_widen(v.v[0]), fg_cmp_widen(v.v[1]));
                });
    return;
  }
  FG_GRID_STRIDE(i, n) {
    y[i] = fg_cmp_eval<C>(op, fg_cmp_widen(a[fg_offset_m(al, am, i)]), fg_cmp_widen(b[fg_offset_m(bl, bm, i)]));
  }
}

#define FG_CMP(SUF, T)                                                                         \
  FG_KERNEL cmp_##SUF(Layout al, const T* a, Layout bl, const T* b, unsigned char* y, fg_u64 n, int op) { \
    fg_cmp<T>(al, a, bl, b, y, n, op);                                                         \
  }
#if FG_BINARY_PART == 2
FG_FOR_ALL(FG_CMP)
#endif

// ---------------------------------------------------------------------------------------------
// where_{b8,b16,b32,b64}: y[i] = c[i] != 0 ? t[i] : f[i], each operand read through its layout
// (only the chosen branch is read).
// ---------------------------------------------------------------------------------------------

template <typename T>
static __device__ __forceinline__ void fg_where(const Layout& cl, const unsigned char* __restrict__ c,
                                                const Layout& tl, const T* __restrict__ t, const Layout& fl,
                                                const T* __restrict__ f, T* __restrict__ y, fg_u64 n) {
  const int cm = fg_mode(cl), tm = fg_mode(tl), fm = fg_mode(fl);
  if (cm == FG_CONTIG && tm == FG_CONTIG && fm == FG_CONTIG) {
    const unsigned char* cp = c + cl.offset;
    const T* tp = t + tl.offset;
    const T* fp = f + fl.offset;
    fg_unrolled(n, [&](fg_u64 i) { return cp[i] ? tp[i] : fp[i]; }, [&](fg_u64 i, T v) { y[i] = v; });
    return;
  }
  FG_GRID_STRIDE(i, n) {
    y[i] = c[fg_offset_m(cl, cm, i)] ? t[fg_offset_m(tl, tm, i)] : f[fg_offset_m(fl, fm, i)];
  }
}

#define FG_WHERE(SUF, T)                                                                       \
  FG_KERNEL where_##SUF(Layout cl, const unsigned char* c, Layout tl, const T* t, Layout fl, const T* f, \
                        T* y, fg_u64 n) {                                                      \
    fg_where<T>(cl, c, tl, t, fl, f, y, n);                                                    \
  }
#if FG_BINARY_PART == 2
FG_FOR_WIDTH(FG_WHERE)
#endif
