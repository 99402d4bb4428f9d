// copy.cu: strided copies and fills (width-only kernels; dtype casts are in cast.cu).
// CPU twins: src/cpu/mod.rs `BackendStorage for CpuStorage`: `copy_strided` / `copy_strided_into`
// (strided::gather_contiguous) and `CpuStorage::full`.

#include "common.cuh"

// ---------------------------------------------------------------------------------------------
// copy_strided_{b8,b16,b32,b64}(Layout sl, const T* src, T* dst, u64 n): dst[i] = src[off(i)]
// ---------------------------------------------------------------------------------------------

template <typename T>
static __device__ __forceinline__ void fg_copy_strided(const Layout& sl, const T* __restrict__ src,
                                                       T* __restrict__ dst, fg_u64 n) {
  const fg_u64 tid = fg_tid(), nt = fg_nthreads();
  const int mode = fg_mode(sl);
  if (mode == FG_CONTIG) {
    const T* s = src + sl.offset;
    constexpr int V = 16 / sizeof(T);
    if (fg_aligned(s, 16) && fg_aligned(dst, 16)) {
      typedef FgPack<T, V> P;
      const fg_u64 nv = n / V;
      const P* sp = reinterpret_cast<const P*>(s);
      P* dp = reinterpret_cast<P*>(dst);
      fg_u64 k = tid;
      for (; k + 3 * nt < nv; k += 4 * nt) {
        P a = sp[k], b = sp[k + nt], c = sp[k + 2 * nt], d = sp[k + 3 * nt];
        dp[k] = a;
        dp[k + nt] = b;
        dp[k + 2 * nt] = c;
        dp[k + 3 * nt] = d;
      }
      for (; k < nv; k += nt) dp[k] = sp[k];
      for (fg_u64 i = nv * V + tid; i < n; i += nt) dst[i] = s[i];
      return;
    }
    fg_unrolled(n, [&](fg_u64 i) { return s[i]; }, [&](fg_u64 i, T v) { dst[i] = v; });
    return;
  }
  if (mode == FG_SCALAR) {
    const T v = src[sl.offset];
    for (fg_u64 i = tid; i < n; i += nt) dst[i] = v;
    return;
  }
  for (fg_u64 i = tid; i < n; i += nt) dst[i] = src[fg_offset(sl, i)];
}

#define FG_COPY_STRIDED(SUF, T)                                                                \
  FG_KERNEL copy_strided_##SUF(Layout sl, const T* src, T* dst, fg_u64 n) {                    \
    fg_copy_strided<T>(sl, src, dst, n);                                                       \
  }
FG_FOR_WIDTH(FG_COPY_STRIDED)

// ---------------------------------------------------------------------------------------------
// fill_{b8,b16,b32,b64}(T* dst, u64 bits, u64 n): every element = the low bits of `bits`
// ---------------------------------------------------------------------------------------------

template <typename T>
static __device__ __forceinline__ void fg_fill(T* __restrict__ dst, fg_u64 bits, fg_u64 n) {
  const fg_u64 tid = fg_tid(), nt = fg_nthreads();
  const T v = (T)bits;
  constexpr int V = 16 / sizeof(T);
  if (fg_aligned(dst, 16)) {
    typedef FgPack<T, V> P;
    P p;
#pragma unroll
    for (int e = 0; e < V; ++e) p.v[e] = v;
    const fg_u64 nv = n / V;
    P* dp = reinterpret_cast<P*>(dst);
    for (fg_u64 k = tid; k < nv; k += nt) dp[k] = p;
    for (fg_u64 i = nv * V + tid; i < n; i += nt) dst[i] = v;
    return;
  }
  for (fg_u64 i = tid; i < n; i += nt) dst[i] = v;
}

#define FG_FILL(SUF, T)                                                                        \
  FG_KERNEL fill_##SUF(T* dst, fg_u64 bits, fg_u64 n) { fg_fill<T>(dst, bits, n); }
FG_FOR_WIDTH(FG_FILL)
