// attention_wgmma.cu: the Hopper (sm_90a) forward and backward of attention, bf16 / f16, head dims
// 64 and 128, with or without dropout: the same algorithm and ABI as attention_tc.cu (FgAttnParams, the
// log-sum-exp, delta and dq_acc of attention_common.cuh), with every product on `wgmma.mma_async`
// (a warpgroup of 4 warps issues one 64 x N x 16 product from shared-memory descriptors) instead
// of mma.sync + ldmatrix. Why: on an H100/H200 the mma.sync kernels stop at 40-54% of cuDNN's
// wgmma kernels at T = 4096 (BENCHMARKS.md, issue 12), bound by ldmatrix traffic (one ldmatrix per
// two mma in the backward) and by 16-32 rows a warp; wgmma reads both operands straight from
// shared memory and gives each warpgroup 64 rows.
// Included by attention.cu only where the module is built for sm_90a (`__CUDA_ARCH_FEAT_SM90_ALL`);
// cuda.rs picks these kernels on such a device when the head dim is 64 or 128; with dropout the
// `wgdrop` build (DROP = true: attention_tc.cu's draws, element for element) runs.
//
// Shared memory: every operand tile is [rows][D] of 16-bit elements, stored as D / 64 "atoms" of
// [rows][64] (128 bytes a row), each row's eight 16-byte chunks XOR-swizzled by (row % 8): the
// 128-byte swizzle the wgmma descriptors describe (fg_wg_desc). The same tile serves as a K-major
// operand (rows = M or N, contiguous = K: S = Q K^T) and as an MN-major one (rows = K, contiguous
// = N: O = P V, the transposed B of the PTX ISA); the swizzle makes both conflict-free. Atom bases
// are 1024-byte aligned (the swizzle is a function of the address bits).
//
// Forward: warpgroups of 64 query rows (2 at d = 64, 3 at d = 128), K/V tiles of 64 keys. Per
// tile: S = Q K^T (SS), online softmax in registers (the exp2 domain, as attention_tc.cu),
// O += P V with P re-packed from the S accumulators as the A operand (RS). At d = 64 every thread
// loads the next tile by cp.async (double-buffered) between block barriers; at d = 128 a producer
// warp loads them by TMA into a four-stage ring handed over by mbarriers (fg_attn_fwd_wg_tma), so
// the warpgroups never wait for each other.
// Backward: 2 warpgroups x 64 keys (BKV = 128) a block at d = 128, x 128 keys (two 64-key m-tiles
// each, BKV = 256) at d = 64; per 64-query step and m-tile S^T = K Q^T and
// dP^T = V dO^T (SS), P^T and dS^T in registers, dV += P^T dO and dK += dS^T Q (RS), dS^T to
// shared memory, then dQ = dS K (SS, both operands transposed) with each warpgroup taking half of
// the head dim, staged in shared memory and added into dq_acc by one bulk asynchronous reduction
// a step (dq_acc's tile layout: fg_wg_dq_pos).
//
// Measured and not kept (H100, bench/kernels/attention_wgmma.sh, 2026-11-24): one-warpgroup blocks
// (two a multiprocessor) for the backward, 1.3-2.4x slower; walking the query blocks from a
// different start in each block, level; 16-byte dQ atomics, level; software-pipelining the backward
// (the next step's S^T, dP^T issued before this step's dQ atomics), 250 registers and 1.15x slower;
// a bulk reduction per dQ row (256 bytes) instead of per tile, level at d = 128 and 1.24x slower at
// d = 64; a warp-specialized forward (one producer warp loading K / V by cp.async into a 3-5 stage
// ring handed over by mbarriers, the warpgroups never meeting at a block barrier), 0.95x at d = 128
// and 0.78-0.91x at d = 64 even with the producer's address math hoisted (a warp issuing 16-byte
// copies cannot feed three warpgroups; the TMA producer does: 1.21x at d = 128); backward blocks in clusters of two
// adding their dQ tiles through distributed shared memory (one bulk reduction of half a tile per
// block: half the traffic), 1.28-1.36x slower at d = 128 (3.86 -> 4.95 ms at T = 4096) and 1.3-1.46x
// at d = 64 (the pair waits for each other every step and the remote reads sit in the step).
// Kept: 64 keys a forward step (1.06-1.2x over 128); the tile-wide bulk reduction of dQ
// (d = 128, T = 4096: backward 4.32 -> 3.90 ms against red.global.add; level at d = 64, where
// leaving the reduction out entirely would still save 0.7 of 2.64 ms: dQ's traffic, 64 x D floats
// per block of keys per 64 queries, is what bounds this backward); so at d = 64 a warpgroup owns
// two m-tiles (256 keys a block: half the traffic; T = 4096 backward 2.64 -> 1.92 ms, at 255
// registers with 28 bytes spilled; 72 with the grouped grid's index math, which still gained).
// d = 128 cannot: its dK and dV alone are 128 registers an m-tile.
// Dropout (the `wgdrop` build, DROP = true; H100, bf16, p = 0.1, fwd+bwd at T = 4096, 2026-11-24,
// BENCHMARKS.md call J8): 173-265 TFLOP/s, 1.20-1.50x the mma.sync kernels with dropout and
// 0.71-0.82 of PyTorch's SDPA (cuDNN) with dropout; without dropout these kernels reach 312-403.
// The Philox draws are the cost, in the forward and again in the backward: with a block per 4
// elements (the mapping before 7a5a7e9) they were about three times the rest of a step's
// per-element work and these rows read 131-220; a block per 8 elements (16-bit halves,
// attention_common.cuh) gave 1.12-1.27x. Drawing the keep bits while the S (and S^T, dP^T)
// products run was measured and not kept: level fwd+bwd, the forward 5-8% slower (the warps are
// issue-bound, the products short). The d = 64 backward spills 116 bytes with dropout (72 without).
//
// Ordering rules kept here: (1) data written by threads (cp.async, st.shared) reaches wgmma (the
// async proxy) only after `fence.proxy.async.shared::cta` and a barrier (TMA writes are in the
// async proxy already: their mbarrier's completion is enough); (2) a wgmma's register
// operands (accumulators, the A fragment) are not touched until `wgmma.wait_group` says it is
// done, and `wgmma.fence` precedes the first wgmma after registers were written; (3) a tile is
// refilled only after a barrier that every warpgroup reaches once its wgmma reading it completed.

#include "attention_wgmma_ops.cuh"

// Warpgroups a block (FG_WG_FWD_WGS: 2 or 3 by head dim, FG_WG_BWD_WGS: 2; one-warpgroup blocks
// would be built for two a multiprocessor) and key rows a forward step (FG_WG_FWD_BKV) are
// compile-time choices, measured in bench/kernels/attention_wgmma.sh (cuda.rs
// `wg_fwd_warpgroups`, `WG_FWD_BKV` mirror them).
#ifndef FG_WG_FWD_WGS
#if FG_ATTN_D > 64
#define FG_WG_FWD_WGS 3  // d = 128: forward 406 -> 441 TFLOP/s at T = 4096 (2 -> 3 warpgroups, 161 registers)
#else
#define FG_WG_FWD_WGS 2  // d = 64: 2 blocks of 2 warpgroups an SM (108 registers) beat 1 of 3 (366 vs 291)
#endif
#endif
#ifndef FG_WG_FWD_BKV
#define FG_WG_FWD_BKV 64
#endif
#ifndef FG_WG_BWD_WGS
#define FG_WG_BWD_WGS 2
#endif
// The forward's K / V tiles by TMA (tensor maps from the host, one producer warp, a ring of
// FG_WG_FWD_STAGES stages handed over by mbarriers) instead of cp.async from every thread between
// block barriers: at d = 128, T = 4096, 434 -> 527 TFLOP/s (causal 396 -> 479); at d = 64 1.02x at
// T = 4096 but 0.92x at T = 1024 and 2048 (three warpgroups; two: 0.87-0.89x), so d = 64 keeps
// the cp.async kernel.
#ifndef FG_WG_FWD_TMA
#if FG_ATTN_D > 64
#define FG_WG_FWD_TMA 1
#else
#define FG_WG_FWD_TMA 0
#endif
#endif
#ifndef FG_WG_FWD_STAGES
#define FG_WG_FWD_STAGES 4  // cuda.rs WG_FWD_STAGES mirrors it; 3 and 5 measured within 1%
#endif
#define FG_WG_FWD_THREADS (128 * FG_WG_FWD_WGS + 32 * FG_WG_FWD_TMA)
#define FG_WG_BWD_THREADS (128 * FG_WG_BWD_WGS)

// Which (batch, head, tile) a block takes. The grid is one-dimensional, B * H * tiles blocks,
// walked in groups of p.group heads (chosen by cuda.rs `wg_group` to about a wave of blocks) and,
// within a group, every head's tile 0 first, then every head's tile 1, ...: tile 0 is the longest
// under a causal mask (the forward's last query block, the backward's first key block), so the
// long blocks start first; and the heads a group shares keep their K / V (forward) or Q, dO and
// dQ's accumulator (backward) in L2 while the group runs. A (B * H, tiles) grid with the heads
// fastest re-read them from DRAM: at d = 128, T = 4096, full, backward 4.23 -> 3.55-3.88 ms with
// the heads' tiles adjacent; a grid of (tiles, H, B) lost up to 1.2x under a causal mask
// (one SM got two longest blocks).
// The mma.sync kernels (attention_tc.cu) keep the (B * H, tiles) grid: the same grouping measured
// 1.01-1.02x without a mask there and 0.93-0.97x under one (2026-11-24, tenth session).
struct FgWgTile {
  unsigned int b, h, bh;
  int tile;
};
static __device__ __forceinline__ FgWgTile fg_wg_tile(const FgAttnParams& p, int ntiles) {
  const unsigned int bhn = p.B * p.H, grp = p.group != 0u && p.group < bhn ? p.group : bhn;
  const unsigned int per = grp * (unsigned int)ntiles, g = blockIdx.x / per, r = blockIdx.x - g * per;
  const unsigned int gsz = min(grp, bhn - g * grp);  // the last group may be smaller
  FgWgTile t;
  t.tile = (int)(r / gsz);
  t.bh = g * grp + (r - (unsigned int)t.tile * gsz);
  t.b = t.bh / p.H;
  t.h = t.bh - t.b * p.H;
  return t;
}

// A shared-memory matrix descriptor: start address, leading / stride byte offsets, 128-byte swizzle.
static __device__ __forceinline__ unsigned long long fg_wg_desc(unsigned int saddr, unsigned int lbo,
                                                                 unsigned int sbo) {
  return (unsigned long long)((saddr & 0x3FFFFu) >> 4) | ((unsigned long long)((lbo >> 4) & 0x3FFFu) << 16) |
         ((unsigned long long)((sbo >> 4) & 0x3FFFu) << 32) | (1ull << 62);
}
// K-major: rows of the tile are M (or N), k16 step `kk` of a tile with `rows` rows.
static __device__ __forceinline__ unsigned long long fg_wg_kmajor(unsigned int base, int rows, int kk) {
  return fg_wg_desc(base + (unsigned int)((kk >> 2) * rows * 128 + (kk & 3) * 32), 16, 1024);
}
// MN-major: rows of the tile are K; k16 step `kk`, starting `col` elements into the contiguous dim.
// LBO = the stride between 64-element atoms of the contiguous dim, SBO = between 8-row groups of K.
static __device__ __forceinline__ unsigned long long fg_wg_mnmajor(unsigned int base, int rows, int kk, int col) {
  const unsigned int start = base + (unsigned int)((col >> 6) * rows * 128 + (col & 63) * 2 + kk * 16 * 128);
  return fg_wg_desc(start, (unsigned int)(rows * 128), 1024);
}

static __device__ __forceinline__ void fg_wg_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
static __device__ __forceinline__ void fg_wg_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int N>
static __device__ __forceinline__ void fg_wg_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}
static __device__ __forceinline__ void fg_proxy_fence() {
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}
// Keeps the compiler from moving accesses of an accumulator across a wgmma wait (its registers
// are written behind the compiler's back until then).
template <int R>
static __device__ __forceinline__ void fg_wg_pin(float (&d)[R][4]) {
#pragma unroll
  for (int i = 0; i < R; ++i)
#pragma unroll
    for (int e = 0; e < 4; ++e) asm volatile("" : "+f"(d[i][e])::"memory");
}

template <typename T, int N, int TA, int TB>
static __device__ __forceinline__ void fg_wg_ss(float (&d)[N / 8][4], unsigned long long da, unsigned long long db,
                                                int scale_d) {
  if constexpr (N == 32) FgWg<T>::template ss32<TA, TB>(d, da, db, scale_d);
  else if constexpr (N == 64) FgWg<T>::template ss64<TA, TB>(d, da, db, scale_d);
  else FgWg<T>::template ss128<TA, TB>(d, da, db, scale_d);
}
template <typename T, int N, int TB>
static __device__ __forceinline__ void fg_wg_rs(float (&d)[N / 8][4], const unsigned int (&a)[4],
                                                unsigned long long db, int scale_d) {
  if constexpr (N == 32) FgWg<T>::template rs32<TB>(d, a, db, scale_d);
  else if constexpr (N == 64) FgWg<T>::template rs64<TB>(d, a, db, scale_d);
  else FgWg<T>::template rs128<TB>(d, a, db, scale_d);
}

// Rows [r0, r0 + ROWS) of a matrix of D contiguous elements (row stride `st`) into a swizzled tile
// at `dst`; rows at or past `nrows` are zero-filled (and not read). All NTH threads of the block.
template <typename T, int ROWS, int D, int NTH>
static __device__ __forceinline__ void fg_wg_load(unsigned int dst, const T* __restrict__ src, long long st, int r0,
                                                  int nrows) {
  constexpr int CPR = D / 8, TOTAL = ROWS * CPR;
#pragma unroll
  for (int k = 0; k < (TOTAL + NTH - 1) / NTH; ++k) {
    const int c = k * NTH + (int)threadIdx.x;
    if (TOTAL % NTH != 0 && c >= TOTAL) break;
    const int row = c / CPR, ch = c - row * CPR;
    const bool valid = r0 + row < nrows;
    const unsigned int off = (unsigned int)((ch >> 3) * ROWS * 128 + row * 128 + (((ch & 7) ^ (row & 7)) << 4));
    fg_cp16(dst + off, src + (long long)(valid ? r0 + row : 0) * st + ch * 8, valid);
  }
}

// ---------------------------------------------------------------------------------------------
// Forward
// ---------------------------------------------------------------------------------------------

#define FG_WG_FWD_BQ (64 * FG_WG_FWD_WGS)

// The accumulators of a 64 x (16 N) wgmma product (float pairs of n8 chunks) as the A fragments of
// the next product (16-bit pairs, one k16 step per row of `a`).
template <typename T, int N>
static __device__ __forceinline__ void fg_wg_pack_a(const float (&c)[2 * N][4], unsigned int (&a)[N][4]) {
  typedef FgTc<T> M;
#pragma unroll
  for (int k = 0; k < N; ++k) {
    a[k][0] = M::pack(c[2 * k][0], c[2 * k][1]);
    a[k][1] = M::pack(c[2 * k][2], c[2 * k][3]);
    a[k][2] = M::pack(c[2 * k + 1][0], c[2 * k + 1][1]);
    a[k][3] = M::pack(c[2 * k + 1][2], c[2 * k + 1][3]);
  }
}

// One key tile of the forward's online softmax on S (a warpgroup's 64 rows x BKV keys from the
// wgmma accumulators): scale into the exp2 domain, mask (keys past Tk, causal), update the row
// max / sum and rescale O's accumulators; S becomes P. `r` is this thread's first row in the
// query block (the second is r + 8).
template <typename T, int D, int BKV>
static __device__ __forceinline__ void fg_attn_wg_softmax_step(float (&s)[BKV / 8][4], float (&acc)[D / 8][4],
                                                               float (&mrow)[2], float (&lrow)[2],
                                                               const FgAttnParams& p, int i0, int j0, int r, int wg,
                                                               int t) {
  constexpr int NT = BKV / 8, DT = D / 8;
  const int Tk = (int)p.Tk;
#pragma unroll
  for (int nt = 0; nt < NT; ++nt)
#pragma unroll
    for (int e = 0; e < 4; ++e) s[nt][e] *= p.scale_log2;
  if (j0 + BKV > Tk || (p.causal && j0 + BKV - 1 > i0 + wg * 64)) {
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int j = j0 + nt * 8 + 2 * t + (e & 1);
        const int i = i0 + r + (e >> 1) * 8;
        if (j >= Tk || (p.causal && j > i)) s[nt][e] = -FG_INF_F;
      }
  }
  // Online softmax (attention_tc.cu's, one 16-row m-tile a warp).
  float alpha[2], mref[2];
#pragma unroll
  for (int hh = 0; hh < 2; ++hh) {
    float mx = -FG_INF_F;
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) mx = fmaxf(mx, fmaxf(s[nt][2 * hh], s[nt][2 * hh + 1]));
    mx = fmaxf(mx, __shfl_xor_sync(FG_FULL, mx, 1));
    mx = fmaxf(mx, __shfl_xor_sync(FG_FULL, mx, 2));
    const float mnew = fmaxf(mrow[hh], mx);
    mref[hh] = mnew == -FG_INF_F ? 0.f : mnew;
    alpha[hh] = fg_exp2(mrow[hh] - mref[hh]);
    mrow[hh] = mnew;
  }
#pragma unroll
  for (int dt = 0; dt < DT; ++dt)
#pragma unroll
    for (int e = 0; e < 4; ++e) acc[dt][e] *= alpha[e >> 1];
#pragma unroll
  for (int hh = 0; hh < 2; ++hh) {
    float ls = 0.f;
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
      for (int e = 2 * hh; e < 2 * hh + 2; ++e) {
        const float pv = fg_exp2(s[nt][e] - mref[hh]);
        s[nt][e] = pv;
        ls += pv;
      }
    lrow[hh] = lrow[hh] * alpha[hh] + ls;
  }
}

// One key tile of the forward for this warpgroup, both kernels': S = Q K^T (SS: the warpgroup's
// 64 query rows at `qwg` of a BQ-row Q tile, the tile's keys at `kst`), the online softmax, and
// O += P V (RS, V's rows are the contraction: MN-major B, at `vst`); every wgmma done on return.
template <typename T, int D, int BQ, int BKV, bool DROP>
static __device__ __forceinline__ void fg_attn_wg_fwd_tile(unsigned int qwg, unsigned int kst, unsigned int vst,
                                                           float (&acc)[D / 8][4], float (&mrow)[2], float (&lrow)[2],
                                                           const FgAttnParams& p, unsigned int bh, int i0, int j0,
                                                           int r, int wg, int t) {
  float s[BKV / 8][4];
  fg_wg_fence();
#pragma unroll
  for (int kk = 0; kk < D / 16; ++kk)
    fg_wg_ss<T, BKV, 0, 0>(s, fg_wg_kmajor(qwg, BQ, kk), fg_wg_kmajor(kst, BKV, kk), kk > 0);
  fg_wg_commit();
  fg_wg_wait<0>();
  fg_wg_pin(s);
  fg_attn_wg_softmax_step<T, D, BKV>(s, acc, mrow, lrow, p, i0, j0, r, wg, t);
  if constexpr (DROP) fg_attn_dropout_fwd<BKV / 8>(s, p, bh, i0 + r, j0, t);  // attention_common.cuh
  unsigned int pa[BKV / 16][4];
  fg_wg_pack_a<T, BKV / 16>(s, pa);
  fg_wg_fence();
#pragma unroll
  for (int kc = 0; kc < BKV / 16; ++kc) fg_wg_rs<T, D, 1>(acc, pa[kc], fg_wg_mnmajor(vst, BKV, kc, 0), 1);
  fg_wg_commit();
  fg_wg_wait<0>();
  fg_wg_pin(acc);
}

// The forward's epilogue: normalise, write the log-sum-exp and O (4-byte pairs straight from the
// accumulators). `row` is this thread's first query row (the second is row + 8).
template <typename T, int D>
static __device__ __forceinline__ void fg_attn_wg_fwd_store(T* __restrict__ o, float* __restrict__ lse,
                                                            const float (&acc)[D / 8][4], const float (&mrow)[2],
                                                            const float (&lrow)[2], const FgAttnParams& p,
                                                            unsigned int bh, unsigned int b, unsigned int h, int row0,
                                                            int t) {
  typedef FgTc<T> M;
  constexpr int DT = D / 8;
  const int Tq = (int)p.Tq;
  T* og = o + (long long)b * p.o.b + (long long)h * p.o.h;
#pragma unroll
  for (int hh = 0; hh < 2; ++hh) {
    float l = lrow[hh];
    l += __shfl_xor_sync(FG_FULL, l, 1);
    l += __shfl_xor_sync(FG_FULL, l, 2);
    const float inv = p.rp_keep / l;
    const int row = row0 + hh * 8;
    if (row < Tq) {
      T* orow = og + (long long)row * p.o.t + 2 * t;
#pragma unroll
      for (int dt = 0; dt < DT; ++dt)
        *reinterpret_cast<unsigned int*>(orow + dt * 8) = M::pack(acc[dt][2 * hh] * inv, acc[dt][2 * hh + 1] * inv);
      if (t == 0) lse[(unsigned long long)bh * Tq + row] = (mrow[hh] + log2f(l)) * FG_ATTN_LN2;
    }
  }
}

template <typename T, int D, bool DROP>
static __device__ __forceinline__ void fg_attn_fwd_wg(const T* __restrict__ q, const T* __restrict__ k,
                                                      const T* __restrict__ v, T* __restrict__ o,
                                                      float* __restrict__ lse, const FgAttnParams& p) {
  typedef FgTc<T> M;
  constexpr int BQ = FG_WG_FWD_BQ, BKV = FG_WG_FWD_BKV, NT = BKV / 8, DT = D / 8, SZ = 2, NTH = FG_WG_FWD_THREADS;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, t = lane & 3;
  const int wg = warp >> 2, wrow = wg * 64 + (warp & 3) * 16;  // this warp's first row in the Q tile
  const int Tq = (int)p.Tq, Tk = (int)p.Tk;
  const int nqb = (Tq + BQ - 1) / BQ;
  const FgWgTile tl = fg_wg_tile(p, nqb);
  const unsigned int b = tl.b, h = tl.h, bh = tl.bh;
  const int i0 = (nqb - 1 - tl.tile) * BQ;  // the longest (causal) blocks start first
  const T* qg = q + (long long)b * p.q.b + (long long)h * p.q.h;
  const T* kg = k + (long long)b * p.k.b + (long long)h * p.k.h;
  const T* vg = v + (long long)b * p.v.b + (long long)h * p.v.h;

  const unsigned int base = (fg_smem_addr(fg_smem) + 1023u) & ~1023u;
  const unsigned int qs = base, ks = qs + BQ * D * SZ, vs = ks + 2 * BKV * D * SZ;

  const int kv_end = p.causal ? min(Tk, i0 + BQ) : Tk;
  const int nkv = (kv_end + BKV - 1) / BKV;

  fg_wg_load<T, BQ, D, NTH>(qs, qg, p.q.t, i0, Tq);
  if (nkv > 0) {
    fg_wg_load<T, BKV, D, NTH>(ks, kg, p.k.t, 0, Tk);
    fg_wg_load<T, BKV, D, NTH>(vs, vg, p.v.t, 0, Tk);
  }
  fg_cp_commit();

  float acc[DT][4];
  float mrow[2] = {-FG_INF_F, -FG_INF_F}, lrow[2] = {0.f, 0.f};
#pragma unroll
  for (int dt = 0; dt < DT; ++dt)
#pragma unroll
    for (int e = 0; e < 4; ++e) acc[dt][e] = 0.f;

  for (int jb = 0; jb < nkv; ++jb) {
    const int stage = jb & 1;
    fg_cp_wait<0>();
    fg_proxy_fence();
    __syncthreads();  // tile jb is in; every warpgroup is done with tile jb - 1 (the other stage)
    if (jb + 1 < nkv) {
      fg_wg_load<T, BKV, D, NTH>(ks + (stage ^ 1) * BKV * D * SZ, kg, p.k.t, (jb + 1) * BKV, Tk);
      fg_wg_load<T, BKV, D, NTH>(vs + (stage ^ 1) * BKV * D * SZ, vg, p.v.t, (jb + 1) * BKV, Tk);
    }
    fg_cp_commit();
    const unsigned int kst = ks + stage * BKV * D * SZ, vst = vs + stage * BKV * D * SZ;

    fg_attn_wg_fwd_tile<T, D, BQ, BKV, DROP>(qs + wg * 64 * 128, kst, vst, acc, mrow, lrow, p, bh, i0, jb * BKV,
                                             wrow + g, wg, t);
  }
  fg_cp_wait<0>();

  fg_attn_wg_fwd_store<T, D>(o, lse, acc, mrow, lrow, p, bh, b, h, i0 + wrow + g, t);
}

#if FG_WG_FWD_TMA
// A CUtensorMap (cuda.h's is 64-byte aligned and 128 bytes; NVRTC has no cuda.h): built on the
// host by cuTensorMapEncodeTiled, passed by value as a __grid_constant__ parameter.
struct alignas(64) FgTmap {
  unsigned long long v[16];
};

static __device__ __forceinline__ void fg_mbar_init(unsigned int bar, unsigned int count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
}
static __device__ __forceinline__ void fg_mbar_arrive(unsigned int bar) {
  asm volatile("mbarrier.arrive.release.cta.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory");
}
static __device__ __forceinline__ void fg_mbar_expect_tx(unsigned int bar, unsigned int bytes) {
  asm volatile("mbarrier.arrive.expect_tx.release.cta.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes) : "memory");
}
static __device__ __forceinline__ void fg_mbar_wait(unsigned int bar, unsigned int parity) {
  asm volatile(
      "{\n .reg .pred p;\n"
      "FG_MBAR_WAIT_%=:\n"
      " mbarrier.try_wait.parity.acquire.cta.shared::cta.b64 p, [%0], %1;\n"
      " @!p bra FG_MBAR_WAIT_%=;\n}\n" ::"r"(bar),
      "r"(parity)
      : "memory");
}
// Box (64 columns, rows) of a [B][H][T][D] (any strides) tensor at (col, row, h, b) into `dst`,
// 128-byte swizzled: exactly the layout of one atom of fg_wg_load's tiles.
static __device__ __forceinline__ void fg_tma_load4(unsigned int dst, const FgTmap& map, int col, int row, int h, int b,
                                                    unsigned int bar) {
  asm volatile(
      "cp.async.bulk.tensor.4d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4, %5}], [%6];\n" ::"r"(dst),
      "l"(reinterpret_cast<unsigned long long>(&map)), "r"(col), "r"(row), "r"(h), "r"(b), "r"(bar)
      : "memory");
}

// The forward with K / V from TMA: warps 0 .. 4 WGS - 1 compute as fg_attn_fwd_wg does, lane 0 of
// the last warp loads. Tile jb goes to stage jb % S: `full[s]` (the producer's expect_tx; TMA's
// bytes complete it) opens it, `empty[s]` (one arrival a consumer warp after its last wgmma
// reading the stage) gives it back. The warpgroups never meet at a block barrier.
template <typename T, int D, bool DROP>
static __device__ __forceinline__ void fg_attn_fwd_wg_tma(const T* __restrict__ q, const FgTmap& tk, const FgTmap& tv,
                                                          T* __restrict__ o, float* __restrict__ lse,
                                                          const FgAttnParams& p) {
  typedef FgTc<T> M;
  constexpr int BQ = FG_WG_FWD_BQ, BKV = FG_WG_FWD_BKV, DT = D / 8, SZ = 2, NC = 128 * FG_WG_FWD_WGS,
                S = FG_WG_FWD_STAGES;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, t = lane & 3;
  const int wg = warp >> 2, wrow = wg * 64 + (warp & 3) * 16;
  const int Tq = (int)p.Tq, Tk = (int)p.Tk;
  const int nqb = (Tq + BQ - 1) / BQ;
  const FgWgTile tl = fg_wg_tile(p, nqb);
  const unsigned int b = tl.b, h = tl.h, bh = tl.bh;
  const int i0 = (nqb - 1 - tl.tile) * BQ;
  const T* qg = q + (long long)b * p.q.b + (long long)h * p.q.h;

  const unsigned int base = (fg_smem_addr(fg_smem) + 1023u) & ~1023u;
  const unsigned int qs = base, ks = qs + BQ * D * SZ, vs = ks + S * BKV * D * SZ;
  const unsigned int full = vs + S * BKV * D * SZ, empty = full + 8 * S;
  const int kv_end = p.causal ? min(Tk, i0 + BQ) : Tk;
  const int nkv = (kv_end + BKV - 1) / BKV;

  if (tid == 0) {
    for (int st = 0; st < S; ++st) {
      fg_mbar_init(full + 8 * st, 1);
      fg_mbar_init(empty + 8 * st, 4 * FG_WG_FWD_WGS);
    }
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  __syncthreads();

  if (warp == 4 * FG_WG_FWD_WGS) {  // the producer
    if (lane == 0) {
      for (int jb = 0; jb < nkv; ++jb) {
        const int st = jb % S;
        if (jb >= S) fg_mbar_wait(empty + 8 * st, (unsigned int)((jb / S - 1) & 1));
        const unsigned int fb = full + 8 * st;
        fg_mbar_expect_tx(fb, 2u * BKV * D * SZ);
#pragma unroll
        for (int a = 0; a < D / 64; ++a) {
          fg_tma_load4(ks + st * BKV * D * SZ + a * BKV * 128, tk, a * 64, jb * BKV, (int)h, (int)b, fb);
          fg_tma_load4(vs + st * BKV * D * SZ + a * BKV * 128, tv, a * 64, jb * BKV, (int)h, (int)b, fb);
        }
      }
    }
    return;
  }

  fg_wg_load<T, BQ, D, NC>(qs, qg, p.q.t, i0, Tq);
  fg_cp_commit();
  fg_cp_wait<0>();
  fg_proxy_fence();
  asm volatile("bar.sync 1, %0;\n" ::"n"(NC) : "memory");  // Q is in (the consumers only)

  float acc[DT][4];
  float mrow[2] = {-FG_INF_F, -FG_INF_F}, lrow[2] = {0.f, 0.f};
#pragma unroll
  for (int dt = 0; dt < DT; ++dt)
#pragma unroll
    for (int e = 0; e < 4; ++e) acc[dt][e] = 0.f;

  for (int jb = 0; jb < nkv; ++jb) {
    const int stage = jb % S;
    fg_mbar_wait(full + 8 * stage, (unsigned int)((jb / S) & 1));
    fg_attn_wg_fwd_tile<T, D, BQ, BKV, DROP>(qs + wg * 64 * 128, ks + stage * BKV * D * SZ, vs + stage * BKV * D * SZ,
                                             acc, mrow, lrow, p, bh, i0, jb * BKV, wrow + g, wg, t);
    __syncwarp();
    if (lane == 0) fg_mbar_arrive(empty + 8 * stage);
  }
  fg_attn_wg_fwd_store<T, D>(o, lse, acc, mrow, lrow, p, bh, b, h, i0 + wrow + g, t);
}
#define FG_WG_FWD_SMEM(D) ((FG_WG_FWD_BQ + 2 * FG_WG_FWD_STAGES * FG_WG_FWD_BKV) * (D) * 2 + 1024 + 16 * FG_WG_FWD_STAGES)
#else
// Dynamic shared memory of the forward (bytes, with 1 KiB for the alignment of the base).
#define FG_WG_FWD_SMEM(D) ((FG_WG_FWD_BQ + 4 * FG_WG_FWD_BKV) * (D) * 2 + 1024)
#endif

#include "attention_wgmma_bwd.cu"
