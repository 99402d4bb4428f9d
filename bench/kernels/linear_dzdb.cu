// dz = dy * gelu'(z) and its column sums (src/fused/linear/linear.cu, bf16) at GPT-2's MLP shapes:
// launch shapes and row-pipelined variants (R rows' loads issued first) against the kernel as built
// (which since 2026-11-24 is the R = 2 form). GB/s over the bytes moved (dy, z read, dz written).
// Run by bench/kernels/linear_dzdb.sh.
#include "common.cuh"
#include "linear.cu"
#include <cstdio>
#include <vector>
#include <cstdlib>
#include <cstring>
#include <algorithm>

typedef __nv_bfloat16 T;
typedef FgPack<T, 8> P;

// R rows a step: the 2R loads issued before any math (software pipelining across rows).
template <int R>
__global__ void __launch_bounds__(1024) dzdb_rows(const T* __restrict__ dy, const T* __restrict__ s, T* __restrict__ dz,
                                                  float* __restrict__ part, fg_u64 rows, fg_u64 cols, fg_u64 rps) {
  constexpr int V = 8;
  const fg_u64 c0 = ((fg_u64)blockIdx.x * blockDim.x + threadIdx.x) * V;
  if (c0 >= cols) return;
  const fg_u64 r0 = (fg_u64)blockIdx.y * rps;
  const fg_u64 r1 = r0 + rps < rows ? r0 + rps : rows;
  float acc[V];
#pragma unroll
  for (int j = 0; j < V; ++j) acc[j] = 0.f;
  fg_u64 r = r0;
  for (; r + R <= r1; r += R) {
    P g[R], x[R];
#pragma unroll
    for (int k = 0; k < R; ++k) {
      g[k] = *reinterpret_cast<const P*>(dy + (r + k) * cols + c0);
      x[k] = *reinterpret_cast<const P*>(s + (r + k) * cols + c0);
    }
#pragma unroll
    for (int k = 0; k < R; ++k) {
      P out, hv;
#pragma unroll
      for (int j = 0; j < V; ++j) {
        out.v[j] = lin_dact_h<T, true>(g[k].v[j], x[k].v[j], &hv.v[j]);
        acc[j] += fg_to_acc(out.v[j]);
      }
      *reinterpret_cast<P*>(dz + (r + k) * cols + c0) = out;
    }
  }
  for (; r < r1; ++r) {
    const P g = *reinterpret_cast<const P*>(dy + r * cols + c0);
    const P x = *reinterpret_cast<const P*>(s + r * cols + c0);
    P out, hv;
#pragma unroll
    for (int j = 0; j < V; ++j) {
      out.v[j] = lin_dact_h<T, true>(g.v[j], x.v[j], &hv.v[j]);
      acc[j] += fg_to_acc(out.v[j]);
    }
    *reinterpret_cast<P*>(dz + r * cols + c0) = out;
  }
#pragma unroll
  for (int j = 0; j < V; ++j) part[(fg_u64)blockIdx.y * cols + c0 + j] = acc[j];
}

#define CK(x) do { cudaError_t e = (x); if (e != cudaSuccess) { printf("%s: %s\n", #x, cudaGetErrorString(e)); exit(1); } } while (0)

template <typename F>
static float time_us(F f) {
  cudaEvent_t a, b; cudaEventCreate(&a); cudaEventCreate(&b);
  for (int i = 0; i < 5; ++i) f();
  cudaEventRecord(a);
  const int reps = 50;
  for (int i = 0; i < reps; ++i) f();
  cudaEventRecord(b); CK(cudaEventSynchronize(b));
  float ms; cudaEventElapsedTime(&ms, a, b);
  return ms * 1000.f / reps;
}

int main() {
  int sms; CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  const fg_u64 rows = 16384;
  for (fg_u64 cols : {3072ull, 4096ull, 768ull}) {
    const fg_u64 n = rows * cols;
    std::vector<T> h(n);
    srand(1);
    for (fg_u64 i = 0; i < n; ++i) h[i] = __float2bfloat16((rand() / (float)RAND_MAX) * 4.f - 2.f);
    T *dy, *z, *dz, *dz2; float *part, *part2;
    CK(cudaMalloc(&dy, n * 2)); CK(cudaMalloc(&z, n * 2)); CK(cudaMalloc(&dz, n * 2)); CK(cudaMalloc(&dz2, n * 2));
    CK(cudaMalloc(&part, 4096 * cols * 4)); CK(cudaMalloc(&part2, 4096 * cols * 4));
    CK(cudaMemcpy(dy, h.data(), n * 2, cudaMemcpyHostToDevice));
    for (fg_u64 i = 0; i < n; ++i) h[i] = __float2bfloat16((rand() / (float)RAND_MAX) * 6.f - 3.f);
    CK(cudaMemcpy(z, h.data(), n * 2, cudaMemcpyHostToDevice));
    const double gb = 3.0 * n * 2 / 1e9;
    const fg_u64 units = cols / 8;
    // dz alone: as built (cfg_1d: blocks capped at sms * 8) and sized like cfg_elementwise.
    {
      const fg_u64 packs = n / 8;
      unsigned b1 = (unsigned)std::min<fg_u64>((packs + 255) / 256, (fg_u64)sms * 8);
      unsigned b2 = (unsigned)std::max<fg_u64>(b1, (packs + 1023) / 1024);
      float t1 = time_us([&] { linear_dgelu_bf16<<<b1, 256>>>(dy, z, dz, nullptr, rows, cols, cols); });
      float t2 = time_us([&] { linear_dgelu_bf16<<<b2, 256>>>(dy, z, dz, nullptr, rows, cols, cols); });
      printf("cols %llu dz alone: %u blocks %.1f us (%.0f GB/s) | %u blocks %.1f us (%.0f GB/s)\n", cols, b1, t1,
             gb / t1 * 1e6, b2, t2, gb / t2 * 1e6);
    }
    int occ = 0;
    CK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&occ, linear_dgelu_db_bf16, 192, 0));
    auto shape = [&](fg_u64 per_sm, unsigned threads, fg_u64& bx, fg_u64& splits, fg_u64& rps) {
      bx = (units + threads - 1) / threads;
      splits = std::max<fg_u64>(1, std::min<fg_u64>(sms * per_sm / bx, rows));
      rps = (rows + splits - 1) / splits;
      splits = (rows + rps - 1) / rps;
    };
    // As built: blocks_x = ceil(units / 256), threads = units / blocks_x rounded up to 32.
    fg_u64 bx0 = (units + 255) / 256;
    unsigned th0 = (unsigned)std::min<fg_u64>(((units + bx0 - 1) / bx0 + 31) / 32 * 32, 256);
    std::vector<T> ref(n), got(n);
    for (int variant = 0; variant < 9; ++variant) {
      fg_u64 bx, splits, rps; unsigned th = th0; const char* what;
      int per_sm = 8;
      if (variant == 7) th = 128;
      if (variant == 8) th = 96;
      const int R = (variant == 2 || variant == 5) ? 2 : (variant == 3 || variant == 6 || variant >= 7) ? 4 : 8;
      if (variant == 1) per_sm = occ;
      if (variant >= 5) {
        int o = 0;
        if (R == 2) CK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&o, dzdb_rows<2>, th, 0));
        else CK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&o, dzdb_rows<4>, th, 0));
        per_sm = o;
      }
      shape(per_sm, th, bx, splits, rps);
      if (variant == 0 || variant == 1) {
        what = variant == 0 ? "as built (8 blocks/SM)" : "one wave at occupancy";
        dim3 g((unsigned)bx, (unsigned)splits);
        float t = time_us([&] { linear_dgelu_db_bf16<<<g, th>>>(dy, z, dz, nullptr, part, rows, cols, cols, rps, 1); });
        if (variant == 0) CK(cudaMemcpy(ref.data(), dz, n * 2, cudaMemcpyDeviceToHost));
        printf("cols %llu dz+db %-28s grid %llux%llu x %u, rps %llu, occ %d: %.1f us (%.0f GB/s)\n", cols, what, bx, splits,
               th, rps, occ, t, gb / t * 1e6);
        continue;
      }
      dim3 g((unsigned)bx, (unsigned)splits);
      float t;
      if (R == 2) t = time_us([&] { dzdb_rows<2><<<g, th>>>(dy, z, dz2, part2, rows, cols, rps); });
      else if (R == 4) t = time_us([&] { dzdb_rows<4><<<g, th>>>(dy, z, dz2, part2, rows, cols, rps); });
      else t = time_us([&] { dzdb_rows<8><<<g, th>>>(dy, z, dz2, part2, rows, cols, rps); });
      CK(cudaMemcpy(got.data(), dz2, n * 2, cudaMemcpyDeviceToHost));
      long bad = 0;
      for (fg_u64 i = 0; i < n; ++i) bad += memcmp(&got[i], &ref[i], 2) != 0;
      printf("cols %llu dz+db rows<%d> %-12s occ %d grid %llux%llu x %u, rps %llu: %.1f us (%.0f GB/s), %ld dz differ\n", cols, R,
             per_sm == 8 ? "8 blocks/SM" : "one wave", per_sm, bx, splits, th, rps, t, gb / t * 1e6, bad);
    }
    // colsum of the as-built partials, for the total
    {
      fg_u64 bx, splits, rps; shape(8, th0, bx, splits, rps);
      dim3 gs((unsigned)((cols + 31) / 32)), bs(32, 32);
      float t = time_us([&] { linear_colsum_bf16<<<gs, bs>>>(part, dz2, splits, cols); });
      printf("cols %llu colsum of %llu splits: %.1f us\n", cols, splits, t);
    }
    cudaFree(dy); cudaFree(z); cudaFree(dz); cudaFree(dz2); cudaFree(part); cudaFree(part2);
  }
  // the device's copy rate for reference (read n, write n bf16 at 16384 x 3072)
  {
    const fg_u64 n = 16384ull * 3072; T *a, *b; CK(cudaMalloc(&a, n * 2)); CK(cudaMalloc(&b, n * 2));
    float t = time_us([&] { cudaMemcpyAsync(b, a, n * 2, cudaMemcpyDeviceToDevice); });
    printf("device copy 100.7 MB: %.1f us (%.0f GB/s read+write)\n", t, 2.0 * n * 2 / t / 1e3);
  }
  return 0;
}
