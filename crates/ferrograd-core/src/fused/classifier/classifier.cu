// classifier.cu: the fused classifier (llm.c's fused_classifier): cross entropy's loss and the
// logits' gradient from one kernel, one block per row, no probability tensor.
// CPU twin: src/fused/classifier/cpu.rs (each row in f64; here in ACC: float for f32 / f16 / bf16,
// double for f64). The row pass (online max and sum, log-sum-exp, target decoding, loss) is
// ce_row.cuh's, shared with cross_entropy.cu.
//
// Targets arrive encoded as cross entropy's (a u32 class id below `valid`, or FG_CE_IGNORED).
//
// classifier_count_{f32,f64,f16,bf16}(const unsigned int* t, ACC* count, u64 rows)
//   count[0] = the number of rows whose target is not FG_CE_IGNORED. One block (any blockDim that is
//   a multiple of 32), grid 1.
// classifier_{f32,f64,f16,bf16}(const T* x, T* dx, const unsigned int* t, const ACC* count,
//                               ACC* loss, u64 rows, u64 cols, u64 valid, u64 ldx, u64 ldd,
//                               ACC scale, int vec, int cache)
//   x: rows of `cols` elements at row stride ldx, of which the first `valid` are the classes (the
//   rest, a padded vocabulary's columns, take no probability and get gradient 0). Per row:
//   pass 1 keeps an online (max m, s = sum exp(x - m)) pair per thread, merged over the block;
//   lse = mf + ln(s) (mf = m, or 0 when m is not finite, the sum then re-taken against 0 as the
//   CPU does); loss[r] = ln(s) - (x[r][t] - mf) (0 for an ignored row). Pass 2 writes
//   dx[r][j] = scale / count[0] * (exp(x[r][j] - lse) - (j == t)) for j < valid, 0 for
//   valid <= j < cols and on ignored rows, at row stride ldd.
//   vec != 0 (the host checked that x and dx bases are congruent mod 16 bytes, and so are their
//   row strides in bytes, so that every row of dx has its row of x's alignment): each row goes as a
//   head of elements up to x's first 16-byte boundary, whole 16-byte vectors (4 in flight per
//   thread), and a tail, both one element at a time. vec == 0: every element alone.
//   cache != 0 (needs vec; dynamic shared memory of >= (cols / V) * 16 bytes, V = 16 / sizeof(T)):
//   pass 1 keeps the row's vectors in shared memory and pass 2 reads them from there, so the logits
//   leave DRAM once (one read of x, one write of dx: the op's floor). cache == 0: pass 2 rereads the
//   row (from L2 when it is still there).
//   dx may be x itself (ldd == ldx): every element is read before the same thread overwrites it,
//   and x[r][t] is read before the barrier that ends pass 1, so x and dx are not __restrict__.
//   Any grid (grid-stride over rows), blockDim a multiple of 32 up to 1024.

#include "ce_row.cuh"

template <typename T>
static __device__ __forceinline__ void fg_cl_count(const unsigned int* __restrict__ t,
                                                   typename FgAcc<T>::type* __restrict__ count, fg_u64 rows) {
  typedef typename FgAcc<T>::type A;
  __shared__ A sh[32];
  A c = (A)0;
  for (fg_u64 r = threadIdx.x; r < rows; r += blockDim.x) c += fg_ce_kept(t[r]) ? (A)1 : (A)0;
  c = fg_block_reduce(c, FgSum(), sh);
  if (threadIdx.x == 0) count[0] = c;
}

// A 16-byte vector's V elements widened to ACC; those at column valid or later become -inf (they
// take no probability). j: the column of the first.
template <typename T, int V>
static __device__ __forceinline__ void fg_cl_unpack(uint4 b, fg_u64 j, fg_u64 valid,
                                                    typename FgAcc<T>::type (&o)[V]) {
  FgPack<T, V> q;
  memcpy(&q, &b, 16);
  // The common case, a vector of classes only, without a comparison per element.
  if (j + V <= valid) {
#pragma unroll
    for (int i = 0; i < V; ++i) o[i] = fg_to_acc(q.v[i]);
  } else {
#pragma unroll
    for (int i = 0; i < V; ++i) o[i] = j + i < valid ? fg_to_acc(q.v[i]) : -fg_inf<typename FgAcc<T>::type>();
  }
}

template <typename T>
static __device__ __forceinline__ void fg_classifier(const T* x, T* dx, const unsigned int* __restrict__ t,
                                                     const typename FgAcc<T>::type* __restrict__ count,
                                                     typename FgAcc<T>::type* __restrict__ loss, fg_u64 rows,
                                                     fg_u64 cols, fg_u64 valid, fg_u64 ldx, fg_u64 ldd,
                                                     typename FgAcc<T>::type scale, int vec, int cache) {
  typedef typename FgAcc<T>::type A;
  constexpr int V = 16 / sizeof(T);
  __shared__ A shm[32], shs[32];
  uint4* const row_cache = reinterpret_cast<uint4*>(fg_smem);
  const fg_u64 nt = blockDim.x, tid = threadIdx.x;
  const A g = scale / count[0];
  for (fg_u64 r = blockIdx.x; r < rows; r += gridDim.x) {
    const T* xr = x + r * ldx;
    T* dr = dx + r * ldd;
    const unsigned int c = t[r];
    // Read before the barriers below: with dx == x, pass 2 may overwrite it.
    const A xc = tid == 0 ? fg_ce_target_logit(xr, c) : (A)0;
    // [0, h): the head; [h, e): nv whole vectors; [e, cols): the tail.
    fg_u64 h = cols;
    if (vec) {
      h = ((16 - ((unsigned long long)xr & 15)) & 15) / sizeof(T);
      if (h > cols) h = cols;
    }
    const fg_u64 nv = (cols - h) / V, e = h + nv * V;
    const uint4* xv = reinterpret_cast<const uint4*>(xr + h);
    A m = -fg_inf<A>(), s = (A)0;
    fg_u64 k = tid;
    for (; k + 3 * nt < nv; k += 4 * nt) {
      uint4 b[4];
#pragma unroll
      for (int u = 0; u < 4; ++u) b[u] = cache ? __ldcs(xv + k + u * nt) : xv[k + u * nt];
#pragma unroll
      for (int u = 0; u < 4; ++u) {
        if (cache) row_cache[k + u * nt] = b[u];
        A v[V];
        fg_cl_unpack<T, V>(b[u], h + (k + u * nt) * V, valid, v);
        fg_online_push_vec_fast(m, s, v);
      }
    }
    for (; k < nv; k += nt) {
      const uint4 b = cache ? __ldcs(xv + k) : xv[k];
      if (cache) row_cache[k] = b;
      A v[V];
      fg_cl_unpack<T, V>(b, h + k * V, valid, v);
      fg_online_push_vec_fast(m, s, v);
    }
    for (fg_u64 j = tid; j < h && j < valid; j += nt) fg_online_push(m, s, fg_to_acc(xr[j]));
    for (fg_u64 j = e + tid; j < valid; j += nt) fg_online_push(m, s, fg_to_acc(xr[j]));
    fg_ce_unit_merge(m, s, true, shm, shs);
    const FgCeLse<A> l = fg_ce_lse(m, s, [&](A mf) {
      A u = (A)0;
      for (fg_u64 j = tid; j < valid; j += nt) u += fg_exp(fg_to_acc(xr[j]) - mf);
      return fg_block_reduce(u, FgSum(), shs);
    });
    const A lse = l.lse(), lsel = fg_log2e_times(lse);
    if (tid == 0) loss[r] = fg_ce_loss(c, xc, l);
    const bool kept = fg_ce_kept(c);
    // The gradient of column j from its logit a.
    auto grad = [&](fg_u64 j, A a) -> T {
      const A p = fg_exp_sub(a, lse, lsel);
      return fg_from_acc<T>(kept && j < valid ? g * (j == c ? p - (A)1 : p) : (A)0);
    };
    // Pass 2 (no thread writes a column before every thread has read the row's values it needs:
    // the barriers of the merge ended pass 1, and pass 2 reads only this thread's own elements).
    uint4* dv = reinterpret_cast<uint4*>(dr + h);
#pragma unroll 2
    for (fg_u64 q = tid; q < nv; q += nt) {
      const uint4 b = cache ? row_cache[q] : __ldcs(xv + q);
      FgPack<T, V> in, out;
      memcpy(&in, &b, 16);
      const fg_u64 j0 = h + q * V;
      if (kept && j0 + V <= valid && (fg_u64)c - j0 >= (fg_u64)V) {
        // Classes only, the target not among them (c < j0 wraps around): softmax times g.
#pragma unroll
        for (int i = 0; i < V; ++i) out.v[i] = fg_from_acc<T>(g * fg_exp_sub(fg_to_acc(in.v[i]), lse, lsel));
      } else {
#pragma unroll
        for (int i = 0; i < V; ++i) out.v[i] = grad(j0 + i, fg_to_acc(in.v[i]));
      }
      uint4 o;
      memcpy(&o, &out, 16);
      __stcs(dv + q, o);
    }
    for (fg_u64 j = tid; j < h; j += nt) dr[j] = grad(j, fg_to_acc(xr[j]));
    for (fg_u64 j = e + tid; j < cols; j += nt) dr[j] = grad(j, fg_to_acc(xr[j]));
  }
}

#define FG_CLASSIFIER(SUF, T)                                                                         \
  FG_KERNEL classifier_count_##SUF(const unsigned int* t, FgAcc<T>::type* count, fg_u64 rows) {      \
    fg_cl_count<T>(t, count, rows);                                                                   \
  }                                                                                                   \
  FG_KERNEL classifier_##SUF(const T* x, T* dx, const unsigned int* t, const FgAcc<T>::type* count,  \
                             FgAcc<T>::type* loss, fg_u64 rows, fg_u64 cols, fg_u64 valid, fg_u64 ldx, \
                             fg_u64 ldd, FgAcc<T>::type scale, int vec, int cache) {                  \
    fg_classifier<T>(x, dx, t, count, loss, rows, cols, valid, ldx, ldd, scale, vec, cache);          \
  }
FG_FOR_FLOAT(FG_CLASSIFIER)
