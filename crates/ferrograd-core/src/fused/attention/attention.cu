// attention.cu: the backward's helper kernels (delta, dQ conversion) and the entry points of
// the attention module (one module per head dim; the ABI is in attention_common.cuh).
//
// The module's source: its headers are declared in mod.rs `attention_module!`, which passes the
// head dim as `-D FG_ATTN_D=<d>`.

#include "common.cuh"
#include "attention_common.cuh"
#include "attention_tc.cu"
#include "attention_simt.cu"

// ---------------------------------------------------------------------------------------------
// Backward helpers, every dtype: delta = rowsum(dO * O) (and dq_acc zeroed), dq_acc -> dq
// ---------------------------------------------------------------------------------------------

template <typename T, int D>
static __device__ __forceinline__ void fg_attn_bwd_pre(const T* __restrict__ o, const T* __restrict__ dout,
                                                       float* __restrict__ delta, float* __restrict__ dq_acc,
                                                       const FgAttnParams& p) {
  const unsigned int lane = threadIdx.x & 31, wpb = blockDim.x >> 5;
  const unsigned long long rows = (unsigned long long)p.B * p.H * p.Tq;
  for (unsigned long long r = (unsigned long long)blockIdx.x * wpb + (threadIdx.x >> 5); r < rows;
       r += (unsigned long long)gridDim.x * wpb) {
    const unsigned long long bh = r / p.Tq, i = r - bh * p.Tq;
    const unsigned long long b = bh / p.H, h = bh - b * p.H;
    const T* orow = o + b * p.o.b + h * p.o.h + i * p.o.t;
    const T* drow = dout + b * p.dout.b + h * p.dout.h + i * p.dout.t;
    float s = 0.f;
    for (int d = lane; d < D; d += 32) s += fg_to_acc(orow[d * p.o.d]) * fg_to_acc(drow[d * p.dout.d]);
    s = fg_warp_reduce(s, FgSum());
    if (lane == 0) delta[r] = s;
    if (dq_acc) {  // the Hopper backward zeroes its own (padded) layout
      float* qa = dq_acc + r * D;
      for (int d = lane; d < D; d += 32) qa[d] = 0.f;
    }
  }
}

template <typename T, int D>
static __device__ __forceinline__ void fg_attn_dq(const float* __restrict__ dq_acc, T* __restrict__ dq,
                                                  const FgAttnParams& p) {
  const unsigned long long n = (unsigned long long)p.B * p.H * p.Tq * D;
  FG_GRID_STRIDE(e, n) {
    const unsigned long long r = e / D, d = e - r * D;
    const unsigned long long bh = r / p.Tq, i = r - bh * p.Tq;
    const unsigned long long b = bh / p.H, h = bh - b * p.H;
    dq[b * p.dq.b + h * p.dq.h + i * p.dq.t + d * p.dq.d] = fg_from_acc<T>(dq_acc[e]);
  }
}

// ---------------------------------------------------------------------------------------------
// Entry points
// ---------------------------------------------------------------------------------------------

#define FG_ATTN_NAME2(stem, d, suf) stem##d##_##suf
#define FG_ATTN_NAME(stem, d, suf) FG_ATTN_NAME2(stem, d, suf)
#define FG_ATTN_TNAME2(stem, d, tile, suf) stem##d##_##tile##_##suf
#define FG_ATTN_TNAME(stem, d, tile, suf) FG_ATTN_TNAME2(stem, d, tile, suf)

// Tensor-core kernels per tile: fg_attn_fwd_d{D}_k{BKV}_{bf16,f16}, fg_attn_bwd_d{D}_q{BQ}_{..}.
#define FG_ATTN_FWD(SUF, T, BKV)                                                                          \
  extern "C" __global__ void __launch_bounds__(FG_ATTN_THREADS)                                            \
      FG_ATTN_TNAME(fg_attn_fwd_d, FG_ATTN_D, k##BKV, SUF)(const T* q, const T* k, const T* v, T* o,       \
                                                          float* lse, FgAttnParams p) {                    \
    fg_attn_fwd_tc<T, FG_ATTN_D, BKV>(q, k, v, o, lse, p);                                                 \
  }
#define FG_ATTN_BWD(SUF, T, BQ)                                                                           \
  extern "C" __global__ void __launch_bounds__(FG_ATTN_THREADS, FG_ATTN_BWD_MIN_BLOCKS)                                            \
      FG_ATTN_TNAME(fg_attn_bwd_d, FG_ATTN_D, q##BQ, SUF)(const T* q, const T* k, const T* v,               \
                                                         const T* dout, const float* lse,                  \
                                                         const float* delta, float* dq_acc, T* dk, T* dv,  \
                                                         FgAttnParams p) {                                 \
    fg_attn_bwd_tc<T, FG_ATTN_D, BQ>(q, k, v, dout, lse, delta, dq_acc, dk, dv, p);                        \
  }
#define FG_ATTN_TILES(SUF, T) FG_ATTN_FWD_TILES(FG_ATTN_FWD, SUF, T) FG_ATTN_BWD_TILES(FG_ATTN_BWD, SUF, T)

// Small head dims: the backward fits in 168 registers (ptxas, no spills), so three blocks share a
// multiprocessor instead of two.
#define FG_ATTN_BWD_MIN_BLOCKS (FG_ATTN_D <= 64 ? 3 : 1)

// The tile each head dim is built with (cuda.rs `tile_choice` mirrors it). Measured on an H200
// (bf16, B * H = 64, T = 1024 and 4096): the backward is faster with 32 query rows a step than 64
// (d=64: 192 against 177 TFLOP/s fwd+bwd at T=4096; d=128: 209 against 192), the d=128 forward
// with 64 key rows a step than 32 (303 against 296 TFLOP/s). d=80 keeps 64 query rows: with 32 its
// dQ split over the warps would be uneven.
#if FG_ATTN_D <= 64
#define FG_ATTN_FWD_TILES(M, SUF, T) M(SUF, T, 64)
#define FG_ATTN_BWD_TILES(M, SUF, T) M(SUF, T, 32)
#elif FG_ATTN_D <= 80
#define FG_ATTN_FWD_TILES(M, SUF, T) M(SUF, T, 32)
#define FG_ATTN_BWD_TILES(M, SUF, T) M(SUF, T, 64)
#else
#define FG_ATTN_FWD_TILES(M, SUF, T) M(SUF, T, 64)
#define FG_ATTN_BWD_TILES(M, SUF, T) M(SUF, T, 32)
#endif

#define FG_ATTN_COMMON(SUF, T)                                                                              \
  FG_KERNEL FG_ATTN_NAME(fg_attn_bwd_pre_d, FG_ATTN_D, SUF)(const T* o, const T* dout, float* delta,         \
                                                            float* dq_acc, FgAttnParams p) {                \
    fg_attn_bwd_pre<T, FG_ATTN_D>(o, dout, delta, dq_acc, p);                                              \
  }                                                                                                         \
  FG_KERNEL FG_ATTN_NAME(fg_attn_dq_d, FG_ATTN_D, SUF)(const float* dq_acc, T* dq, FgAttnParams p) {         \
    fg_attn_dq<T, FG_ATTN_D>(dq_acc, dq, p);                                                               \
  }

// Hopper kernels (attention_wgmma.cu): fg_attn_fwd_d{64,128}_{wg,wgdrop}_{bf16,f16},
// fg_attn_bwd_d{64,128}_{wg,wgdrop}_{..} (wgdrop: with dropout), blocks of FG_WG_FWD_THREADS /
// FG_WG_BWD_THREADS, one-dimensional grids of B * H * ceil(Tq / FG_WG_FWD_BQ) and
// B * H * ceil(Tk / FG_WG_BWD_BKVD(D)) blocks (fg_wg_tile), dynamic shared memory FG_WG_FWD_SMEM(D) /
// FG_WG_BWD_SMEM(D) (cuda.rs `wg_fwd_threads`, `wg_fwd_smem`, `wg_bwd_smem` mirror them). They are
// their own modules (`-D FG_ATTN_WG_PART`, mod.rs `attention_wg_module!`, built for
// sm_90a and only for sm_90 devices): apart from the mma.sync kernels they compile in parallel, and a
// run on such a device compiles only them. wgmma exists on no other target (bench/kernels/
// attention_wgmma.sh's nvcc harness, built for sm_90a only, asks with -DFG_ATTN_WG_FORCE).
#if defined(FG_ATTN_WG_FORCE) || \
    (defined(FG_ATTN_WG_PART) && (FG_ATTN_D == 64 || FG_ATTN_D == 128) && defined(__CUDA_ARCH_FEAT_SM90_ALL))
#define FG_ATTN_HAS_WG 1
#include "attention_wgmma.cu"
#if FG_WG_FWD_TMA
#define FG_WG_FWD_ARGS(T) const T* q, const __grid_constant__ FgTmap tk, const __grid_constant__ FgTmap tv, T* o, float* lse, FgAttnParams p
#define FG_WG_FWD_CALL(T, DROP) fg_attn_fwd_wg_tma<T, FG_ATTN_D, DROP>(q, tk, tv, o, lse, p)
#else
#define FG_WG_FWD_ARGS(T) const T* q, const T* k, const T* v, T* o, float* lse, FgAttnParams p
#define FG_WG_FWD_CALL(T, DROP) fg_attn_fwd_wg<T, FG_ATTN_D, DROP>(q, k, v, o, lse, p)
#endif
// The forward and backward kernels without dropout (`wg`) or with it (`wgdrop`, `-D FG_ATTN_WG_DROP=1`:
// a module of its own, mod.rs `attention_wg_module!`). Dropout's Philox draws spill in the d = 64
// backward and the d = 128 forward, which a run without dropout should neither pay nor compile.
// Both modules carry the backward's helpers.
#ifndef FG_ATTN_WG_DROP
#define FG_ATTN_WG_DROP 0
#endif
#define FG_ATTN_WG_PAIR(SUF, T, KIND, DROP)                                                                  \
  extern "C" __global__ void __launch_bounds__(FG_WG_FWD_THREADS, FG_WG_FWD_WGS == 1 ? 2 : 1) FG_ATTN_NAME(fg_attn_fwd_d, FG_ATTN_D, KIND##_##SUF)( \
      FG_WG_FWD_ARGS(T)) {                                                                                   \
    FG_WG_FWD_CALL(T, DROP);                                                                                 \
  }                                                                                                          \
  extern "C" __global__ void __launch_bounds__(FG_WG_BWD_THREADS, 3 - FG_WG_BWD_WGS) FG_ATTN_NAME(fg_attn_bwd_d, FG_ATTN_D, KIND##_##SUF)( \
      const T* q, const T* k, const T* v, const T* dout, const float* lse, const float* delta, float* dq_acc,  \
      T* dk, T* dv, FgAttnParams p) {                                                                        \
    fg_attn_bwd_wg<T, FG_ATTN_D, DROP>(q, k, v, dout, lse, delta, dq_acc, dk, dv, p);                        \
  }
#if FG_ATTN_WG_DROP
#define FG_ATTN_WG_KERNELS(SUF, T) FG_ATTN_WG_PAIR(SUF, T, wgdrop, true)
#else
#define FG_ATTN_WG_KERNELS(SUF, T) FG_ATTN_WG_PAIR(SUF, T, wg, false)
#endif
#define FG_ATTN_WG(SUF, T)                                                                                   \
  FG_ATTN_WG_KERNELS(SUF, T)                                                                                 \
  FG_KERNEL FG_ATTN_NAME(fg_attn_bwd_pre_d, FG_ATTN_D, wg_##SUF)(const T* o, const T* dout, float* delta,        \
                                                                float* dq_acc, FgAttnParams p) {             \
    fg_attn_bwd_pre<T, FG_ATTN_D>(o, dout, delta, nullptr, p);                                               \
    const unsigned long long n = (unsigned long long)p.B * p.H * ((p.Tq + 63ull) / 64 * 64) * FG_ATTN_D;     \
    FG_GRID_STRIDE(e, n) dq_acc[e] = 0.f;                                                                    \
  }                                                                                                          \
  FG_KERNEL FG_ATTN_NAME(fg_attn_dq_d, FG_ATTN_D, wg_##SUF)(const float* dq_acc, T* dq, FgAttnParams p) {        \
    fg_attn_dq_wg<T, FG_ATTN_D>(dq_acc, dq, p);                                                              \
  }
#else
#define FG_ATTN_WG(SUF, T)
#endif

// One NVRTC module per head dim and dtype (`-D FG_ATTN_DTYPE`: 0 bf16, 1 f16, 2 f32; mod.rs
// `attention_module!`): a head dim's twelve kernels in one module took 3-7 s of NVRTC; its three
// dtypes compile in parallel, and a run compiles only the dtype it launches.
#if !defined(FG_ATTN_DTYPE)
#error "FG_ATTN_DTYPE comes from Rust (src/fused/attention/mod.rs)"
#elif defined(FG_ATTN_WG_PART) && FG_ATTN_DTYPE == 0
FG_ATTN_WG(bf16, __nv_bfloat16)
#elif defined(FG_ATTN_WG_PART) && FG_ATTN_DTYPE == 1
FG_ATTN_WG(f16, __half)
#elif defined(FG_ATTN_WG_PART)
#error "the Hopper part is built for FG_ATTN_DTYPE 0 (bf16) and 1 (f16)"
#elif FG_ATTN_DTYPE == 0
FG_ATTN_TILES(bf16, __nv_bfloat16)
FG_ATTN_COMMON(bf16, __nv_bfloat16)
FG_ATTN_WG(bf16, __nv_bfloat16)  // only with FG_ATTN_WG_FORCE: the harness builds both families in one unit
#elif FG_ATTN_DTYPE == 1
FG_ATTN_TILES(f16, __half)
FG_ATTN_COMMON(f16, __half)
FG_ATTN_WG(f16, __half)
#elif FG_ATTN_DTYPE == 2
FG_ATTN_COMMON(f32, float)

extern "C" __global__ void __launch_bounds__(256) FG_ATTN_NAME(fg_attn_fwd_d, FG_ATTN_D, f32)(
    const float* q, const float* k, const float* v, float* o, float* lse, FgAttnParams p) {
  fg_attn_fwd_simt<FG_ATTN_D>(q, k, v, o, lse, p);
}
extern "C" __global__ void __launch_bounds__(128) FG_ATTN_NAME(fg_attn_bwd_d, FG_ATTN_D, f32)(
    const float* q, const float* k, const float* v, const float* dout, const float* lse, const float* delta,
    float* dq_acc, float* dk, float* dv, FgAttnParams p) {
  fg_attn_bwd_simt<FG_ATTN_D>(q, k, v, dout, lse, delta, dq_acc, dk, dv, p);
}
#else
#error "FG_ATTN_DTYPE is 0 (bf16), 1 (f16) or 2 (f32)"
#endif
