// sscan_fwd.cuh: the selective scan's forward (entry points fg_sscan_fwd_{NT}x{K}_{f32,bf16},
// selective_scan.cu documents the ABI). One block of NT threads per (batch, channel) walks the
// sequence in chunks of NT * K steps; thread t owns steps t*K .. t*K+K-1 of a chunk, in registers.
//
// What makes it fast (issue 19; it replaced a forward that staged every row through a shared-memory
// tile, as the backward still does, at 2.7x the time: BENCHMARKS.md, 2026-11-23 fifth session):
// - every row (u, delta, z, out, and B / C of each state) moves straight between global memory
//   and the owning thread's registers in 16-byte vectors (sscan_common.cuh), bf16 packed: no
//   shared-memory tile and no barrier around a load;
// - the next state's B and C rows are loaded before this state's scan, so their latency hides
//   behind it;
// - exponentials are ex2.approx of dt * A[n] * log2(e) (A pre-scaled once a state), and the
//   product of a thread's K factors is one more of its summed dt (not K - 1 multiplies);
// - one barrier a state (none with one warp): the warps' totals go through shared memory, and the
//   chunk's last thread, whose final x is the state at the end of the chunk (steps past the end
//   have a = 1, b = 0), carries it to the next chunk.
//
// Shared memory is written once a chunk per address: each state has its own slots for the warps'
// totals, and the carried state is double buffered by the chunk's parity (read from c & 1, written
// to (c + 1) & 1). Then a slot's reads and its next write are always a chunk apart, with the
// chunk's barrier between them. The first version double buffered the totals by the state's
// parity and kept one carry row: racecheck found hazards in its bf16 build at 2 warps (H200,
// 2026-11-23). The SASS showed why: the compiled code read the warps' totals, wa[2][2], with one 16-byte
// LDS.128, so a warp reading state n's totals also read state n + 1's slots, which the other warp
// was writing. The extra words were discarded (the results were right), but it is a race on the
// bytes; so the slots of a state are padded to 16 bytes and never shared with another state.

#pragma once

#include "sscan_common.cuh"

template <typename T, int NT, int K>
static __device__ __forceinline__ void fg_sscan_fwd_impl(const T* __restrict__ u, const T* __restrict__ delta,
                                                         const float* __restrict__ A, const T* __restrict__ B,
                                                         const T* __restrict__ C, const float* __restrict__ D,
                                                         const T* __restrict__ z, const float* __restrict__ bias,
                                                         T* __restrict__ out, float* __restrict__ states,
                                                         const FgScanParams& p) {
  constexpr int CH = NT * K, NW = NT / 32;
  // A state's slots are padded to 16 bytes: the compiler reads them with 16-byte vector loads.
  constexpr int NWP = (NW + 3) / 4 * 4, NS = NW > 1 ? FG_SSCAN_MAX_STATE : 1;
  __shared__ __align__(16) float wa[NS][NWP], wb[NS][NWP];
  __shared__ float carry[2][FG_SSCAN_MAX_STATE];
  const unsigned int row = blockIdx.x, d = row % p.dim, bb = row / p.dim, g = d / p.dim_per_group;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, base = tid * K;
  const size_t xoff = (size_t)row * p.len;
  const size_t bcoff = ((size_t)bb * p.groups + g) * p.state * p.len;
  const float* An = A + (size_t)d * p.state;
  const float Dd = p.has_d ? D[d] : 0.f, bd = p.has_bias ? bias[d] : 0.f;
  for (unsigned int n = tid; n < p.state; n += NT) carry[0][n] = 0.f;
  for (unsigned int c = 0; c < p.chunks; ++c) {
    // Orders the carry: written by the last thread in the previous chunk (or zeroed), read by all;
    // and every slot's reads in the previous chunk before its writes in this one.
    __syncthreads();
    const float* cin_row = carry[c & 1];
    float* cout_row = carry[(c + 1) & 1];
    const unsigned int l0 = c * CH;
    const int rem = (int)min((unsigned int)CH, p.len - l0) - base;  // this thread's steps in the sequence
    const size_t at = xoff + l0 + base;
    float dt[K], du[K], y[K], dsum = 0.f;
    {
      float uv[K];
      fg_sscan_ldf<T, K>(u + at, rem, uv);
      fg_sscan_ldf<T, K>(delta + at, rem, dt);
#pragma unroll
      for (int i = 0; i < K; ++i) {
        float t = dt[i] + bd;
        if (p.softplus) t = fg_sscan_softplus_fast(t);
        dt[i] = i < rem ? t : 0.f;  // a = exp(0) = 1 and b = 0 past the end: x passes through
        du[i] = dt[i] * uv[i];
        y[i] = Dd * uv[i];
        dsum += dt[i];
      }
    }
    const T* brow = B + bcoff + l0 + base;
    const T* crow = C + bcoff + l0 + base;
    FgSscanRow<T, K> bn, cn;
    fg_sscan_ld<T, K>(brow, rem, bn);
    fg_sscan_ld<T, K>(crow, rem, cn);
    // bf16: unrolled by two, so that the prefetched rows alternate between two register sets
    // instead of being copied (16 moves a state); f32 rows are twice the registers (ptxas: 212
    // with the unroll, 162 without), so it keeps the copies.
#pragma unroll(sizeof(T) == 2 ? 2 : 1)
    for (unsigned int n = 0; n < p.state; ++n) {
      const FgSscanRow<T, K> bv = bn, cv = cn;
      if (n + 1 < p.state) {
        fg_sscan_ld<T, K>(brow + (size_t)(n + 1) * p.len, rem, bn);
        fg_sscan_ld<T, K>(crow + (size_t)(n + 1) * p.len, rem, cn);
      }
      const float an = An[n] * FG_SSCAN_LOG2E, cin = cin_row[n];
      // The product of the thread's K factors a is one exponential of the summed dt.
      float a[K], bx[K], ta = fg_sscan_ex2(dsum * an), tb = 0.f;
#pragma unroll
      for (int i = 0; i < K; ++i) {
        a[i] = fg_sscan_ex2(dt[i] * an);
        bx[i] = du[i] * fg_sscan_at<K>(bv, i);
        tb = a[i] * tb + bx[i];
      }
      fg_sscan_warp_fwd(ta, tb, lane);
      // The composition of the earlier lanes of this warp (identity for lane 0).
      float ea = __shfl_up_sync(FG_SSCAN_FULL, ta, 1), eb = __shfl_up_sync(FG_SSCAN_FULL, tb, 1);
      if (lane == 0) {
        ea = 1.f;
        eb = 0.f;
      }
      float x = cin;
      if constexpr (NW > 1) {
        if (lane == 31) {
          wa[n][warp] = ta;
          wb[n][warp] = tb;
        }
        __syncthreads();
        for (int w = 0; w < warp; ++w) x = wa[n][w] * x + wb[n][w];
      }
      x = ea * x + eb;
#pragma unroll
      for (int i = 0; i < K; ++i) {
        x = a[i] * x + bx[i];
        y[i] += fg_sscan_at<K>(cv, i) * x;
      }
      if (tid == NT - 1) {
        cout_row[n] = x;
        states[((size_t)row * p.chunks + c) * p.state + n] = x;
      }
    }
    if (p.has_z) {
      float zv[K];
      fg_sscan_ldf<T, K>(z + at, rem, zv);
#pragma unroll
      for (int i = 0; i < K; ++i) y[i] *= zv[i] * fg_sscan_sigmoid_fast(zv[i]);
    }
    fg_sscan_st<T, K>(out + at, rem, y);
  }
}
