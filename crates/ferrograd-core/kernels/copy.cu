// copy.cu: strided copies (a tiled path for permuted views) and fills (width-only kernels; dtype casts are in cast.cu).
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
// copy_view_{b8,b16,b32,b64}(Layout sl, const T* src, Layout dl, T* dst, u64 n):
// dst[off(dl, i)] = src[off(sl, i)], into a strided view (`Tensor::cat` along a dim other than the
// first: each input into its slice of the output). The Rust side checks that `dl` does not overlap
// itself and lies inside dst (backend.rs check_view_dst).
// ---------------------------------------------------------------------------------------------

template <typename T>
static __device__ __forceinline__ void fg_copy_view(const Layout& sl, const T* __restrict__ src, const Layout& dl,
                                                    T* __restrict__ dst, fg_u64 n) {
  const int mode = fg_mode(sl);
  for (fg_u64 i = fg_tid(); i < n; i += fg_nthreads()) dst[fg_offset(dl, i)] = src[fg_offset_m(sl, mode, i)];
}

#define FG_COPY_VIEW(SUF, T)                                                                   \
  FG_KERNEL copy_view_##SUF(Layout sl, const T* src, Layout dl, T* dst, fg_u64 n) {            \
    fg_copy_view<T>(sl, src, dl, dst, n);                                                      \
  }
FG_FOR_WIDTH(FG_COPY_VIEW)

// ---------------------------------------------------------------------------------------------
// copy_transpose_{b8,b16,b32,b64}(FgTranspose p, const T* src, T* dst): the strided copies whose
// source has unit stride in a dim other than the last (a permuted view: `x.t().contiguous()`,
// `[B, L, D] -> [B, D, L]`). copy_strided_* reads such a view one element per 32-byte sector (the
// destination's neighbours are `stride` apart in the source); this kernel moves 32 x 32 tiles
// through shared memory instead, reading along the source's unit-stride dim (`rows`) and writing
// along the destination's (`cols`), both coalesced. The other dims (at most 6; `batches` tiles'
// worth) take blockIdx.z, striding by gridDim.z. Block (32, 8); grid (ceil(cols / 32),
// ceil(rows / 32), min(batches, 65535)). Rust side: src/cuda/ops/copy.rs `TransposePlan`.
// ---------------------------------------------------------------------------------------------

struct FgTranspose {
  unsigned int rank_o;  // outer dims, 0..=6
  unsigned int pad;
  fg_u64 offset;          // the source's first element
  fg_u64 rows, cols;      // the tile dims: rows has source stride 1, cols destination stride 1
  fg_u64 src_col_stride;  // the source stride of cols
  fg_u64 dst_row_stride;  // the destination stride of rows
  fg_u64 batches;         // the product of the outer dims
  fg_u64 dims[6], src[6], dst[6];  // the outer dims and their source / destination strides
};

template <typename T>
static __device__ __forceinline__ void fg_copy_transpose(const FgTranspose& p, const T* __restrict__ src,
                                                         T* __restrict__ dst) {
  __shared__ T tile[32][33];  // one column of padding: the transposed reads hit distinct banks
  const fg_u64 c0 = (fg_u64)blockIdx.x * 32, r0 = (fg_u64)blockIdx.y * 32;
  const int tx = threadIdx.x, ty = threadIdx.y;
  for (fg_u64 b = blockIdx.z; b < p.batches; b += gridDim.z) {
    fg_u64 so = p.offset, dso = 0, rem = b;
    for (int d = (int)p.rank_o - 1; d >= 0; --d) {
      const fg_u64 i = rem % p.dims[d];
      rem /= p.dims[d];
      so += i * p.src[d];
      dso += i * p.dst[d];
    }
    const fg_u64 r = r0 + tx;
#pragma unroll
    for (int k = 0; k < 32; k += 8) {
      const fg_u64 c = c0 + ty + k;
      if (r < p.rows && c < p.cols) tile[ty + k][tx] = src[so + r + c * p.src_col_stride];
    }
    __syncthreads();
    const fg_u64 c = c0 + tx;
#pragma unroll
    for (int k = 0; k < 32; k += 8) {
      const fg_u64 rr = r0 + ty + k;
      if (rr < p.rows && c < p.cols) dst[dso + rr * p.dst_row_stride + c] = tile[tx][ty + k];
    }
    __syncthreads();
  }
}

#define FG_COPY_TRANSPOSE(SUF, T)                                                              \
  FG_KERNEL copy_transpose_##SUF(FgTranspose p, const T* src, T* dst) {                        \
    fg_copy_transpose<T>(p, src, dst);                                                         \
  }
FG_FOR_WIDTH(FG_COPY_TRANSPOSE)

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
