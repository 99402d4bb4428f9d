// linear_dgrad_wgmma.cu: a prototype, not a ferrograd kernel (yet). The fused linear's input
// gradient with the GELU derivative folded into the GEMM's operand load: from the upstream gradient
// dy [M, N], the kept pre-activation z [M, N] and the weight W [N, K] (bf16), one Hopper kernel
// computes dz = dy * gelu_tanh'(z) in registers as the A operand of wgmma (RS), dx = dz W [M, K]
// with f32 accumulation, and writes dz once (for the weight gradient dW = dz^T x, which stays a
// cuBLASLt GEMM). Timed beside what ferrograd runs today for the same two outputs (the dz pass, then
// cuBLASLt's dx = dz W) and checked against them element by element (outputs poisoned first).
//
// Why (BENCHMARKS.md, eighteenth session): on an H200 the linear + GELU step at 16384 x 1024 ->
// 4096 is 1.06-1.08x PyTorch eager against a 1.1x target; its backward is the dz pass (a
// memory-bound 384 MiB pass, ~107 µs) and two GEMMs at PyTorch's speed. Folding the pass into the dx
// GEMM's operand load removes dz's read by that GEMM and the pass's separate trip through memory;
// what it costs is the GELU derivative recomputed once per 256-column tile of dx (K / 256 times:
// 4 at 1024 -> 4096), on the CUDA cores while the tensor cores run.
//
// Layout: persistent, one block an SM, tiles of 128 rows x 256 columns of dx (n-fastest, so the
// blocks in flight share dy and z rows in L2). Lane 0 of warp 8 (a warpgroup of its own, registers given to the other two) loads, per 64-wide k-step, dy and z
// [128 x 64] and W [64 x 256] (four 64-column atoms, MN-major for wgmma) by TMA into a 3-stage ring
// (64 KiB a stage). Warpgroup w of warps 0-7 owns rows 64w..64w+63: per k-step it ldmatrix-loads its
// dy and z fragments, forms dz in f32 and packs it as the A registers of 4 x 2 wgmma m64n128k16 (two
// register sets, alternating by k-step, so forming the next while the last runs), and, on the
// k-steps whose dz this block writes (kt % tiles_n == its column tile: each dz chunk written by
// exactly one block), stmatrix-stages it and TMA-stores it. The dx epilogue goes through the same
// two staging buffers a warpgroup (8 KiB each) and TMA stores.
//
// What it measured (BENCHMARKS.md, twenty-first session; µs, 16384 x 1024 -> 4096): correct (with
// tanhf, dz and dx bit-identical to the pass + cuBLASLt; with tanh.approx within 1 / 2 ulps but for
// 0.7% / 0.3%), and slower than today: H100 527 (tanhf) / 366 (tanh.approx) against 309 for the
// pass + cuBLASLt back to back. Taken apart on the H100: the same kernel with no GELU math and no dz
// store 234 (cuBLASLt's dx alone 178: the RS loads of two operand tiles cost 30%), storing dz from
// the k-loop +74, the derivative (formed 4 times an element) +50 (tanh.approx) / +210 (tanhf), and
// formed once an element (one k16 step in four) still 326. So folding the pass into the operand
// load pays only where each dz element is formed once and stored without stalling the k-loop: a
// cluster of the K / 256 blocks of one row tile, each forming a quarter of the dz tile and sharing
// it by DSMEM as an SS operand. Not built; this kernel is kept as the measurement.
//
// Build and run on a GPU machine from the repository root: bash bench/kernels/linear_dgrad_wgmma.sh
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

// 128-byte swizzle descriptor (attention_wgmma.cu's fg_wg_desc).
static __device__ __forceinline__ unsigned long long wg_desc(unsigned saddr, unsigned lbo, unsigned sbo) {
  return (unsigned long long)((saddr & 0x3FFFFu) >> 4) | ((unsigned long long)((lbo >> 4) & 0x3FFFu) << 16) |
         ((unsigned long long)((sbo >> 4) & 0x3FFFu) << 32) | (1ull << 62);
}
// MN-major B: the tile's rows are the contraction (64 a k-step), its columns in 64-wide atoms of
// [64 rows][128 bytes]; k16 step kk, from column `col` (a multiple of 64).
static __device__ __forceinline__ unsigned long long wg_mnmajor(unsigned base, int kk, int col) {
  return wg_desc(base + (unsigned)((col >> 6) * 64 * 128 + kk * 16 * 128), 64 * 128, 1024);
}
static __device__ __forceinline__ void ldsm_x4(unsigned (&r)[4], unsigned addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr)
               : "memory");
}
static __device__ __forceinline__ void stsm_x4(unsigned addr, const unsigned (&r)[4]) {
  asm volatile("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1, %2, %3, %4};\n" ::"r"(addr), "r"(r[0]), "r"(r[1]),
               "r"(r[2]), "r"(r[3])
               : "memory");
}
template <int R>
static __device__ __forceinline__ void pin(float (&d)[R][4]) {
#pragma unroll
  for (int i = 0; i < R; ++i)
#pragma unroll
    for (int e = 0; e < 4; ++e) asm volatile("" : "+f"(d[i][e])::"memory");
}

// gelu_tanh'(x), the expressions of ferrograd's fg_gelu_tanh_grad_and_value (acc_math.cuh) in f32;
// APPROX: tanh.approx.f32 instead of tanhf.
template <bool APPROX>
static __device__ __forceinline__ float dgelu(float x) {
  const float k = 0.7978845608028654f, c = 0.044715f;
  const float u = k * (x + c * x * x * x);
  const float t = APPROX ? tanh_fast(u) : tanhf(u);
  return 0.5f * (1.f + t) + 0.5f * x * (1.f - t * t) * k * (1.f + 3.f * c * x * x);
}
// One register of two bf16 (low half the lower column): dy * gelu'(z), packed back.
template <bool APPROX>
static __device__ __forceinline__ unsigned dz_pair(unsigned dy, unsigned z) {
  const float zl = __uint_as_float(z << 16), zh = __uint_as_float(z & 0xFFFF0000u);
  const float dl = __uint_as_float(dy << 16), dh = __uint_as_float(dy & 0xFFFF0000u);
  __nv_bfloat162 v = __floats2bfloat162_rn(dl * dgelu<APPROX>(zl), dh * dgelu<APPROX>(zh));
  return *reinterpret_cast<unsigned*>(&v);
}

// ---- host ---------------------------------------------------------------------------------------

// Today's dz pass (the arithmetic of linear.cu's linear_dgelu_*, 16 bytes a thread, without the
// bias partial sums): the reference dz, and its time.
__global__ void dz_pass(const uint4* __restrict__ dy, const uint4* __restrict__ z, uint4* __restrict__ dz, size_t n8) {
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n8; i += (size_t)gridDim.x * blockDim.x) {
    const uint4 a = dy[i], b = z[i];
    dz[i] = make_uint4(dz_pair<false>(a.x, b.x), dz_pair<false>(a.y, b.y), dz_pair<false>(a.z, b.z),
                       dz_pair<false>(a.w, b.w));
  }
}

// How many elements of ours differ from ref by more than `ulps` bf16 ulps of ref, the worst
// |ours - ref| / (|ref| + 1e-2), and the non-finite ones.
static void compare(const char* what, const bf16* d_ours, const bf16* d_ref, size_t n, double ulps) {
  std::vector<bf16> a(n), b(n);
  CK(cudaMemcpy(a.data(), d_ours, n * 2, cudaMemcpyDeviceToHost));
  CK(cudaMemcpy(b.data(), d_ref, n * 2, cudaMemcpyDeviceToHost));
  double worst = 0;
  size_t bad = 0, nonfinite = 0, same = 0;
  for (size_t i = 0; i < n; ++i) {
    const float x = __bfloat162float(a[i]), r = __bfloat162float(b[i]);
    if (!std::isfinite(x)) {
      ++nonfinite;
      continue;
    }
    same += x == r;
    const double d = std::fabs((double)x - r);
    worst = std::max(worst, d / (std::fabs(r) + 1e-2));
    if (d > ulps * std::ldexp(1.0, std::ilogb(std::fabs(r) + 1e-30) - 7)) ++bad;
  }
  printf("  %s: %zu of %zu equal, %zu beyond %.0f ulps, max rel %.3g, %zu non-finite\n", what, same, n, bad, ulps,
         worst, nonfinite);
}

// cuBLASLt's dx = dz W, column-major: dx^T (K x M) = W^T (K x N, W's rows as is) x dz^T (N x M).
static void lt_init(Lt& L, int M, int N, int K) {
  CL(cublasLtCreate(&L.h));
  CL(cublasLtMatmulDescCreate(&L.d, CUBLAS_COMPUTE_32F, CUDA_R_32F));
  cublasOperation_t op = CUBLAS_OP_N;
  CL(cublasLtMatmulDescSetAttribute(L.d, CUBLASLT_MATMUL_DESC_TRANSA, &op, sizeof(op)));
  CL(cublasLtMatmulDescSetAttribute(L.d, CUBLASLT_MATMUL_DESC_TRANSB, &op, sizeof(op)));
  CL(cublasLtMatrixLayoutCreate(&L.la, CUDA_R_16BF, K, N, K));
  CL(cublasLtMatrixLayoutCreate(&L.lb, CUDA_R_16BF, N, M, N));
  CL(cublasLtMatrixLayoutCreate(&L.ld, CUDA_R_16BF, K, M, K));
  lt_pick(L);
}

// ---- the kernel ----------------------------------------------------------------------------------

constexpr int BM = 128, BN = 256, BK = 64;
constexpr unsigned A_BYTES = BM * BK * 2, W_BYTES = BK * BN * 2, STAGE = 2 * A_BYTES + W_BYTES;
constexpr unsigned CHUNK = 64 * 64 * 2;  // one staging box: 64 rows x 64 columns

// One k-step of a warpgroup: dz from this stage's dy and z into `a` (4 k16 steps x 4 registers),
// the 8 products issued and committed, dz staged and stored when `write`.
// MATH (an experiment, what the GELU derivative costs): 0 every element, 1 none (A = dy), 2 one
// k16 step in four (the load of a design where each dz element is formed once, not K / 256 times).
template <bool APPROX, int MATH>
static __device__ __forceinline__ void kstep(float (&acc)[2][16][4], unsigned (&a)[4][4], unsigned st, int lrow,
                                             int lane, bool first, bool write, unsigned stg, const Tmap& tdz, int c0,
                                             int r0, bool elected, int wg, int& q_all) {
  const unsigned dyb = st, zb = st + A_BYTES, wb = st + 2 * A_BYTES;
#pragma unroll
  for (int kk = 0; kk < 4; ++kk) {
    const int ch = 2 * kk + (lane >> 4);
    const unsigned off = (unsigned)(lrow * 128 + ((ch ^ (lrow & 7)) << 4));
    unsigned d[4], z[4];
    ldsm_x4(d, dyb + off);
    ldsm_x4(z, zb + off);
#pragma unroll
    for (int e = 0; e < 4; ++e)
      a[kk][e] = MATH == 1 || (MATH == 2 && kk != 0) ? d[e] ^ (z[e] & 0x00010001u) : dz_pair<APPROX>(d[e], z[e]);
  }
  asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
#pragma unroll
  for (int kk = 0; kk < 4; ++kk)
#pragma unroll
    for (int h = 0; h < 2; ++h) FgWg<bf16>::rs128<1>(acc[h], a[kk], wg_mnmajor(wb, kk, h * 128), !first || kk > 0);
  asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
  if (write) {
    const unsigned buf = stg + (q_all & 1) * CHUNK;
    ++q_all;
    if (elected) asm volatile("cp.async.bulk.wait_group.read 1;\n" ::: "memory");
    named_bar(1 + wg, 128);
    const int r = lrow - wg * 64;  // the staging box holds this warpgroup's 64 rows
#pragma unroll
    for (int kk = 0; kk < 4; ++kk) {
      const int ch = 2 * kk + (lane >> 4);
      stsm_x4(buf + (unsigned)(r * 128 + ((ch ^ (r & 7)) << 4)), a[kk]);
    }
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
    named_bar(1 + wg, 128);
    if (elected) {
      tma_store2(tdz, buf, c0, r0);
      asm volatile("cp.async.bulk.commit_group;\n" ::: "memory");
    }
  }
}

template <int S, bool APPROX, bool WRITE_DZ, int MATH>
__global__ void __launch_bounds__(384, 1)
    lin_dgrad(const __grid_constant__ Tmap tdy, const __grid_constant__ Tmap tz, const __grid_constant__ Tmap tw,
              const __grid_constant__ Tmap tdz, const __grid_constant__ Tmap tdx, int M, int N, int K) {
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  const unsigned base = (smem_u32(smem_raw) + 1023u) & ~1023u;
  const unsigned stg0 = base + S * STAGE;   // per warpgroup 2 staging boxes
  const unsigned bars = stg0 + 4 * CHUNK;   // full[S], empty[S]
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int tiles_n = K / BN, tiles = (M / BM) * tiles_n, KT = N / BK;

  if (tid == 0) {
    for (int s = 0; s < S; ++s) {
      mbar_init(bars + 8 * s, 1);
      mbar_init(bars + 8 * (S + s), 8);
    }
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  __syncthreads();

  if (warp >= 8) {
    // The loading warpgroup gives its registers to the two computing ones (40 + 2 x 232 a thread).
    asm volatile("setmaxnreg.dec.sync.aligned.u32 40;\n" ::: "memory");
    if (warp != 8 || lane != 0) return;
    int it = 0;
    for (int tile = blockIdx.x; tile < tiles; tile += gridDim.x) {
      const int n0 = (tile % tiles_n) * BN, m0 = (tile / tiles_n) * BM;
      for (int kt = 0; kt < KT; ++kt, ++it) {
        const int s = it % S;
        if (it >= S) mbar_wait(bars + 8 * (S + s), (unsigned)((it / S - 1) & 1));
        const unsigned full = bars + 8 * s, st = base + s * STAGE;
        mbar_expect_tx(full, STAGE);
        tma_load2(st, tdy, kt * BK, m0, full);
        tma_load2(st + A_BYTES, tz, kt * BK, m0, full);
#pragma unroll
        for (int j = 0; j < BN / 64; ++j) tma_load2(st + 2 * A_BYTES + j * 64 * 128, tw, n0 + j * 64, kt * BK, full);
      }
    }
    return;
  }
  asm volatile("setmaxnreg.inc.sync.aligned.u32 232;\n" ::: "memory");

  const int wg = warp >> 2, g = lane >> 2, t = lane & 3;
  const int lrow = wg * 64 + (warp & 3) * 16 + (lane & 15);  // this lane's ldmatrix row in the tile
  const int wr = (warp & 3) * 16 + g;                         // its accumulator row in the warpgroup
  const bool elected = (tid & 127) == 0;
  const unsigned stg = stg0 + wg * 2 * CHUNK;
  int it = 0, q_all = 0;
  for (int tile = blockIdx.x; tile < tiles; tile += gridDim.x) {
    const int nt = tile % tiles_n, n0 = nt * BN, m0 = (tile / tiles_n) * BM;
    float acc[2][16][4];
    unsigned a0[4][4], a1[4][4];
    for (int kt = 0; kt < KT; ++kt, ++it) {
      const int s = it % S;
      mbar_wait(bars + 8 * s, (unsigned)((it / S) & 1));
      const bool write = WRITE_DZ && kt % tiles_n == nt;
      if (kt & 1)
        kstep<APPROX, MATH>(acc, a1, base + s * STAGE, lrow, lane, kt == 0, write, stg, tdz, kt * BK, m0 + wg * 64, elected,
                      wg, q_all);
      else
        kstep<APPROX, MATH>(acc, a0, base + s * STAGE, lrow, lane, kt == 0, write, stg, tdz, kt * BK, m0 + wg * 64, elected,
                      wg, q_all);
      asm volatile("wgmma.wait_group.sync.aligned 1;\n" ::: "memory");
      if (kt > 0 && lane == 0) mbar_arrive(bars + 8 * (S + (it - 1) % S));
    }
    asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");
    pin(acc[0]);
    pin(acc[1]);
    if (lane == 0) mbar_arrive(bars + 8 * (S + (it - 1) % S));
    // dx: 64-column chunks, registers -> staging -> one TMA store each.
#pragma unroll
    for (int q = 0; q < BN / 64; ++q) {
      const unsigned buf = stg + (q_all & 1) * CHUNK;
      ++q_all;
      if (elected) asm volatile("cp.async.bulk.wait_group.read 1;\n" ::: "memory");
      named_bar(1 + wg, 128);
      const int h = q >> 1;
#pragma unroll
      for (int jj = 0; jj < 8; ++jj) {
        const float* c = acc[h][(q & 1) * 8 + jj];
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          __nv_bfloat162 v = __floats2bfloat162_rn(c[2 * e], c[2 * e + 1]);
          const int r = wr + 8 * e;
          asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(buf + r * 128 + ((jj ^ (r & 7)) * 16) + 4 * t),
                       "r"(*reinterpret_cast<unsigned*>(&v))
                       : "memory");
        }
      }
      asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
      named_bar(1 + wg, 128);
      if (elected) {
        tma_store2(tdx, buf, n0 + q * 64, m0 + wg * 64);
        asm volatile("cp.async.bulk.commit_group;\n" ::: "memory");
      }
    }
  }
  if (elected) asm volatile("cp.async.bulk.wait_group 0;\n" ::: "memory");
}

// ---- runner -------------------------------------------------------------------------------------

template <int S, bool APPROX, bool WRITE_DZ, int MATH = 0>
static void run(const char* name, const Tmap& tdy, const Tmap& tz, const Tmap& tw, bf16* dz, bf16* dx,
                const bf16* dzref, const bf16* dxref, int M, int N, int K, double flops) {
  if (const char* only = getenv("LD_ONLY"); only && !strstr(name, only)) return;
  const size_t smem = S * STAGE + 4 * CHUNK + 16 * S + 1024;
  auto k = lin_dgrad<S, APPROX, WRITE_DZ, MATH>;
  CK(cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
  int dev, sms;
  CK(cudaGetDevice(&dev));
  CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
  const int tiles = (M / BM) * (K / BN);
  const dim3 grid(std::min(sms, tiles));
  const Tmap tdz = make_map(dz, M, N, 64), tdx = make_map(dx, M, K, 64);
  CK(cudaMemset(dz, 0xFF, (size_t)M * N * 2));
  CK(cudaMemset(dx, 0xFF, (size_t)M * K * 2));
  auto launch = [&] {
    k<<<grid, 384, smem>>>(tdy, tz, tw, tdz, tdx, M, N, K);
    CK(cudaGetLastError());
  };
  launch();
  CK(cudaDeviceSynchronize());
  printf("%-40s grid %u, smem %zu\n", name, grid.x, smem);
  if (MATH == 0) {
    if (WRITE_DZ) compare("dz vs the pass", dz, dzref, (size_t)M * N, APPROX ? 1 : 0);
    compare("dx vs cuBLASLt(dz) ", dx, dxref, (size_t)M * K, 2);
  }
  const float us = time_us(launch, 20);
  printf("  %.1f us (%.0f TFLOP/s)\n", us, flops / us * 1e-6);
}

int main(int argc, char** argv) {
  // Optional: the index of the one shape to run (0-2: GPT-2's; 3: a small one for compute-sanitizer).
  const int only = argc > 1 ? atoi(argv[1]) : -1;
  const cudaDeviceProp p = device_banner();
  // {M, K (the forward's input width, dx's), N (its output width, dz's)}
  const int shapes[4][3] = {{16384, 1024, 4096}, {16384, 768, 3072}, {16384, 3072, 768}, {256, 256, 512}};
  for (int si = 0; si < 4; ++si) {
    if (only >= 0 ? si != only : si == 3) continue;
    const int M = shapes[si][0], K = shapes[si][1], N = shapes[si][2];
    const double flops = 2.0 * M * N * K;
    bf16 *dy, *z, *w, *dz, *dx, *dzr, *dxr;
    CK(cudaMalloc(&dy, (size_t)M * N * 2));
    CK(cudaMalloc(&z, (size_t)M * N * 2));
    CK(cudaMalloc(&w, (size_t)N * K * 2));
    CK(cudaMalloc(&dz, (size_t)M * N * 2));
    CK(cudaMalloc(&dx, (size_t)M * K * 2));
    CK(cudaMalloc(&dzr, (size_t)M * N * 2));
    CK(cudaMalloc(&dxr, (size_t)M * K * 2));
    fill_rand<<<1024, 256>>>(dy, (size_t)M * N, 1u, 1.0f);
    fill_rand<<<1024, 256>>>(z, (size_t)M * N, 2u, 4.0f);
    fill_rand<<<1024, 256>>>(w, (size_t)N * K, 3u, 1.0f / sqrtf((float)N));
    CK(cudaDeviceSynchronize());
    printf("\nM %d, forward %d -> %d: dx [%d x %d] = (dy * gelu'(z)) W, dz written (bf16)\n", M, K, N, M, K);
    const size_t n8 = (size_t)M * N / 8;
    auto pass = [&] {
      dz_pass<<<p.multiProcessorCount * 8, 256>>>((const uint4*)dy, (const uint4*)z, (uint4*)dzr, n8);
      CK(cudaGetLastError());
    };
    Lt L;
    lt_init(L, M, N, K);
    pass();
    lt_run(L, dzr, w, dxr);
    CK(cudaDeviceSynchronize());
    const float pass_us = time_us(pass, 20);
    const float lt_us = time_us([&] { lt_run(L, dzr, w, dxr); }, 20);
    const float both_us = time_us(
        [&] {
          pass();
          lt_run(L, dzr, w, dxr);
        },
        20);
    printf("today: dz pass %.1f us, cuBLASLt dx %.1f us (%.0f TFLOP/s), the two back to back %.1f us\n", pass_us,
           lt_us, flops / lt_us * 1e-6, both_us);
    const Tmap tdy = make_map(dy, M, N, 128), tz = make_map(z, M, N, 128), tw = make_map(w, N, K, 64);
    run<3, false, true>("fused, tanhf, dz written", tdy, tz, tw, dz, dx, dzr, dxr, M, N, K, flops);
    run<3, true, true>("fused, tanh.approx, dz written", tdy, tz, tw, dz, dx, dzr, dxr, M, N, K, flops);
    run<3, true, false>("fused, tanh.approx, no dz", tdy, tz, tw, dz, dx, dzr, dxr, M, N, K, flops);
    run<3, true, false, 1>("experiment: no GELU math, no dz", tdy, tz, tw, dz, dx, dzr, dxr, M, N, K, flops);
    run<3, true, true, 1>("experiment: no GELU math, dz written", tdy, tz, tw, dz, dx, dzr, dxr, M, N, K, flops);
    run<3, true, true, 2>("experiment: 1/4 GELU math, dz written", tdy, tz, tw, dz, dx, dzr, dxr, M, N, K, flops);
    run<3, false, true, 2>("experiment: 1/4 GELU math tanhf, dz wr", tdy, tz, tw, dz, dx, dzr, dxr, M, N, K, flops);
    const float lt_us2 = time_us([&] { lt_run(L, dzr, w, dxr); }, 20);
    printf("cuBLASLt dx again %.1f us\n", lt_us2);
    for (bf16* q : {dy, z, w, dz, dx, dzr, dxr}) CK(cudaFree(q));
    CK(cudaFree(L.ws));
  }
  return 0;
}
