// classifier.cu: the fused classifier (llm.c's fused_classifier): cross entropy's loss and the
// logits' gradient from one kernel, one block per row, no probability tensor.
// CPU twin: src/fused/classifier/cpu.rs (each row in f64; here in ACC: float for f32 / f16 / bf16,
// double for f64).
//
// Targets arrive encoded as cross entropy's (a u32 class id below `valid`, or FG_CL_IGNORED).
//
// classifier_count_{f32,f64,f16,bf16}(const unsigned int* t, ACC* count, u64 rows)
//   count[0] = the number of rows whose target is not FG_CL_IGNORED. One block (any blockDim that is
//   a multiple of 32), grid 1.
// classifier_{f32,f64,f16,bf16}(const T* x, T* dx, const unsigned int* t, const ACC* count,
//                               ACC* loss, u64 rows, u64 cols, u64 valid, u64 ldx, u64 ldd,
//                               ACC scale, int vec)
//   x: rows of `cols` elements at row stride ldx, of which the first `valid` are the classes (the
//   rest, a padded vocabulary's columns, take no probability and get gradient 0). Per row:
//   pass 1 keeps an online (max m, s = sum exp(x - m)) pair per thread, merged over the block;
//   lse = mf + ln(s) (mf = m, or 0 when m is not finite, the sum then re-taken against 0 as the
//   CPU does); loss[r] = lse - x[r][t] (0 for an ignored row). Pass 2 writes
//   dx[r][j] = scale / count[0] * (exp(x[r][j] - lse) - (j == t)) for j < valid, 0 for
//   valid <= j < cols and on ignored rows, at row stride ldd. Pass 2 rereads the row (from L2:
//   one row of GPT-2's 50304 bf16 logits is 100 KB).
//   dx may be x itself (ldd == ldx): each element is read before the same thread overwrites it,
//   and x[r][t] is read before the barrier that ends pass 1, so x and dx are not __restrict__.
//   vec != 0 (the host checked ldx and ldd are multiples of V = 16 / sizeof(T) and both bases are
//   16-byte aligned): the row goes in 16-byte vectors, the tail past the last whole vector one
//   element at a time.
//   Any grid (grid-stride over rows), blockDim a multiple of 32 up to 1024.

#include "online_softmax.cuh"

#if !defined(FG_CL_IGNORED)
#error "FG_CL_IGNORED comes from Rust (src/fused/classifier/mod.rs)"
#endif

template <typename T>
static __device__ __forceinline__ void fg_cl_count(const unsigned int* __restrict__ t,
                                                   typename FgAcc<T>::type* __restrict__ count, fg_u64 rows) {
  typedef typename FgAcc<T>::type A;
  __shared__ A sh[32];
  A c = (A)0;
  for (fg_u64 r = threadIdx.x; r < rows; r += blockDim.x) c += t[r] != FG_CL_IGNORED ? (A)1 : (A)0;
  c = fg_block_reduce(c, FgSum(), sh);
  if (threadIdx.x == 0) count[0] = c;
}

template <typename T, int V>
static __device__ __forceinline__ void fg_cl_load(const T* p, typename FgAcc<T>::type (&o)[V]) {
  const FgPack<T, V> q = *reinterpret_cast<const FgPack<T, V>*>(p);
#pragma unroll
  for (int i = 0; i < V; ++i) o[i] = fg_to_acc(q.v[i]);
}

template <typename T>
static __device__ __forceinline__ void fg_classifier(const T* x, T* dx, const unsigned int* __restrict__ t,
                                                     const typename FgAcc<T>::type* __restrict__ count,
                                                     typename FgAcc<T>::type* __restrict__ loss, fg_u64 rows,
                                                     fg_u64 cols, fg_u64 valid, fg_u64 ldx, fg_u64 ldd,
                                                     typename FgAcc<T>::type scale, int vec) {
  typedef typename FgAcc<T>::type A;
  constexpr int V = 16 / sizeof(T);
  __shared__ A shm[32], shs[32];
  const unsigned int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
  const fg_u64 nt = blockDim.x;
  const A ninf = -fg_inf<A>();
  const A g = scale / count[0];
  // Whole vectors cover [0, vv) of the valid columns and [0, cv) of all columns.
  const fg_u64 vv = vec ? valid / V * V : 0, cv = vec ? cols / V * V : 0;
  for (fg_u64 r = blockIdx.x; r < rows; r += gridDim.x) {
    const T* xr = x + r * ldx;
    T* dr = dx + r * ldd;
    const unsigned int c = t[r];
    // Read before the barrier below: with dx == x, pass 2 may overwrite it.
    const A xc = (threadIdx.x == 0 && c != FG_CL_IGNORED) ? fg_to_acc(xr[c]) : (A)0;
    A m = ninf, s = (A)0;
    for (fg_u64 j = threadIdx.x * (fg_u64)V; j < vv; j += nt * V) {
      A v[V];
      fg_cl_load<T, V>(xr + j, v);
#pragma unroll
      for (int i = 0; i < V; ++i) fg_online_push(m, s, v[i]);
    }
    for (fg_u64 j = vv + threadIdx.x; j < valid; j += nt) fg_online_push(m, s, fg_to_acc(xr[j]));
    fg_online_warp_merge(m, s, FgGreater());
    __syncthreads();  // the previous row's readers are done with shm / shs
    if (lane == 0) {
      shm[warp] = m;
      shs[warp] = s;
    }
    __syncthreads();
    m = lane < nw ? shm[lane] : ninf;
    s = lane < nw ? shs[lane] : (A)0;
    fg_online_warp_merge(m, s, FgGreater());
    // An all -inf row (or one holding +inf) has no finite max: sum against 0 (uniform over the block).
    const bool finite = m > ninf && m < fg_inf<A>();
    const A mf = finite ? m : (A)0;
    if (!finite) {
      A u = (A)0;
      for (fg_u64 k = threadIdx.x; k < valid; k += nt) u += fg_exp(fg_to_acc(xr[k]) - mf);
      s = fg_block_reduce(u, FgSum(), shs);
    }
    const A lse = mf + fg_log(s);
    if (threadIdx.x == 0) loss[r] = c == FG_CL_IGNORED ? (A)0 : lse - xc;
    const bool kept = c != FG_CL_IGNORED;
    // Pass 2: the gradient (no thread writes a column before every thread has read the row's
    // values it needs: the barriers above ended pass 1, and pass 2 reads only its own elements).
    for (fg_u64 j = threadIdx.x * (fg_u64)V; j < cv; j += nt * V) {
      A v[V];
      fg_cl_load<T, V>(xr + j, v);
      FgPack<T, V> q;
#pragma unroll
      for (int i = 0; i < V; ++i) {
        const fg_u64 jj = j + i;
        const A p = fg_exp(v[i] - lse);
        q.v[i] = fg_from_acc<T>(kept && jj < valid ? g * (jj == c ? p - (A)1 : p) : (A)0);
      }
      *reinterpret_cast<FgPack<T, V>*>(dr + j) = q;
    }
    for (fg_u64 j = cv + threadIdx.x; j < cols; j += nt) {
      const A p = fg_exp(fg_to_acc(xr[j]) - lse);
      dr[j] = fg_from_acc<T>(kept && j < valid ? g * (j == c ? p - (A)1 : p) : (A)0);
    }
  }
}

#define FG_CLASSIFIER(SUF, T)                                                                         \
  FG_KERNEL classifier_count_##SUF(const unsigned int* t, FgAcc<T>::type* count, fg_u64 rows) {      \
    fg_cl_count<T>(t, count, rows);                                                                   \
  }                                                                                                   \
  FG_KERNEL classifier_##SUF(const T* x, T* dx, const unsigned int* t, const FgAcc<T>::type* count,  \
                             FgAcc<T>::type* loss, fg_u64 rows, fg_u64 cols, fg_u64 valid, fg_u64 ldx, \
                             fg_u64 ldd, FgAcc<T>::type scale, int vec) {                             \
    fg_classifier<T>(x, dx, t, count, loss, rows, cols, valid, ldx, ldd, scale, vec);                 \
  }
FG_FOR_FLOAT(FG_CLASSIFIER)
