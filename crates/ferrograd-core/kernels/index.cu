// index.cu: index checks, index_select / gather and their adjoints index_add / scatter_add,
// and index_copy_ (in place).
// CPU twins: src/cpu/index.rs `index_select`, `index_copy_into`, `gather` (`gather_positions`), `index_add` and
// `scatter_add` (`add_at`: dst = T::from_f64(dst + src), so integer sums saturate), and the
// checks of src/cpu/index.rs / src/fused/cross_entropy/cpu.rs `encode_targets`.
//
// The index kernels take `const unsigned int*` ids, contiguous, starting at element 0, made by
// `ids_*` from the user's integer ids: each is in range, or FG_ID_NONE (0xffffffff, from Rust) for
// an id that was out of range (reported through the error flag; the kernels write 0 for it or add
// nothing) or ignored (cross entropy's ignore index). Layout offsets of the index / destination
// layouts (il, dl) are not used: those tensors are contiguous from their pointers; only the source
// layout `sl` of gather is a view.

#include "error_flag.cuh"

#ifndef FG_ID_NONE
#error "FG_ID_NONE comes from Rust (src/cuda/ops/index.rs NO_ID)"
#endif

// ---------------------------------------------------------------------------------------------
// ids_{i32,u32,u8,i8}(Layout il, const T* ids, unsigned int* out, u64 n, u64 size, int has_ignore,
//                     long long ignore, int op, unsigned int* claim, FgErrorRecord* rec)
// out[i] = ids[i] (read through il) when 0 <= ids[i] < size; FG_ID_NONE when has_ignore and
// ids[i] == ignore; else FG_ID_NONE, and the first such id is reported as (op, value, size).
// ---------------------------------------------------------------------------------------------

template <typename T>
static __device__ __forceinline__ void fg_ids(const Layout& il, const T* __restrict__ ids, unsigned int* __restrict__ out,
                                              fg_u64 n, fg_u64 size, int has_ignore, long long ignore, int op,
                                              unsigned int* claim, FgErrorRecord* rec) {
  const int mode = fg_mode(il);
  FG_GRID_STRIDE(i, n) {
    const long long v = (long long)ids[fg_offset_m(il, mode, i)];
    unsigned int o;
    if (has_ignore && v == ignore) {
      o = FG_ID_NONE;
    } else if (v < 0 || (fg_u64)v >= size || (fg_u64)v >= (fg_u64)FG_ID_NONE) {
      o = FG_ID_NONE;
      fg_bad_index(claim, rec, op, v, size);
    } else {
      o = (unsigned int)v;
    }
    out[i] = o;
  }
}

#define FG_IDS(SUF, T)                                                                         \
  FG_KERNEL ids_##SUF(Layout il, const T* ids, unsigned int* out, fg_u64 n, fg_u64 size, int has_ignore, \
                      long long ignore, int op, unsigned int* claim, FgErrorRecord* rec) {     \
    fg_ids<T>(il, ids, out, n, size, has_ignore, ignore, op, claim, rec);                      \
  }
FG_FOR_INT(FG_IDS)

// ---------------------------------------------------------------------------------------------
// index_select_{b8,b16,b32,b64}(const T* src, const unsigned int* ids, T* dst, u64 outer, u64 size,
//                               u64 inner, u64 nids)
// src contiguous [outer, size, inner]; dst [outer, nids, inner]; dst[o, j, k] = src[o, ids[j], k].
// ---------------------------------------------------------------------------------------------

template <typename T>
static __device__ __forceinline__ void fg_index_select(const T* __restrict__ src, const unsigned int* __restrict__ ids,
                                                       T* __restrict__ dst, fg_u64 outer, fg_u64 size, fg_u64 inner,
                                                       fg_u64 nids) {
  const fg_u64 n = outer * nids * inner;
  FG_GRID_STRIDE(i, n) {
    fg_u64 t, k, o, j;
    fg_divmod(i, inner, t, k);
    fg_divmod(t, nids, o, j);
    const unsigned int id = ids[j];
    dst[i] = id == FG_ID_NONE ? T(0) : src[(o * size + id) * inner + k];
  }
}

#define FG_INDEX_SELECT(SUF, T)                                                                \
  FG_KERNEL index_select_##SUF(const T* src, const unsigned int* ids, T* dst, fg_u64 outer, fg_u64 size, \
                               fg_u64 inner, fg_u64 nids) {                                    \
    fg_index_select<T>(src, ids, dst, outer, size, inner, nids);                               \
  }
FG_FOR_WIDTH(FG_INDEX_SELECT)

// ---------------------------------------------------------------------------------------------
// index_copy_{b8,b16,b32,b64}(const T* src, const unsigned int* ids, T* dst, u64 outer, u64 size,
//                             u64 inner, u64 nids)
// index_select's inverse, in place: src contiguous [outer, nids, inner]; dst contiguous
// [outer, size, inner]; dst[o, ids[j], k] = src[o, j, k]. A bad id (FG_ID_NONE, reported by the
// index check) writes nothing. Ids that repeat leave one of their rows (unspecified which), as
// torch's index_copy_. Used where a captured step writes at a position held in device memory
// (the KV cache of a CUDA-graph decode step).
// ---------------------------------------------------------------------------------------------

template <typename T>
static __device__ __forceinline__ void fg_index_copy(const T* __restrict__ src, const unsigned int* __restrict__ ids,
                                                     T* __restrict__ dst, fg_u64 outer, fg_u64 size, fg_u64 inner,
                                                     fg_u64 nids) {
  const fg_u64 n = outer * nids * inner;
  FG_GRID_STRIDE(i, n) {
    fg_u64 t, k, o, j;
    fg_divmod(i, inner, t, k);
    fg_divmod(t, nids, o, j);
    const unsigned int id = ids[j];
    if (id != FG_ID_NONE) dst[(o * size + id) * inner + k] = src[i];
  }
}

#define FG_INDEX_COPY(SUF, T)                                                                  \
  FG_KERNEL index_copy_##SUF(const T* src, const unsigned int* ids, T* dst, fg_u64 outer, fg_u64 size, \
                             fg_u64 inner, fg_u64 nids) {                                      \
    fg_index_copy<T>(src, ids, dst, outer, size, inner, nids);                                 \
  }
FG_FOR_WIDTH(FG_INDEX_COPY)

// ---------------------------------------------------------------------------------------------
// gather_{b8,b16,b32,b64}(Layout sl, const T* src, Layout il, const unsigned int* ids, T* dst, u64 n,
//                         unsigned int dim)
// For element i of the index tensor (multi-index over il.dims, row-major), read src at the same
// multi-index with coordinate `dim` replaced by ids[i], through sl's offset and strides.
// ---------------------------------------------------------------------------------------------

template <typename T>
static __device__ __forceinline__ void fg_gather(const Layout& sl, const T* __restrict__ src, const Layout& il,
                                                 const unsigned int* __restrict__ ids, T* __restrict__ dst, fg_u64 n,
                                                 unsigned int dim) {
  FG_GRID_STRIDE(i, n) {
    const unsigned int id = ids[i];
    if (id == FG_ID_NONE) {
      dst[i] = T(0);
      continue;
    }
    fg_u64 rest = i, off = sl.offset;
#pragma unroll 1
    for (int d = (int)il.rank - 1; d >= 0; --d) {
      fg_u64 q, c;
      fg_divmod(rest, il.dims[d], q, c);
      rest = q;
      off += ((unsigned int)d == dim ? (fg_u64)id : c) * sl.strides[d];
    }
    dst[i] = src[off];
  }
}

#define FG_GATHER(SUF, T)                                                                      \
  FG_KERNEL gather_##SUF(Layout sl, const T* src, Layout il, const unsigned int* ids, T* dst, fg_u64 n, \
                         unsigned int dim) {                                                   \
    fg_gather<T>(sl, src, il, ids, dst, n, dim);                                               \
  }
FG_FOR_WIDTH(FG_GATHER)

// ---------------------------------------------------------------------------------------------
// Atomic adds. Floats use the hardware atomics (f16 / bf16 round once per add, like the CPU's
// f16::from_f64(a + b)). Integers saturate like the CPU's from_f64 (a CAS loop; a plain atomicAdd
// would wrap).
// ---------------------------------------------------------------------------------------------

static __device__ __forceinline__ void fg_atomic_add(float* p, float v) { atomicAdd(p, v); }
static __device__ __forceinline__ void fg_atomic_add(double* p, double v) { atomicAdd(p, v); }
static __device__ __forceinline__ void fg_atomic_add(__half* p, __half v) { atomicAdd(p, v); }
static __device__ __forceinline__ void fg_atomic_add(__nv_bfloat16* p, __nv_bfloat16 v) { atomicAdd(p, v); }
static __device__ __forceinline__ void fg_atomic_add(int* p, int v) {
  if (v == 0) return;
  int old = *p, assumed;
  do {
    assumed = old;
    const long long s = (long long)assumed + (long long)v;
    const int nv = s > 2147483647LL ? 2147483647 : (s < -2147483648LL ? (int)0x80000000 : (int)s);
    if (nv == assumed) return;  // already saturated
    old = atomicCAS(p, assumed, nv);
  } while (old != assumed);
}
static __device__ __forceinline__ void fg_atomic_add(unsigned int* p, unsigned int v) {
  if (v == 0) return;
  unsigned int old = *p, assumed;
  do {
    assumed = old;
    const unsigned long long s = (unsigned long long)assumed + v;
    const unsigned int nv = s > 0xffffffffULL ? 0xffffffffu : (unsigned int)s;
    if (nv == assumed) return;
    old = atomicCAS(p, assumed, nv);
  } while (old != assumed);
}

// ---------------------------------------------------------------------------------------------
// index_add_{f32,f64,f16,bf16,i32,u32}(T* dst, const unsigned int* ids, const T* src, u64 outer,
//                                      u64 size, u64 inner, u64 nids)
// dst contiguous [outer, size, inner]; src contiguous [outer, nids, inner];
// dst[o, ids[j], k] += src[o, j, k].
// ---------------------------------------------------------------------------------------------

template <typename T>
static __device__ __forceinline__ void fg_index_add(T* dst, const unsigned int* __restrict__ ids,
                                                    const T* __restrict__ src, fg_u64 outer, fg_u64 size,
                                                    fg_u64 inner, fg_u64 nids) {
  const fg_u64 n = outer * nids * inner;
  FG_GRID_STRIDE(i, n) {
    fg_u64 t, k, o, j;
    fg_divmod(i, inner, t, k);
    fg_divmod(t, nids, o, j);
    const unsigned int id = ids[j];
    if (id != FG_ID_NONE) fg_atomic_add(dst + (o * size + id) * inner + k, src[i]);
  }
}

// ---------------------------------------------------------------------------------------------
// scatter_add_{f32,f64,f16,bf16,i32,u32}(T* dst, Layout dl, Layout il, const unsigned int* ids,
//                                        const T* src, u64 n, unsigned int dim)
// dst contiguous with dims dl.dims; for element i of the contiguous index / src tensor of dims
// il.dims, dst[multi-index of i with coordinate dim replaced by ids[i]] += src[i].
// ---------------------------------------------------------------------------------------------

template <typename T>
static __device__ __forceinline__ void fg_scatter_add(T* dst, const Layout& dl, const Layout& il,
                                                      const unsigned int* __restrict__ ids, const T* __restrict__ src,
                                                      fg_u64 n, unsigned int dim) {
  FG_GRID_STRIDE(i, n) {
    const unsigned int id = ids[i];
    if (id == FG_ID_NONE) continue;
    fg_u64 rest = i, off = 0, stride = 1;
#pragma unroll 1
    for (int d = (int)il.rank - 1; d >= 0; --d) {
      fg_u64 q, c;
      fg_divmod(rest, il.dims[d], q, c);
      rest = q;
      off += ((unsigned int)d == dim ? (fg_u64)id : c) * stride;
      stride *= dl.dims[d];
    }
    fg_atomic_add(dst + off, src[i]);
  }
}

#define FG_INDEX_ADD(SUF, T)                                                                   \
  FG_KERNEL index_add_##SUF(T* dst, const unsigned int* ids, const T* src, fg_u64 outer, fg_u64 size, \
                            fg_u64 inner, fg_u64 nids) {                                       \
    fg_index_add<T>(dst, ids, src, outer, size, inner, nids);                                  \
  }                                                                                            \
  FG_KERNEL scatter_add_##SUF(T* dst, Layout dl, Layout il, const unsigned int* ids, const T* src, fg_u64 n, \
                              unsigned int dim) {                                              \
    fg_scatter_add<T>(dst, dl, il, ids, src, n, dim);                                          \
  }
FG_INDEX_ADD(f32, float)
FG_INDEX_ADD(f64, double)
FG_INDEX_ADD(f16, __half)
FG_INDEX_ADD(bf16, __nv_bfloat16)
FG_INDEX_ADD(i32, int)
FG_INDEX_ADD(u32, unsigned int)
