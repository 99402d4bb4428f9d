// row_reduce.cuh: rows kept in registers, a group of threads per row. The geometry (which rows a
// thread works on) and the reduction over a row's group, shared by the row-in-registers kernels
// (src/fused/softmax/softmax.cu, src/fused/layer_norm/layer_norm.cu). The Rust side's launch shape
// for them is src/cuda/launch.rs `cfg_row_regs`, which mirrors these conditions.
// CPU twin: none needed (the reductions are sums and maxima in ACC; each kernel names its own).

#pragma once

#include "common.cuh"

#ifndef FG_ROW_CAP_FLOAT
#error "FG_ROW_CAP_FLOAT / FG_ROW_CAP_DOUBLE come from Rust (src/cuda/launch.rs ROW_CAP_*)"
#endif

// Elements of its row each thread keeps in registers (ACC): FG_ROW_CAP_FLOAT = 32 floats (8 x 16
// bytes of f32, 4 of f16 / bf16) or FG_ROW_CAP_DOUBLE = 8 doubles (double math needs more
// registers), within the 64 registers that a 1024-thread launch allows (ptxas -v, NVRTC 13.0: no
// spills in softmax_rows_*; layer_norm_fwd_rows_* spills 16 bytes for f32 on sm_90, 8 / 24 bytes for
// f32 / f16 / bf16 on sm_80).
template <typename T>
static __device__ __forceinline__ constexpr int fg_row_cap() {
  return sizeof(typename FgAcc<T>::type) == 8 ? FG_ROW_CAP_DOUBLE : FG_ROW_CAP_FLOAT;
}

// `t` = the thread's index in its group, rows r0 + sub, r0 + sub + step, ... (r0 and step are uniform
// over the warp, or the block, so loops over r0 are too).
struct FgRowGeom {
  unsigned int g, t, sub;
  fg_u64 r0, step;
};

// nvec = vectors in a row, n = vector slots per thread, block: one row per block (else per group).
static __device__ __forceinline__ FgRowGeom fg_row_geom(unsigned int nvec, unsigned int n, bool block) {
  FgRowGeom q;
  if (block) {
    q.g = blockDim.x;
    q.t = threadIdx.x;
    q.sub = 0;
    q.r0 = blockIdx.x;
    q.step = gridDim.x;
  } else {
    const unsigned int need = (nvec + n - 1) / n;  // 1..32
    q.g = need <= 1 ? 1u : 1u << (32 - __clz(need - 1));
    const unsigned int lane = threadIdx.x & 31, per = 32 / q.g, wpb = blockDim.x >> 5;
    q.t = lane & (q.g - 1);
    q.sub = lane / q.g;
    q.r0 = ((fg_u64)blockIdx.x * wpb + (threadIdx.x >> 5)) * per;
    q.step = (fg_u64)gridDim.x * wpb * per;
  }
  return q;
}

// Reduce over the row's group: xor shuffles below min(g, 32) (a group within a warp is aligned), then
// for a block of several warps `sh` (32 A, not used by the previous reduction: callers alternate two
// buffers, so one barrier suffices: a thread writes a buffer only after the barrier of the reduction
// in between, which every reader of the buffer's previous contents passed after reading it).
template <typename A, typename Op>
static __device__ __forceinline__ A fg_row_reduce(A v, Op op, unsigned int g, A* sh) {
  for (unsigned int o = (g < 32 ? g : 32) >> 1; o > 0; o >>= 1) v = op(v, __shfl_xor_sync(0xffffffffu, v, o));
  if (g <= 32) return v;
  const unsigned int nw = g >> 5, lane = threadIdx.x & 31;
  if (lane == 0) sh[threadIdx.x >> 5] = v;
  __syncthreads();
  v = lane < nw ? sh[lane] : op.template identity<A>();
  return fg_warp_reduce(v, op);
}

