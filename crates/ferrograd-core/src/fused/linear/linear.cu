// linear.cu: the activation gradient of the fused linear op (src/fused/linear/), the one step of
// its backward that is not a cuBLASLt matmul: dz = dy * act'(s), where s is the pre-activation z
// (GELU, tanh form) or the output y (ReLU: y > 0 exactly where z > 0).
// CPU twin: src/fused/linear/cpu.rs `act_backward` (UnaryOp::GeluTanhGrad in src/op.rs; on the
// device acc_math.cuh's fg_gelu_tanh_grad, the one unary.cu uses).
//
// dy and dz are contiguous [rows, cols]; s has row stride `lds` (the GELU aux buffer's leading
// dimension is padded to a multiple of 8). linear_d{gelu,relu}_*: when lds == cols and the three
// pointers are 16-byte aligned, every thread moves 16-byte packs; otherwise one element at a time.
// linear_d{gelu,relu}_db_* also sum the columns of dz (the bias gradient, below).
// linear_dgelu*: `h` (nullable, contiguous like dz) also receives gelu_tanh(z) rounded to T, the
// hidden activation that `mlp_recompute`'s backward needs and did not keep: the same bits as the
// unary op (`Tensor::gelu_tanh`) would give, for one more store instead of a pass.

#include "acc_math.cuh"
#include "col_sums.cuh"

template <typename T, bool GELU>
static __device__ __forceinline__ T lin_dact(T dy, T s) {
  typedef typename FgAcc<T>::type A;
  const A g = fg_to_acc(dy), x = fg_to_acc(s);
  if (GELU) return fg_from_acc<T>(g * fg_gelu_tanh_grad<A>(x));
  return fg_from_acc<T>(x > (A)0 ? g : (A)0);
}

template <typename P>
struct LinPair {
  P a, b;
};

// dz = dy * gelu'(s) and, into *h, gelu(s): one tanh for both (the kernels below store *h only
// where asked, so the loops are not written twice).
template <typename T>
static __device__ __forceinline__ T lin_dgelu_h(T dy, T s, T* h) {
  typedef typename FgAcc<T>::type A;
  A y;
  const A g = fg_gelu_tanh_grad_and_value<A>(fg_to_acc(s), &y);
  *h = fg_from_acc<T>(y);
  return fg_from_acc<T>(fg_to_acc(dy) * g);
}

// lin_dact, with gelu(s) into *h for GELU (unused for ReLU).
template <typename T, bool GELU>
static __device__ __forceinline__ T lin_dact_h(T dy, T s, T* h) {
  if (GELU) return lin_dgelu_h<T>(dy, s, h);
  return lin_dact<T, false>(dy, s);
}

template <typename T, bool GELU>
static __device__ __forceinline__ void lin_dact_rows(const T* dy, const T* s, T* dz, T* h, fg_u64 rows, fg_u64 cols,
                                                      fg_u64 lds) {
  const fg_u64 n = rows * cols;
  constexpr int V = 16 / sizeof(T);
  if (lds == cols && fg_aligned(dy, 16) && fg_aligned(s, 16) && fg_aligned(dz, 16) &&
      (h == nullptr || fg_aligned(h, 16))) {
    typedef FgPack<T, V> P;
    const fg_u64 packs = n / V;
    const P* dyp = reinterpret_cast<const P*>(dy);
    const P* sp = reinterpret_cast<const P*>(s);
    P* dzp = reinterpret_cast<P*>(dz);
    P* hp = reinterpret_cast<P*>(h);
    fg_unrolled(
        packs, [&](fg_u64 i) { return LinPair<P>{dyp[i], sp[i]}; },
        [&](fg_u64 i, const LinPair<P>& v) {
          P out, hv;
#pragma unroll
          for (int j = 0; j < V; ++j) out.v[j] = lin_dact_h<T, GELU>(v.a.v[j], v.b.v[j], &hv.v[j]);
          dzp[i] = out;
          if (GELU && h != nullptr) hp[i] = hv;
        });
    for (fg_u64 i = packs * V + fg_tid(); i < n; i += fg_nthreads()) {
      T hv;
      dz[i] = lin_dact_h<T, GELU>(dy[i], s[i], &hv);
      if (GELU && h != nullptr) h[i] = hv;
    }
    return;
  }
  FG_GRID_STRIDE(i, n) {
    fg_u64 r, c;
    fg_divmod(i, cols, r, c);
    T hv;
    dz[i] = lin_dact_h<T, GELU>(dy[i], s[r * lds + c], &hv);
    if (GELU && h != nullptr) h[i] = hv;
  }
}

// One row's pack of lin_dact_db_v: dz (and h) stored at offset o, the stored dz added to acc.
template <typename T, bool GELU, int V>
static __device__ __forceinline__ void lin_dact_db_row(const FgPack<T, V>& g, const FgPack<T, V>& x, T* __restrict__ dz,
                                                       T* __restrict__ h, typename FgAcc<T>::type* acc, fg_u64 o) {
  FgPack<T, V> out, hv;
#pragma unroll
  for (int j = 0; j < V; ++j) {
    out.v[j] = lin_dact_h<T, GELU>(g.v[j], x.v[j], &hv.v[j]);
    acc[j] += fg_to_acc(out.v[j]);
  }
  *reinterpret_cast<FgPack<T, V>*>(dz + o) = out;
  if (GELU && h != nullptr) *reinterpret_cast<FgPack<T, V>*>(h + o) = hv;
}

// lin_dact_rows, also summing each column of dz (the bias gradient) without another pass over it. Block
// (bx, by) owns columns [bx * blockDim.x * V, ...) and rows [by * rps, (by + 1) * rps); each thread
// keeps V column sums in ACC over its rows, of the dz values as stored (rounded to T, as a matmul
// reading dz would see them), and writes them to part[by * cols + column]: deterministic, no
// atomics. linear_colsum_* then adds the gridDim.y partial rows. V = 16 / sizeof(T) when cols and
// lds are multiples of V and the pointers 16-byte aligned, else 1.
template <typename T, bool GELU, int V>
static __device__ __forceinline__ void lin_dact_db_v(const T* __restrict__ dy, const T* __restrict__ s,
                                                     T* __restrict__ dz, T* __restrict__ h,
                                                     typename FgAcc<T>::type* __restrict__ part,
                                                     fg_u64 rows, fg_u64 cols, fg_u64 lds, fg_u64 rps) {
  typedef typename FgAcc<T>::type A;
  typedef FgPack<T, V> P;
  const fg_u64 c0 = ((fg_u64)blockIdx.x * blockDim.x + threadIdx.x) * V;
  if (c0 >= cols) return;
  const fg_u64 r0 = (fg_u64)blockIdx.y * rps;
  const fg_u64 r1 = r0 + rps < rows ? r0 + rps : rows;
  A acc[V];
#pragma unroll
  for (int j = 0; j < V; ++j) acc[j] = (A)0;
  // Two rows a step, both rows' loads issued before any math (an unrolled one-row loop was
  // slower: its loads were not in flight together): dz + db at 16384 x 3072 bf16 went from 137 to
  // 120 µs on an H100, x4096 159 -> 153, x768 38 -> 31 (bench/kernels/linear_dzdb.sh, 2026-11-24).
  fg_u64 r = r0;
  for (; r + 2 <= r1; r += 2) {
    P g[2], x[2];
#pragma unroll
    for (int k = 0; k < 2; ++k) {
      g[k] = *reinterpret_cast<const P*>(dy + (r + k) * cols + c0);
      x[k] = *reinterpret_cast<const P*>(s + (r + k) * lds + c0);
    }
#pragma unroll
    for (int k = 0; k < 2; ++k) lin_dact_db_row<T, GELU, V>(g[k], x[k], dz, h, acc, (r + k) * cols + c0);
  }
  if (r < r1) {
    const P g = *reinterpret_cast<const P*>(dy + r * cols + c0);
    const P x = *reinterpret_cast<const P*>(s + r * lds + c0);
    lin_dact_db_row<T, GELU, V>(g, x, dz, h, acc, r * cols + c0);
  }
#pragma unroll
  for (int j = 0; j < V; ++j) part[(fg_u64)blockIdx.y * cols + c0 + j] = acc[j];
}

template <typename T, bool GELU>
static __device__ __forceinline__ void lin_dact_db(const T* dy, const T* s, T* dz, T* h,
                                                   typename FgAcc<T>::type* part, fg_u64 rows, fg_u64 cols,
                                                   fg_u64 lds, fg_u64 rps, int vec) {
  constexpr int V = 16 / sizeof(T);
  if (vec) lin_dact_db_v<T, GELU, V>(dy, s, dz, h, part, rows, cols, lds, rps);
  else lin_dact_db_v<T, GELU, 1>(dy, s, dz, h, part, rows, cols, lds, rps);
}

#define FG_LINEAR_DACT(T, SUF)                                                                                 \
  FG_KERNEL linear_dgelu_##SUF(const T* dy, const T* z, T* dz, T* h, fg_u64 rows, fg_u64 cols, fg_u64 ldz) {   \
    lin_dact_rows<T, true>(dy, z, dz, h, rows, cols, ldz);                                                     \
  }                                                                                                            \
  FG_KERNEL linear_drelu_##SUF(const T* dy, const T* y, T* dz, fg_u64 rows, fg_u64 cols, fg_u64 ldy) {         \
    lin_dact_rows<T, false>(dy, y, dz, nullptr, rows, cols, ldy);                                              \
  }                                                                                                            \
  FG_KERNEL linear_dgelu_db_##SUF(const T* dy, const T* z, T* dz, T* h, FgAcc<T>::type* part, fg_u64 rows,     \
                                  fg_u64 cols, fg_u64 ldz, fg_u64 rps, int vec) {                              \
    lin_dact_db<T, true>(dy, z, dz, h, part, rows, cols, ldz, rps, vec);                                       \
  }                                                                                                            \
  FG_KERNEL linear_drelu_db_##SUF(const T* dy, const T* y, T* dz, FgAcc<T>::type* part, fg_u64 rows,           \
                                  fg_u64 cols, fg_u64 ldy, fg_u64 rps, int vec) {                              \
    lin_dact_db<T, false>(dy, y, dz, nullptr, part, rows, cols, ldy, rps, vec);                                \
  }                                                                                                            \
  FG_KERNEL linear_colsum_##SUF(const FgAcc<T>::type* part, T* db, fg_u64 splits, fg_u64 cols) {               \
    fg_col_sums<T>(part, db, splits, cols);                                                                     \
  }

// One dtype per compiled part (`-D FG_LINEAR_DTYPE`, mod.rs `MODULES`): the four in one module
// were the longest NVRTC pole of a cold precompile (2.3-2.7 s alone, ~5 s among 16 threads), and a
// run compiles only the parts it launches (a bf16 model: bf16, and f32 for its f32 bias sums).
#if !defined(FG_LINEAR_DTYPE)
#error "FG_LINEAR_DTYPE comes from Rust (src/fused/linear/mod.rs MODULES)"
#elif FG_LINEAR_DTYPE == 0
FG_LINEAR_DACT(float, f32)
#elif FG_LINEAR_DTYPE == 1
FG_LINEAR_DACT(double, f64)
#elif FG_LINEAR_DTYPE == 2
FG_LINEAR_DACT(__half, f16)
#else
FG_LINEAR_DACT(__nv_bfloat16, bf16)
#endif
