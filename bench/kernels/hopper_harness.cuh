// hopper_harness.cuh: what the Hopper GEMM prototypes of this folder share (linear_wgmma.cu,
// linear_dgrad_wgmma.cu): error checks, the tensor map type and its 128-byte-swizzled encoding,
// mbarrier and TMA helpers, random bf16 fills and the timing loop (median of 7 batches).
#pragma once
#include <cublasLt.h>
#include <cuda.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <vector>

#define CK(x)                                                                            \
  do {                                                                                   \
    cudaError_t e_ = (x);                                                                \
    if (e_ != cudaSuccess) {                                                             \
      fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e_)); \
      exit(1);                                                                           \
    }                                                                                    \
  } while (0)
#define CL(x)                                                                           \
  do {                                                                                  \
    cublasStatus_t s_ = (x);                                                            \
    if (s_ != CUBLAS_STATUS_SUCCESS) {                                                  \
      fprintf(stderr, "%s:%d %s: cublas status %d\n", __FILE__, __LINE__, #x, (int)s_); \
      exit(1);                                                                          \
    }                                                                                   \
  } while (0)

typedef __nv_bfloat16 bf16;

struct alignas(64) Tmap {
  unsigned long long v[16];
};

static __device__ __forceinline__ unsigned smem_u32(const void* p) {
  return static_cast<unsigned>(__cvta_generic_to_shared(p));
}

static __device__ __forceinline__ void mbar_init(unsigned bar, unsigned count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
}

static __device__ __forceinline__ void mbar_arrive(unsigned bar) {
  asm volatile("mbarrier.arrive.release.cta.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory");
}

static __device__ __forceinline__ void mbar_expect_tx(unsigned bar, unsigned bytes) {
  asm volatile("mbarrier.arrive.expect_tx.release.cta.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes)
               : "memory");
}

static __device__ __forceinline__ void mbar_wait(unsigned bar, unsigned parity) {
  asm volatile(
      "{\n .reg .pred p;\n"
      "W_%=:\n"
      " mbarrier.try_wait.parity.acquire.cta.shared::cta.b64 p, [%0], %1;\n"
      " @!p bra W_%=;\n}\n" ::"r"(bar),
      "r"(parity)
      : "memory");
}

static __device__ __forceinline__ void tma_load2(unsigned dst, const Tmap& map, int c0, int c1, unsigned bar) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], "
      "[%4];\n" ::"r"(dst),
      "l"(reinterpret_cast<unsigned long long>(&map)), "r"(c0), "r"(c1), "r"(bar)
      : "memory");
}

static __device__ __forceinline__ void tma_store2(const Tmap& map, unsigned src, int c0, int c1) {
  asm volatile("cp.async.bulk.tensor.2d.global.shared::cta.bulk_group [%0, {%1, %2}], [%3];\n" ::"l"(
                   reinterpret_cast<unsigned long long>(&map)),
               "r"(c0), "r"(c1), "r"(src)
               : "memory");
}

static __device__ __forceinline__ void named_bar(int id, int n) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(n) : "memory");
}

static __device__ __forceinline__ float tanh_fast(float x) {
  float y;
  asm("tanh.approx.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// A 2-D map of a row-major [rows][cols] bf16 matrix, boxes of [box_rows][64], 128-byte swizzle.
static Tmap make_map(const bf16* ptr, int rows, int cols, int box_rows) {
  Tmap m;
  cuuint64_t dims[2] = {(cuuint64_t)cols, (cuuint64_t)rows};
  cuuint64_t strides[1] = {(cuuint64_t)cols * 2};
  cuuint32_t box[2] = {64, (cuuint32_t)box_rows};
  cuuint32_t es[2] = {1, 1};
  CUresult r =
      cuTensorMapEncodeTiled(reinterpret_cast<CUtensorMap*>(&m), CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, (void*)ptr, dims,
                             strides, box, es, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                             CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (r != CUDA_SUCCESS) {
    fprintf(stderr, "cuTensorMapEncodeTiled: %d\n", (int)r);
    exit(1);
  }
  return m;
}

__global__ void fill_rand(bf16* p, size_t n, unsigned seed, float scale) {
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
    unsigned h = (unsigned)i * 2654435761u ^ seed;
    h ^= h >> 15;
    h *= 2246822519u;
    h ^= h >> 13;
    p[i] = __float2bfloat16(((h & 0xFFFFFF) / 16777216.0f * 2.f - 1.f) * scale);
  }
}

template <typename F>
static float time_us(F f, int reps) {
  cudaEvent_t a, b;
  CK(cudaEventCreate(&a));
  CK(cudaEventCreate(&b));
  for (int i = 0; i < 3; ++i) f();
  std::vector<float> v;
  for (int round = 0; round < 7; ++round) {
    CK(cudaEventRecord(a));
    for (int i = 0; i < reps; ++i) f();
    CK(cudaEventRecord(b));
    CK(cudaEventSynchronize(b));
    float ms;
    CK(cudaEventElapsedTime(&ms, a, b));
    v.push_back(ms * 1000.f / reps);
  }
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// A cuBLASLt matmul for comparison: the caller sets its descriptor and layouts (A = the weight),
// lt_pick takes the heuristic's first algorithm and a workspace.
struct Lt {
  cublasLtHandle_t h;
  cublasLtMatmulDesc_t d;
  cublasLtMatrixLayout_t la, lb, ld;
  cublasLtMatmulAlgo_t algo;
  void* ws;
  size_t wss = 32u << 20;
};
static void lt_pick(Lt& L) {
  cublasLtMatmulPreference_t pref;
  CL(cublasLtMatmulPreferenceCreate(&pref));
  CL(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &L.wss, sizeof(L.wss)));
  cublasLtMatmulHeuristicResult_t res;
  int found = 0;
  CL(cublasLtMatmulAlgoGetHeuristic(L.h, L.d, L.la, L.lb, L.ld, L.ld, pref, 1, &res, &found));
  if (!found) {
    fprintf(stderr, "no cuBLASLt algorithm\n");
    exit(1);
  }
  L.algo = res.algo;
  CK(cudaMalloc(&L.ws, L.wss));
}
// out = w (A) x in (B), as laid out by the caller.
static void lt_run(Lt& L, const bf16* in, const bf16* w, bf16* out) {
  const float one = 1.f, zero = 0.f;
  CL(cublasLtMatmul(L.h, L.d, &one, w, L.la, in, L.lb, &zero, out, L.ld, out, L.ld, &L.algo, L.ws, L.wss, 0));
}

// The current device's properties, its name and SM count printed first.
static cudaDeviceProp device_banner() {
  int dev;
  CK(cudaGetDevice(&dev));
  cudaDeviceProp p;
  CK(cudaGetDeviceProperties(&p, dev));
  printf("%s, %d SMs\n", p.name, p.multiProcessorCount);
  return p;
}
