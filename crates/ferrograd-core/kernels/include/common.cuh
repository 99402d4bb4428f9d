// common.cuh: included by every kernel file (`#include "common.cuh"`; the Rust side hands NVRTC the
// text of the shared headers a module declares, src/cuda/modules.rs; docs/kernel-abi.md is the
// contract).
// CPU twins: src/layout.rs (`Layout`, row-major element order), src/dtype.rs (`WithDType::from_f64`
// / `to_f64`: saturating float->int, `half` crate rounding for f16/bf16).
//
// Everything here is `__device__ __forceinline__` (or a type / macro): each .cu file becomes its own
// module and they must not clash.

#pragma once

#include <cuda_fp16.h>
#include <cuda_bf16.h>

typedef unsigned long long fg_u64;
typedef long long fg_i64;

#ifndef FG_MAX_DIMS
#error "FG_MAX_DIMS comes from Rust (src/cuda/klayout.rs MAX_DIMS)"
#endif

// Mirrored by a #[repr(C)] Rust struct: 4 + 4 + 8 + 64 + 64 = 144 bytes.
struct Layout {
  unsigned int rank;         // 0..=8
  unsigned int contiguous;   // 1: element i is at offset + i (fast path)
  unsigned long long offset; // in elements
  unsigned long long dims[FG_MAX_DIMS];
  unsigned long long strides[FG_MAX_DIMS]; // in elements; 0 for broadcast dims
};

// Every kernel may be launched with up to 1024 threads per block; this keeps ptxas within the
// register budget that such a launch needs (64 per thread).
#define FG_KERNEL extern "C" __global__ void __launch_bounds__(1024)

#define FG_INF_F __int_as_float(0x7f800000)
#define FG_NAN_F __int_as_float(0x7fffffff)
#define FG_INF_D __longlong_as_double(0x7ff0000000000000ULL)
#define FG_NAN_D __longlong_as_double(0x7ff8000000000000ULL)

// ---------------------------------------------------------------------------------------------
// Index arithmetic
// ---------------------------------------------------------------------------------------------

// 64-bit division is a long software sequence on the GPU: kept out of line (one copy per module,
// which keeps NVRTC time and code size down) and only reached when an operand exceeds 32 bits.
__device__ __noinline__ fg_u64 fg_div64(fg_u64 a, fg_u64 b) { return a / b; }

// q = a / b, r = a % b, with the 32-bit path for the usual case.
__device__ __forceinline__ void fg_divmod(fg_u64 a, fg_u64 b, fg_u64& q, fg_u64& r) {
  if (((a | b) >> 32) == 0) {
    unsigned int a32 = (unsigned int)a, b32 = (unsigned int)b;
    unsigned int q32 = a32 / b32;
    q = q32;
    r = a32 - q32 * b32;
  } else {
    q = fg_div64(a, b);
    r = a - q * b;
  }
}

// Storage offset of logical (row-major) element i.
__device__ __forceinline__ fg_u64 fg_offset(const Layout& l, fg_u64 i) {
  if (l.contiguous) return l.offset + i;
  fg_u64 off = l.offset;
#pragma unroll 1  // (unrolling this runtime-trip loop only bloats code; it is not the bottleneck)
  for (int d = (int)l.rank - 1; d >= 0; --d) {
    fg_u64 q, r;
    fg_divmod(i, l.dims[d], q, r);
    off += r * l.strides[d];
    i = q;
  }
  return off;
}

// How a kernel walks one operand, decided once per thread before its grid-stride loop.
enum { FG_CONTIG = 0, FG_SCALAR = 1, FG_STRIDED = 2 };

__device__ __forceinline__ int fg_mode(const Layout& l) {
  if (l.contiguous) return FG_CONTIG;
  for (unsigned int d = 0; d < l.rank; ++d)
    if (l.strides[d] != 0 && l.dims[d] != 1) return FG_STRIDED;
  return FG_SCALAR;  // every element is the one at `offset` (a broadcast scalar)
}

__device__ __forceinline__ fg_u64 fg_offset_m(const Layout& l, int mode, fg_u64 i) {
  if (mode == FG_CONTIG) return l.offset + i;
  if (mode == FG_SCALAR) return l.offset;
  return fg_offset(l, i);
}

// Grid-stride loop over [0, n).
#define FG_GRID_STRIDE(i, n)                                                                   \
  for (fg_u64 i = (fg_u64)blockIdx.x * blockDim.x + threadIdx.x; i < (fg_u64)(n);             \
       i += (fg_u64)blockDim.x * gridDim.x)

__device__ __forceinline__ fg_u64 fg_tid() { return (fg_u64)blockIdx.x * blockDim.x + threadIdx.x; }
__device__ __forceinline__ fg_u64 fg_nthreads() { return (fg_u64)blockDim.x * gridDim.x; }

// Grid-stride over [0, n) with four independent loads in flight per thread: `load(i)` reads the
// inputs of element i, `store(i, v)` computes and writes it. With one element per thread (a grid
// of ceil(n / blockDim) blocks) only the remainder loop runs; with a smaller grid each thread keeps
// 4 loads in flight, which a memory-bound loop needs to approach full bandwidth. The 2-element
// step serves a grid of two elements a thread (the binary maps' launch, launch.rs `cfg_map`: two
// operands, so two elements are four loads), which would otherwise run the remainder loop with
// one load in flight.
template <typename L, typename S>
__device__ __forceinline__ void fg_unrolled(fg_u64 n, L load, S store) {
  const fg_u64 nt = fg_nthreads();
  fg_u64 i = fg_tid();
  for (; i + 3 * nt < n; i += 4 * nt) {
    const auto a = load(i);
    const auto b = load(i + nt);
    const auto c = load(i + 2 * nt);
    const auto d = load(i + 3 * nt);
    store(i, a);
    store(i + nt, b);
    store(i + 2 * nt, c);
    store(i + 3 * nt, d);
  }
  if (i + nt < n) {
    const auto a = load(i);
    const auto b = load(i + nt);
    store(i, a);
    store(i + nt, b);
    i += 2 * nt;
  }
  for (; i < n; i += nt) store(i, load(i));
}

// The same over one row of a block-per-row kernel: j = threadIdx.x, += blockDim.x, up to cols.
template <typename L, typename S>
__device__ __forceinline__ void fg_row_unrolled(fg_u64 cols, L load, S use) {
  const unsigned int bs = blockDim.x;
  fg_u64 j = threadIdx.x;
  for (; j + 3 * bs < cols; j += 4 * bs) {
    const auto a = load(j);
    const auto b = load(j + bs);
    const auto c = load(j + 2 * bs);
    const auto d = load(j + 3 * bs);
    use(j, a);
    use(j + bs, b);
    use(j + 2 * bs, c);
    use(j + 3 * bs, d);
  }
  for (; j < cols; j += bs) use(j, load(j));
}

template <typename P>
__device__ __forceinline__ bool fg_aligned(const P* p, unsigned int bytes) {
  return (((unsigned long long)p) & (bytes - 1)) == 0;
}

// N elements of T moved as one access (N * sizeof(T) is 2..16 bytes, a power of two).
template <typename T, int N>
struct alignas(sizeof(T) * N) FgPack {
  T v[N];
};

// Bytes of dynamic shared memory this launch was given.
__device__ __forceinline__ unsigned int fg_dynamic_smem_bytes() {
  unsigned int r;
  asm("mov.u32 %0, %%dynamic_smem_size;" : "=r"(r));
  return r;
}

extern __shared__ __align__(16) unsigned char fg_smem[];

// ---------------------------------------------------------------------------------------------
// Element types: ACC, f64 conversions (CPU `WithDType`), ACC conversions
// ---------------------------------------------------------------------------------------------

template <typename T> struct FgAcc { typedef double type; };  // i32 u32 u8 i8
template <> struct FgAcc<float> { typedef float type; };
template <> struct FgAcc<double> { typedef double type; };
template <> struct FgAcc<__half> { typedef float type; };
template <> struct FgAcc<__nv_bfloat16> { typedef float type; };

// Exact widening to f64 (`WithDType::to_f64`).
__device__ __forceinline__ double fg_to_f64(float x) { return (double)x; }
__device__ __forceinline__ double fg_to_f64(double x) { return x; }
__device__ __forceinline__ double fg_to_f64(__half x) { return (double)__half2float(x); }
__device__ __forceinline__ double fg_to_f64(__nv_bfloat16 x) { return (double)__bfloat162float(x); }
__device__ __forceinline__ double fg_to_f64(int x) { return (double)x; }
__device__ __forceinline__ double fg_to_f64(unsigned int x) { return (double)x; }
__device__ __forceinline__ double fg_to_f64(unsigned char x) { return (double)x; }
__device__ __forceinline__ double fg_to_f64(signed char x) { return (double)x; }

// Saturating float -> int, Rust `as` semantics: truncate toward zero, NaN -> 0, out of range ->
// the type's min/max.
__device__ __forceinline__ int fg_sat_i32(double d) {
  if (d != d) return 0;
  if (d <= -2147483648.0) return (int)0x80000000;
  if (d >= 2147483647.0) return 0x7fffffff;
  return __double2int_rz(d);
}
__device__ __forceinline__ unsigned int fg_sat_u32(double d) {
  if (!(d > 0.0)) return 0u;  // negatives, -0 and NaN
  if (d >= 4294967295.0) return 0xffffffffu;
  return __double2uint_rz(d);
}
__device__ __forceinline__ unsigned char fg_sat_u8(double d) {
  if (!(d > 0.0)) return 0;
  if (d >= 255.0) return 255;
  return (unsigned char)__double2uint_rz(d);
}
__device__ __forceinline__ signed char fg_sat_i8(double d) {
  if (d != d) return 0;
  if (d <= -128.0) return -128;
  if (d >= 127.0) return 127;
  return (signed char)__double2int_rz(d);
}

// `half::bf16::from_f64`, bit for bit: it rounds from the top 32 bits of the f64 only (the low 32
// mantissa bits take no part in the sticky bit), so a plain correctly rounded conversion would
// differ from the CPU backend on rare near-ties.
__device__ __forceinline__ __nv_bfloat16 fg_f64_to_bf16(double value) {
  fg_u64 val = (fg_u64)__double_as_longlong(value);
  unsigned int x = (unsigned int)(val >> 32);
  unsigned int sign = x & 0x80000000u;
  unsigned int exp = x & 0x7FF00000u;
  unsigned int man = x & 0x000FFFFFu;
  unsigned short bits;
  if (exp == 0x7FF00000u) {
    unsigned int nan_bit = (man == 0 && (unsigned int)val == 0) ? 0u : 0x0040u;
    bits = (unsigned short)((sign >> 16) | 0x7F80u | nan_bit | (man >> 13));
    return __ushort_as_bfloat16(bits);
  }
  unsigned int half_sign = sign >> 16;
  int half_exp = (int)(exp >> 20) - 1023 + 127;
  if (half_exp >= 0xFF) return __ushort_as_bfloat16((unsigned short)(half_sign | 0x7F80u));
  if (half_exp <= 0) {
    if (7 - half_exp > 21) return __ushort_as_bfloat16((unsigned short)half_sign);
    unsigned int m = man | 0x00100000u;
    unsigned int half_man = m >> (14 - half_exp);
    unsigned int round_bit = 1u << (13 - half_exp);
    if ((m & round_bit) != 0 && (m & (3u * round_bit - 1u)) != 0) half_man += 1;
    return __ushort_as_bfloat16((unsigned short)(half_sign | half_man));
  }
  unsigned int he = ((unsigned int)half_exp) << 7;
  unsigned int half_man = man >> 13;
  unsigned int round_bit = 0x00001000u;
  if ((man & round_bit) != 0 && (man & (3u * round_bit - 1u)) != 0)
    bits = (unsigned short)((half_sign | he | half_man) + 1u);
  else
    bits = (unsigned short)(half_sign | he | half_man);
  return __ushort_as_bfloat16(bits);
}

// `WithDType::from_f64` for each dtype, as the CPU backend computes it on x86-64. f16: the `half`
// crate converts through f32 when the CPU has F16C (runtime-detected, every x86-64 machine we
// target), so f64 -> f32 -> f16, two roundings, is what we mirror.
template <typename T> __device__ __forceinline__ T fg_from_f64(double d);
template <> __device__ __forceinline__ float fg_from_f64<float>(double d) { return __double2float_rn(d); }
template <> __device__ __forceinline__ double fg_from_f64<double>(double d) { return d; }
template <> __device__ __forceinline__ __half fg_from_f64<__half>(double d) {
  return __float2half_rn(__double2float_rn(d));
}
template <> __device__ __forceinline__ __nv_bfloat16 fg_from_f64<__nv_bfloat16>(double d) {
  return fg_f64_to_bf16(d);
}
template <> __device__ __forceinline__ int fg_from_f64<int>(double d) { return fg_sat_i32(d); }
template <> __device__ __forceinline__ unsigned int fg_from_f64<unsigned int>(double d) { return fg_sat_u32(d); }
template <> __device__ __forceinline__ unsigned char fg_from_f64<unsigned char>(double d) { return fg_sat_u8(d); }
template <> __device__ __forceinline__ signed char fg_from_f64<signed char>(double d) { return fg_sat_i8(d); }

// To / from ACC (float for f32 f16 bf16, double for f64 and the integers). from_acc of float uses
// the `half` crate's from_f32 rounding (round to nearest even), which is what the CPU's f16/bf16
// elementwise paths use; integers saturate.
__device__ __forceinline__ float fg_to_acc(float x) { return x; }
__device__ __forceinline__ double fg_to_acc(double x) { return x; }
__device__ __forceinline__ float fg_to_acc(__half x) { return __half2float(x); }
__device__ __forceinline__ float fg_to_acc(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ __forceinline__ double fg_to_acc(int x) { return (double)x; }
__device__ __forceinline__ double fg_to_acc(unsigned int x) { return (double)x; }
__device__ __forceinline__ double fg_to_acc(unsigned char x) { return (double)x; }
__device__ __forceinline__ double fg_to_acc(signed char x) { return (double)x; }

template <typename T> __device__ __forceinline__ T fg_from_acc(typename FgAcc<T>::type a);
template <> __device__ __forceinline__ float fg_from_acc<float>(float a) { return a; }
template <> __device__ __forceinline__ double fg_from_acc<double>(double a) { return a; }
template <> __device__ __forceinline__ __half fg_from_acc<__half>(float a) { return __float2half_rn(a); }
template <> __device__ __forceinline__ __nv_bfloat16 fg_from_acc<__nv_bfloat16>(float a) {
  return __float2bfloat16_rn(a);
}
template <> __device__ __forceinline__ int fg_from_acc<int>(double a) { return fg_sat_i32(a); }
template <> __device__ __forceinline__ unsigned int fg_from_acc<unsigned int>(double a) { return fg_sat_u32(a); }
template <> __device__ __forceinline__ unsigned char fg_from_acc<unsigned char>(double a) { return fg_sat_u8(a); }
template <> __device__ __forceinline__ signed char fg_from_acc<signed char>(double a) { return fg_sat_i8(a); }

__device__ __forceinline__ bool fg_isnan(float x) { return x != x; }
__device__ __forceinline__ bool fg_isnan(double x) { return x != x; }

template <typename A> __device__ __forceinline__ A fg_inf();
template <> __device__ __forceinline__ float fg_inf<float>() { return FG_INF_F; }
template <> __device__ __forceinline__ double fg_inf<double>() { return FG_INF_D; }
template <typename A> __device__ __forceinline__ A fg_nan();
template <> __device__ __forceinline__ float fg_nan<float>() { return FG_NAN_F; }
template <> __device__ __forceinline__ double fg_nan<double>() { return FG_NAN_D; }

// ---------------------------------------------------------------------------------------------
// Reductions: combiners, warp shuffles, block reductions
// ---------------------------------------------------------------------------------------------

struct FgSum {
  template <typename A> __device__ __forceinline__ A operator()(A a, A b) const { return a + b; }
  template <typename A> __device__ __forceinline__ A identity() const { return (A)0; }
};
// Max / min that propagate NaN (ReduceOp::Max / Min of src/cpu/reduce.rs).
struct FgMax {
  template <typename A> __device__ __forceinline__ A operator()(A a, A b) const {
    return (b > a || b != b) ? b : a;
  }
  template <typename A> __device__ __forceinline__ A identity() const { return -fg_inf<A>(); }
};
struct FgMin {
  template <typename A> __device__ __forceinline__ A operator()(A a, A b) const {
    return (b < a || b != b) ? b : a;
  }
  template <typename A> __device__ __forceinline__ A identity() const { return fg_inf<A>(); }
};
// Max / min that ignore NaN (f64::max / fmaxf), as softmax's row max does.
struct FgFMax {
  template <typename A> __device__ __forceinline__ A operator()(A a, A b) const { return fmax(a, b); }
  template <typename A> __device__ __forceinline__ A identity() const { return -fg_inf<A>(); }
};

template <typename A, typename Op>
__device__ __forceinline__ A fg_warp_reduce(A v, Op op) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = op(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

// Reduce over the whole block; every thread gets the result. `sh` holds >= 32 A in shared memory.
// blockDim.x must be a multiple of 32. Safe to call repeatedly with the same `sh`.
template <typename A, typename Op>
__device__ __forceinline__ A fg_block_reduce(A v, Op op, A* sh) {
  v = fg_warp_reduce(v, op);
  if (blockDim.x == 32) return v;
  const unsigned int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
  __syncthreads();  // a previous call's readers are done with sh
  if (lane == 0) sh[warp] = v;
  __syncthreads();
  v = lane < nw ? sh[lane] : op.template identity<A>();
  return fg_warp_reduce(v, op);
}

// Two sums at once (one pass of shuffles / one round of barriers).
template <typename A>
__device__ __forceinline__ void fg_block_sum2(A& a, A& b, A* sh /* >= 64 */) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    a += __shfl_xor_sync(0xffffffffu, a, o);
    b += __shfl_xor_sync(0xffffffffu, b, o);
  }
  if (blockDim.x == 32) return;
  const unsigned int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
  __syncthreads();
  if (lane == 0) {
    sh[warp] = a;
    sh[32 + warp] = b;
  }
  __syncthreads();
  a = lane < nw ? sh[lane] : (A)0;
  b = lane < nw ? sh[32 + lane] : (A)0;
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    a += __shfl_xor_sync(0xffffffffu, a, o);
    b += __shfl_xor_sync(0xffffffffu, b, o);
  }
}

// ---------------------------------------------------------------------------------------------
// Entry-point instantiation helpers: FG_FOR_*(M) expands M(suffix, C type) once per dtype.
// ---------------------------------------------------------------------------------------------

#define FG_FOR_FLOAT(M) M(f32, float) M(f64, double) M(f16, __half) M(bf16, __nv_bfloat16)
#define FG_FOR_INT(M) M(i32, int) M(u32, unsigned int) M(u8, unsigned char) M(i8, signed char)
#define FG_FOR_ALL(M) FG_FOR_FLOAT(M) FG_FOR_INT(M)
#define FG_FOR_WIDTH(M) M(b8, unsigned char) M(b16, unsigned short) M(b32, unsigned int) M(b64, unsigned long long)
