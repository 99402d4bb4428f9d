// The sm_90a attention kernels (src/fused/attention/attention_wgmma.cu) against the mma.sync ones
// (attention_tc.cu, checked against float64 by the test suite) on the same inputs, bf16: O, the
// log-sum-exp, dQ, dK, dV compared; then both timed, TFLOP/s as FlashAttention counts them
// (forward 4 B H T^2 D, halved when causal; backward 2.5x that). Outputs are poisoned (NaN)
// before every kernel. Built and run by bench/kernels/attention_wgmma.sh, once per head dim;
// `attention_wgmma_d64 check` runs the comparisons without the timed sizes (for compute-sanitizer).
#include "common.cuh"
#include "attention.cu"
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>
#include <cmath>
#if FG_WG_FWD_TMA
#include <cuda.h>
#endif

typedef __nv_bfloat16 T;
#define D FG_ATTN_D
#define K_FWD_TC FG_ATTN_TNAME(fg_attn_fwd_d, FG_ATTN_D, k64, bf16)
#define K_BWD_TC FG_ATTN_TNAME(fg_attn_bwd_d, FG_ATTN_D, q32, bf16)
#define K_PRE FG_ATTN_NAME(fg_attn_bwd_pre_d, FG_ATTN_D, bf16)
#define K_DQ FG_ATTN_NAME(fg_attn_dq_d, FG_ATTN_D, bf16)
#define K_FWD_WG FG_ATTN_NAME(fg_attn_fwd_d, FG_ATTN_D, wg_bf16)
#define K_BWD_WG FG_ATTN_NAME(fg_attn_bwd_d, FG_ATTN_D, wg_bf16)
#define K_PRE_WG FG_ATTN_NAME(fg_attn_bwd_pre_d, FG_ATTN_D, wg_bf16)
#define K_DQ_WG FG_ATTN_NAME(fg_attn_dq_d, FG_ATTN_D, wg_bf16)

#define CK(x)                                                                            \
  do {                                                                                   \
    cudaError_t e_ = (x);                                                                \
    if (e_ != cudaSuccess) {                                                             \
      printf("CUDA error %s at %s:%d\n", cudaGetErrorString(e_), __FILE__, __LINE__);    \
      exit(1);                                                                           \
    }                                                                                    \
  } while (0)

__global__ void fill_rand(T* x, size_t n, unsigned seed) {
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
    unsigned h = (unsigned)i * 2654435761u ^ seed;
    h ^= h >> 15; h *= 2246822519u; h ^= h >> 13; h *= 3266489917u; h ^= h >> 16;
    x[i] = __float2bfloat16(((h & 0xFFFFFF) / 16777216.f) * 2.f - 1.f);
  }
}

#define HB_BKV FG_WG_BWD_BKVD(D)
static const int FWD_TC_SMEM = (128 + 4 * 64) * (D + 8) * 2;
static const int BWD_TC_SMEM = (2 * 64 + 4 * 32) * (D + 8) * 2 + 64 * (32 + 8) * 2 + 4 * 32 * 4;
static const int FWD_WG_SMEM = FG_WG_FWD_SMEM(D);
static const int BWD_WG_SMEM = FG_WG_BWD_SMEM(D);

struct Bufs {
  T *q, *k, *v, *dout, *o_ref, *o_wg, *dq_ref, *dk_ref, *dv_ref, *dq_wg, *dk_wg, *dv_wg;
  float *lse_ref, *lse_wg, *delta, *dq_acc;
};

static FgAttnParams params(int B, int H, int Tn, bool causal) {
  FgAttnParams p;
  memset(&p, 0, sizeof(p));
  FgStride4 s = {(long long)Tn * H * D, D, (long long)H * D, 1};
  p.q = p.k = p.v = p.o = p.dout = p.dq = p.dk = p.dv = s;
  p.B = B; p.H = H; p.Tq = Tn; p.Tk = Tn;
  p.scale = 1.f / sqrtf((float)D);
  p.scale_log2 = p.scale * 1.4426950408889634f;
  p.rp_keep = 1.f;
  p.causal = causal;
  return p;
}

#if FG_WG_FWD_TMA
// The tensor map of a [B][T][H][D]-strided bf16 tensor, boxes of 64 columns x FG_WG_FWD_BKV rows,
// 128-byte swizzle (what cuda.rs builds for the kernel).
static FgTmap tmap(const T* x, const FgStride4& st, const FgAttnParams& p, int rows) {
  FgTmap m;
  cuuint64_t dims[4] = {D, p.Tk, p.H, p.B};
  cuuint64_t strides[3] = {(cuuint64_t)st.t * 2, (cuuint64_t)st.h * 2, (cuuint64_t)st.b * 2};
  cuuint32_t box[4] = {64, (cuuint32_t)rows, 1, 1}, es[4] = {1, 1, 1, 1};
  CUresult r = cuTensorMapEncodeTiled(reinterpret_cast<CUtensorMap*>(&m), CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 4, (void*)x, dims, strides, box, es,
                                      CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                                      CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (r != CUDA_SUCCESS) { printf("cuTensorMapEncodeTiled: %d\n", (int)r); exit(1); }
  return m;
}
#endif

// The Hopper kernels' one-dimensional grid, in groups of about a wave of blocks (cuda.rs
// `wg_group`); WG_GROUP=0 in the environment: every head in one group (the old order), WG_WAVES=n:
// groups of n waves.
static int g_sms = 132;
static unsigned wg_group(int bh, int ntiles, int per_sm) {
  const char* e = getenv("WG_GROUP");
  if (e) return (unsigned)atoi(e);
  const char* w = getenv("WG_WAVES");  // groups of this many waves (as built: 1 at d = 128, 2 at d = 64)
  const int waves = w ? atoi(w) : (FG_ATTN_D > 64 ? 1 : 2);
  const int g = (waves * g_sms * per_sm + ntiles - 1) / ntiles;
  return (unsigned)(g < 1 ? 1 : g > bh ? bh : g);
}
#define WG_GRID(n) dim3(BH * (n))
static void fwd(bool wg, const Bufs& b, const FgAttnParams& p0, T* o, float* lse) {
  const int BH = p0.B * p0.H;
  FgAttnParams p = p0;
  p.group = wg_group(BH, (p.Tq + FG_WG_FWD_BQ - 1) / FG_WG_FWD_BQ, FG_ATTN_D <= 64 ? 2 : 1);
#if FG_WG_FWD_TMA
  if (wg) {
    const FgTmap tk = tmap(b.k, p.k, p, FG_WG_FWD_BKV), tv = tmap(b.v, p.v, p, FG_WG_FWD_BKV);
    K_FWD_WG<<<WG_GRID((p.Tq + FG_WG_FWD_BQ - 1) / FG_WG_FWD_BQ), FG_WG_FWD_THREADS, FWD_WG_SMEM>>>(b.q, tk, tv, o, lse, p);
    return;
  }
#else
  if (wg) K_FWD_WG<<<WG_GRID((p.Tq + FG_WG_FWD_BQ - 1) / FG_WG_FWD_BQ), FG_WG_FWD_THREADS, FWD_WG_SMEM>>>(b.q, b.k, b.v, o, lse, p);
#endif
  else K_FWD_TC<<<dim3(BH, (p.Tq + 127) / 128), 128, FWD_TC_SMEM>>>(b.q, b.k, b.v, o, lse, p);
}
static void bwd(bool wg, const Bufs& b, const FgAttnParams& p0, T* dq, T* dk, T* dv) {
  const int BH = p0.B * p0.H;
  FgAttnParams p = p0;
  p.group = wg_group(BH, (p.Tk + HB_BKV - 1) / HB_BKV, 1);
  const size_t rows = (size_t)BH * p.Tq;
  if (wg) K_PRE_WG<<<(unsigned)((rows + 7) / 8), 256>>>(b.o_ref, b.dout, b.delta, b.dq_acc, p);
  else K_PRE<<<(unsigned)((rows + 7) / 8), 256>>>(b.o_ref, b.dout, b.delta, b.dq_acc, p);
  if (wg) K_BWD_WG<<<WG_GRID((p.Tk + HB_BKV - 1) / HB_BKV), FG_WG_BWD_THREADS, BWD_WG_SMEM>>>(b.q, b.k, b.v, b.dout, b.lse_ref, b.delta, b.dq_acc, dk, dv, p);
  else K_BWD_TC<<<dim3(BH, (p.Tk + 63) / 64), 128, BWD_TC_SMEM>>>(b.q, b.k, b.v, b.dout, b.lse_ref, b.delta, b.dq_acc, dk, dv, p);
  if (wg) K_DQ_WG<<<1024, 256>>>(b.dq_acc, dq, p);
  else K_DQ<<<1024, 256>>>(b.dq_acc, dq, p);
}

static float bf(T x) { return __bfloat162float(x); }
// max |a - b| / max |b| over n elements; NaNs in `a` counted.
static double cmp(const char* what, const T* a_d, const T* b_d, size_t n, int* bad) {
  std::vector<T> a(n), b(n);
  CK(cudaMemcpy(a.data(), a_d, n * 2, cudaMemcpyDeviceToHost));
  CK(cudaMemcpy(b.data(), b_d, n * 2, cudaMemcpyDeviceToHost));
  double md = 0, mb = 0;
  size_t nan = 0;
  for (size_t i = 0; i < n; ++i) {
    const float x = bf(a[i]), y = bf(b[i]);
    if (!std::isfinite(x)) { ++nan; continue; }
    md = fmax(md, fabs((double)x - y));
    mb = fmax(mb, fabs((double)y));
  }
  const double r = md / (mb > 0 ? mb : 1);
  const bool ok = nan == 0 && r < 2e-2;
  if (!ok) ++*bad;
  printf("  %-4s rel %.2e (max |diff| %.3e, max |ref| %.3e)%s%s\n", what, r, md, mb, nan ? " NaN!" : "", ok ? "" : "  FAIL");
  return r;
}
static void cmpf(const char* what, const float* a_d, const float* b_d, size_t n, int* bad) {
  std::vector<float> a(n), b(n);
  CK(cudaMemcpy(a.data(), a_d, n * 4, cudaMemcpyDeviceToHost));
  CK(cudaMemcpy(b.data(), b_d, n * 4, cudaMemcpyDeviceToHost));
  double md = 0;
  size_t nan = 0;
  for (size_t i = 0; i < n; ++i) {
    if (!std::isfinite(a[i])) { ++nan; continue; }
    md = fmax(md, fabs((double)a[i] - b[i]));
  }
  const bool ok = nan == 0 && md < 1e-2;
  if (!ok) ++*bad;
  printf("  %-4s max |diff| %.3e%s%s\n", what, md, nan ? " NaN!" : "", ok ? "" : "  FAIL");
}

int main(int argc, char** argv) {
  CK(cudaDeviceGetAttribute(&g_sms, cudaDevAttrMultiProcessorCount, 0));
  CK(cudaFuncSetAttribute(K_FWD_TC, cudaFuncAttributeMaxDynamicSharedMemorySize, FWD_TC_SMEM));
  CK(cudaFuncSetAttribute(K_BWD_TC, cudaFuncAttributeMaxDynamicSharedMemorySize, BWD_TC_SMEM));
  CK(cudaFuncSetAttribute(K_FWD_WG, cudaFuncAttributeMaxDynamicSharedMemorySize, FWD_WG_SMEM));
  CK(cudaFuncSetAttribute(K_BWD_WG, cudaFuncAttributeMaxDynamicSharedMemorySize, BWD_WG_SMEM));
  struct C { int B, H, T, causal; bool time; };
  std::vector<C> cs = {{1, 3, 77, 0, 0},  {1, 3, 77, 1, 0},  {2, 2, 300, 0, 0}, {2, 2, 300, 1, 0}, {1, 2, 1000, 1, 0},
                       {1, 1, 129, 0, 0}, {1, 1, 1, 0, 0},   {4, 16, 1024, 0, 1}, {4, 16, 1024, 1, 1},
                       {4, 16, 2048, 0, 1}, {4, 16, 4096, 0, 1}, {4, 16, 4096, 1, 1}};
  int bad = 0;
  const bool check_only = argc > 1 && strcmp(argv[1], "check") == 0;
  for (const C& c : cs) {
    if (check_only && c.time) continue;
    const size_t n = (size_t)c.B * c.T * c.H * D, rows = (size_t)c.B * c.H * c.T;
    Bufs b;
    T** tb[] = {&b.q, &b.k, &b.v, &b.dout, &b.o_ref, &b.o_wg, &b.dq_ref, &b.dk_ref, &b.dv_ref, &b.dq_wg, &b.dk_wg, &b.dv_wg};
    for (T** x : tb) CK(cudaMalloc(x, n * 2));
    float** fb[] = {&b.lse_ref, &b.lse_wg, &b.delta};
    for (float** x : fb) CK(cudaMalloc(x, rows * 4));
    CK(cudaMalloc(&b.dq_acc, (size_t)c.B * c.H * ((c.T + 63) / 64 * 64) * D * 4));  // the Hopper layout's padding
    fill_rand<<<512, 256>>>(b.q, n, 1u);
    fill_rand<<<512, 256>>>(b.k, n, 2u);
    fill_rand<<<512, 256>>>(b.v, n, 3u);
    fill_rand<<<512, 256>>>(b.dout, n, 4u);
    for (int i = 4; i < 12; ++i) CK(cudaMemset(*tb[i], 0xFF, n * 2));
    CK(cudaMemset(b.lse_ref, 0xFF, rows * 4));
    CK(cudaMemset(b.lse_wg, 0xFF, rows * 4));
    const FgAttnParams p = params(c.B, c.H, c.T, c.causal);
    printf("B=%d H=%d T=%d D=%d %s\n", c.B, c.H, c.T, D, c.causal ? "causal" : "full");
    fwd(false, b, p, b.o_ref, b.lse_ref);
    fwd(true, b, p, b.o_wg, b.lse_wg);
    CK(cudaGetLastError());
    CK(cudaDeviceSynchronize());
    cmp("O", b.o_wg, b.o_ref, n, &bad);
    cmpf("lse", b.lse_wg, b.lse_ref, rows, &bad);
    bwd(false, b, p, b.dq_ref, b.dk_ref, b.dv_ref);
    bwd(true, b, p, b.dq_wg, b.dk_wg, b.dv_wg);
    CK(cudaGetLastError());
    CK(cudaDeviceSynchronize());
    cmp("dQ", b.dq_wg, b.dq_ref, n, &bad);
    cmp("dK", b.dk_wg, b.dk_ref, n, &bad);
    cmp("dV", b.dv_wg, b.dv_ref, n, &bad);
    if (c.time) {
      cudaEvent_t e0, e1;
      CK(cudaEventCreate(&e0));
      CK(cudaEventCreate(&e1));
      const double fl = 4.0 * c.B * c.H * (double)c.T * c.T * D / (c.causal ? 2 : 1);
      double ms[2][2];
      for (int wg = 0; wg < 2; ++wg) {
        for (int pass = 0; pass < 2; ++pass) {
          const int reps = 20;
          fwd(wg, b, p, wg ? b.o_wg : b.o_ref, wg ? b.lse_wg : b.lse_ref);  // warm
          bwd(wg, b, p, wg ? b.dq_wg : b.dq_ref, wg ? b.dk_wg : b.dk_ref, wg ? b.dv_wg : b.dv_ref);
          CK(cudaEventRecord(e0));
          for (int r = 0; r < reps; ++r) {
            if (pass == 0) fwd(wg, b, p, wg ? b.o_wg : b.o_ref, wg ? b.lse_wg : b.lse_ref);
            else bwd(wg, b, p, wg ? b.dq_wg : b.dq_ref, wg ? b.dk_wg : b.dk_ref, wg ? b.dv_wg : b.dv_ref);
          }
          CK(cudaEventRecord(e1));
          CK(cudaEventSynchronize(e1));
          float t;
          CK(cudaEventElapsedTime(&t, e0, e1));
          ms[wg][pass] = t / reps;
        }
      }
      for (int wg = 0; wg < 2; ++wg)
        printf("  TIME %-7s fwd %.3f ms %.1f TFLOP/s | bwd %.3f ms %.1f TFLOP/s | fwd+bwd %.1f TFLOP/s\n",
               wg ? "wgmma" : "mma", ms[wg][0], fl / ms[wg][0] / 1e9, ms[wg][1], 2.5 * fl / ms[wg][1] / 1e9,
               3.5 * fl / (ms[wg][0] + ms[wg][1]) / 1e9);
      printf("  SPEEDUP wgmma/mma fwd %.2fx bwd %.2fx fwd+bwd %.2fx\n", ms[0][0] / ms[1][0], ms[0][1] / ms[1][1],
             (ms[0][0] + ms[0][1]) / (ms[1][0] + ms[1][1]));
    }
    for (T** x : tb) CK(cudaFree(*x));
    for (float** x : fb) CK(cudaFree(*x));
    CK(cudaFree(b.dq_acc));
  }
  printf("%s: %d comparison(s) failed\n", bad ? "FAIL" : "PASS", bad);
  return bad ? 1 : 0;
}
