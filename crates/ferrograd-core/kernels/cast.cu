// cast.cu: dtype casts, cast_{S}_{D} for the 56 ordered pairs of distinct dtypes. A module of its
// own (not in copy.cu) because it is the largest: NVRTC compiles modules in parallel, so the
// largest one decides how long a cold start waits.
// CPU twin: src/cpu/mod.rs `to_dtype` (`T::from_f64(x.to_f64())` with its f16/bf16 <-> f32
// shortcuts).

#include "common.cuh"

// ---------------------------------------------------------------------------------------------
// cast_{S}_{D}(Layout sl, const S* src, D* dst, u64 n) for the 56 ordered pairs S != D
// ---------------------------------------------------------------------------------------------

// The CPU's `to_dtype`: D::from_f64(S::to_f64(x)), except for the shortcuts it takes, which we
// must mirror where they round differently: f32 -> f16 (`f16::from_f32`) and f32 -> bf16
// (`bf16::from_f32`, correctly rounded, while `bf16::from_f64` is not quite). f16/bf16 -> f32 is
// exact either way.
template <typename S, typename D>
struct FgCast {
  static __device__ __forceinline__ D apply(S x) { return fg_from_f64<D>(fg_to_f64(x)); }
};
template <> struct FgCast<float, __half> {
  static __device__ __forceinline__ __half apply(float x) { return __float2half_rn(x); }
};
template <> struct FgCast<float, __nv_bfloat16> {
  static __device__ __forceinline__ __nv_bfloat16 apply(float x) { return __float2bfloat16_rn(x); }
};
template <> struct FgCast<__half, float> {
  static __device__ __forceinline__ float apply(__half x) { return __half2float(x); }
};
template <> struct FgCast<__nv_bfloat16, float> {
  static __device__ __forceinline__ float apply(__nv_bfloat16 x) { return __bfloat162float(x); }
};
// f16 <-> bf16 through f32: exact widening, then one rounding; equal to the CPU's f64 path because
// the source has at most 11 significant bits (no low-word bits for `bf16::from_f64` to ignore).
template <> struct FgCast<__half, __nv_bfloat16> {
  static __device__ __forceinline__ __nv_bfloat16 apply(__half x) { return __float2bfloat16_rn(__half2float(x)); }
};
template <> struct FgCast<__nv_bfloat16, __half> {
  static __device__ __forceinline__ __half apply(__nv_bfloat16 x) { return __float2half_rn(__bfloat162float(x)); }
};

// The pairs that training moves in bulk (autocast: f32 <-> bf16 / f16, and between the halves)
// get the loop with 4 loads in flight; the other 44 (integers, f64) a plain grid-stride loop.
template <typename T> struct FgIsF32Like { static constexpr bool v = false; };
template <> struct FgIsF32Like<float> { static constexpr bool v = true; };
template <> struct FgIsF32Like<__half> { static constexpr bool v = true; };
template <> struct FgIsF32Like<__nv_bfloat16> { static constexpr bool v = true; };

// The strided index arithmetic out of line for the rarely hot pairs (integers, f64): one copy for
// the module instead of one per kernel.
static __device__ __noinline__ fg_u64 fg_cast_offset(const Layout& l, fg_u64 i) { return fg_offset(l, i); }

// Few loops (56 entry points, and NVRTC time grows with every loop variant and every inlined
// copy: these choices took the module from 3.1 s to 1.8 s of NVRTC on the dev machine).
template <typename S, typename D>
static __device__ __forceinline__ void fg_cast(const Layout& sl, const S* __restrict__ src,
                                               D* __restrict__ dst, fg_u64 n) {
  if (sl.contiguous) {
    const S* s = src + sl.offset;
    if constexpr (FgIsF32Like<S>::v && FgIsF32Like<D>::v) {
      fg_unrolled(n, [&](fg_u64 i) { return s[i]; }, [&](fg_u64 i, S v) { dst[i] = FgCast<S, D>::apply(v); });
    } else {
      FG_GRID_STRIDE(i, n) dst[i] = FgCast<S, D>::apply(s[i]);
    }
    return;
  }
  if constexpr (FgIsF32Like<S>::v && FgIsF32Like<D>::v) {
    // Inline for autocast's pairs: the GPT step casts transposed weight gradients through here,
    // and with the offset out of line those casts took 4.1 instead of 2.5 ms a step (H200).
    FG_GRID_STRIDE(i, n) dst[i] = FgCast<S, D>::apply(src[fg_offset(sl, i)]);
  } else {
    FG_GRID_STRIDE(i, n) dst[i] = FgCast<S, D>::apply(src[fg_cast_offset(sl, i)]);
  }
}

#define FG_CAST(SS, ST, DS, DT)                                                                \
  FG_KERNEL cast_##SS##_##DS(Layout sl, const ST* src, DT* dst, fg_u64 n) {                     \
    fg_cast<ST, DT>(sl, src, dst, n);                                                          \
  }

// Every destination for one source, skipping S == D.
#define FG_CAST_FROM(SS, ST)                                                                   \
  FG_CAST_IF_##SS##_f32(SS, ST, f32, float)                                                    \
  FG_CAST_IF_##SS##_f64(SS, ST, f64, double)                                                   \
  FG_CAST_IF_##SS##_f16(SS, ST, f16, __half)                                                   \
  FG_CAST_IF_##SS##_bf16(SS, ST, bf16, __nv_bfloat16)                                          \
  FG_CAST_IF_##SS##_i32(SS, ST, i32, int)                                                      \
  FG_CAST_IF_##SS##_u32(SS, ST, u32, unsigned int)                                             \
  FG_CAST_IF_##SS##_u8(SS, ST, u8, unsigned char)                                              \
  FG_CAST_IF_##SS##_i8(SS, ST, i8, signed char)

// FG_CAST_IF_<S>_<D> is FG_CAST unless S == D.
#define FG_SKIP(SS, ST, DS, DT)
#define FG_CAST_IF_f32_f32 FG_SKIP
#define FG_CAST_IF_f32_f64 FG_CAST
#define FG_CAST_IF_f32_f16 FG_CAST
#define FG_CAST_IF_f32_bf16 FG_CAST
#define FG_CAST_IF_f32_i32 FG_CAST
#define FG_CAST_IF_f32_u32 FG_CAST
#define FG_CAST_IF_f32_u8 FG_CAST
#define FG_CAST_IF_f32_i8 FG_CAST
#define FG_CAST_IF_f64_f32 FG_CAST
#define FG_CAST_IF_f64_f64 FG_SKIP
#define FG_CAST_IF_f64_f16 FG_CAST
#define FG_CAST_IF_f64_bf16 FG_CAST
#define FG_CAST_IF_f64_i32 FG_CAST
#define FG_CAST_IF_f64_u32 FG_CAST
#define FG_CAST_IF_f64_u8 FG_CAST
#define FG_CAST_IF_f64_i8 FG_CAST
#define FG_CAST_IF_f16_f32 FG_CAST
#define FG_CAST_IF_f16_f64 FG_CAST
#define FG_CAST_IF_f16_f16 FG_SKIP
#define FG_CAST_IF_f16_bf16 FG_CAST
#define FG_CAST_IF_f16_i32 FG_CAST
#define FG_CAST_IF_f16_u32 FG_CAST
#define FG_CAST_IF_f16_u8 FG_CAST
#define FG_CAST_IF_f16_i8 FG_CAST
#define FG_CAST_IF_bf16_f32 FG_CAST
#define FG_CAST_IF_bf16_f64 FG_CAST
#define FG_CAST_IF_bf16_f16 FG_CAST
#define FG_CAST_IF_bf16_bf16 FG_SKIP
#define FG_CAST_IF_bf16_i32 FG_CAST
#define FG_CAST_IF_bf16_u32 FG_CAST
#define FG_CAST_IF_bf16_u8 FG_CAST
#define FG_CAST_IF_bf16_i8 FG_CAST
#define FG_CAST_IF_i32_f32 FG_CAST
#define FG_CAST_IF_i32_f64 FG_CAST
#define FG_CAST_IF_i32_f16 FG_CAST
#define FG_CAST_IF_i32_bf16 FG_CAST
#define FG_CAST_IF_i32_i32 FG_SKIP
#define FG_CAST_IF_i32_u32 FG_CAST
#define FG_CAST_IF_i32_u8 FG_CAST
#define FG_CAST_IF_i32_i8 FG_CAST
#define FG_CAST_IF_u32_f32 FG_CAST
#define FG_CAST_IF_u32_f64 FG_CAST
#define FG_CAST_IF_u32_f16 FG_CAST
#define FG_CAST_IF_u32_bf16 FG_CAST
#define FG_CAST_IF_u32_i32 FG_CAST
#define FG_CAST_IF_u32_u32 FG_SKIP
#define FG_CAST_IF_u32_u8 FG_CAST
#define FG_CAST_IF_u32_i8 FG_CAST
#define FG_CAST_IF_u8_f32 FG_CAST
#define FG_CAST_IF_u8_f64 FG_CAST
#define FG_CAST_IF_u8_f16 FG_CAST
#define FG_CAST_IF_u8_bf16 FG_CAST
#define FG_CAST_IF_u8_i32 FG_CAST
#define FG_CAST_IF_u8_u32 FG_CAST
#define FG_CAST_IF_u8_u8 FG_SKIP
#define FG_CAST_IF_u8_i8 FG_CAST
#define FG_CAST_IF_i8_f32 FG_CAST
#define FG_CAST_IF_i8_f64 FG_CAST
#define FG_CAST_IF_i8_f16 FG_CAST
#define FG_CAST_IF_i8_bf16 FG_CAST
#define FG_CAST_IF_i8_i32 FG_CAST
#define FG_CAST_IF_i8_u32 FG_CAST
#define FG_CAST_IF_i8_u8 FG_CAST
#define FG_CAST_IF_i8_i8 FG_SKIP

FG_FOR_ALL(FG_CAST_FROM)
