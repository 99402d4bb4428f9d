// attention.cu: fused scaled-dot-product attention, forward and backward (FlashAttention-2 style:
// tiles of Q against tiles of K/V, online softmax, only O and the per-row log-sum-exp leave the
// chip; the backward recomputes P from the log-sum-exp).
// Rust side: src/fused/attention/{mod.rs, cuda.rs}; CPU twin (the reference): cpu.rs.
//
// The module is compiled once per head dim: the Rust side prepends `#define FG_ATTN_D <d>` (and
// common.cuh), and every entry point carries the head dim in its name, `fg_attn_fwd_d64_bf16`, so
// that modules of different head dims never share a kernel name.
//
// Entry points (T = bf16 / f16 use tensor cores; f32 runs the SIMT kernels, exact f32 FMAs):
//   fg_attn_fwd_d{D}_{bf16,f16,f32}(const T* q, const T* k, const T* v, T* o, float* lse, FgAttnParams p)
//     grid (B * H, ceil(Tq / BQ)), block 128 (tensor cores) or 256 (f32), dynamic shared memory as
//     `fg_attn_smem_*` below (the Rust side mirrors the formulas). o [B, Tq, H, D] through p.o
//     (d stride 1), lse [B * H, Tq] contiguous: the natural-log log-sum-exp of each row of scaled
//     scores (what the backward needs).
//   fg_attn_bwd_pre_d{D}_{..}(const T* o, const T* dout, float* delta, float* dq_acc, FgAttnParams p)
//     any grid, block a multiple of 32: one warp per row, delta[r] = sum_d dout * o (f32) and
//     dq_acc[r, :] = 0; r = bh * Tq + i over B * H * Tq rows.
//   fg_attn_bwd_d{D}_{..}(const T* q, const T* k, const T* v, const T* dout, const float* lse,
//       const float* delta, float* dq_acc, T* dk, T* dv, FgAttnParams p)
//     grid (B * H, ceil(Tk / BKV)), block 128; each block owns BKV rows of K and V, walks the Q
//     blocks that see them, writes its dK and dV rows and adds its share of dQ into dq_acc (f32,
//     [B * H, Tq, D], atomics: the sum order, and so the last bits of dQ, vary between runs).
//   fg_attn_dq_d{D}_{..}(const float* dq_acc, T* dq, FgAttnParams p): any grid-stride launch;
//     dq = dq_acc converted (dq_acc already carries the softmax scale).
//
// Inputs are read in place through element strides (p.q / p.k / p.v / p.dout: b, h, t, d). The
// tensor-core kernels copy 16-byte rows with cp.async, so they need d stride 1, every other stride
// and the first element 16-byte aligned (the Rust side copies a view that is not); the f32 kernels
// take any strides.
//
// Semantics (PyTorch's F.scaled_dot_product_attention): S = scale * Q K^T; causal keeps j <= i (top
// left, as torch's is_causal); P = softmax(S) per row; with dropout each P[i][j] is kept with
// probability 1 - p and scaled by 1 / (1 - p); O = P V. Dropout draws from Philox 4x32-10 (the
// project's generator, src/rng.rs): element (b, h, i, j) reads word j % 4 of block
// rng_offset + ((b * H + h) * Tq + i) * ceil(Tk / 4) + j / 4, and is kept when (word >> 8) >=
// drop_thr = ceil(p * 2^24), i.e. when the uniform (word >> 8) * 2^-24 is >= p. The CPU twin draws
// the same numbers; the backward regenerates them.
//
// Tensor-core kernels (mma.sync m16n8k16, f32 accumulators, ldmatrix, cp.async double buffering):
// 4 warps. Forward: each warp owns 16 * MT query rows and walks K/V tiles of BKV rows (S = Q K^T,
// online softmax in the exp2 domain, O += P V with P re-packed from the S accumulators as the A
// operand). Backward: each warp owns 16 rows of K/V; per Q block it computes S^T = K Q^T and
// dP^T = V dO^T (so that P^T and dS^T are in the A-operand layout for dV += P^T dO and
// dK += dS^T Q without a trip through shared memory), writes dS^T to shared memory, and the block
// then computes dQ_partial = dS K, which goes to dq_acc with atomics. Shared-memory rows are padded
// by 16 bytes, so ldmatrix's eight row addresses fall in distinct banks.

#ifndef FG_ATTN_D
#error "FG_ATTN_D (the head dim) must be defined before attention.cu"
#endif

#define FG_ATTN_WARPS 4
#define FG_ATTN_THREADS (FG_ATTN_WARPS * 32)
#define FG_ATTN_LOG2E 1.4426950408889634f
#define FG_ATTN_LN2 0.6931471805599453f
#define FG_FULL 0xffffffffu

struct FgStride4 {
  long long b, h, t, d;  // element strides
};

// Mirrored by `AttnParams` in cuda.rs (#[repr(C)]).
struct FgAttnParams {
  FgStride4 q, k, v, o, dout, dq, dk, dv;
  unsigned long long seed, rng_offset;
  unsigned int B, H, Tq, Tk;
  float scale;       // softmax scale
  float scale_log2;  // scale * log2(e)
  float rp_keep;     // 1 / (1 - p): applied to kept elements
  unsigned int drop_thr;  // 0: no dropout; else keep when (philox word >> 8) >= drop_thr
  unsigned int causal;
  unsigned int pad_;
};

// ---------------------------------------------------------------------------------------------
// Philox 4x32-10: the same function as kernels/rng.cu `fg_philox4x32_10` (src/rng.rs), repeated
// because each .cu file is its own module; the dropout parity tests check CPU and GPU agree.
// ---------------------------------------------------------------------------------------------

struct FgAttnU4 {
  unsigned int x[4];
};

static __device__ __forceinline__ FgAttnU4 fg_attn_philox(unsigned long long seed, unsigned long long index) {
  unsigned int c0 = (unsigned int)index, c1 = (unsigned int)(index >> 32), c2 = 0u, c3 = 0u;
  unsigned int k0 = (unsigned int)seed, k1 = (unsigned int)(seed >> 32);
#pragma unroll
  for (int round = 0; round < 10; ++round) {
    if (round > 0) {
      k0 += 0x9E3779B9u;
      k1 += 0xBB67AE85u;
    }
    const unsigned int hi0 = __umulhi(0xD2511F53u, c0), lo0 = 0xD2511F53u * c0;
    const unsigned int hi1 = __umulhi(0xCD9E8D57u, c2), lo1 = 0xCD9E8D57u * c2;
    const unsigned int n0 = hi1 ^ c1 ^ k0, n2 = hi0 ^ c3 ^ k1;
    c0 = n0;
    c1 = lo1;
    c2 = n2;
    c3 = lo0;
  }
  FgAttnU4 r;
  r.x[0] = c0;
  r.x[1] = c1;
  r.x[2] = c2;
  r.x[3] = c3;
  return r;
}

// Word i (0..3, a run-time value) of a block, without indexing a register array at run time.
static __device__ __forceinline__ unsigned int fg_attn_word(const FgAttnU4& r, int i) {
  const unsigned int lo = (i & 1) ? r.x[1] : r.x[0];
  const unsigned int hi = (i & 1) ? r.x[3] : r.x[2];
  return (i & 2) ? hi : lo;
}

// ---------------------------------------------------------------------------------------------
// PTX wrappers
// ---------------------------------------------------------------------------------------------

static __device__ __forceinline__ float fg_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

static __device__ __forceinline__ unsigned int fg_smem_addr(const void* p) {
  return (unsigned int)__cvta_generic_to_shared(p);
}

// 16 bytes global -> shared, bypassing L1; zero-filled (nothing read) when !valid.
static __device__ __forceinline__ void fg_cp16(unsigned int dst, const void* src, bool valid) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(valid ? 16 : 0));
}
static __device__ __forceinline__ void fg_cp_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int N>
static __device__ __forceinline__ void fg_cp_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

static __device__ __forceinline__ void fg_ldsm4(unsigned int (&r)[4], unsigned int addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}
static __device__ __forceinline__ void fg_ldsm4t(unsigned int (&r)[4], unsigned int addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}

// d += a b for one m16n8k16 tile (a: 4 registers of the A fragment, b: 2 of B).
template <typename T> struct FgTc;
template <> struct FgTc<__nv_bfloat16> {
  static __device__ __forceinline__ void mma(float (&d)[4], const unsigned int (&a)[4], unsigned int b0,
                                             unsigned int b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
  // Two floats as one register of 16-bit values, `lo` in the low half (the lower column).
  static __device__ __forceinline__ unsigned int pack(float lo, float hi) {
    __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<unsigned int*>(&v);
  }
};
template <> struct FgTc<__half> {
  static __device__ __forceinline__ void mma(float (&d)[4], const unsigned int (&a)[4], unsigned int b0,
                                             unsigned int b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
  static __device__ __forceinline__ unsigned int pack(float lo, float hi) {
    __half2 v = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<unsigned int*>(&v);
  }
};

// ---------------------------------------------------------------------------------------------
// Tile shapes (cuda.rs `TileShape` mirrors these; change both together)
// ---------------------------------------------------------------------------------------------

template <int D> struct FgAttnTile {
  // Forward: query rows per warp = 16 * MT (key/value rows per step: the kernel's BKV).
  static constexpr int MT = D <= 128 ? 2 : 1;
  static constexpr int FWD_BQ = FG_ATTN_WARPS * 16 * MT;
  // Backward: key/value rows per block, 16 per warp (query rows per step: the kernel's BQ).
  static constexpr int BWD_BKV = FG_ATTN_WARPS * 16;
  // Shared-memory row stride in elements: 16 bytes of padding per row.
  static constexpr int DP = D + 8;
};

// ---------------------------------------------------------------------------------------------
// Tile loads
// ---------------------------------------------------------------------------------------------

// Rows [r0, r0 + ROWS) of a matrix with `nrows` rows of D contiguous elements (row stride `st`) into
// shared memory at `dst` (row stride DP elements), 16 bytes per cp.async; rows past the end are
// zero-filled (and not read).
template <typename T, int ROWS, int D, int DP>
static __device__ __forceinline__ void fg_attn_load(unsigned int dst, const T* __restrict__ src, long long st,
                                                    int r0, int nrows) {
  constexpr int CPR = D / 8;  // 16-byte chunks a row
  constexpr int TOTAL = ROWS * CPR;
  constexpr int PER = (TOTAL + FG_ATTN_THREADS - 1) / FG_ATTN_THREADS;  // chunks a thread
  if constexpr (FG_ATTN_THREADS % CPR == 0) {
    // Every chunk of a thread is in the same column, RSTEP rows apart: one address computation.
    constexpr int RSTEP = FG_ATTN_THREADS / CPR;
    const int row = (int)threadIdx.x / CPR, col = ((int)threadIdx.x % CPR) * 8;
    const T* s = src + (long long)(r0 + row) * st + col;
    const unsigned int d = dst + (unsigned int)((row * DP + col) * (int)sizeof(T));
#pragma unroll
    for (int k = 0; k < PER; ++k) {
      if (TOTAL % FG_ATTN_THREADS == 0 || row + k * RSTEP < ROWS) {
        const bool valid = r0 + row + k * RSTEP < nrows;
        fg_cp16(d + (unsigned int)(k * RSTEP * DP * (int)sizeof(T)), valid ? s + (long long)k * RSTEP * st : src,
                valid);
      }
    }
  } else {
#pragma unroll
    for (int k = 0; k < PER; ++k) {
      const int c = k * FG_ATTN_THREADS + (int)threadIdx.x;
      if (TOTAL % FG_ATTN_THREADS == 0 || c < TOTAL) {
        const int row = c / CPR, col = (c - row * CPR) * 8;
        const int gr = r0 + row;
        const bool valid = gr < nrows;
        fg_cp16(dst + (unsigned int)((row * DP + col) * (int)sizeof(T)),
                src + (long long)(valid ? gr : 0) * st + col, valid);
      }
    }
  }
}

// Copy ROWS x D of shared memory (row stride DP) to global rows [r0, ...) below `nrows`, 16 bytes a
// lane, by one warp.
template <typename T, int ROWS, int D, int DP>
static __device__ __forceinline__ void fg_attn_store_warp(T* __restrict__ dst, long long st, const T* src, int r0,
                                                          int nrows) {
  constexpr int CPR = D / 8;
  const int lane = threadIdx.x & 31;
#pragma unroll
  for (int c = lane; c < ROWS * CPR; c += 32) {
    const int row = c / CPR, col = (c - row * CPR) * 8;
    if (r0 + row < nrows)
      *reinterpret_cast<uint4*>(dst + (long long)(r0 + row) * st + col) =
          *reinterpret_cast<const uint4*>(src + row * DP + col);
  }
}

// ---------------------------------------------------------------------------------------------
// Forward, tensor cores
// ---------------------------------------------------------------------------------------------

template <typename T, int D, int BKV>
static __device__ __forceinline__ void fg_attn_fwd_tc(const T* __restrict__ q, const T* __restrict__ k,
                                                      const T* __restrict__ v, T* __restrict__ o,
                                                      float* __restrict__ lse, const FgAttnParams& p) {
  typedef FgAttnTile<D> C;
  typedef FgTc<T> M;
  constexpr int MT = C::MT, BQ = C::FWD_BQ, DP = C::DP;
  constexpr int NT = BKV / 8, DT = D / 8, KC = D / 16, SZ = (int)sizeof(T);
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, t = lane & 3;
  const unsigned int bh = blockIdx.x, b = bh / p.H, h = bh - b * p.H;
  const int Tq = (int)p.Tq, Tk = (int)p.Tk;
  const int nqb = (Tq + BQ - 1) / BQ;
  const int i0 = (nqb - 1 - (int)blockIdx.y) * BQ;  // the longest (causal) blocks start first
  const T* qg = q + (long long)b * p.q.b + (long long)h * p.q.h;
  const T* kg = k + (long long)b * p.k.b + (long long)h * p.k.h;
  const T* vg = v + (long long)b * p.v.b + (long long)h * p.v.h;

  T* Qs = reinterpret_cast<T*>(fg_smem);
  const unsigned int qs = fg_smem_addr(Qs);
  const unsigned int ks = qs + BQ * DP * SZ;        // K stages: 2 x BKV x DP
  const unsigned int vs = ks + 2 * BKV * DP * SZ;   // V stages: 2 x BKV x DP

  const int kv_end = p.causal ? min(Tk, i0 + BQ) : Tk;
  const int nkv = (kv_end + BKV - 1) / BKV;

  fg_attn_load<T, BQ, D, DP>(qs, qg, p.q.t, i0, Tq);
  fg_attn_load<T, BKV, D, DP>(ks, kg, p.k.t, 0, Tk);
  fg_attn_load<T, BKV, D, DP>(vs, vg, p.v.t, 0, Tk);
  fg_cp_commit();

  // ldmatrix lane offsets in bytes: A x4 (16 rows x 16 cols), B x4 (two n8 tiles x k16),
  // transposed B x4 (k16 x two n8 tiles).
  const unsigned int a_off = ((lane & 15) * DP + (lane >> 4) * 8) * SZ;
  const unsigned int b_off = (((lane & 7) + ((lane >> 4) << 3)) * DP + ((lane >> 3) & 1) * 8) * SZ;
  const unsigned int bt_off = (((lane & 7) + (((lane >> 3) & 1) << 3)) * DP + (lane >> 4) * 8) * SZ;
  const int wrow = warp * 16 * MT;  // this warp's first row in the Q tile

  float acc[MT][DT][4];
  float mrow[MT][2], lrow[MT][2];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
    for (int dt = 0; dt < DT; ++dt)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[mt][dt][e] = 0.f;
    mrow[mt][0] = mrow[mt][1] = -FG_INF_F;
    lrow[mt][0] = lrow[mt][1] = 0.f;
  }
  const unsigned long long nb4 = ((unsigned long long)Tk + 3) / 4;

  for (int jb = 0; jb < nkv; ++jb) {
    const int stage = jb & 1;
    if (jb + 1 < nkv) {
      fg_attn_load<T, BKV, D, DP>(ks + (stage ^ 1) * BKV * DP * SZ, kg, p.k.t, (jb + 1) * BKV, Tk);
      fg_attn_load<T, BKV, D, DP>(vs + (stage ^ 1) * BKV * DP * SZ, vg, p.v.t, (jb + 1) * BKV, Tk);
    }
    fg_cp_commit();
    fg_cp_wait<1>();
    __syncthreads();
    const unsigned int kst = ks + stage * BKV * DP * SZ, vst = vs + stage * BKV * DP * SZ;

    // S = Q K^T
    float s[MT][NT][4];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int nt = 0; nt < NT; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) s[mt][nt][e] = 0.f;
#pragma unroll
    for (int kc = 0; kc < KC; ++kc) {
      unsigned int qa[MT][4];
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) fg_ldsm4(qa[mt], qs + ((wrow + mt * 16) * DP + kc * 16) * SZ + a_off);
#pragma unroll
      for (int np = 0; np < NT / 2; ++np) {
        unsigned int kb[4];
        fg_ldsm4(kb, kst + (np * 16 * DP + kc * 16) * SZ + b_off);
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
          M::mma(s[mt][2 * np], qa[mt], kb[0], kb[1]);
          M::mma(s[mt][2 * np + 1], qa[mt], kb[2], kb[3]);
        }
      }
    }

    // Scaled into the exp2 domain first (any sign of scale), then masked.
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int nt = 0; nt < NT; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) s[mt][nt][e] *= p.scale_log2;
    const int j0 = jb * BKV;
    if (j0 + BKV > Tk || (p.causal && j0 + BKV - 1 > i0)) {
#pragma unroll
      for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int nt = 0; nt < NT; ++nt)
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const int j = j0 + nt * 8 + 2 * t + (e & 1);
            const int i = i0 + wrow + mt * 16 + g + (e >> 1) * 8;
            if (j >= Tk || (p.causal && j > i)) s[mt][nt][e] = -FG_INF_F;
          }
    }

    // Online softmax: m = running row max of scale * log2(e) * S, l = this thread's share of the
    // row sum (the four threads of a row are summed at the end).
    float alpha[MT][2], mref[MT][2];
    bool grew = false;
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
      for (int hh = 0; hh < 2; ++hh) {
        float mx = -FG_INF_F;
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) mx = fmaxf(mx, fmaxf(s[mt][nt][2 * hh], s[mt][nt][2 * hh + 1]));
        mx = fmaxf(mx, __shfl_xor_sync(FG_FULL, mx, 1));
        mx = fmaxf(mx, __shfl_xor_sync(FG_FULL, mx, 2));
        const float mnew = fmaxf(mrow[mt][hh], mx);
        mref[mt][hh] = mnew == -FG_INF_F ? 0.f : mnew;
        alpha[mt][hh] = fg_exp2(mrow[mt][hh] - mref[mt][hh]);
        grew |= mnew != mrow[mt][hh];
        mrow[mt][hh] = mnew;
      }
    }
    // O is rescaled only when a row maximum of this warp grew (rarely, once past the first tiles).
    if (__any_sync(FG_FULL, grew)) {
#pragma unroll
      for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int dt = 0; dt < DT; ++dt)
#pragma unroll
          for (int e = 0; e < 4; ++e) acc[mt][dt][e] *= alpha[mt][e >> 1];
    }
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
      for (int hh = 0; hh < 2; ++hh) {
        float ls = 0.f;
#pragma unroll
        for (int nt = 0; nt < NT; ++nt)
#pragma unroll
          for (int e = 2 * hh; e < 2 * hh + 2; ++e) {
            const float pv = fg_exp2(s[mt][nt][e] - mref[mt][hh]);
            s[mt][nt][e] = pv;
            ls += pv;
          }
        lrow[mt][hh] = lrow[mt][hh] * alpha[mt][hh] + ls;
      }
    }

    // Dropout: the row sum above is the softmax's; only P V sees the mask (the 1 / (1 - p) is
    // applied with the normalisation). Threads t and t ^ 1 hold the two halves of one Philox
    // block per row: the even one draws row g's block, the odd one row g + 8's, and they trade
    // the words the other needs.
    if (p.drop_thr) {
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
        const int ig = i0 + wrow + mt * 16 + g;
        const unsigned long long rowbase =
            p.rng_offset + ((unsigned long long)bh * Tq + (unsigned long long)((t & 1) ? ig + 8 : ig)) * nb4;
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) {
          const FgAttnU4 r = fg_attn_philox(p.seed, rowbase + (unsigned long long)((j0 + nt * 8) / 4 + (t >> 1)));
          const unsigned int s0 = (t & 1) ? r.x[0] : r.x[2], s1 = (t & 1) ? r.x[1] : r.x[3];
          const unsigned int r0 = __shfl_xor_sync(FG_FULL, s0, 1), r1 = __shfl_xor_sync(FG_FULL, s1, 1);
          const unsigned int w0 = (t & 1) ? r0 : r.x[0], w1 = (t & 1) ? r1 : r.x[1];
          const unsigned int w2 = (t & 1) ? r.x[2] : r0, w3 = (t & 1) ? r.x[3] : r1;
          if ((w0 >> 8) < p.drop_thr) s[mt][nt][0] = 0.f;
          if ((w1 >> 8) < p.drop_thr) s[mt][nt][1] = 0.f;
          if ((w2 >> 8) < p.drop_thr) s[mt][nt][2] = 0.f;
          if ((w3 >> 8) < p.drop_thr) s[mt][nt][3] = 0.f;
        }
      }
    }

    // O += P V: the S accumulators of n-tiles 2c and 2c + 1 are the A fragment of k-chunk c.
#pragma unroll
    for (int kc = 0; kc < BKV / 16; ++kc) {
      unsigned int pa[MT][4];
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
        pa[mt][0] = M::pack(s[mt][2 * kc][0], s[mt][2 * kc][1]);
        pa[mt][1] = M::pack(s[mt][2 * kc][2], s[mt][2 * kc][3]);
        pa[mt][2] = M::pack(s[mt][2 * kc + 1][0], s[mt][2 * kc + 1][1]);
        pa[mt][3] = M::pack(s[mt][2 * kc + 1][2], s[mt][2 * kc + 1][3]);
      }
#pragma unroll
      for (int dp = 0; dp < DT / 2; ++dp) {
        unsigned int vb[4];
        fg_ldsm4t(vb, vst + (kc * 16 * DP + dp * 16) * SZ + bt_off);
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
          M::mma(acc[mt][2 * dp], pa[mt], vb[0], vb[1]);
          M::mma(acc[mt][2 * dp + 1], pa[mt], vb[2], vb[3]);
        }
      }
    }
    __syncthreads();
  }
  fg_cp_wait<0>();

  // Normalise, write the log-sum-exp, stage O in this warp's own Q rows (no other warp reads
  // them) and store it with 16-byte writes.
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
      float l = lrow[mt][hh];
      l += __shfl_xor_sync(FG_FULL, l, 1);
      l += __shfl_xor_sync(FG_FULL, l, 2);
      const float inv = p.rp_keep / l;
      const int row = wrow + mt * 16 + g + hh * 8;
#pragma unroll
      for (int dt = 0; dt < DT; ++dt)
        *reinterpret_cast<unsigned int*>(Qs + row * DP + dt * 8 + 2 * t) =
            M::pack(acc[mt][dt][2 * hh] * inv, acc[mt][dt][2 * hh + 1] * inv);
      if (t == 0 && i0 + row < Tq) lse[(unsigned long long)bh * Tq + i0 + row] = (mrow[mt][hh] + log2f(l)) * FG_ATTN_LN2;
    }
  }
  __syncwarp();
  T* og = o + (long long)b * p.o.b + (long long)h * p.o.h;
  fg_attn_store_warp<T, 16 * MT, D, DP>(og, p.o.t, Qs + wrow * DP, i0 + wrow, Tq);
}

// ---------------------------------------------------------------------------------------------
// Backward, tensor cores
// ---------------------------------------------------------------------------------------------

template <typename T, int D, int BQ>
static __device__ __forceinline__ void fg_attn_bwd_tc(const T* __restrict__ q, const T* __restrict__ k,
                                                      const T* __restrict__ v, const T* __restrict__ dout,
                                                      const float* __restrict__ lse,
                                                      const float* __restrict__ delta, float* __restrict__ dq_acc,
                                                      T* __restrict__ dk, T* __restrict__ dv,
                                                      const FgAttnParams& p) {
  typedef FgAttnTile<D> C;
  typedef FgTc<T> M;
  constexpr int BKV = C::BWD_BKV, DP = C::DP, SP = BQ + 8, SZ = (int)sizeof(T);
  constexpr int NQ = BQ / 8, DT = D / 8, KC = D / 16, QC = BQ / 16;
  // dQ = dS K: warp w takes query m-tile w % QC and n-tiles [w / QC * DTW, ...) of the head dim.
  constexpr int WN = FG_ATTN_WARPS / QC, DTW = DT / WN;
  static_assert(FG_ATTN_WARPS % QC == 0 && DT % WN == 0 && DTW % 2 == 0, "dQ warp split");
  static_assert(2 * BQ >= BKV, "the epilogue stages dK / dV in the Q / dO buffers");
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, t = lane & 3;
  const unsigned int bh = blockIdx.x, b = bh / p.H, h = bh - b * p.H;
  const int Tq = (int)p.Tq, Tk = (int)p.Tk;
  const int j0 = (int)blockIdx.y * BKV;
  const T* qg = q + (long long)b * p.q.b + (long long)h * p.q.h;
  const T* kg = k + (long long)b * p.k.b + (long long)h * p.k.h;
  const T* vg = v + (long long)b * p.v.b + (long long)h * p.v.h;
  const T* og = dout + (long long)b * p.dout.b + (long long)h * p.dout.h;
  const float* lseg = lse + (unsigned long long)bh * Tq;
  const float* dlg = delta + (unsigned long long)bh * Tq;

  T* Ks = reinterpret_cast<T*>(fg_smem);
  T* Qs = Ks + 2 * BKV * DP;   // [2][BQ][DP], after K and V
  T* Os = Qs + 2 * BQ * DP;    // dO: [2][BQ][DP]
  T* St = Os + 2 * BQ * DP;    // dS^T: [BKV][SP]
  float* lse2s = reinterpret_cast<float*>(St + BKV * SP);  // [2][BQ]: log2(e) * lse, +inf past Tq
  float* dls = lse2s + 2 * BQ;                             // [2][BQ]: delta
  const unsigned int ks = fg_smem_addr(Ks), vs = ks + BKV * DP * SZ, qs = fg_smem_addr(Qs), os = fg_smem_addr(Os),
                     sts = fg_smem_addr(St);

  const int nqb = (Tq + BQ - 1) / BQ;
  const int ib0 = p.causal ? j0 / BQ : 0;  // query blocks before this one see none of these keys
  const int nit = nqb > ib0 ? nqb - ib0 : 0;

  auto load_q = [&](int it, int stage) {
    const int i0 = (ib0 + it) * BQ;
    fg_attn_load<T, BQ, D, DP>(qs + stage * BQ * DP * SZ, qg, p.q.t, i0, Tq);
    fg_attn_load<T, BQ, D, DP>(os + stage * BQ * DP * SZ, og, p.dout.t, i0, Tq);
    for (int r = tid; r < BQ; r += FG_ATTN_THREADS) {
      const int i = i0 + r;
      lse2s[stage * BQ + r] = i < Tq ? lseg[i] * FG_ATTN_LOG2E : FG_INF_F;
      dls[stage * BQ + r] = i < Tq ? dlg[i] : 0.f;
    }
  };

  fg_attn_load<T, BKV, D, DP>(ks, kg, p.k.t, j0, Tk);
  fg_attn_load<T, BKV, D, DP>(vs, vg, p.v.t, j0, Tk);
  if (nit > 0) load_q(0, 0);
  fg_cp_commit();

  const unsigned int a_off = ((lane & 15) * DP + (lane >> 4) * 8) * SZ;
  const unsigned int b_off = (((lane & 7) + ((lane >> 4) << 3)) * DP + ((lane >> 3) & 1) * 8) * SZ;
  const unsigned int bt_off = (((lane & 7) + (((lane >> 3) & 1) << 3)) * DP + (lane >> 4) * 8) * SZ;
  // A operand from dS^T stored [kv][q] (transposed ldmatrix): matrices (kv 0-7, q 0-7),
  // (kv 0-7, q 8-15), (kv 8-15, q 0-7), (kv 8-15, q 8-15).
  const unsigned int at_off = (((lane & 7) + ((lane >> 4) << 3)) * SP + ((lane >> 3) & 1) * 8) * SZ;

  float dka[DT][4], dva[DT][4];
#pragma unroll
  for (int dt = 0; dt < DT; ++dt)
#pragma unroll
    for (int e = 0; e < 4; ++e) dka[dt][e] = dva[dt][e] = 0.f;
  const int wkv = warp * 16;  // this warp's first key row in the block
  const unsigned long long nb4 = ((unsigned long long)Tk + 3) / 4;

  for (int it = 0; it < nit; ++it) {
    const int stage = it & 1;
    const int i0 = (ib0 + it) * BQ;
    if (it + 1 < nit) load_q(it + 1, stage ^ 1);
    fg_cp_commit();
    fg_cp_wait<1>();
    __syncthreads();
    const unsigned int qst = qs + stage * BQ * DP * SZ, ost = os + stage * BQ * DP * SZ;
    const float* l2 = lse2s + stage * BQ;
    const float* dl = dls + stage * BQ;

    // S^T = K Q^T and dP^T = V dO^T for this warp's 16 keys x BQ queries.
    float sa[NQ][4], dpa[NQ][4];
#pragma unroll
    for (int nt = 0; nt < NQ; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) sa[nt][e] = dpa[nt][e] = 0.f;
#pragma unroll
    for (int kc = 0; kc < KC; ++kc) {
      unsigned int ka[4], va[4];
      fg_ldsm4(ka, ks + (wkv * DP + kc * 16) * SZ + a_off);
      fg_ldsm4(va, vs + (wkv * DP + kc * 16) * SZ + a_off);
#pragma unroll
      for (int np = 0; np < NQ / 2; ++np) {
        unsigned int qb[4], ob[4];
        fg_ldsm4(qb, qst + (np * 16 * DP + kc * 16) * SZ + b_off);
        M::mma(sa[2 * np], ka, qb[0], qb[1]);
        M::mma(sa[2 * np + 1], ka, qb[2], qb[3]);
        fg_ldsm4(ob, ost + (np * 16 * DP + kc * 16) * SZ + b_off);
        M::mma(dpa[2 * np], va, ob[0], ob[1]);
        M::mma(dpa[2 * np + 1], va, ob[2], ob[3]);
      }
    }

    // P^T = exp(S^T - lse), dS^T = P^T (dP^T - delta); with dropout dP sees the mask and dV the
    // dropped P. Element e of n-tile nt: key wkv + g + 8 (e >> 1), query nt * 8 + 2 t + (e & 1).
    const bool need_mask = j0 + BKV > Tk || (p.causal && j0 + BKV - 1 > i0);
    const int slot = g & 3;  // key % 4: the Philox word of every element this thread holds
#pragma unroll
    for (int nt = 0; nt < NQ; ++nt) {
      unsigned int w[4] = {0u, 0u, 0u, 0u};
      if (p.drop_thr) {
        // The four blocks (query 2t or 2t+1) x (keys g or g + 8) are shared by the four threads
        // of this t whose g agree but for the low two bits: each draws one and they trade words.
        const int qi = i0 + nt * 8 + 2 * t + (slot & 1);
        const unsigned long long kvb = (unsigned long long)((j0 + wkv) / 4 + (g >> 2) + (slot >> 1) * 2);
        const FgAttnU4 mine =
            fg_attn_philox(p.seed, p.rng_offset + ((unsigned long long)bh * Tq + (unsigned long long)qi) * nb4 + kvb);
#pragma unroll
        for (int s = 0; s < 4; ++s) {
          const unsigned int send = fg_attn_word(mine, slot ^ s);
          const unsigned int got = s == 0 ? send : __shfl_xor_sync(FG_FULL, send, s << 2);
          const int blk = slot ^ s;  // the block the word came from is element `blk`'s
          w[0] = blk == 0 ? got : w[0];
          w[1] = blk == 1 ? got : w[1];
          w[2] = blk == 2 ? got : w[2];
          w[3] = blk == 3 ? got : w[3];
        }
      }
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int ql = nt * 8 + 2 * t + (e & 1);
        const int kv = j0 + wkv + g + (e >> 1) * 8;
        float pv = fg_exp2(fmaf(sa[nt][e], p.scale_log2, -l2[ql]));
        if (need_mask && (kv >= Tk || (p.causal && kv > i0 + ql))) pv = 0.f;
        float dpv = dpa[nt][e], pk = pv;
        if (p.drop_thr) {
          const bool keep = (w[e] >> 8) >= p.drop_thr;
          dpv = keep ? dpv * p.rp_keep : 0.f;
          pk = keep ? pv * p.rp_keep : 0.f;
        }
        dpa[nt][e] = pv * (dpv - dl[ql]);
        sa[nt][e] = pk;
      }
    }

    // dV += P^T dO and dK += dS^T Q (the softmax scale is applied to dK at the end).
#pragma unroll
    for (int qc = 0; qc < QC; ++qc) {
      unsigned int pa[4], da[4];
      pa[0] = M::pack(sa[2 * qc][0], sa[2 * qc][1]);
      pa[1] = M::pack(sa[2 * qc][2], sa[2 * qc][3]);
      pa[2] = M::pack(sa[2 * qc + 1][0], sa[2 * qc + 1][1]);
      pa[3] = M::pack(sa[2 * qc + 1][2], sa[2 * qc + 1][3]);
      da[0] = M::pack(dpa[2 * qc][0], dpa[2 * qc][1]);
      da[1] = M::pack(dpa[2 * qc][2], dpa[2 * qc][3]);
      da[2] = M::pack(dpa[2 * qc + 1][0], dpa[2 * qc + 1][1]);
      da[3] = M::pack(dpa[2 * qc + 1][2], dpa[2 * qc + 1][3]);
#pragma unroll
      for (int dp = 0; dp < DT / 2; ++dp) {
        unsigned int ob[4], qb[4];
        fg_ldsm4t(ob, ost + (qc * 16 * DP + dp * 16) * SZ + bt_off);
        M::mma(dva[2 * dp], pa, ob[0], ob[1]);
        M::mma(dva[2 * dp + 1], pa, ob[2], ob[3]);
        fg_ldsm4t(qb, qst + (qc * 16 * DP + dp * 16) * SZ + bt_off);
        M::mma(dka[2 * dp], da, qb[0], qb[1]);
        M::mma(dka[2 * dp + 1], da, qb[2], qb[3]);
      }
    }

    // dS^T to shared memory for dQ = dS K, which contracts over all keys of the block.
#pragma unroll
    for (int nt = 0; nt < NQ; ++nt) {
      const int col = nt * 8 + 2 * t;
      *reinterpret_cast<unsigned int*>(St + (wkv + g) * SP + col) = M::pack(dpa[nt][0], dpa[nt][1]);
      *reinterpret_cast<unsigned int*>(St + (wkv + g + 8) * SP + col) = M::pack(dpa[nt][2], dpa[nt][3]);
    }
    __syncthreads();

    {
      const int mw = warp % QC, dpart = warp / QC;
      float dqa[DTW][4];
#pragma unroll
      for (int dt = 0; dt < DTW; ++dt)
#pragma unroll
        for (int e = 0; e < 4; ++e) dqa[dt][e] = 0.f;
#pragma unroll
      for (int kc = 0; kc < BKV / 16; ++kc) {
        unsigned int da[4];
        fg_ldsm4t(da, sts + (kc * 16 * SP + mw * 16) * SZ + at_off);
#pragma unroll
        for (int dp = 0; dp < DTW / 2; ++dp) {
          unsigned int kb[4];
          fg_ldsm4t(kb, ks + (kc * 16 * DP + (dpart * DTW + dp * 2) * 8) * SZ + bt_off);
          M::mma(dqa[2 * dp], da, kb[0], kb[1]);
          M::mma(dqa[2 * dp + 1], da, kb[2], kb[3]);
        }
      }
#pragma unroll
      for (int hh = 0; hh < 2; ++hh) {
        const int row = i0 + mw * 16 + g + hh * 8;
        if (row < Tq) {
          float* dst = dq_acc + ((unsigned long long)bh * Tq + row) * D + dpart * DTW * 8 + 2 * t;
#pragma unroll
          for (int dt = 0; dt < DTW; ++dt) {
#if __CUDA_ARCH__ >= 900
            atomicAdd(reinterpret_cast<float2*>(dst + dt * 8),
                      make_float2(p.scale * dqa[dt][2 * hh], p.scale * dqa[dt][2 * hh + 1]));
#else
            atomicAdd(dst + dt * 8, p.scale * dqa[dt][2 * hh]);
            atomicAdd(dst + dt * 8 + 1, p.scale * dqa[dt][2 * hh + 1]);
#endif
          }
        }
      }
    }
    // The next iteration's loads go to the other stage; its dS^T writes come after its first
    // barrier, which every warp reaches only once done with this iteration's reads.
  }
  fg_cp_wait<0>();
  __syncthreads();  // every warp is past its last read of the Q / dO buffers reused below

  // dK (times the scale) and dV through this warp's slices of the Q and dO buffers.
  T* stk = Qs + wkv * DP;
  T* stv = Os + wkv * DP;
#pragma unroll
  for (int dt = 0; dt < DT; ++dt) {
    const int col = dt * 8 + 2 * t;
    *reinterpret_cast<unsigned int*>(stk + g * DP + col) = M::pack(p.scale * dka[dt][0], p.scale * dka[dt][1]);
    *reinterpret_cast<unsigned int*>(stk + (g + 8) * DP + col) = M::pack(p.scale * dka[dt][2], p.scale * dka[dt][3]);
    *reinterpret_cast<unsigned int*>(stv + g * DP + col) = M::pack(dva[dt][0], dva[dt][1]);
    *reinterpret_cast<unsigned int*>(stv + (g + 8) * DP + col) = M::pack(dva[dt][2], dva[dt][3]);
  }
  __syncwarp();
  fg_attn_store_warp<T, 16, D, DP>(dk + (long long)b * p.dk.b + (long long)h * p.dk.h, p.dk.t, stk, j0 + wkv, Tk);
  fg_attn_store_warp<T, 16, D, DP>(dv + (long long)b * p.dv.b + (long long)h * p.dv.h, p.dv.t, stv, j0 + wkv, Tk);
}

// ---------------------------------------------------------------------------------------------
// Backward helpers, every dtype: delta = rowsum(dO * O) (and dq_acc zeroed), dq_acc -> dq
// ---------------------------------------------------------------------------------------------

template <typename T, int D>
static __device__ __forceinline__ void fg_attn_bwd_pre(const T* __restrict__ o, const T* __restrict__ dout,
                                                       float* __restrict__ delta, float* __restrict__ dq_acc,
                                                       const FgAttnParams& p) {
  const unsigned int lane = threadIdx.x & 31, wpb = blockDim.x >> 5;
  const unsigned long long rows = (unsigned long long)p.B * p.H * p.Tq;
  for (unsigned long long r = (unsigned long long)blockIdx.x * wpb + (threadIdx.x >> 5); r < rows;
       r += (unsigned long long)gridDim.x * wpb) {
    const unsigned long long bh = r / p.Tq, i = r - bh * p.Tq;
    const unsigned long long b = bh / p.H, h = bh - b * p.H;
    const T* orow = o + b * p.o.b + h * p.o.h + i * p.o.t;
    const T* drow = dout + b * p.dout.b + h * p.dout.h + i * p.dout.t;
    float s = 0.f;
    for (int d = lane; d < D; d += 32) s += fg_to_acc(orow[d * p.o.d]) * fg_to_acc(drow[d * p.dout.d]);
    s = fg_warp_reduce(s, FgSum());
    if (lane == 0) delta[r] = s;
    float* qa = dq_acc + r * D;
    for (int d = lane; d < D; d += 32) qa[d] = 0.f;
  }
}

template <typename T, int D>
static __device__ __forceinline__ void fg_attn_dq(const float* __restrict__ dq_acc, T* __restrict__ dq,
                                                  const FgAttnParams& p) {
  const unsigned long long n = (unsigned long long)p.B * p.H * p.Tq * D;
  FG_GRID_STRIDE(e, n) {
    const unsigned long long r = e / D, d = e - r * D;
    const unsigned long long bh = r / p.Tq, i = r - bh * p.Tq;
    const unsigned long long b = bh / p.H, h = bh - b * p.H;
    dq[b * p.dq.b + h * p.dq.h + i * p.dq.t + d * p.dq.d] = fg_from_acc<T>(dq_acc[e]);
  }
}

// ---------------------------------------------------------------------------------------------
// f32: SIMT kernels (exact f32 FMAs, any strides). Forward: 256 threads, 64 query rows a block,
// 32 keys a step; thread (ty, tx) = (tid / 16, tid % 16) holds S rows 4 ty .. 4 ty + 3, columns
// 2 tx, 2 tx + 1 and O rows 4 ty .., columns tx + 16 c. Backward: 128 threads, 32 keys a block,
// 32 queries a step, the same thread grid over (keys, queries) for S^T and (rows, head dim) for
// dK, dV and dQ.
// ---------------------------------------------------------------------------------------------

#define FG_SIMT_FWD_BQ 64
#define FG_SIMT_FWD_BK 32
#define FG_SIMT_BWD_B 32

template <int D>
static __device__ __forceinline__ void fg_attn_fwd_simt(const float* __restrict__ q, const float* __restrict__ k,
                                                        const float* __restrict__ v, float* __restrict__ o,
                                                        float* __restrict__ lse, const FgAttnParams& p) {
  constexpr int BQ = FG_SIMT_FWD_BQ, BK = FG_SIMT_FWD_BK, DS = D + 1, PS = BK + 1, NC = D / 16;
  const int tid = threadIdx.x, ty = tid >> 4, tx = tid & 15;
  const unsigned int bh = blockIdx.x, b = bh / p.H, h = bh - b * p.H;
  const int Tq = (int)p.Tq, Tk = (int)p.Tk;
  const int nqb = (Tq + BQ - 1) / BQ;
  const int i0 = (nqb - 1 - (int)blockIdx.y) * BQ;
  const float* qg = q + (long long)b * p.q.b + (long long)h * p.q.h;
  const float* kg = k + (long long)b * p.k.b + (long long)h * p.k.h;
  const float* vg = v + (long long)b * p.v.b + (long long)h * p.v.h;
  float* Qs = reinterpret_cast<float*>(fg_smem);
  float* Ks = Qs + BQ * DS;
  float* Vs = Ks + BK * DS;
  float* Ps = Vs + BK * DS;
  for (int e = tid; e < BQ * D; e += 256) {
    const int r = e / D, d = e - r * D, i = i0 + r;
    Qs[r * DS + d] = i < Tq ? qg[(long long)i * p.q.t + (long long)d * p.q.d] : 0.f;
  }
  float acc[4][NC], m[4], l[4];
#pragma unroll
  for (int r = 0; r < 4; ++r) {
    m[r] = -FG_INF_F;
    l[r] = 0.f;
#pragma unroll
    for (int c = 0; c < NC; ++c) acc[r][c] = 0.f;
  }
  const int kv_end = p.causal ? min(Tk, i0 + BQ) : Tk;
  const int nkv = (kv_end + BK - 1) / BK;
  const unsigned long long nb4 = ((unsigned long long)Tk + 3) / 4;
  for (int jb = 0; jb < nkv; ++jb) {
    const int j0 = jb * BK;
    __syncthreads();
    for (int e = tid; e < BK * D; e += 256) {
      const int r = e / D, d = e - r * D, j = j0 + r;
      const bool ok = j < Tk;
      Ks[r * DS + d] = ok ? kg[(long long)j * p.k.t + (long long)d * p.k.d] : 0.f;
      Vs[r * DS + d] = ok ? vg[(long long)j * p.v.t + (long long)d * p.v.d] : 0.f;
    }
    __syncthreads();
    float s[4][2];
#pragma unroll
    for (int r = 0; r < 4; ++r) s[r][0] = s[r][1] = 0.f;
#pragma unroll 4
    for (int d = 0; d < D; ++d) {
      const float k0 = Ks[(2 * tx) * DS + d], k1 = Ks[(2 * tx + 1) * DS + d];
#pragma unroll
      for (int r = 0; r < 4; ++r) {
        const float qv = Qs[(4 * ty + r) * DS + d];
        s[r][0] = fmaf(qv, k0, s[r][0]);
        s[r][1] = fmaf(qv, k1, s[r][1]);
      }
    }
#pragma unroll
    for (int r = 0; r < 4; ++r) {
      const int i = i0 + 4 * ty + r;
#pragma unroll
      for (int c = 0; c < 2; ++c) {
        const int j = j0 + 2 * tx + c;
        s[r][c] = (j >= Tk || (p.causal && j > i)) ? -FG_INF_F : s[r][c] * p.scale_log2;
      }
      float mx = fmaxf(s[r][0], s[r][1]);
#pragma unroll
      for (int o2 = 1; o2 < 16; o2 <<= 1) mx = fmaxf(mx, __shfl_xor_sync(FG_FULL, mx, o2));
      const float mnew = fmaxf(m[r], mx);
      const float mref = mnew == -FG_INF_F ? 0.f : mnew;
      const float alpha = exp2f(m[r] - mref);
      m[r] = mnew;
      const float p0 = exp2f(s[r][0] - mref), p1 = exp2f(s[r][1] - mref);
      l[r] = l[r] * alpha + p0 + p1;
#pragma unroll
      for (int c = 0; c < NC; ++c) acc[r][c] *= alpha;
      float k0 = p0, k1 = p1;
      if (p.drop_thr) {
        const FgAttnU4 w = fg_attn_philox(
            p.seed, p.rng_offset + ((unsigned long long)bh * Tq + (unsigned long long)i) * nb4 +
                        (unsigned long long)((j0 + 2 * tx) / 4));
        const int lo = (2 * tx) & 3;
        if ((fg_attn_word(w, lo) >> 8) < p.drop_thr) k0 = 0.f;
        if ((fg_attn_word(w, lo + 1) >> 8) < p.drop_thr) k1 = 0.f;
      }
      Ps[(4 * ty + r) * PS + 2 * tx] = k0;
      Ps[(4 * ty + r) * PS + 2 * tx + 1] = k1;
    }
    __syncthreads();
#pragma unroll 4
    for (int kk = 0; kk < BK; ++kk) {
      float pv[4];
#pragma unroll
      for (int r = 0; r < 4; ++r) pv[r] = Ps[(4 * ty + r) * PS + kk];
#pragma unroll
      for (int c = 0; c < NC; ++c) {
        const float vv = Vs[kk * DS + tx + 16 * c];
#pragma unroll
        for (int r = 0; r < 4; ++r) acc[r][c] = fmaf(pv[r], vv, acc[r][c]);
      }
    }
  }
  float* ob = o + (long long)b * p.o.b + (long long)h * p.o.h;
#pragma unroll
  for (int r = 0; r < 4; ++r) {
    float lr = l[r];
#pragma unroll
    for (int o2 = 1; o2 < 16; o2 <<= 1) lr += __shfl_xor_sync(FG_FULL, lr, o2);
    const int i = i0 + 4 * ty + r;
    if (i < Tq) {
      const float inv = p.rp_keep / lr;
#pragma unroll
      for (int c = 0; c < NC; ++c) ob[(long long)i * p.o.t + (long long)(tx + 16 * c) * p.o.d] = acc[r][c] * inv;
      if (tx == 0) lse[(unsigned long long)bh * Tq + i] = (m[r] + log2f(lr)) * FG_ATTN_LN2;
    }
  }
}

template <int D>
static __device__ __forceinline__ void fg_attn_bwd_simt(const float* __restrict__ q, const float* __restrict__ k,
                                                        const float* __restrict__ v,
                                                        const float* __restrict__ dout,
                                                        const float* __restrict__ lse,
                                                        const float* __restrict__ delta, float* __restrict__ dq_acc,
                                                        float* __restrict__ dk, float* __restrict__ dv,
                                                        const FgAttnParams& p) {
  constexpr int B = FG_SIMT_BWD_B, DS = D + 1, PS = B + 1, NC = D / 16;
  const int tid = threadIdx.x, ty = tid >> 4, tx = tid & 15;
  const unsigned int bh = blockIdx.x, b = bh / p.H, h = bh - b * p.H;
  const int Tq = (int)p.Tq, Tk = (int)p.Tk;
  const int j0 = (int)blockIdx.y * B;
  const float* qg = q + (long long)b * p.q.b + (long long)h * p.q.h;
  const float* kg = k + (long long)b * p.k.b + (long long)h * p.k.h;
  const float* vg = v + (long long)b * p.v.b + (long long)h * p.v.h;
  const float* og = dout + (long long)b * p.dout.b + (long long)h * p.dout.h;
  float* Ks = reinterpret_cast<float*>(fg_smem);
  float* Vs = Ks + B * DS;
  float* Qs = Vs + B * DS;
  float* Os = Qs + B * DS;
  float* Pt = Os + B * DS;
  float* St = Pt + B * PS;
  float* l2 = St + B * PS;
  float* dl = l2 + B;
  for (int e = tid; e < B * D; e += 128) {
    const int r = e / D, d = e - r * D, j = j0 + r;
    const bool ok = j < Tk;
    Ks[r * DS + d] = ok ? kg[(long long)j * p.k.t + (long long)d * p.k.d] : 0.f;
    Vs[r * DS + d] = ok ? vg[(long long)j * p.v.t + (long long)d * p.v.d] : 0.f;
  }
  float dka[4][NC], dva[4][NC];
#pragma unroll
  for (int r = 0; r < 4; ++r)
#pragma unroll
    for (int c = 0; c < NC; ++c) dka[r][c] = dva[r][c] = 0.f;
  const int nqb = (Tq + B - 1) / B;
  const unsigned long long nb4 = ((unsigned long long)Tk + 3) / 4;
  for (int ib = p.causal ? j0 / B : 0; ib < nqb; ++ib) {
    const int i0 = ib * B;
    __syncthreads();
    for (int e = tid; e < B * D; e += 128) {
      const int r = e / D, d = e - r * D, i = i0 + r;
      const bool ok = i < Tq;
      Qs[r * DS + d] = ok ? qg[(long long)i * p.q.t + (long long)d * p.q.d] : 0.f;
      Os[r * DS + d] = ok ? og[(long long)i * p.dout.t + (long long)d * p.dout.d] : 0.f;
    }
    for (int r = tid; r < B; r += 128) {
      const int i = i0 + r;
      l2[r] = i < Tq ? lse[(unsigned long long)bh * Tq + i] * FG_ATTN_LOG2E : FG_INF_F;
      dl[r] = i < Tq ? delta[(unsigned long long)bh * Tq + i] : 0.f;
    }
    __syncthreads();
    // S^T and dP^T: keys 4 ty + r, queries 2 tx + c.
    float s[4][2], dpv[4][2];
#pragma unroll
    for (int r = 0; r < 4; ++r) s[r][0] = s[r][1] = dpv[r][0] = dpv[r][1] = 0.f;
#pragma unroll 4
    for (int d = 0; d < D; ++d) {
      const float q0 = Qs[(2 * tx) * DS + d], q1 = Qs[(2 * tx + 1) * DS + d];
      const float o0 = Os[(2 * tx) * DS + d], o1 = Os[(2 * tx + 1) * DS + d];
#pragma unroll
      for (int r = 0; r < 4; ++r) {
        const float kv = Ks[(4 * ty + r) * DS + d], vv = Vs[(4 * ty + r) * DS + d];
        s[r][0] = fmaf(kv, q0, s[r][0]);
        s[r][1] = fmaf(kv, q1, s[r][1]);
        dpv[r][0] = fmaf(vv, o0, dpv[r][0]);
        dpv[r][1] = fmaf(vv, o1, dpv[r][1]);
      }
    }
#pragma unroll
    for (int c = 0; c < 2; ++c) {
      const int ql = 2 * tx + c, i = i0 + ql;
      FgAttnU4 w = {{0u, 0u, 0u, 0u}};
      if (p.drop_thr)
        w = fg_attn_philox(p.seed, p.rng_offset + ((unsigned long long)bh * Tq + (unsigned long long)i) * nb4 +
                                       (unsigned long long)((j0 + 4 * ty) / 4));
#pragma unroll
      for (int r = 0; r < 4; ++r) {
        const int j = j0 + 4 * ty + r;
        float pv = exp2f(fmaf(s[r][c], p.scale_log2, -l2[ql]));
        if (j >= Tk || (p.causal && j > i)) pv = 0.f;
        float dp = dpv[r][c], pk = pv;
        if (p.drop_thr) {
          const bool keep = (w.x[r] >> 8) >= p.drop_thr;
          dp = keep ? dp * p.rp_keep : 0.f;
          pk = keep ? pv * p.rp_keep : 0.f;
        }
        Pt[(4 * ty + r) * PS + ql] = pk;
        St[(4 * ty + r) * PS + ql] = pv * (dp - dl[ql]);
      }
    }
    __syncthreads();
    float dqa[4][NC];
#pragma unroll
    for (int r = 0; r < 4; ++r)
#pragma unroll
      for (int c = 0; c < NC; ++c) dqa[r][c] = 0.f;
#pragma unroll 4
    for (int x = 0; x < B; ++x) {
      float pr[4], sr[4], sc[4];
#pragma unroll
      for (int r = 0; r < 4; ++r) {
        pr[r] = Pt[(4 * ty + r) * PS + x];  // key row 4 ty + r, query x
        sr[r] = St[(4 * ty + r) * PS + x];
        sc[r] = St[x * PS + 4 * ty + r];     // key x, query row 4 ty + r
      }
#pragma unroll
      for (int c = 0; c < NC; ++c) {
        const float ov = Os[x * DS + tx + 16 * c], qv = Qs[x * DS + tx + 16 * c], kv = Ks[x * DS + tx + 16 * c];
#pragma unroll
        for (int r = 0; r < 4; ++r) {
          dva[r][c] = fmaf(pr[r], ov, dva[r][c]);
          dka[r][c] = fmaf(sr[r], qv, dka[r][c]);
          dqa[r][c] = fmaf(sc[r], kv, dqa[r][c]);
        }
      }
    }
#pragma unroll
    for (int r = 0; r < 4; ++r) {
      const int i = i0 + 4 * ty + r;
      if (i < Tq) {
        float* dst = dq_acc + ((unsigned long long)bh * Tq + i) * D + tx;
#pragma unroll
        for (int c = 0; c < NC; ++c) atomicAdd(dst + 16 * c, p.scale * dqa[r][c]);
      }
    }
  }
  float* dkb = dk + (long long)b * p.dk.b + (long long)h * p.dk.h;
  float* dvb = dv + (long long)b * p.dv.b + (long long)h * p.dv.h;
#pragma unroll
  for (int r = 0; r < 4; ++r) {
    const int j = j0 + 4 * ty + r;
    if (j < Tk) {
#pragma unroll
      for (int c = 0; c < NC; ++c) {
        dkb[(long long)j * p.dk.t + (long long)(tx + 16 * c) * p.dk.d] = p.scale * dka[r][c];
        dvb[(long long)j * p.dv.t + (long long)(tx + 16 * c) * p.dv.d] = dva[r][c];
      }
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Entry points
// ---------------------------------------------------------------------------------------------

#define FG_ATTN_NAME2(stem, d, suf) stem##d##_##suf
#define FG_ATTN_NAME(stem, d, suf) FG_ATTN_NAME2(stem, d, suf)
#define FG_ATTN_TNAME2(stem, d, tile, suf) stem##d##_##tile##_##suf
#define FG_ATTN_TNAME(stem, d, tile, suf) FG_ATTN_TNAME2(stem, d, tile, suf)

// Tensor-core kernels per tile: fg_attn_fwd_d{D}_k{BKV}_{bf16,f16}, fg_attn_bwd_d{D}_q{BQ}_{..}.
#define FG_ATTN_FWD(SUF, T, BKV)                                                                          \
  extern "C" __global__ void __launch_bounds__(FG_ATTN_THREADS)                                            \
      FG_ATTN_TNAME(fg_attn_fwd_d, FG_ATTN_D, k##BKV, SUF)(const T* q, const T* k, const T* v, T* o,       \
                                                          float* lse, FgAttnParams p) {                    \
    fg_attn_fwd_tc<T, FG_ATTN_D, BKV>(q, k, v, o, lse, p);                                                 \
  }
#define FG_ATTN_BWD(SUF, T, BQ)                                                                           \
  extern "C" __global__ void __launch_bounds__(FG_ATTN_THREADS)                                            \
      FG_ATTN_TNAME(fg_attn_bwd_d, FG_ATTN_D, q##BQ, SUF)(const T* q, const T* k, const T* v,               \
                                                         const T* dout, const float* lse,                  \
                                                         const float* delta, float* dq_acc, T* dk, T* dv,  \
                                                         FgAttnParams p) {                                 \
    fg_attn_bwd_tc<T, FG_ATTN_D, BQ>(q, k, v, dout, lse, delta, dq_acc, dk, dv, p);                        \
  }
#define FG_ATTN_TILES(SUF, T) FG_ATTN_FWD_TILES(FG_ATTN_FWD, SUF, T) FG_ATTN_BWD_TILES(FG_ATTN_BWD, SUF, T)

// The tiles each head dim is built with (cuda.rs picks among them).
#if FG_ATTN_D <= 64
#define FG_ATTN_FWD_TILES(M, SUF, T) M(SUF, T, 64)
#define FG_ATTN_BWD_TILES(M, SUF, T) M(SUF, T, 32) M(SUF, T, 64)
#elif FG_ATTN_D <= 96
#define FG_ATTN_FWD_TILES(M, SUF, T) M(SUF, T, 32)
#define FG_ATTN_BWD_TILES(M, SUF, T) M(SUF, T, 64)
#else
#define FG_ATTN_FWD_TILES(M, SUF, T) M(SUF, T, 32) M(SUF, T, 64)
#define FG_ATTN_BWD_TILES(M, SUF, T) M(SUF, T, 32) M(SUF, T, 64)
#endif

#define FG_ATTN_COMMON(SUF, T)                                                                              \
  FG_KERNEL FG_ATTN_NAME(fg_attn_bwd_pre_d, FG_ATTN_D, SUF)(const T* o, const T* dout, float* delta,         \
                                                            float* dq_acc, FgAttnParams p) {                \
    fg_attn_bwd_pre<T, FG_ATTN_D>(o, dout, delta, dq_acc, p);                                              \
  }                                                                                                         \
  FG_KERNEL FG_ATTN_NAME(fg_attn_dq_d, FG_ATTN_D, SUF)(const float* dq_acc, T* dq, FgAttnParams p) {         \
    fg_attn_dq<T, FG_ATTN_D>(dq_acc, dq, p);                                                               \
  }

FG_ATTN_TILES(bf16, __nv_bfloat16)
FG_ATTN_TILES(f16, __half)
FG_ATTN_COMMON(bf16, __nv_bfloat16)
FG_ATTN_COMMON(f16, __half)
FG_ATTN_COMMON(f32, float)

extern "C" __global__ void __launch_bounds__(256) FG_ATTN_NAME(fg_attn_fwd_d, FG_ATTN_D, f32)(
    const float* q, const float* k, const float* v, float* o, float* lse, FgAttnParams p) {
  fg_attn_fwd_simt<FG_ATTN_D>(q, k, v, o, lse, p);
}
extern "C" __global__ void __launch_bounds__(128) FG_ATTN_NAME(fg_attn_bwd_d, FG_ATTN_D, f32)(
    const float* q, const float* k, const float* v, const float* dout, const float* lse, const float* delta,
    float* dq_acc, float* dk, float* dv, FgAttnParams p) {
  fg_attn_bwd_simt<FG_ATTN_D>(q, k, v, dout, lse, delta, dq_acc, dk, dv, p);
}
