// selective_scan.cu: the selective scan of Mamba (mamba_ssm's selective_scan_fn, real A, variable
// B and C), forward and backward. Rust side: src/fused/selective_scan/{mod.rs, cuda.rs}; the CPU
// twin (the reference) is cpu.rs there, and mod.rs documents the recurrence.
//
// Entry points, T = float (suffix f32) or __nv_bfloat16 (bf16); NT threads, K steps a thread, a
// chunk of NT * K steps (forward configs 32x4, 32x8, 32x16, 64x16, 128x16, backward 32x4, 32x8,
// 64x8, 128x8, 256x8: the same chunk lengths; cuda.rs `config` picks the smallest chunk that
// holds the sequence, else 2048 steps, mod.rs CHUNK):
//   fg_sscan_fwd_{NT}x{K}_{sfx}(const T* u, const T* delta, const float* A, const T* B, const T* C,
//       const float* D, const T* z, const float* delta_bias, T* out, float* states, FgScanParams p)
//   fg_sscan_bwd_{NT}x{K}_{sfx}(const T* u, const T* delta, const float* A, const T* B, const T* C,
//       const float* D, const T* z, const float* delta_bias, const float* states, const T* dout,
//       T* du, T* ddelta, float* dA, float* dB, float* dC, float* dD, T* dz, float* ddelta_bias,
//       FgScanParams p)
//   grid (batch * dim), block NT, static shared memory only. Every tensor is contiguous: u, delta,
//   z, out, dout, du, ddelta, dz [batch, dim, len]; A, dA [dim, state]; B, C, dB, dC [batch,
//   groups, state, len]; D, dD, delta_bias, ddelta_bias [dim]; states [batch, dim, chunks, state],
//   the state after the last step of each chunk. D, z, delta_bias (and dD, dz, ddelta_bias) may be
//   null when p.has_d / has_z / has_bias is 0. The backward adds into dA, dB, dC, dD and
//   ddelta_bias (f32, zeroed by the caller) with atomics: channels of one group share dB / dC
//   rows, batch rows share the parameters; so their last bits vary between runs.
//
// Organisation (the one of mamba_ssm's selective_scan_fwd/bwd kernels, written anew): one block per
// (batch, channel) walks the sequence chunk by chunk (forward in order, backward in reverse), with
// the state of each of the `state` recurrences carried between chunks in shared memory. Within a
// chunk, for each state n: thread t owns steps t*K .. t*K+K-1; the step x_l = a_l x_{l-1} + b_l
// (a_l = exp(dt_l A[n]), b_l = dt_l B_l u_l) is a pair (a_l, b_l) composed associatively; each
// thread composes its K pairs, a warp-shuffle scan composes the threads' pairs, the warps' totals
// go through shared memory, and each thread then replays its steps from its starting state. The
// backward runs the same forward scan (from the saved state of the previous chunk) to get x, and a
// reverse scan of the pairs (a_l, a_l g_l), g_l = dy_l C_l, which carries s_l = a_l dL/dx_l from
// the end of the sequence: dL/dx_l = g_l + s_{l+1}. The forward (sscan_fwd.cuh) moves each
// thread's steps straight between global memory and registers; the backward moves them
// through a shared-memory tile padded one word per 32, so that thread t reading its K consecutive
// steps hits distinct banks.

#include "sscan_fwd.cuh"

#define FG_SSCAN_PAD(j) ((j) + ((j) >> 5))

// Accurate softplus and logistic function of the backward (unused in the forward's parts:
// `unused` keeps NVRTC quiet there).
__attribute__((unused)) static __device__ __forceinline__ float fg_sscan_softplus(float x) {
  return x <= 20.f ? log1pf(expf(x)) : x;
}
__attribute__((unused)) static __device__ __forceinline__ float fg_sscan_sigmoid(float x) {
  return 1.f / (1.f + expf(-x));
}

// Steps [0, nv) of a chunk from global memory (zero past nv) into v[i] = step t*K + i.
template <int NT, int K, typename T>
static __device__ __forceinline__ void fg_sscan_load(const T* __restrict__ src, int nv, float* sm, float (&v)[K]) {
  for (int j = threadIdx.x; j < NT * K; j += NT) sm[FG_SSCAN_PAD(j)] = j < nv ? fg_to_acc(src[j]) : 0.f;
  __syncthreads();
#pragma unroll
  for (int i = 0; i < K; ++i) v[i] = sm[FG_SSCAN_PAD(threadIdx.x * K + i)];
  __syncthreads();
}

// v[i] (step t*K + i) to global memory, steps [0, nv) only.
template <int NT, int K, typename T>
static __device__ __forceinline__ void fg_sscan_store(T* __restrict__ dst, int nv, float* sm, const float (&v)[K]) {
#pragma unroll
  for (int i = 0; i < K; ++i) sm[FG_SSCAN_PAD(threadIdx.x * K + i)] = v[i];
  __syncthreads();
  for (int j = threadIdx.x; j < nv; j += NT) dst[j] = fg_from_acc<T>(sm[FG_SSCAN_PAD(j)]);
  __syncthreads();
}

// Row n of B and C of one chunk into the two tiles (zero past nv); the caller synchronizes.
template <int NT, int K, typename T>
static __device__ __forceinline__ void fg_sscan_stage_bc(const T* __restrict__ b, const T* __restrict__ c, int nv,
                                                         float* sb, float* sc) {
  for (int j = threadIdx.x; j < NT * K; j += NT) {
    sb[FG_SSCAN_PAD(j)] = j < nv ? fg_to_acc(b[j]) : 0.f;
    sc[FG_SSCAN_PAD(j)] = j < nv ? fg_to_acc(c[j]) : 0.f;
  }
}

template <typename T, int NT, int K>
static __device__ __forceinline__ void fg_sscan_bwd(
    const T* __restrict__ u, const T* __restrict__ delta, const float* __restrict__ A, const T* __restrict__ B,
    const T* __restrict__ C, const float* __restrict__ D, const T* __restrict__ z, const float* __restrict__ bias,
    const float* __restrict__ states, const T* __restrict__ dout, T* __restrict__ du, T* __restrict__ ddelta,
    float* __restrict__ dA, float* __restrict__ dB, float* __restrict__ dC, float* __restrict__ dD,
    T* __restrict__ dz, float* __restrict__ dbias, const FgScanParams& p) {
  constexpr int CH = NT * K, NW = NT / 32, SM = CH + CH / 32;
  __shared__ float sb[SM], sc[SM];
  __shared__ float wa[NW], wb[NW], ra[NW], rb[NW], red[2 * NW];
  __shared__ float carry[FG_SSCAN_MAX_STATE], dAs[FG_SSCAN_MAX_STATE];
  const unsigned int row = blockIdx.x, d = row % p.dim, bb = row / p.dim, g = d / p.dim_per_group;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, base = tid * K;
  const size_t xoff = (size_t)row * p.len;
  const size_t bcoff = ((size_t)bb * p.groups + g) * p.state * p.len;
  const float Dd = p.has_d ? D[d] : 0.f, bd = p.has_bias ? bias[d] : 0.f;
  for (unsigned int n = tid; n < p.state; n += NT) {
    carry[n] = 0.f;  // s = a * dL/dx entering the chunk from the right
    dAs[n] = 0.f;
  }
  float dd_part = 0.f, dbias_part = 0.f;
  for (int c = (int)p.chunks - 1; c >= 0; --c) {
    const unsigned int l0 = (unsigned int)c * CH;
    const int nv = (int)min((unsigned int)CH, p.len - l0);
    float uv[K], dt[K], dy[K], duv[K], ddt[K], y[K], a[K], x[K];
    fg_sscan_load<NT, K>(u + xoff + l0, nv, sb, uv);
    fg_sscan_load<NT, K>(delta + xoff + l0, nv, sb, dt);
    fg_sscan_load<NT, K>(dout + xoff + l0, nv, sb, dy);
    if (p.has_z) {
      float zv[K];
      fg_sscan_load<NT, K>(z + xoff + l0, nv, sb, zv);
#pragma unroll
      for (int i = 0; i < K; ++i) dy[i] *= zv[i] * fg_sscan_sigmoid(zv[i]);
    }
#pragma unroll
    for (int i = 0; i < K; ++i) {
      dt[i] += bd;
      if (p.softplus) dt[i] = fg_sscan_softplus(dt[i]);
      duv[i] = dy[i] * Dd;
      ddt[i] = 0.f;
      y[i] = Dd * uv[i];
      dd_part += dy[i] * uv[i];  // zero past nv: u and dout load as zero there
    }
    for (unsigned int n = 0; n < p.state; ++n) {
      const float an = A[(size_t)d * p.state + n], an2 = an * FG_SSCAN_LOG2E;
      const float cin = carry[n];
      const float xin = c > 0 ? states[((size_t)row * p.chunks + c - 1) * p.state + n] : 0.f;
      fg_sscan_stage_bc<NT, K>(B + bcoff + (size_t)n * p.len + l0, C + bcoff + (size_t)n * p.len + l0, nv, sb, sc);
      __syncthreads();
      float ta = 1.f, tb = 0.f, qa = 1.f, qb = 0.f;
#pragma unroll
      for (int i = 0; i < K; ++i) {
        const bool valid = base + i < nv;
        a[i] = valid ? fg_sscan_ex2(dt[i] * an2) : 1.f;
        tb = a[i] * tb + (valid ? dt[i] * uv[i] * sb[FG_SSCAN_PAD(base + i)] : 0.f);
        ta = a[i] * ta;
      }
#pragma unroll
      for (int i = K - 1; i >= 0; --i) {
        qb = a[i] * (qb + dy[i] * sc[FG_SSCAN_PAD(base + i)]);
        qa = a[i] * qa;
      }
      fg_sscan_warp_fwd(ta, tb, lane);
      fg_sscan_warp_rev(qa, qb, lane);
      if (lane == 31) {
        wa[warp] = ta;
        wb[warp] = tb;
      }
      if (lane == 0) {
        ra[warp] = qa;
        rb[warp] = qb;
      }
      float ea = __shfl_up_sync(FG_SSCAN_FULL, ta, 1), eb = __shfl_up_sync(FG_SSCAN_FULL, tb, 1);
      float fa = __shfl_down_sync(FG_SSCAN_FULL, qa, 1), fb = __shfl_down_sync(FG_SSCAN_FULL, qb, 1);
      if (lane == 0) {
        ea = 1.f;
        eb = 0.f;
      }
      if (lane == 31) {
        fa = 1.f;
        fb = 0.f;
      }
      __syncthreads();
      // The state before this thread's first step, and s entering its last step from the right.
      float x0 = xin;
      for (int w = 0; w < warp; ++w) x0 = wa[w] * x0 + wb[w];
      x0 = ea * x0 + eb;
      float s = cin;
      for (int w = NW - 1; w > warp; --w) s = ra[w] * s + rb[w];
      s = fa * s + fb;
      float xs = x0;
#pragma unroll
      for (int i = 0; i < K; ++i) {
        xs = a[i] * xs + (base + i < nv ? dt[i] * uv[i] * sb[FG_SSCAN_PAD(base + i)] : 0.f);
        x[i] = xs;
        y[i] += sc[FG_SSCAN_PAD(base + i)] * xs;
      }
      float da_part = 0.f;
#pragma unroll
      for (int i = K - 1; i >= 0; --i) {
        const float bv = sb[FG_SSCAN_PAD(base + i)], cv = sc[FG_SSCAN_PAD(base + i)];
        const float h = dy[i] * cv + s;  // dL/dx at this step
        const float prev = i > 0 ? x[i - 1] : x0;
        const float ha = h * prev * a[i];
        ddt[i] += ha * an + h * bv * uv[i];
        // Past nv a = 1 and dy = u = B = 0: h and x pass through unchanged, but dt is not zero.
        if (base + i < nv) da_part += ha * dt[i];
        duv[i] += h * dt[i] * bv;
        sb[FG_SSCAN_PAD(base + i)] = h * dt[i] * uv[i];  // this thread's own slots: dB, dC
        sc[FG_SSCAN_PAD(base + i)] = dy[i] * x[i];
        s = a[i] * h;
      }
      da_part = fg_sscan_warp_sum(da_part);
      if (lane == 0) atomicAdd(&dAs[n], da_part);
      if (tid == 0) {
        float tot = cin;
        for (int w = NW - 1; w >= 0; --w) tot = ra[w] * tot + rb[w];
        carry[n] = tot;  // every thread read carry[n] before the first barrier of this state
      }
      __syncthreads();
      float* dbr = dB + bcoff + (size_t)n * p.len + l0;
      float* dcr = dC + bcoff + (size_t)n * p.len + l0;
      for (int j = tid; j < nv; j += NT) {
        atomicAdd(dbr + j, sb[FG_SSCAN_PAD(j)]);
        atomicAdd(dcr + j, sc[FG_SSCAN_PAD(j)]);
      }
      __syncthreads();
    }
    // d delta through the softplus and the bias; dz from the pre-gate output y.
    float raw[K];
    fg_sscan_load<NT, K>(delta + xoff + l0, nv, sb, raw);
#pragma unroll
    for (int i = 0; i < K; ++i) {
      const float r = raw[i] + bd;
      if (p.softplus && r <= 20.f) ddt[i] *= fg_sscan_sigmoid(r);
      if (base + i < nv) dbias_part += ddt[i];
    }
    fg_sscan_store<NT, K>(du + xoff + l0, nv, sb, duv);
    fg_sscan_store<NT, K>(ddelta + xoff + l0, nv, sb, ddt);
    if (p.has_z) {
      float zv[K], go[K];
      fg_sscan_load<NT, K>(z + xoff + l0, nv, sb, zv);
      fg_sscan_load<NT, K>(dout + xoff + l0, nv, sb, go);
#pragma unroll
      for (int i = 0; i < K; ++i) {
        const float sg = fg_sscan_sigmoid(zv[i]);
        go[i] *= y[i] * sg * (1.f + zv[i] * (1.f - sg));
      }
      fg_sscan_store<NT, K>(dz + xoff + l0, nv, sb, go);
    }
  }
  dd_part = fg_sscan_warp_sum(dd_part);
  dbias_part = fg_sscan_warp_sum(dbias_part);
  if (lane == 0) {
    red[warp] = dd_part;
    red[NW + warp] = dbias_part;
  }
  __syncthreads();
  if (tid == 0) {
    float s0 = 0.f, s1 = 0.f;
    for (int w = 0; w < NW; ++w) {
      s0 += red[w];
      s1 += red[NW + w];
    }
    if (p.has_d) atomicAdd(dD + d, s0);
    if (p.has_bias) atomicAdd(dbias + d, s1);
  }
  for (unsigned int n = tid; n < p.state; n += NT) atomicAdd(dA + (size_t)d * p.state + n, dAs[n]);
}

#define FG_SSCAN_FWD(SUF, T, NT, K)                                                                     \
  extern "C" __global__ void __launch_bounds__(NT) fg_sscan_fwd_##NT##x##K##_##SUF(                      \
      const T* u, const T* delta, const float* A, const T* B, const T* C, const float* D, const T* z,         \
      const float* bias, T* out, float* states, FgScanParams p) {                                             \
    fg_sscan_fwd_impl<T, NT, K>(u, delta, A, B, C, D, z, bias, out, states, p);                                   \
  }
#define FG_SSCAN_BWD(SUF, T, NT, K)                                                                          \
  extern "C" __global__ void __launch_bounds__(NT) fg_sscan_bwd_##NT##x##K##_##SUF(                          \
      const T* u, const T* delta, const float* A, const T* B, const T* C, const float* D, const T* z,         \
      const float* bias, const float* states, const T* dout, T* du, T* ddelta, float* dA, float* dB,          \
      float* dC, float* dD, T* dz, float* dbias, FgScanParams p) {                                            \
    fg_sscan_bwd<T, NT, K>(u, delta, A, B, C, D, z, bias, states, dout, du, ddelta, dA, dB, dC, dD, dz,       \
                           dbias, p);                                                                         \
  }

// The backward keeps eight K-step arrays in registers: with K = 16 it needs all 255 registers
// (ptxas, sm_90), so its long chunks run twice the threads with K = 8 (same chunk lengths as the
// forward's, which the saved states require).
#define FG_SSCAN_FWDS(SUF, T)                                                                   \
  FG_SSCAN_FWD(SUF, T, 32, 4)                                                                   \
  FG_SSCAN_FWD(SUF, T, 32, 8)                                                                   \
  FG_SSCAN_FWD(SUF, T, 32, 16)                                                                  \
  FG_SSCAN_FWD(SUF, T, 64, 16)                                                                  \
  FG_SSCAN_FWD(SUF, T, 128, 16)
#define FG_SSCAN_BWDS_SHORT(SUF, T)                                                             \
  FG_SSCAN_BWD(SUF, T, 32, 4)                                                                   \
  FG_SSCAN_BWD(SUF, T, 32, 8)
#define FG_SSCAN_BWDS_LONG(SUF, T)                                                              \
  FG_SSCAN_BWD(SUF, T, 64, 8)                                                                   \
  FG_SSCAN_BWD(SUF, T, 128, 8)                                                                  \
  FG_SSCAN_BWD(SUF, T, 256, 8)

// Which entry points this NVRTC module holds (`-D FG_SSCAN_PART=<n>`, mod.rs `MODULES`): all 20
// in one module took 9 s of NVRTC, the longest pole of a cold precompile; the parts compile in
// parallel, and a run compiles only the parts it launches.
#if !defined(FG_SSCAN_PART)
#error "FG_SSCAN_PART comes from Rust (src/fused/selective_scan/mod.rs MODULES)"
#elif FG_SSCAN_PART == 0
FG_SSCAN_FWDS(f32, float)
#elif FG_SSCAN_PART == 1
FG_SSCAN_FWDS(bf16, __nv_bfloat16)
#elif FG_SSCAN_PART == 2
FG_SSCAN_BWDS_SHORT(f32, float)
#elif FG_SSCAN_PART == 3
FG_SSCAN_BWDS_LONG(f32, float)
#elif FG_SSCAN_PART == 4
FG_SSCAN_BWDS_SHORT(bf16, __nv_bfloat16)
#elif FG_SSCAN_PART == 5
FG_SSCAN_BWDS_LONG(bf16, __nv_bfloat16)
#else
#error "FG_SSCAN_PART is 0..5 (mod.rs MODULES)"
#endif
