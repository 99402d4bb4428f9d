// linear_wgmma.cu: a prototype, not a ferrograd kernel (yet). The fused linear's forward with GELU
// and the kept pre-activation (y = gelu_tanh(x W^T + b), z = x W^T + b, bf16, f32 accumulation) as
// a Hopper GEMM of our own: TMA loads into a ring of stages handed over by mbarriers, wgmma from
// 128-byte-swizzled shared memory (the helpers of src/fused/attention/attention_wgmma.cu), the
// epilogue through shared memory and TMA stores. Timed beside cuBLASLt's GELU_AUX_BIAS on the same
// problem (back-to-back launches, median of 7 batches of 20) and checked against it element by
// element (outputs poisoned with NaN first; z bit-identical, y within 2 bf16 ulps: tanh.approx
// against cuBLASLt's).
//
// Why (BENCHMARKS.md, 2026-11-25 eighteenth session): on an H200 the linear + GELU step at 16384 x
// 1024 -> 4096 is 1.06-1.08x PyTorch eager, and its forward is cuBLASLt's aux kernel (235-240 µs
// alone) where the same GEMM without the aux output takes ~210; cuBLASLt offers no faster one.
// What the variants measured (H200, 1024 -> 4096, median µs; cuBLASLt 232-240 in the same runs;
// BENCHMARKS.md has every run and the other two GPT-2 shapes):
//   v1 (not kept): a 128 x 128 tile a block, 2 blocks an SM, 4-byte stores from registers:
//       348-391, L2-bound (Nsight Compute: L2 82%, tensor pipe 42%; cuBLASLt 45% / 63% with half
//       our L2 sectors). 16-byte stores through a quad transpose: no better.
//   v3 (lin_fwd_coop): persistent, one block an SM, the epilogue through swizzled shared memory
//       and TMA stores: 128 x 128 tiles, 4 stages 229-244 (0.97-1.04x cuBLASLt; alone in Nsight
//       Compute 235.9 against 244.6); 128 x 256, 3 stages 247-268.
//   not kept: the epilogue of tile i between tile i + 1's k-steps in the same warpgroup (a second
//       register set; 2 chunks or 16 slices) 267-293; a warpgroup of its own for the epilogue (f32
//       accumulators handed over in shared memory, room for only 3 stages) 283-288.
//   v7 (lin_fwd_coop, SHARED): one staging buffer for the block, so 128 x 256 tiles keep 4 stages:
//       244 (218 without the stores); 1.02x cuBLASLt at 3072 -> 768.
//   v8 (lin_fwd_pingpong): each consumer warpgroup on whole 128 x 128 tiles in turn: 240 (1.0x),
//       1.03-1.09x at 768 -> 3072.
//   v9 (lin_fwd_coop, MC = 2): clusters of 2 blocks along M sharing the weight tile by TMA
//       multicast: 253 (128 x 128) / 281 (128 x 256); 515-719 with cluster-scope release / acquire
//       on the stage hand-back (the first attempt). Correct, not faster.
// So an epilogue of our own is level with cuBLASLt's aux kernel, not yet past it: with the stores
// hidden (v8) the 128 x 128 tiles' products are the limit (~220-226 µs alone), 128 x 256 tiles
// (218 alone) leave no staging room for a hidden epilogue, and sharing a tile between two blocks
// ties their rings together. Next: deeper rings with the multicast operand only, or 256 x 128
// tiles over three consumer warpgroups.
//
// Build and run on a GPU machine from the repository root: bash bench/kernels/linear_wgmma.sh
#include <cublasLt.h>
#include <cuda.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "attention_wgmma_ops.cuh"
#include "hopper_harness.cuh"

static __device__ __forceinline__ unsigned long long wg_desc(unsigned saddr) {
  // 128-byte swizzle, K-major: LBO 16 bytes (unused for swizzled K-major), SBO 1024 (8 rows x 128 B).
  return (unsigned long long)((saddr & 0x3FFFFu) >> 4) | ((unsigned long long)(16 >> 4) << 16) |
         ((unsigned long long)(1024 >> 4) << 32) | (1ull << 62);
}

// ---- host ---------------------------------------------------------------------------------------

// cuBLASLt's GELU_AUX_BIAS on the same problem, as ferrograd's fused linear calls it
// (src/fused/linear/cuda.rs): column-major y^T (N x M) = W (N x K, read transposed) x^T.
static void lt_init(Lt& L, const bf16* bias, bf16* aux, int M, int N, int K) {
  CL(cublasLtCreate(&L.h));
  CL(cublasLtMatmulDescCreate(&L.d, CUBLAS_COMPUTE_32F, CUDA_R_32F));
  cublasOperation_t ta = CUBLAS_OP_T, tb = CUBLAS_OP_N;
  CL(cublasLtMatmulDescSetAttribute(L.d, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof(ta)));
  CL(cublasLtMatmulDescSetAttribute(L.d, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof(tb)));
  cublasLtEpilogue_t ep = CUBLASLT_EPILOGUE_GELU_AUX_BIAS;
  CL(cublasLtMatmulDescSetAttribute(L.d, CUBLASLT_MATMUL_DESC_EPILOGUE, &ep, sizeof(ep)));
  CL(cublasLtMatmulDescSetAttribute(L.d, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &bias, sizeof(bias)));
  CL(cublasLtMatmulDescSetAttribute(L.d, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER, &aux, sizeof(aux)));
  int64_t ldaux = N;
  CL(cublasLtMatmulDescSetAttribute(L.d, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD, &ldaux, sizeof(ldaux)));
  CL(cublasLtMatrixLayoutCreate(&L.la, CUDA_R_16BF, K, N, K));
  CL(cublasLtMatrixLayoutCreate(&L.lb, CUDA_R_16BF, K, M, K));
  CL(cublasLtMatrixLayoutCreate(&L.ld, CUDA_R_16BF, N, M, N));
  lt_pick(L);
}

// Max |ours - ref| over |ref| + 1e-2, and how many elements differ by more than 2 bf16 ulps of ref.
static void compare(const char* what, const bf16* d_ours, const bf16* d_ref, size_t n) {
  std::vector<bf16> a(n), b(n);
  CK(cudaMemcpy(a.data(), d_ours, n * 2, cudaMemcpyDeviceToHost));
  CK(cudaMemcpy(b.data(), d_ref, n * 2, cudaMemcpyDeviceToHost));
  double worst = 0;
  size_t bad = 0, nonfinite = 0;
  for (size_t i = 0; i < n; ++i) {
    const float x = __bfloat162float(a[i]), r = __bfloat162float(b[i]);
    if (!std::isfinite(x)) {
      ++nonfinite;
      continue;
    }
    const double d = std::fabs((double)x - r);
    worst = std::max(worst, d / (std::fabs(r) + 1e-2));
    if (d > 2.0 * std::ldexp(1.0, std::ilogb(std::fabs(r) + 1e-30) - 7)) ++bad;
  }
  printf("  %s vs cuBLASLt: max rel %.3g, %zu of %zu beyond 2 ulps, %zu non-finite\n", what, worst, bad, n, nonfinite);
}

// ---- shared by the kernels below ------------------------------------------------------------------

static __device__ __forceinline__ unsigned cluster_rank() {
  unsigned r;
  asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
  return r;
}
static __device__ __forceinline__ void cluster_sync() {
  asm volatile("barrier.cluster.arrive.release.aligned;\nbarrier.cluster.wait.acquire.aligned;\n" ::: "memory");
}
// Arrive on the mbarrier at offset `bar` of block `cta` of the cluster (CTA-scope release, as
// CUTLASS's ClusterBarrier: with cluster-scope release and acquire the first multicast attempt ran
// 1.5-3x slower than no cluster at all).
static __device__ __forceinline__ void mbar_arrive_cluster(unsigned bar, unsigned cta) {
  unsigned r;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(r) : "r"(bar), "r"(cta));
  asm volatile("mbarrier.arrive.shared::cluster.b64 _, [%0];\n" ::"r"(r) : "memory");
}
static __device__ __forceinline__ void tma_load2_mc(unsigned dst, const Tmap& map, int c0, int c1, unsigned bar,
                                                    unsigned short mask) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes.multicast::cluster [%0], [%1, "
      "{%2, "
      "%3}], [%4], %5;\n" ::"r"(dst),
      "l"(reinterpret_cast<unsigned long long>(&map)), "r"(c0), "r"(c1), "r"(bar), "h"(mask)
      : "memory");
}

// One 8-column group of an accumulator fragment (c[0..1]: row `row`, columns 2t and 2t + 1;
// c[2..3]: row + 8): bias, GELU, and y and z as bf16 into the 128-byte-swizzled staging boxes
// `ybuf` / `zbuf` (rows of 64 columns; `jj` the group within the box). STORE = false: the math
// only (a write that never happens keeps it alive), to measure what the stores cost.
template <bool STORE>
static __device__ __forceinline__ void epi_group(const float (&c)[4], float2 bb, int row, int jj, int t, unsigned ybuf,
                                                 unsigned zbuf) {
  const float k0 = 0.7978845608028654f, k1 = 0.044715f;
#pragma unroll
  for (int e = 0; e < 2; ++e) {
    const float za = c[2 * e] + bb.x, zb = c[2 * e + 1] + bb.y;
    const float ta_ = tanh_fast(k0 * (za + k1 * za * za * za)), tb_ = tanh_fast(k0 * (zb + k1 * zb * zb * zb));
    __nv_bfloat162 yv = __floats2bfloat162_rn(0.5f * za * (1.f + ta_), 0.5f * zb * (1.f + tb_));
    __nv_bfloat162 zv = __floats2bfloat162_rn(za, zb);
    const int r = row + 8 * e;
    const unsigned off = r * 128 + ((jj ^ (r & 7)) * 16) + 4 * t;
    const unsigned yw = *reinterpret_cast<unsigned*>(&yv), zw = *reinterpret_cast<unsigned*>(&zv);
    if (!STORE) {
      if ((yw ^ zw) == 0x7fc17fc1u) asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(ybuf + off), "r"(yw) : "memory");
      continue;
    }
    asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(ybuf + off), "r"(yw) : "memory");
    asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(zbuf + off), "r"(zw) : "memory");
  }
}

// The producer (lane 0 of warp 8): every tile's k-steps in order into the S-stage ring, A's rows
// of the tile and W's (NB halves of 128 rows; with MC > 1 this block's 1/MC of each half,
// multicast to the cluster). Tile groups as the consumers walk them: grp = blockIdx.x / MC, +=
// clusters; a group is MC m-tiles at one n-tile.
template <int NB, int S, int MC>
static __device__ __forceinline__ void produce(const Tmap& ta, const Tmap& tb, unsigned base, unsigned bars,
                                               int tiles_n, int groups, int clusters, int KT, unsigned rank) {
  constexpr int BM = 128, BN = 128 * NB, BK = 64;
  constexpr unsigned A_BYTES = BM * BK * 2, STAGE = A_BYTES + BN * BK * 2;
  int it = 0;
  for (int grp = blockIdx.x / MC; grp < groups; grp += clusters) {
    const int n0 = (grp % tiles_n) * BN, m0 = ((grp / tiles_n) * MC + (int)rank) * BM;
    for (int kt = 0; kt < KT; ++kt, ++it) {
      const int s = it % S;
      if (it >= S) mbar_wait(bars + 8 * (S + s), (unsigned)((it / S - 1) & 1));
      const unsigned full = bars + 8 * s, a = base + s * STAGE;
      mbar_expect_tx(full, STAGE);
      tma_load2(a, ta, kt * BK, m0, full);
#pragma unroll
      for (int h = 0; h < NB; ++h) {
        if (MC > 1)
          tma_load2_mc(a + A_BYTES + h * 128 * 128 + rank * (128 / MC) * 128, tb, kt * BK,
                       n0 + h * 128 + (int)rank * (128 / MC), full, (unsigned short)((1u << MC) - 1));
        else
          tma_load2(a + A_BYTES + h * 128 * 128, tb, kt * BK, n0 + h * 128, full);
      }
    }
  }
}

// ---- the cooperative kernel: both consumer warpgroups on one tile -------------------------------
// Persistent (one block an SM; tiles n-fastest, so the blocks in flight share A's rows and all of B
// in L2). Warps 0-7 compute (warpgroup w the tile's rows 64w..64w+63), lane 0 of warp 8 loads by
// TMA. The epilogue goes through swizzled shared memory and TMA stores (asynchronous: the next
// tile's products start while the copy engine writes this one's y and z; stores from registers
// cost 70-150 µs more than none). Template choices, each a variant measured in BENCHMARKS.md:
//   NB       tile width 128 * NB (v3: 1 or 2);
//   S        stages of the load ring;
//   STORE    false: no stores (the products and the GELU alone);
//   SHARED   one staging buffer for the block (128-row boxes; v7), else two per warpgroup (v3);
//   MC       clusters of MC blocks along M sharing the B tile by TMA multicast (v9), stages given
//            back to every block of the cluster.
template <int NB, int S, bool STORE, bool SHARED, int MC>
__global__ void __launch_bounds__(288, 1)
    lin_fwd_coop(const __grid_constant__ Tmap ta, const __grid_constant__ Tmap tb, const __grid_constant__ Tmap ty,
                 const __grid_constant__ Tmap tz, const bf16* __restrict__ bias, int M, int N, int K) {
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  constexpr int BM = 128, BN = 128 * NB, BK = 64, BOX = SHARED ? 128 : 64;  // staging box rows
  constexpr unsigned A_BYTES = BM * BK * 2, B_BYTES = BN * BK * 2, STAGE = A_BYTES + B_BYTES;
  constexpr unsigned CHUNK = BOX * 64 * 2;
  const unsigned base = (smem_u32(smem_raw) + 1023u) & ~1023u;
  const unsigned bars = base + S * STAGE;                 // full[S], empty[S]
  const unsigned epi = (bars + 16 * S + 1023u) & ~1023u;  // SHARED: y, z; else per warpgroup 2 x (y, z)
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const unsigned rank = MC > 1 ? cluster_rank() : 0;
  const int tiles_n = N / BN, groups = (M / BM / MC) * tiles_n, clusters = gridDim.x / MC;
  const int KT = K / BK;

  if (tid == 0) {
    for (int s = 0; s < S; ++s) {
      mbar_init(bars + 8 * s, 1);
      mbar_init(bars + 8 * (S + s), 8 * MC);
    }
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  if (MC > 1)
    cluster_sync();
  else
    __syncthreads();

  if (warp == 8) {
    if (lane == 0) produce<NB, S, MC>(ta, tb, base, bars, tiles_n, groups, clusters, KT, rank);
  } else {
    const int wg = warp >> 2, g = lane >> 2, t = lane & 3, wr = (warp & 3) * 16 + g;
    const bool elected = SHARED ? tid == 0 : (tid & 127) == 0;
    const int bar_id = SHARED ? 1 : 1 + wg, bar_n = SHARED ? 256 : 128;
    int it = 0, q_all = 0;
    for (int grp = blockIdx.x / MC; grp < groups; grp += clusters) {
      const int n0 = (grp % tiles_n) * BN, m0 = ((grp / tiles_n) * MC + (int)rank) * BM;
      float acc[NB][16][4];
      for (int kt = 0; kt < KT; ++kt, ++it) {
        const int s = it % S;
        mbar_wait(bars + 8 * s, (unsigned)((it / S) & 1));
        const unsigned a = base + s * STAGE + wg * 64 * 128, b = base + s * STAGE + A_BYTES;
        asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
#pragma unroll
        for (int kk = 0; kk < 4; ++kk) {
#pragma unroll
          for (int h = 0; h < NB; ++h)
            FgWg<bf16>::ss128<0, 0>(acc[h], wg_desc(a + kk * 32), wg_desc(b + h * 128 * 128 + kk * 32), (kt | kk) != 0);
        }
        asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
        asm volatile("wgmma.wait_group.sync.aligned 1;\n" ::: "memory");
        if (kt > 0 && lane == 0) {
          const unsigned e = bars + 8 * (S + (it - 1) % S);
          if (MC > 1)
            for (int c = 0; c < MC; ++c) mbar_arrive_cluster(e, (unsigned)c);
          else
            mbar_arrive(e);
        }
      }
      asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");
      if (lane == 0) {
        const unsigned e = bars + 8 * (S + (it - 1) % S);
        if (MC > 1)
          for (int c = 0; c < MC; ++c) mbar_arrive_cluster(e, (unsigned)c);
        else
          mbar_arrive(e);
      }
      // 64-column chunks: registers -> staging -> one TMA store each for y and z.
#pragma unroll
      for (int q = 0; q < NB * 2; ++q, ++q_all) {
        const unsigned buf = SHARED ? epi : epi + wg * 4 * CHUNK + (q_all & 1) * 2 * CHUNK;
        if (elected) {
          if (SHARED)
            asm volatile("cp.async.bulk.wait_group.read 0;\n" ::: "memory");
          else
            asm volatile("cp.async.bulk.wait_group.read 1;\n" ::: "memory");
        }
        named_bar(bar_id, bar_n);
        const int h = q >> 1;
#pragma unroll
        for (int jj = 0; jj < 8; ++jj) {
          const int j = (q & 1) * 8 + jj;
          const float2 bb =
              __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(bias + n0 + h * 128 + j * 8 + 2 * t));
          epi_group<STORE>(acc[h][j], bb, (SHARED ? wg * 64 : 0) + wr, jj, t, buf, buf + CHUNK);
        }
        asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
        named_bar(bar_id, bar_n);
        if (STORE && elected) {
          const int r0 = m0 + (SHARED ? 0 : wg * 64);
          tma_store2(ty, buf, n0 + q * 64, r0);
          tma_store2(tz, buf + CHUNK, n0 + q * 64, r0);
          asm volatile("cp.async.bulk.commit_group;\n" ::: "memory");
        }
      }
    }
    if (elected) asm volatile("cp.async.bulk.wait_group 0;\n" ::: "memory");
  }
  // No block leaves while a cluster peer may still write into it or arrive on its barriers.
  if (MC > 1) cluster_sync();
}

// ---- the ping-pong kernel (v8): each consumer warpgroup owns whole 128 x 128 tiles ---------------
// Two m64 halves a warpgroup (128 accumulator registers a thread); warpgroup 0 takes the block's
// even tiles, 1 the odd ones; the producer streams every tile's stages in order, so one
// warpgroup's products run while the other does its epilogue. Named barriers 3 and 4 alternate
// the two warpgroups' products: besides keeping the tensor cores to one tile at a time, a
// warpgroup then never waits on a stage more than one phase ahead (the first version, without
// them, waited two phases ahead, which the mbarrier's parity cannot tell, and faulted).
template <int S>
__global__ void __launch_bounds__(288, 1)
    lin_fwd_pingpong(const __grid_constant__ Tmap ta, const __grid_constant__ Tmap tb, const __grid_constant__ Tmap ty,
                     const __grid_constant__ Tmap tz, const bf16* __restrict__ bias, int M, int N, int K) {
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  constexpr int BM = 128, BN = 128, BK = 64;
  constexpr unsigned A_BYTES = BM * BK * 2, B_BYTES = BN * BK * 2, STAGE = A_BYTES + B_BYTES;
  constexpr unsigned CHUNK = BM * 64 * 2;  // one output box: 128 rows x 64 columns
  const unsigned base = (smem_u32(smem_raw) + 1023u) & ~1023u;
  const unsigned epi = base + S * STAGE;  // per warpgroup: y chunk, z chunk
  const unsigned bars = epi + 4 * CHUNK;  // full[S], empty[S]
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int tiles_n = N / BN, tiles = (M / BM) * tiles_n;
  const int KT = K / BK;

  if (tid == 0) {
    for (int s = 0; s < S; ++s) {
      mbar_init(bars + 8 * s, 1);
      mbar_init(bars + 8 * (S + s), 4);  // a stage is read by one warpgroup
    }
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  __syncthreads();

  if (warp == 8) {
    if (lane == 0) produce<1, S, 1>(ta, tb, base, bars, tiles_n, tiles, gridDim.x, KT, 0);
    return;
  }

  const int wg = warp >> 2, g = lane >> 2, t = lane & 3, wr = (warp & 3) * 16 + g;
  const bool elected = (tid & 127) == 0;
  const unsigned buf = epi + wg * 2 * CHUNK;
  for (int i = wg;; i += 2) {
    const int tile = blockIdx.x + i * gridDim.x;
    if (tile >= tiles) break;
    const int n0 = (tile % tiles_n) * BN, m0 = (tile / tiles_n) * BM;
    if (i > 0) named_bar(wg == 0 ? 4 : 3, 256);
    const bool other_next = blockIdx.x + (i + 1) * gridDim.x < tiles;
    float acc[2][16][4];
    int it = i * KT;
    for (int kt = 0; kt < KT; ++kt, ++it) {
      const int s = it % S;
      mbar_wait(bars + 8 * s, (unsigned)((it / S) & 1));
      const unsigned a = base + s * STAGE, b = a + A_BYTES;
      asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
#pragma unroll
      for (int kk = 0; kk < 4; ++kk) {
#pragma unroll
        for (int h = 0; h < 2; ++h)
          FgWg<bf16>::ss128<0, 0>(acc[h], wg_desc(a + h * 64 * 128 + kk * 32), wg_desc(b + kk * 32), (kt | kk) != 0);
      }
      asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
      // The last k-step is issued: the other warpgroup may start its tile.
      if (kt == KT - 1 && other_next) asm volatile("bar.arrive %0, 256;\n" ::"r"(wg == 0 ? 3 : 4) : "memory");
      asm volatile("wgmma.wait_group.sync.aligned 1;\n" ::: "memory");
      if (kt > 0 && lane == 0) mbar_arrive(bars + 8 * (S + (it - 1) % S));
    }
    asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");
    if (lane == 0) mbar_arrive(bars + 8 * (S + (it - 1) % S));
#pragma unroll
    for (int q = 0; q < 2; ++q) {
      if (elected) asm volatile("cp.async.bulk.wait_group.read 0;\n" ::: "memory");
      named_bar(1 + wg, 128);
#pragma unroll
      for (int jj = 0; jj < 8; ++jj) {
        const int j = q * 8 + jj;
        const float2 bb = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(bias + n0 + j * 8 + 2 * t));
#pragma unroll
        for (int h = 0; h < 2; ++h) epi_group<true>(acc[h][j], bb, h * 64 + wr, jj, t, buf, buf + CHUNK);
      }
      asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
      named_bar(1 + wg, 128);
      if (elected) {
        tma_store2(ty, buf, n0 + q * 64, m0);
        tma_store2(tz, buf + CHUNK, n0 + q * 64, m0);
        asm volatile("cp.async.bulk.commit_group;\n" ::: "memory");
      }
    }
  }
  if (elected) asm volatile("cp.async.bulk.wait_group 0;\n" ::: "memory");
}

// ---- runners ------------------------------------------------------------------------------------

// Launch `k` (grid / cluster from `cfg`) once on poisoned outputs, time it, and check y and z.
template <typename Kern>
static void run(const char* name, Kern k, cudaLaunchConfig_t cfg, bool check, const Tmap& ta, const Tmap& tb,
                const bf16* bias, bf16* y, bf16* z, const bf16* yref, const bf16* zref, int M, int N, int K,
                double flops, int box_rows) {
  // LW_ONLY=<text>: run only the variants whose name holds it (one kernel under compute-sanitizer).
  if (const char* only = getenv("LW_ONLY"); only && !strstr(name, only)) return;
  CK(cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)cfg.dynamicSmemBytes));
  const Tmap ty = make_map(y, M, N, box_rows), tz = make_map(z, M, N, box_rows);
  CK(cudaMemset(y, 0xFF, (size_t)M * N * 2));
  CK(cudaMemset(z, 0xFF, (size_t)M * N * 2));
  auto launch = [&] { CK(cudaLaunchKernelEx(&cfg, k, ta, tb, ty, tz, bias, M, N, K)); };
  launch();
  CK(cudaDeviceSynchronize());
  const float us = time_us(launch, 20);
  printf("%-36s grid %u, smem %zu: %.1f us (%.0f TFLOP/s)\n", name, cfg.gridDim.x, cfg.dynamicSmemBytes, us,
         flops / us * 1e-6);
  if (check) {
    compare("y", y, yref, (size_t)M * N);
    compare("z", z, zref, (size_t)M * N);
  }
}

// A persistent launch of `blocks_per_cluster`-block clusters, as many as fit (at most one a tile).
template <typename Kern>
static cudaLaunchConfig_t persistent(Kern k, size_t smem, int blocks_per_cluster, int tiles, cudaLaunchAttribute* at) {
  CK(cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
  cudaLaunchConfig_t cfg = {};
  cfg.blockDim = dim3(288);
  cfg.dynamicSmemBytes = smem;
  at[0].id = cudaLaunchAttributeClusterDimension;
  at[0].val.clusterDim.x = blocks_per_cluster;
  at[0].val.clusterDim.y = 1;
  at[0].val.clusterDim.z = 1;
  cfg.attrs = at;
  cfg.numAttrs = 1;
  cfg.gridDim = dim3(blocks_per_cluster);
  int clusters = 0;
  CK(cudaOccupancyMaxActiveClusters(&clusters, k, &cfg));
  cfg.gridDim = dim3(std::min(clusters * blocks_per_cluster, tiles));
  if (blocks_per_cluster == 1) cfg.numAttrs = 0;  // a plain launch where no cluster is needed
  return cfg;
}

template <int NB, int S, bool STORE, bool SHARED, int MC>
static void run_coop(const char* name, const Tmap& ta, const Tmap& tb, const bf16* bias, bf16* y, bf16* z,
                     const bf16* yref, const bf16* zref, int M, int N, int K, double flops) {
  constexpr int BOX = SHARED ? 128 : 64;
  const size_t smem = S * (128 * 64 * 2 + 128 * NB * 64 * 2) + 16 * S + 1024 + 1024 + (SHARED ? 2 : 8) * BOX * 64 * 2;
  auto k = lin_fwd_coop<NB, S, STORE, SHARED, MC>;
  cudaLaunchAttribute at[1];
  const cudaLaunchConfig_t cfg = persistent(k, smem, MC, (M / 128) * (N / (128 * NB)), at);
  run(name, k, cfg, STORE, ta, tb, bias, y, z, yref, zref, M, N, K, flops, BOX);
}

template <int S>
static void run_pingpong(const char* name, const Tmap& ta, const Tmap& tb, const bf16* bias, bf16* y, bf16* z,
                         const bf16* yref, const bf16* zref, int M, int N, int K, double flops) {
  const size_t smem = S * (128 * 64 * 2 * 2) + 4 * 128 * 64 * 2 + 16 * S + 1024;
  auto k = lin_fwd_pingpong<S>;
  cudaLaunchAttribute at[1];
  const cudaLaunchConfig_t cfg = persistent(k, smem, 1, (M / 128) * (N / 128), at);
  run(name, k, cfg, true, ta, tb, bias, y, z, yref, zref, M, N, K, flops, 128);
}

int main(int argc, char** argv) {
  // Optional: the index of the one shape to run (0, 1, 2: GPT-2's; 3: a small one, for profiling and
  // compute-sanitizer).
  const int only = argc > 1 ? atoi(argv[1]) : -1;
  device_banner();
  const int shapes[4][3] = {{16384, 1024, 4096}, {16384, 768, 3072}, {16384, 3072, 768}, {512, 256, 512}};
  for (int si = 0; si < 4; ++si) {
    if (only >= 0 ? si != only : si == 3) continue;
    const int* s = shapes[si];
    const int M = s[0], K = s[1], N = s[2];
    const double flops = 2.0 * M * N * K;
    bf16 *x, *w, *b, *y, *z, *yr, *zr;
    CK(cudaMalloc(&x, (size_t)M * K * 2));
    CK(cudaMalloc(&w, (size_t)N * K * 2));
    CK(cudaMalloc(&b, (size_t)N * 2));
    CK(cudaMalloc(&y, (size_t)M * N * 2));
    CK(cudaMalloc(&z, (size_t)M * N * 2));
    CK(cudaMalloc(&yr, (size_t)M * N * 2));
    CK(cudaMalloc(&zr, (size_t)M * N * 2));
    fill_rand<<<1024, 256>>>(x, (size_t)M * K, 1u, 2.0f);
    fill_rand<<<1024, 256>>>(w, (size_t)N * K, 2u, 1.0f / sqrtf((float)K));
    fill_rand<<<64, 256>>>(b, (size_t)N, 3u, 1.0f / sqrtf((float)K));
    CK(cudaDeviceSynchronize());
    printf("\nM %d, K %d -> N %d (bf16, GELU tanh, z kept)\n", M, K, N);
    Lt L;
    lt_init(L, b, zr, M, N, K);
    lt_run(L, x, w, yr);
    CK(cudaDeviceSynchronize());
    const float lt_us = time_us([&] { lt_run(L, x, w, yr); }, 20);
    printf("%-34s %.1f us (%.0f TFLOP/s)\n", "cuBLASLt GELU_AUX_BIAS", lt_us, flops / lt_us * 1e-6);
    const Tmap ta = make_map(x, M, K, 128);
    const Tmap tb = make_map(w, N, K, 128);
    const Tmap tbh = make_map(w, N, K, 64);  // half the B tile, for the multicast
    run_coop<1, 4, true, false, 1>("v3 128x128, 4 stages", ta, tb, b, y, z, yr, zr, M, N, K, flops);
    run_coop<2, 3, true, false, 1>("v3 128x256, 3 stages", ta, tb, b, y, z, yr, zr, M, N, K, flops);
    run_coop<2, 4, true, true, 1>("v7 128x256, 4 stages, one staging", ta, tb, b, y, z, yr, zr, M, N, K, flops);
    run_coop<2, 4, false, true, 1>("v7 128x256, 4 stages, no stores", ta, tb, b, y, z, yr, zr, M, N, K, flops);
    run_pingpong<4>("v8 ping-pong 128x128, 4 stages", ta, tb, b, y, z, yr, zr, M, N, K, flops);
    run_pingpong<5>("v8 ping-pong 128x128, 5 stages", ta, tb, b, y, z, yr, zr, M, N, K, flops);
    run_coop<1, 4, true, false, 2>("v9 128x128, 4 stages, B mc x2", ta, tbh, b, y, z, yr, zr, M, N, K, flops);
    run_coop<2, 3, true, false, 2>("v9 128x256, 3 stages, B mc x2", ta, tbh, b, y, z, yr, zr, M, N, K, flops);
    const float lt_us2 = time_us([&] { lt_run(L, x, w, yr); }, 20);
    printf("%-34s %.1f us (again)\n", "cuBLASLt GELU_AUX_BIAS", lt_us2);
    for (bf16* q : {x, w, b, y, z, yr, zr}) CK(cudaFree(q));
    CK(cudaFree(L.ws));
  }
  return 0;
}
