// attention_common.cuh: fused scaled-dot-product attention, forward and backward (FlashAttention-2 style:
// tiles of Q against tiles of K/V, online softmax, only O and the per-row log-sum-exp leave the
// chip; the backward recomputes P from the log-sum-exp).
// Rust side: src/fused/attention/{mod.rs, cuda.rs}; CPU twin (the reference): cpu.rs.
//
// One NVRTC module per head dim (mod.rs `attention_module!`, `-D FG_ATTN_D=<d>` from Rust):
// attention.cu includes common.cuh, this file, attention_tc.cu (tensor-core kernels) and
// attention_simt.cu (f32), then defines the helpers and entry points. Every entry point carries the
// head dim in its name (`fg_attn_fwd_d64_k64_bf16`), which keeps profiles readable (functions are
// cached by module and name, so equal names in two modules would be safe too).
//
// Entry points (T = bf16 / f16 use tensor cores; f32 runs the SIMT kernels, exact f32 FMAs):
//   fg_attn_fwd_d{D}_k{BKV}_{bf16,f16}, fg_attn_fwd_d{D}_f32
//       (const T* q, const T* k, const T* v, T* o, float* lse, FgAttnParams p)
//     grid (B * H, ceil(Tq / BQ)), block 128 (tensor cores) or 256 (f32), dynamic shared memory as
//     cuda.rs `tiles` computes it (BKV: key rows a step, the tile in the name; BQ = 128 query rows
//     a block, 64 for f32). o [B, Tq, H, D] through p.o (d stride 1), lse [B * H, Tq] contiguous:
//     the natural-log log-sum-exp of each row of scaled scores (what the backward needs).
//   fg_attn_bwd_pre_d{D}_{bf16,f16,f32}(const T* o, const T* dout, float* delta, float* dq_acc, FgAttnParams p)
//     any grid, block a multiple of 32: one warp per row, delta[r] = sum_d dout * o (f32) and
//     dq_acc[r, :] = 0; r = bh * Tq + i over B * H * Tq rows.
//   fg_attn_bwd_d{D}_q{BQ}_{bf16,f16}, fg_attn_bwd_d{D}_f32(const T* q, const T* k, const T* v,
//       const T* dout, const float* lse, const float* delta, float* dq_acc, T* dk, T* dv, FgAttnParams p)
//     grid (B * H, ceil(Tk / BKV)), block 128, BKV = 64 (32 for f32), BQ query rows a step (the tile
//     in the name; 32 for f32); each block owns BKV rows of K and V, walks the Q blocks that see
//     them, writes its dK and dV rows and adds its share of dQ into dq_acc (f32, [B * H, Tq, D],
//     atomics: the sum order, and so the last bits of dQ, vary between runs).
//   fg_attn_dq_d{D}_{bf16,f16,f32}(const float* dq_acc, T* dq, FgAttnParams p): any grid-stride
//     launch; dq = dq_acc converted (dq_acc already carries the softmax scale).
//
// Inputs are read in place through element strides (p.q / p.k / p.v / p.dout: b, h, t, d). The
// tensor-core kernels copy 16-byte rows with cp.async, so they need d stride 1, every other stride
// and the first element 16-byte aligned (the Rust side copies a view that is not); the f32 kernels
// take any strides.
//
// Semantics (PyTorch's F.scaled_dot_product_attention): S = scale * Q K^T; causal keeps j <= i (top
// left, as torch's is_causal); P = softmax(S) per row; with dropout each P[i][j] is kept with
// probability 1 - p and scaled by 1 / (1 - p); O = P V. Dropout draws from Philox 4x32-10 (the
// project's generator, src/rng.rs): element (b, h, i, j) reads 16-bit half j % 2 (0: the low one)
// of word (j % 8) / 2 of block rng_offset + ((b * H + h) * Tq + i) * ceil(Tk / 8) + j / 8, and is
// kept when that half >= drop_thr = ceil(p * 2^16), i.e. when the uniform half * 2^-16 is >= p
// (mod.rs `Dropout`; fg_attn_block, fg_attn_keep_fwd and fg_attn_keep_bwd below). The CPU twin
// draws the same numbers; the backward regenerates them.
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
#error "FG_ATTN_D (the head dim) comes from Rust: fused/attention/mod.rs attention_module!"
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
  unsigned int drop_thr;  // 0: no dropout; else keep when a 16-bit half of a Philox word >= drop_thr
  unsigned int causal;
  unsigned int group;  // Hopper kernels: heads a group of blocks walks together (fg_wg_tile); 0 = all
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

// ---- Dropout's mask: one Philox block per 8 keys of a query row (the mapping is in the header) ----

// Philox, out of line: the tensor-core kernels' unrolled tile loops draw a block per pair of
// n-tiles, and inlined those copies were ~20% of each bf16 / f16 module's NVRTC time (0.2-0.45 s
// of 0.9-1.9 s on the dev machine). Called on the dropout path only.
static __device__ __noinline__ FgAttnU4 fg_attn_philox_ni(unsigned long long seed, unsigned long long index) {
  return fg_attn_philox(seed, index);
}

// The block of head `bh`, query row `i` and key chunk `c` (keys 8 c .. 8 c + 7).
static __device__ __forceinline__ unsigned long long fg_attn_block(const FgAttnParams& p, unsigned int bh, int i,
                                                                   int c) {
  return p.rng_offset + ((unsigned long long)bh * p.Tq + (unsigned long long)i) * (((unsigned long long)p.Tk + 7) / 8) +
         (unsigned long long)c;
}

// Whether the element drawing 16-bit half `h` (0: low) of `word` is kept.
static __device__ __forceinline__ bool fg_attn_kept(unsigned int word, int h, const FgAttnParams& p) {
  return (h ? word >> 16 : word & 0xffffu) >= p.drop_thr;
}

// Keep bits of a forward fragment pair (mma.sync m16n8 accumulators, and wgmma's, whose per-warp
// layout is the same): thread (g, t) holds rows ig and ig + 8 and keys k0 + 8 n + 2 t + (e & 1) of
// n-tiles n = 0, 1 (k0 a multiple of 8); bit 4 n + e is element e (row ig + 8 (e >> 1)) of n-tile
// n. The four threads of a quad need the same four blocks (two rows x two chunks), word t of each:
// thread t draws block t (row ig + 8 (t & 1), chunk k0 / 8 + (t >> 1)) and in round s sends word
// t ^ s to thread t ^ s, receiving word t of block t ^ s, whose halves are bits 2 (t ^ s) and
// 2 (t ^ s) + 1. One draw per 8 elements.
static __device__ __forceinline__ unsigned int fg_attn_keep_fwd(const FgAttnParams& p, unsigned int bh, int ig, int k0,
                                                                int t) {
  const FgAttnU4 mine = fg_attn_philox_ni(p.seed, fg_attn_block(p, bh, ig + 8 * (t & 1), k0 / 8 + (t >> 1)));
  unsigned int keep = 0u;
#pragma unroll
  for (int s = 0; s < 4; ++s) {
    const unsigned int send = fg_attn_word(mine, t ^ s);
    const unsigned int got = s == 0 ? send : __shfl_xor_sync(FG_FULL, send, s);
    const unsigned int two = (unsigned int)fg_attn_kept(got, 0, p) | (unsigned int)fg_attn_kept(got, 1, p) << 1;
    keep |= two << (2 * (t ^ s));
  }
  return keep;
}

// Dropout on the P of a forward fragment (NT n-tiles of the layout above, rows ig and ig + 8, keys
// from j0, a multiple of 8), after the softmax step: the row sums stay the softmax's, only P V
// sees the mask, and the 1 / (1 - p) goes on with the normalisation. Both forward kernel families
// (attention_tc.cu, attention_wgmma.cu) call it.
template <int NT>
static __device__ __forceinline__ void fg_attn_dropout_fwd(float (&s)[NT][4], const FgAttnParams& p, unsigned int bh,
                                                           int ig, int j0, int t) {
  static_assert(NT % 2 == 0, "keep bits come a pair of n-tiles at a time");
#pragma unroll
  for (int nt = 0; nt < NT; nt += 2) {
    const unsigned int keep = fg_attn_keep_fwd(p, bh, ig, j0 + nt * 8, t);
#pragma unroll
    for (int b = 0; b < 8; ++b)
      if (!((keep >> b) & 1u)) s[nt + (b >> 2)][b & 3] = 0.f;
  }
}

// Keep bits of a backward fragment pair (the transposed S^T accumulators): thread (g, t) holds
// keys kw + g + 8 (e >> 1) (kw: the warp's first key, a multiple of 16) and queries
// q0 + 8 n + 2 t + (e & 1) of n-tiles n = 0, 1; bit 4 n + e is element e of n-tile n. The eight
// threads sharing t need eight blocks (n-tile n, query parity q, key chunk c) and from each the
// half of their own key g: thread g draws block 4 n + 2 q + c = g, turns its 8 halves into a byte
// of keep bits (bit k: key 8 c + k of the chunk), and eight shuffles gather the bytes of the
// eight threads, from each of which thread g keeps bit g. One draw per 8 elements.
// The mma.sync backward inlines it behind a run-time branch, so its registers count without
// dropout too: gathering by shuffles, its d = 64 build spills 8 bytes (24 with 8c87981's draws);
// transposing by 8 ballots and a select it spilled 48 and ran 2-3% slower without dropout on an
// H100, and out of line (a call changes the whole kernel's register allocation) d = 128 lost 10%.
static __device__ __forceinline__ unsigned int fg_attn_keep_bwd(const FgAttnParams& p, unsigned int bh, int q0, int kw,
                                                                int g, int t) {
  const FgAttnU4 w = fg_attn_philox_ni(p.seed, fg_attn_block(p, bh, q0 + 8 * (g >> 2) + 2 * t + ((g >> 1) & 1),
                                                             kw / 8 + (g & 1)));
  unsigned int byte = 0u;
#pragma unroll
  for (int k = 0; k < 8; ++k) byte |= (unsigned int)fg_attn_kept(w.x[k >> 1], k & 1, p) << k;
  unsigned int keep = 0u;
#pragma unroll
  for (int gp = 0; gp < 8; ++gp) {  // block gp = 4 n + 2 q + c is element e = 2 c + q of n-tile n
    const unsigned int b = __shfl_sync(FG_FULL, byte, 4 * gp + t);
    keep |= ((b >> g) & 1u) << (4 * (gp >> 2) + 2 * (gp & 1) + ((gp >> 1) & 1));
  }
  return keep;
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
// Tile shapes (cuda.rs `tiles` mirrors these; change both together)
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

// The backward's per-step row statistics of queries [i0, i0 + BQ) of one head, into shared memory
// by the block's NTH threads: log2(e) * lse (+inf past Tq, so that P = 0 there) and delta (0 there).
template <int BQ, int NTH>
static __device__ __forceinline__ void fg_attn_stage_stats(float* lse2, float* dl, const float* __restrict__ lseg,
                                                           const float* __restrict__ dlg, int i0, int Tq) {
  for (int r = (int)threadIdx.x; r < BQ; r += NTH) {
    const int i = i0 + r;
    lse2[r] = i < Tq ? lseg[i] * FG_ATTN_LOG2E : FG_INF_F;
    dl[r] = i < Tq ? dlg[i] : 0.f;
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
