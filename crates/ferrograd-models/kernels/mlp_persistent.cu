// mlp_persistent.cu: a whole MLP training run (every step's forward, backward, gradient reduction
// and Adam) in ONE cooperative launch. Written for any small MLP (widths <= 128, depth <= 16,
// ReLU or linear after each layer, MSE loss, Adam) whose weights fit in shared memory; Monster
// Walk (71-47-23-11-5-11-23-47-71, 9,690 parameters, 8,023 steps of 5,041 rows) is the workload
// it was built for. Rust side: src/persistent/ (layout.rs mirrors every offset used here).
// Over 600 lines on purpose: design note, fragment helpers and kernel are one unit whose offsets
// and invariants must be read together.
//
// ---- Design note --------------------------------------------------------------------------------
// The floor (issue 14, 113 copies x 71 epochs): 40.4M samples x 56.7 kFLOP (forward 2x9,452 MACs,
// backward twice that) = 2.3 TFLOP, and 40.4M x 71 x 4 B = 11.5 GB of input reads: 2.4 ms of HBM
// and 6-40 ms of math on an H200. Neither dominates: 8,023 dependent steps do, because every step
// needs every SM's gradient before any SM can take the next one. The target (<= 0.1 s) leaves
// 12.5 us a step, so the design is about per-step latency: few grid-wide barriers, no host round
// trip, all operands on chip, and every warp of an SM busy on the critical path.
//
// What lives where (one block of 512 threads per SM, G = #SMs blocks, all co-resident):
//   shared memory, per block (Monster Walk: ~160 KB)
//     W   all weights, augmented: layer l is [out_pad8][ks_in] row-major with the bias as column
//         `in` (the activations carry a constant 1 there, so bias and weight gradients come out of
//         one matrix product); rows padded to 8, ks(w) = roundup(w + 1, 8) + 4 (== 4 mod 8 so
//         that fragment loads hit 32 different banks). The same layout is the global `params`
//         buffer, so the per-step refresh is a straight 16-byte cp.async copy.
//     A_l activations (inputs of every layer) of the block's rows; A_0 double-buffered so the
//         next step's rows stream in (cp.async, zero-filled past the batch) during this step.
//     D_l the loss gradient w.r.t. every layer's pre-activation, for the weight gradients.
//     Adam master weights, m and v of the block's slice of the parameters (never in global).
//   global memory (L2-resident): params (11,264 padded floats), one partial gradient row per
//     block (G x 45 KB = 5.9 MB; the block's loss sum sits after the parameters), the barrier
//     counters (one for barriers B and 2, one per reducer warp for barrier A).
//   mapped pinned host memory: the loss of every step (the host polls it; the kernel never waits).
//
// The schedule (layer-parallel). Rows are split in 8-row tiles, tile i -> block i mod G (Monster
// Walk: 631 tiles -> 4 or 5 per block, <= 40 rows). A *unit* is one mma output block of 16
// features x NT row tiles (W's fragment is loaded and split once per k-step for all NT): NT = 1
// in the forward, NT <= 2 in the backward (measured on an H100, Monster Walk 113 x 71, f32:
// 0.255 s with the earlier NT <= 3 everywhere, 0.244 s with NT = 1 everywhere, 0.234 s with 1 / 2
// and the division-free unit indices of mlp_train; a step's layer products are so small that
// more busy warps beat fewer fragment loads, while the backward's units share warps with
// weight-gradient items). Every layer's units are spread over the block's 16 warps and layers
// are separated by block barriers, so all warps work on the dependent chain of 15 layer products
// together (the first version gave each warp its own tile through all 15: 5 of 8 warps busy,
// 229 registers, ~60 K warp instructions an SM a step at IPC ~1). Per step, per block:
//   1. forward, layer by layer (units: out/16 x row tiles; Monster Walk <= 25 units, at most
//      two rounds on 16 warps); the output layer computes the loss and D_{L-1}. Layer 0 waits
//      only for W_0's refresh, layer 1 for W_1's, layer 2 for the rest: the refresh overlaps
//      the forward.
//   2. backward, layer by layer: D_{l-1} = W_l^T D_l masked by ReLU' (units: in/16 x groups of
//      <= 2 row tiles), and on the warps those units leave idle, weight-gradient items
//      dW_l' = D_l'^T A_l' (16 features x 3 column tiles, K = the block's rows) of layers whose
//      D is ready (l' >= l), in a fixed order; the rest (dW_0 at least) in a last phase. Items
//      go to the block's partial row in L2 as they finish (st.cg), so the writes overlap the
//      chain.
//   3. the gradient row is two regions: A = every layer but the first, plus the loss sum (index
//      pp); B = W_0. Region A is complete after the last backward phase, so during the last phase
//      (dW_0 on the first 10 warps) the last MLP_RWARPS = 6 warps pass grid barrier A (each warp
//      on a counter of its own, shared with the same warp of every other block) and
//      reduce-scatter region A (block b sums its slice, 60 floats for Monster Walk, over the G
//      partial rows, in registers: a warp per float4 column, <= 15 loads a lane in flight, a
//      shuffle butterfly, in a fixed order: deterministic), then run Adam on it: updating m, v,
//      master weights, `params`. No barrier among those 6 warps (nor any other partial
//      barrier): every warp of the block executes the same sequence of block barriers
//      (reduce_adam_a says why that matters).
//   4. grid barrier B (bar[0]): every dW_0 is in L2; all 512 threads reduce region B (28 floats a
//      block) and run its Adam.
//   5. grid barrier #2 (bar[0]); the loss goes to the host ring only now (a gpu-scope fence after a
//      store to mapped host memory would wait for its PCIe round trip); the refresh of W from
//      `params` is issued as three cp.async groups (W_0, W_1, the rest) and waited for in step 1.
// Synchronization per step: 3 grid barriers (A overlapped with dW_0), L + L = 16 block barriers.
//
// Per-step budget (Monster Walk on an H200, SM clock ~1.84 GHz; estimates, to be measured):
//   math: 1,170 m16n8k8 products an SM a step (40 rows: forward 440, backward 290, dW 440;
//     x3 HMMA in 3xTF32). Cost in warp instructions per product (LDS + split + HMMA; W's
//     fragment shared by 2 row tiles): ~19 f32, ~13 tf32, ~7 bf16; with epilogues ~27 K / 19 K /
//     12 K instructions an SM, 4 schedulers at an achieved IPC of ~2.5 -> ~5.8 / 4.1 / 2.6 us.
//     The tensor pipe (3,510 HMMA at ~0.67/clk/SM in 3xTF32) is ~2.9 us of that, overlapped.
//   fixed: the last dW items' writes drain (~0.3 us), barrier #1 (fence + atomic + poll: ~3 L2
//     round trips, ~0.8 us), reduce (46 KB of L2 reads per SM, ~1.3 us at the ~5.5 TB/s all
//     SMs share), Adam (~0.1 us), barrier #2 (~0.8 us), W_0's refresh (14 KB; ~0.5 us; the other
//     31 KB under the forward): ~3.8 us.
//   total ~9.6 us (f32) / ~7.9 us (tf32) / ~6.4 us (bf16) a step, 0.08 / 0.06 / 0.05 s a run.
//   Measured (H100, f32, BENCHMARKS.md): 24.2 us a step, 0.194 s a run: forward 6.9 (of which the
//   wait for W_0's refresh ~2.1, the output layer and the loss ~2.0), backward + dW 10.0, barrier
//   B 4.4, reduce B + Adam 1.3, barrier 2 1.2 us. Before MLP_FIXED_DESC each forward layer cost
//   ~0.45 us whatever its size (descriptor loads and address math); with it, ~0.3 us.
// What would cut more (not done): clusters with distributed shared memory. A cooperative launch
// with clusters runs on an H100 (bench/kernels/cluster_probe.py: up to 8 clusters of 16 = 128
// blocks resident, 7 = 112 through CudaDevice::launch_cooperative_cluster_raw on the same GPU,
// tests/core_suite/cuda_clusters.rs; a cluster barrier 0.045 us against 1.03 us for a grid barrier). Each
// cluster could sum its partials over DSMEM, one grid barrier exchange the cluster sums, every
// cluster run Adam on its own copy and pass the new W around over DSMEM: one grid barrier a step,
// no L2 refresh. Its ceiling, measured (BENCHMARKS.md 2026-11-25 twentieth session): with every
// grid-wide wait and the refresh removed (wrong results, timing only) a run takes 0.168 s against
// 0.194, so no synchronization design brings this schedule near 0.10 s; the chain of 15 layer
// products inside a block (and the weight-gradient items sharing its phases) is the rest.
// Measured and not kept (H100, 113 x 71, f32, BENCHMARKS.md 2026-11-24 twelfth session, against
// 0.196 s for the kernel before the forward's full unroll): the time between blocks is the
// slowest block's chain plus an L2 round trip or two, whatever form the synchronization takes.
// Region B reduced by the dW warps under region A's reduce, behind per-warp barrier-B counters:
// 0.213-0.237 s (the dW warps' polling and the two reduces contend). Barrier 2 replaced by
// per-block flags: 0.196 s (polled all at once) or 0.246 (polled per slice while refreshing).
// Block barriers dropped between layers of one 16-feature tile (a warp per row tile,
// __syncwarp): 0.198. ldmatrix for the forward's fragments: 0.195; with W_0's refresh as one TMA
// bulk copy: 0.193 (not worth an mbarrier and a second refresh path).
// Weights split into tf32 hi / lo once as they land (W_lo beside W: no split in any product's
// inner loop, ~40% of its instructions): 0.201, the split pass costing more than the products
// save. The forward and backward are latency-bound chains, not instruction-bound.
// 1024 threads (32 warps: the output layer's 25 units in one round, twice the warps for the
// weight-gradient items; 64 registers a thread under the launch bound): 0.242 s (tf32 0.181,
// bf16 0.180) against 0.195 (0.166, 0.165), backward + dW 13.2 against 9.8 us a step (H100,
// BENCHMARKS.md 2026-11-24 fifteenth session).
//
// Precision (template P): F32 = 3xTF32 (a = hi + lo with hi = a rounded to TF32, lo = a - hi;
// a*b ~ hi*hi + hi*lo + lo*hi, error ~2^-21 relative per product, f32 accumulation: the exact-f32
// mode), TF32 (one pass), BF16 (one pass, inputs rounded to bf16). Accumulation is f32 everywhere.
// The bf16 path uses the m16n8k8 bf16 shape with the tf32 fragment coordinates: lane (g, t)
// holds k = t and t + 4 in both A and B, a permutation of k that both operands share.
//
// Padding invariants (the code relies on them): every smem float starts at 0; padded columns of
// A_l/D_l and padded rows/columns of W stay exactly 0 (never written), so padding contributes
// exact zeros to every product. Fragment loads may run past a buffer (W rows up to out_pad16,
// W^T columns up to in_pad16, D_l columns up to out_pad16): those values only reach accumulator
// rows that are discarded, and slack after W and D keeps every read inside the allocation. Rows
// of a tile past the batch read zeros from A_0 and get D = 0 at the output layer, so they add
// exact zeros to every gradient; row tiles past the block's count are never computed.
// --------------------------------------------------------------------------------------------------

#define MLP_MAX_LAYERS 16
#define MLP_THREADS 512
#define MLP_WARPS 16
// Warps that reduce the gradients of layers >= 1 while the others compute layer 0's (the last phase).
#define MLP_RWARPS 6
// u32 words between grid-barrier counters (128 bytes: each its own L2 line): bar[0] is barriers B
// and 2, bar[MLP_BAR_STRIDE * (1 + wr)] barrier A of reducer warp wr.
#define MLP_BAR_STRIDE 32
#define PREC_F32 0
#define PREC_TF32 1
#define PREC_BF16 2

// Mirrored by #[repr(C)] structs in src/persistent/layout.rs; all fields are 32-bit.
struct MlpLayer {
  int in, out;       // features
  int ks_in, ks_out; // row strides of this layer's input (and W) and of its output/delta buffers
  int woff;          // offset of W_l in the W region and in global `params`
  int aoff;          // smem offset of A_l (l >= 1; A_0 is double-buffered, see a0_off)
  int doff;          // smem offset of D_l
  int relu;          // 1: ReLU after this layer, 0: linear
};
struct MlpDesc {
  int layers, pp, pstride, rows_cap;
  int slice_a, unused, w_base, a0_off0;  // `unused` keeps the descriptor 144 words (w_base 16-byte aligned)
  int a0_off1, red_off, adam_off, wloss_off;
  int smem_floats, dw_items, slice_b, ngroups_b;
  MlpLayer l[MLP_MAX_LAYERS];
};
struct AdamArgs {
  double b1d, b2d;
  float lr, b1, b2, omb1, omb2, eps;
};
#define MLP_DESC_FLOATS ((int)(sizeof(MlpDesc) / 4))

// The descriptor as compile-time constants (src/persistent/trainer.rs `specialized` prepends
// `#define MLP_FIXED_DESC <the 144 words of Layout::desc_words>`; every launch uses such a module).
// Why: with the descriptor in shared memory, every layer of every step re-derived its sizes and
// addresses through a dependent chain of shared-memory loads and integer math, ~0.45 us a layer
// whatever its size (16 layers a step: ~7 us of ~29). With constants, the unrolled forward is
// straight-line code per layer, the backward and the weight-gradient items read the descriptor
// from the constant cache. Measured on an H100, Monster Walk 113 x 71, f32: 0.234 -> 0.196 s.
// Unrolling the backward's layer loop as well made it slower (0.202-0.219 s: the code of the
// weight-gradient items, inlined into every layer, grew the kernel from ~120 to ~220 KB).
// Without the define (the compile tests, FERROGRAD_KERNEL_DIR experiments) the kernel reads the
// `desc` argument, as a general kernel must.
#if defined(MLP_FIXED_DESC)
static __constant__ const MlpDesc kFixedDesc = {MLP_FIXED_DESC};
#define MLP_UNIT_INLINE __forceinline__
#else
#define MLP_UNIT_INLINE
#endif

// ---- small PTX helpers --------------------------------------------------------------------------

__device__ __forceinline__ unsigned smem_addr(const void* p) {
  return static_cast<unsigned>(__cvta_generic_to_shared(p));
}
__device__ __forceinline__ void cp_async4(float* dst, const float* src, bool valid) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(smem_addr(dst)), "l"(src), "r"(valid ? 4 : 0));
}
__device__ __forceinline__ void cp_async16(float* dst, const float* src) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(smem_addr(dst)), "l"(src));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
__device__ __forceinline__ void cp_async_wait_all() { asm volatile("cp.async.wait_all;\n" ::: "memory"); }
// Wait until at most N of this thread's most recent cp.async groups are still in flight.
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}
// Loads of data other blocks wrote in this launch: L2 only (L1 is not coherent across SMs).
__device__ __forceinline__ float4 ld_cg4(const float* p) {
  float4 v;
  asm volatile("ld.global.cg.v4.f32 {%0,%1,%2,%3}, [%4];\n" : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w) : "l"(p));
  return v;
}
__device__ __forceinline__ void st_cg2(float* p, float a, float b) {
  asm volatile("st.global.cg.v2.f32 [%0], {%1,%2};\n" ::"l"(p), "f"(a), "f"(b) : "memory");
}
__device__ __forceinline__ unsigned ld_acquire(const unsigned* p) {
  unsigned v;
  asm volatile("ld.acquire.gpu.global.u32 %0, [%1];\n" : "=r"(v) : "l"(p) : "memory");
  return v;
}
// Arrive at a grid barrier counter: every write this thread has seen (its block's, through the
// block barrier before) becomes visible to whoever acquires the new count.
__device__ __forceinline__ void arrive_release(unsigned* p) {
  asm volatile("red.release.gpu.global.add.u32 [%0], 1;\n" ::"l"(p) : "memory");
}
__device__ __forceinline__ void wait_acquire(const unsigned* p, unsigned target) {
  while (static_cast<int>(ld_acquire(p) - target) < 0) {
  }
}

// Grid-wide barrier (every block is resident: cooperative launch), as cooperative_groups'
// grid.sync() does it on sm_70+: after the block barrier, thread 0 adds its arrival with release
// semantics (every write the block made before the barrier becomes visible first) and polls with
// acquire loads; the block barrier after it passes that on to every thread. The counter only
// grows: each barrier adds gridDim.x, and `target` is this block's count of barriers x gridDim.x.
__device__ __forceinline__ void grid_sync(unsigned* bar, unsigned& target) {
  __syncthreads();
  target += gridDim.x;
  if (threadIdx.x == 0) {
    arrive_release(bar);
    wait_acquire(bar, target);
  }
  __syncthreads();
}

// ---- fragments and the three precisions ---------------------------------------------------------

// TF32 with round-half-up (ties away), done with integer ops: cvt.rna.tf32 costs 4 instructions on
// sm_90, this 2. Finite inputs only (weights, activations and deltas are).
__device__ __forceinline__ unsigned tf32_hi(float x) { return (__float_as_uint(x) + 0x1000u) & 0xffffe000u; }
// Two floats as bf16x2: `lo` in the low half (the lower k index), `hi` in the high half.
__device__ __forceinline__ unsigned pack_bf16(float lo, float hi) {
  unsigned r;
  asm("cvt.rn.bf16x2.f32 %0, %1, %2;\n" : "=r"(r) : "f"(hi), "f"(lo));
  return r;
}

// A fragment (16x8): a0 = A[g][t], a1 = A[g+8][t], a2 = A[g][t+4], a3 = A[g+8][t+4].
// B fragment (8x8):  b0 = B[t][g], b1 = B[t+4][g].  C: c0 = C[g][2t], c1 = C[g][2t+1], c2/c3 row g+8.
// For F32 (3xTF32) `l` is the remainder a - hi, passed as raw f32: the tensor core reads only the
// top 19 bits of a TF32 operand, which truncates it (CUTLASS's fast 3xTF32 does the same); the
// error of a product stays ~2^-21 relative.
template <int P>
struct FragA {
  unsigned h[4];
  unsigned l[4];
};
template <int P>
struct FragB {
  unsigned h[2];
  unsigned l[2];
};

template <int P>
__device__ __forceinline__ FragA<P> frag_a(float a0, float a1, float a2, float a3) {
  FragA<P> f;
  if constexpr (P == PREC_BF16) {
    f.h[0] = pack_bf16(a0, a2);
    f.h[1] = pack_bf16(a1, a3);
  } else {
    const float v[4] = {a0, a1, a2, a3};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      f.h[i] = tf32_hi(v[i]);
      if constexpr (P == PREC_F32) f.l[i] = __float_as_uint(v[i] - __uint_as_float(f.h[i]));
    }
  }
  return f;
}

template <int P>
__device__ __forceinline__ FragB<P> frag_b(float b0, float b1) {
  FragB<P> f;
  if constexpr (P == PREC_BF16) {
    f.h[0] = pack_bf16(b0, b1);
  } else {
    f.h[0] = tf32_hi(b0);
    f.h[1] = tf32_hi(b1);
    if constexpr (P == PREC_F32) {
      f.l[0] = __float_as_uint(b0 - __uint_as_float(f.h[0]));
      f.l[1] = __float_as_uint(b1 - __uint_as_float(f.h[1]));
    }
  }
  return f;
}

__device__ __forceinline__ void mma_tf32(float (&c)[4], const unsigned (&a)[4], const unsigned (&b)[2]) {
  asm("mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

// N accumulator tiles of 16x8. For F32 the two cross products of 3xTF32 get their own
// accumulators: three independent HMMA chains of K/8 instead of one of 3K/8 (latency), summed
// small-first at the end.
template <int P, int N>
struct Acc {
  float c[N][4];
  float x[P == PREC_F32 ? N : 1][4];
  float y[P == PREC_F32 ? N : 1][4];
  __device__ __forceinline__ void zero() {
#pragma unroll
    for (int m = 0; m < N; ++m) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        c[m][e] = 0.f;
        if constexpr (P == PREC_F32) x[m][e] = y[m][e] = 0.f;
      }
    }
  }
  __device__ __forceinline__ void mma(int m, const FragA<P>& a, const FragB<P>& b) {
    if constexpr (P == PREC_BF16) {
      asm("mma.sync.aligned.m16n8k8.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5}, {%6}, {%0,%1,%2,%3};\n"
          : "+f"(c[m][0]), "+f"(c[m][1]), "+f"(c[m][2]), "+f"(c[m][3])
          : "r"(a.h[0]), "r"(a.h[1]), "r"(b.h[0]));
    } else {
      if constexpr (P == PREC_F32) {
        mma_tf32(x[m], a.l, b.h);
        mma_tf32(y[m], a.h, b.l);
      }
      mma_tf32(c[m], a.h, b.h);
    }
  }
  __device__ __forceinline__ float get(int m, int e) const {
    if constexpr (P == PREC_F32) return c[m][e] + (x[m][e] + y[m][e]);
    return c[m][e];
  }
};

// ---- units: 16 features x NT row tiles of one layer product -------------------------------------

// Z^T (M = 16 output features from W's row 0, N = NT x 8 rows, K = in + 1) = W_aug * X_aug^T.
// W's fragment is loaded and split once per k-step for all NT row tiles. `upper`: rows 8..15 of
// the tile exist in W_l; where they are padding past out_pad8, rows 0..7 are read again instead
// (their results are discarded), so no read leaves W_l: the next layer's weights may still be
// landing (the refresh overlaps the forward).
template <int P, int NT>
__device__ __forceinline__ void mma_wx(Acc<P, NT>& c, const float* __restrict__ W, int ksw, int ksteps, bool upper,
                                       const float* __restrict__ X, int ksx, int g, int t) {
  c.zero();
  const float* w0 = W + g * ksw + t;
  const float* w1 = upper ? w0 + 8 * ksw : w0;
  const float* x = X + g * ksx + t;
  // With MLP_FIXED_DESC the forward's layer loop is unrolled and ksteps is a constant: unrolled
  // whole, the k-loop's loads are scheduled ahead of the products (H100, 113 x 71, f32: 0.196 ->
  // 0.194 s; tf32 0.167 -> 0.165). Pipelining the loads by hand did the same here and slowed the
  // backward's loops (mma_wtd, dw_item: 0.205 s).
#if defined(MLP_FIXED_DESC)
#pragma unroll
#else
#pragma unroll 2
#endif
  for (int kk = 0; kk < ksteps; ++kk, w0 += 8, w1 += 8, x += 8) {
    const FragA<P> a = frag_a<P>(w0[0], w1[0], w0[4], w1[4]);
#pragma unroll
    for (int n = 0; n < NT; ++n) c.mma(n, a, frag_b<P>(x[n * 8 * ksx], x[n * 8 * ksx + 4]));
  }
}

// (W^T D^T) (M = 16 input features from W's column 0, N = NT x 8 rows, K = out features).
template <int P, int NT>
__device__ __forceinline__ void mma_wtd(Acc<P, NT>& c, const float* __restrict__ W, int ksw, int ksteps,
                                        const float* __restrict__ D, int ksd, int g, int t) {
  c.zero();
  const float* w0 = W + t * ksw + g;
  const float* x = D + g * ksd + t;
#pragma unroll 2
  for (int kk = 0; kk < ksteps; ++kk, w0 += 8 * ksw, x += 8) {
    const float* w1 = w0 + 4 * ksw;
    const FragA<P> a = frag_a<P>(w0[0], w0[8], w1[0], w1[8]);
#pragma unroll
    for (int n = 0; n < NT; ++n) c.mma(n, a, frag_b<P>(x[n * 8 * ksd], x[n * 8 * ksd + 4]));
  }
}

// Forward unit: layer l, output features [16m, 16m+16), the block's row tiles k .. k+NT-1.
// A hidden layer writes act(z) into A_{l+1} (the ones column and the padding are never written);
// the output layer adds its rows' squared errors to `loss` and writes D_{L-1} = dLoss/dz. The
// target is `br.y` (global, rows of `out`) or, for an autoencoder (no y), the input rows in A_0.
template <int P, int NT>
__device__ MLP_UNIT_INLINE void fwd_unit(const MlpDesc& d, float* sm, const float* A0, int l, int m, int k, int rows,
                         const float* __restrict__ y, float scale, float& loss, int g, int t) {
  const MlpLayer& ly = d.l[l];
  const int ksw = ly.ks_in, kso = ly.ks_out, out = ly.out, relu = ly.relu;
  const float* X = ((l == 0) ? A0 : sm + ly.aoff) + k * 8 * ksw;
  Acc<P, NT> c;
  const bool upper = m * 16 + 8 < ((out + 7) & ~7);
  mma_wx<P, NT>(c, sm + d.w_base + ly.woff + m * 16 * ksw, ksw, (ly.in + 8) >> 3, upper, X, ksw, g, t);
  if (l + 1 < d.layers) {
    float* Y = sm + d.l[l + 1].aoff + k * 8 * kso;
#pragma unroll
    for (int n = 0; n < NT; ++n) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int j = m * 16 + g + (e >> 1) * 8, r = n * 8 + 2 * t + (e & 1);
        if (j < out) {
          const float z = c.get(n, e);
          Y[r * kso + j] = relu ? fmaxf(z, 0.f) : z;
        }
      }
    }
  } else {
    float* D = sm + ly.doff + k * 8 * kso;
    const int ks0 = d.l[0].ks_in;
    const float* X0 = A0 + k * 8 * ks0;
#pragma unroll
    for (int n = 0; n < NT; ++n) {
      const int row0 = (blockIdx.x + (k + n) * gridDim.x) * 8;  // the tile's first row in the batch
      const int nv = min(8, rows - row0);
      const float* yt = y ? y + (size_t)row0 * out : nullptr;
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int j = m * 16 + g + (e >> 1) * 8, r = 2 * t + (e & 1), rr = n * 8 + r;
        if (j < out) {
          const float z = c.get(n, e);
          const float yv = relu ? fmaxf(z, 0.f) : z;
          float diff = 0.f;
          if (r < nv) diff = yv - (yt ? __ldg(yt + (size_t)r * out + j) : X0[rr * ks0 + j]);
          loss = fmaf(diff, diff, loss);
          D[rr * kso + j] = (relu && !(z > 0.f)) ? 0.f : scale * diff;
        }
      }
    }
  }
}

// Backward unit: layer l >= 1, input features [16m, 16m+16), row tiles k .. k+NT-1:
// D_{l-1}[r][i] = (W_l^T D_l)[i][r] masked by ReLU' of layer l-1 (A_l > 0), for i < in.
template <int P, int NT>
__device__ MLP_UNIT_INLINE void bwd_unit(const MlpDesc& d, float* sm, int l, int m, int k, int g, int t) {
  const MlpLayer& ly = d.l[l];
  const int ks = ly.ks_in, in = ly.in, relu = d.l[l - 1].relu;
  Acc<P, NT> c;
  mma_wtd<P, NT>(c, sm + d.w_base + ly.woff + m * 16, ks, (ly.out + 7) >> 3, sm + ly.doff + k * 8 * ly.ks_out,
                 ly.ks_out, g, t);
  float* Dn = sm + d.l[l - 1].doff + k * 8 * ks;
  const float* Aact = sm + ly.aoff + k * 8 * ks;
#pragma unroll
  for (int n = 0; n < NT; ++n) {
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int i = m * 16 + g + (e >> 1) * 8, r = n * 8 + 2 * t + (e & 1);
      if (i < in) Dn[r * ks + i] = (relu && !(Aact[r * ks + i] > 0.f)) ? 0.f : c.get(n, e);
    }
  }
}

// ---- weight gradients ---------------------------------------------------------------------------

// dW_l[j][i] = sum_r D_l[r][j] A_l[r][i] for j in [j0, j0+16) and up to 3 column tiles of 8 from
// nt0: M = out features, N = in features (+ the bias column), K = the block's rows (ktiles x 8).
template <int P, int CNT>
__device__ void dw_item(const float* __restrict__ D, int ksd, const float* __restrict__ A, int ksa, int ktiles, int j0,
                        int nt0, int out, float* dst, int ksw, int g, int t) {
  Acc<P, CNT> c;
  c.zero();
  const float* d0 = D + t * ksd + j0 + g;
  const float* x0 = A + t * ksa + nt0 * 8 + g;
#pragma unroll 2
  for (int kk = 0; kk < ktiles; ++kk, d0 += 8 * ksd, x0 += 8 * ksa) {
    const float* d1 = d0 + 4 * ksd;
    const float* x1 = x0 + 4 * ksa;
    const FragA<P> a = frag_a<P>(d0[0], d0[8], d1[0], d1[8]);
#pragma unroll
    for (int q = 0; q < CNT; ++q) c.mma(q, a, frag_b<P>(x0[q * 8], x1[q * 8]));
  }
#pragma unroll
  for (int q = 0; q < CNT; ++q) {
    const int i = (nt0 + q) * 8 + 2 * t, j = j0 + g;
    // Columns past `in` are exact zeros (A's padding), so pairs are written whole.
    if (j < out) st_cg2(dst + j * ksw + i, c.get(q, 0), c.get(q, 1));
    if (j + 8 < out) st_cg2(dst + (j + 8) * ksw + i, c.get(q, 2), c.get(q, 3));
  }
}

// Weight-gradient items of layer l: 16-row tiles of W x groups of <= 3 column tiles.
__device__ __forceinline__ int dw_count(const MlpLayer& ly) {
  return ((ly.out + 15) >> 4) * ((((ly.in + 8) >> 3) + 2) / 3);
}

// Item `it` in the order the backward makes them available: layer L-1's first, layer 0's last.
template <int P>
__device__ void dw_work(const MlpDesc& d, const float* sm, const float* A0, int it, int ktiles, float* part, int g,
                        int t) {
  for (int l = d.layers - 1; l >= 0; --l) {
    const MlpLayer& ly = d.l[l];
    const int nt = (ly.in + 8) >> 3, ng = (nt + 2) / 3, cnt = ((ly.out + 15) >> 4) * ng;
    if (it < cnt) {
      const int m = it / ng, q = it - m * ng;
      const float* A = (l == 0) ? A0 : sm + ly.aoff;
      const int cnt = min(3, nt - q * 3);
      const float* D = sm + ly.doff;
      float* dst = part + ly.woff;
      if (cnt == 3) dw_item<P, 3>(D, ly.ks_out, A, ly.ks_in, ktiles, m * 16, q * 3, ly.out, dst, ly.ks_in, g, t);
      else if (cnt == 2) dw_item<P, 2>(D, ly.ks_out, A, ly.ks_in, ktiles, m * 16, q * 3, ly.out, dst, ly.ks_in, g, t);
      else dw_item<P, 1>(D, ly.ks_out, A, ly.ks_in, ktiles, m * 16, q * 3, ly.out, dst, ly.ks_in, g, t);
      return;
    }
    it -= cnt;
  }
}

// ---- the training run ---------------------------------------------------------------------------

// One batch: x rows (in_0 floats each), optional targets (out_last floats each), row count.
struct BatchRef {
  const float* x;
  const float* y;
  int rows;
};
__device__ __forceinline__ BatchRef batch_ref(const unsigned* __restrict__ tab, int i) {
  const uint4 a = __ldg(reinterpret_cast<const uint4*>(tab) + 2 * i);
  const uint4 b = __ldg(reinterpret_cast<const uint4*>(tab) + 2 * i + 1);
  BatchRef r;
  r.x = reinterpret_cast<const float*>((static_cast<unsigned long long>(a.y) << 32) | a.x);
  r.y = reinterpret_cast<const float*>((static_cast<unsigned long long>(a.w) << 32) | a.z);
  r.rows = static_cast<int>(b.x);
  return r;
}

// Row tiles of a `rows`-row batch that block b holds.
__device__ __forceinline__ int my_tiles(int rows) {
  const int tiles = (rows + 7) >> 3, G = gridDim.x, b = blockIdx.x;
  return tiles > b ? (tiles - b + G - 1) / G : 0;
}

// Start copying this block's rows of batch `br` into A_0 buffer `dst` (zero past the batch): a
// warp per row, a lane per feature (rows of `in` floats are not 16-byte aligned).
__device__ __forceinline__ void prefetch_rows(const MlpDesc& d, float* dst, const BatchRef& br, int warp, int lane) {
  const int G = gridDim.x, b = blockIdx.x, in = d.l[0].in, ks = d.l[0].ks_in;
  const int nrows = my_tiles(br.rows) * 8;
  for (int rl = warp; rl < nrows; rl += MLP_WARPS) {
    const int row = (b + (rl >> 3) * G) * 8 + (rl & 7);
    const bool valid = row < br.rows;
    const float* src = br.x + (valid ? (size_t)row * in : 0);
    for (int k = lane; k < in; k += 32) cp_async4(dst + rl * ks + k, src + (valid ? k : 0), valid);
  }
}

// Copy floats [lo, hi) of `params` into W (both 16-byte aligned: every layer is 8 x ks floats).
__device__ __forceinline__ void refresh(float* W, const float* __restrict__ params, int lo, int hi) {
  for (int i = lo / 4 + threadIdx.x; i < hi / 4; i += MLP_THREADS) cp_async16(W + 4 * i, params + 4 * i);
  cp_async_commit();
}

__device__ __forceinline__ void stamp(unsigned long long* ph, int i, unsigned long long& clk) {
  if (threadIdx.x == 0) {
    const unsigned long long now = clock64();
    ph[i] += now - clk;
    clk = now;
  }
}

// One block's share of a region of the gradient row: floats [g0, g0 + slice).
struct Slice {
  int g0, slice;
  int own;      // parameters it updates
  int own_red;  // floats it sums: the parameters and, in region A, maybe the loss column
  int ng;       // region B: row groups of reduce_slice (threads / (slice / 4))
  int ad;       // offset of its Adam state in pm / mm / vm
};

// Block b's slice of region A ([w1, pp + 4): every layer but the first, and the loss column) or
// of region B ([0, w1): W_0). Recomputed where needed (cheap) rather than kept in registers.
__device__ __forceinline__ Slice region_slice(const MlpDesc& d, bool a) {
  const int pp = d.pp, w1 = d.layers > 1 ? d.l[1].woff : pp, b = blockIdx.x;
  Slice S;
  if (a) {
    S.slice = d.slice_a;
    S.g0 = w1 + b * S.slice;
    S.own = max(0, min(S.slice, pp - S.g0));
    S.own_red = max(0, min(S.slice, pp + 4 - S.g0));
    S.ng = 1;  // region A is summed by reduce_adam_a, in registers
    S.ad = 0;
  } else {
    S.slice = d.slice_b;
    S.g0 = b * S.slice;
    S.own = S.own_red = max(0, min(S.slice, w1 - S.g0));
    S.ng = d.ngroups_b;
    S.ad = d.slice_a;
  }
  return S;
}

// red[grp][i] = sum over the partial rows bb = grp, grp + ng, ... (< active) of row bb's float
// g0 + i: thread `t` of `nthr`, up to 8 rows in flight at once, summed in row order, so the
// result does not depend on timing (deterministic).
__device__ __forceinline__ void reduce_slice(const float* __restrict__ partial, int pst, int active, const Slice& S,
                                             float* red, int t, int nthr) {
  const int q4 = S.slice / 4, ng = S.ng;
  for (int w = t; w < q4 * ng; w += nthr) {
    const int c = w % q4, grp = w / q4;
    float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
    if (4 * c < S.own_red) {
      const float* src = partial + S.g0 + 4 * c;
      for (int bb0 = grp; bb0 < active; bb0 += 8 * ng) {
        float4 v[8];
#pragma unroll
        for (int j = 0; j < 8; ++j) {
          const int bb = bb0 + j * ng;
          v[j] = bb < active ? ld_cg4(src + (size_t)bb * pst) : make_float4(0.f, 0.f, 0.f, 0.f);
        }
#pragma unroll
        for (int j = 0; j < 8; ++j) {
          acc.x += v[j].x;
          acc.y += v[j].y;
          acc.z += v[j].z;
          acc.w += v[j].w;
        }
      }
    }
    reinterpret_cast<float4*>(red + grp * S.slice)[c] = acc;
  }
}

// Adam on parameter k of the block's Adam state (= float g0 + i of the gradient row) given its
// summed gradient (the formula of kernels/optim.cu adam_f32 and of the fused Monster Walk step);
// the new weight goes to `params` for every block.
__device__ __forceinline__ void adam_one(int k, int gi, float gsum, float* pm, float* mm, float* vm,
                                         float* __restrict__ params, float* __restrict__ grad_out,
                                         const AdamArgs& ad, float step, float sbc2) {
  const float mi = ad.b1 * mm[k] + ad.omb1 * gsum;
  const float vi = ad.b2 * vm[k] + ad.omb2 * (gsum * gsum);
  const float p = pm[k] - step * (mi / (sqrtf(vi) / sbc2 + ad.eps));
  mm[k] = mi;
  vm[k] = vi;
  pm[k] = p;
  params[gi] = p;
  if (grad_out) grad_out[gi] = gsum;
}

// Adam on the slice's parameters from the summed gradient in `red` (region B: reduce_slice's
// groups, summed here in group order).
__device__ __forceinline__ void adam_slice(const Slice& S, const float* red, float* pm, float* mm, float* vm,
                                           float* __restrict__ params, float* __restrict__ grad_out,
                                           const AdamArgs& ad, float step, float sbc2, int t, int nthr) {
  for (int i = t; i < S.own; i += nthr) {
    float gsum = 0.f;
    for (int grp = 0; grp < S.ng; ++grp) gsum += red[grp * S.slice + i];
    adam_one(S.ad + i, S.g0 + i, gsum, pm, mm, vm, params, grad_out, ad, step, sbc2);
  }
}

// Region A's reduce-scatter and Adam on ONE warp (`wr` of the MLP_RWARPS reducer warps), with no
// shared memory and no barrier between warps. Why: the previous version summed row groups into
// shared memory and ordered that with a named barrier among the reducer warps only (`bar.sync 1,
// 192`, twice a step). compute-sanitizer racecheck then reported 289 shared-memory hazards on
// Monster Walk between the `wloss` write (a reducer warp's lane 0, e.g. thread 352 = warp 11) and
// thread 0's read of it, although those two are separated by a whole-block `bar.sync 0` that every
// warp executes the same number of times: the only asymmetry in the block's barriers was that the
// reducer warps passed two more (partial) barriers a step than the others, which racecheck's
// barrier accounting does not match up. No partial barrier means every warp runs the identical
// sequence of `bar.sync 0`, so the hazard tracking and the hardware agree by construction. The
// cost is nothing: a warp sums its float4 columns of the slice in registers (lane l takes the
// partial rows l, l+32, ...; up to MLP_RA_COLS x MLP_RA_ROWS loads in flight at once), a xor
// butterfly of shuffles gives every lane the column sums (the same on every lane: IEEE addition
// commutes), and lane 4j + e runs Adam on float e of its j-th column. Summation order is fixed
// (rows in order per lane, then the butterfly): deterministic. Returns the loss column's sum on
// the thread that owns it (index `loss_i` of the slice; see loss_lane) and 0 elsewhere.
#define MLP_RA_COLS 3
#define MLP_RA_ROWS 5
__device__ __forceinline__ float reduce_adam_a(const float* __restrict__ partial, int pst, int active, const Slice& S,
                                               int wr, int lane, int loss_i, float* pm, float* mm, float* vm,
                                               float* __restrict__ params, float* __restrict__ grad_out,
                                               const AdamArgs& ad, float step, float sbc2) {
  const int nq = (S.own_red + 3) >> 2;  // float4 columns holding a parameter or the loss
  float loss = 0.f;
  for (int c0 = wr; c0 < nq; c0 += MLP_RA_COLS * MLP_RWARPS) {
    float4 acc[MLP_RA_COLS];
#pragma unroll
    for (int j = 0; j < MLP_RA_COLS; ++j) acc[j] = make_float4(0.f, 0.f, 0.f, 0.f);
    for (int bb0 = lane; bb0 < active; bb0 += 32 * MLP_RA_ROWS) {
      float4 v[MLP_RA_COLS][MLP_RA_ROWS];
#pragma unroll
      for (int j = 0; j < MLP_RA_COLS; ++j) {
        const int c = c0 + j * MLP_RWARPS;
#pragma unroll
        for (int r = 0; r < MLP_RA_ROWS; ++r) {
          const int bb = bb0 + 32 * r;
          v[j][r] = (c < nq && bb < active) ? ld_cg4(partial + (size_t)bb * pst + S.g0 + 4 * c)
                                            : make_float4(0.f, 0.f, 0.f, 0.f);
        }
      }
#pragma unroll
      for (int j = 0; j < MLP_RA_COLS; ++j) {
#pragma unroll
        for (int r = 0; r < MLP_RA_ROWS; ++r) {
          acc[j].x += v[j][r].x;
          acc[j].y += v[j][r].y;
          acc[j].z += v[j][r].z;
          acc[j].w += v[j][r].w;
        }
      }
    }
#pragma unroll
    for (int j = 0; j < MLP_RA_COLS; ++j) {
#pragma unroll
      for (int o = 16; o > 0; o >>= 1) {
        acc[j].x += __shfl_xor_sync(0xffffffffu, acc[j].x, o);
        acc[j].y += __shfl_xor_sync(0xffffffffu, acc[j].y, o);
        acc[j].z += __shfl_xor_sync(0xffffffffu, acc[j].z, o);
        acc[j].w += __shfl_xor_sync(0xffffffffu, acc[j].w, o);
      }
    }
    const int jl = lane >> 2, e = lane & 3;
    float gsum = 0.f;
#pragma unroll
    for (int j = 0; j < MLP_RA_COLS; ++j) {
      if (j == jl) gsum = e == 0 ? acc[j].x : e == 1 ? acc[j].y : e == 2 ? acc[j].z : acc[j].w;
    }
    const int c = c0 + jl * MLP_RWARPS, i = 4 * c + e;
    if (jl < MLP_RA_COLS && c < nq) {
      if (i < S.own) adam_one(S.ad + i, S.g0 + i, gsum, pm, mm, vm, params, grad_out, ad, step, sbc2);
      if (i == loss_i) loss = gsum;
    }
  }
  return loss;
}

// The reducer thread (warp wr = warp - (MLP_WARPS - MLP_RWARPS), lane) that reduce_adam_a gives
// float `i` of region A's slice: column c = i / 4 goes to warp c % MLP_RWARPS, as its
// ((c / MLP_RWARPS) % MLP_RA_COLS)-th column, lane 4 x that + i % 4.
__device__ __forceinline__ bool ra_owner(int i, int wr, int lane) {
  const int c = i >> 2;
  return wr == c % MLP_RWARPS && lane == 4 * ((c / MLP_RWARPS) % MLP_RA_COLS) + (i & 3);
}

template <int P>
__device__ void mlp_train(const int* __restrict__ desc, const unsigned* __restrict__ batches, int nb, int nsteps,
                          int t0, float* __restrict__ params, float* __restrict__ m_io, float* __restrict__ v_io,
                          float* __restrict__ partial, unsigned* __restrict__ bar, float* __restrict__ loss_ring,
                          float* __restrict__ grad_out, unsigned long long* __restrict__ prof, AdamArgs ad) {
  extern __shared__ float4 smem4[];
  float* sm = reinterpret_cast<float*>(smem4);
#if defined(MLP_FIXED_DESC)
  const MlpDesc& d = kFixedDesc;  // the shared-memory copy below is still made (and unused)
#else
  const MlpDesc& d = *reinterpret_cast<const MlpDesc*>(sm);
#endif
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, t = lane & 3;
  const int G = gridDim.x, b = blockIdx.x;

  // Everything starts at zero (the padding invariants), then the descriptor and the ones columns.
  {
    const int n4 = desc[12] / 4;  // smem_floats
    for (int i = tid; i < n4; i += MLP_THREADS) smem4[i] = make_float4(0.f, 0.f, 0.f, 0.f);
    __syncthreads();
    for (int i = tid; i < MLP_DESC_FLOATS; i += MLP_THREADS) reinterpret_cast<int*>(sm)[i] = desc[i];
    __syncthreads();
    for (int l = 0; l < d.layers; ++l) {
      const MlpLayer& ly = d.l[l];
      for (int r = tid; r < d.rows_cap; r += MLP_THREADS) {
        if (l == 0) {
          sm[d.a0_off0 + r * ly.ks_in + ly.in] = 1.f;
          sm[d.a0_off1 + r * ly.ks_in + ly.in] = 1.f;
        } else {
          sm[ly.aoff + r * ly.ks_in + ly.in] = 1.f;
        }
      }
    }
  }
  const int L = d.layers, pp = d.pp;
  // The gradient row in two regions: B = W_0 = [0, w1), finished last; A = [w1, pp + 4), every
  // other layer and the loss sum (index pp), reduced while W_0's gradients are computed. Each
  // block owns one slice of each, and the Adam state (master weights, m, v) of its parameters
  // stays in shared memory.
  const int w1 = L > 1 ? d.l[1].woff : pp, w2 = L > 2 ? d.l[2].woff : pp;
  // The reducer warps (the last MLP_RWARPS; wr < 0 elsewhere) and the thread that sums the loss
  // column (in region A's slice of one block).
  const int wr = warp - (MLP_WARPS - MLP_RWARPS);
  const int loss_i = pp - region_slice(d, true).g0;
  const bool loss_owner = wr >= 0 && loss_i >= 0 && loss_i < d.slice_a && ra_owner(loss_i, wr, lane);
  const int adam_n = d.slice_a + d.slice_b;
  float* pm = sm + d.adam_off;
  float* mm = pm + adam_n;
  float* vm = mm + adam_n;
  for (int r = 0; r < 2; ++r) {
    const Slice S = region_slice(d, r == 0);
    for (int i = tid; i < S.own; i += MLP_THREADS) {
      pm[S.ad + i] = params[S.g0 + i];
      mm[S.ad + i] = m_io[S.g0 + i];
      vm[S.ad + i] = v_io[S.g0 + i];
    }
  }
  float* W = sm + d.w_base;
  const int out_last = d.l[L - 1].out;
  if (nsteps > 0) prefetch_rows(d, sm + d.a0_off0, batch_ref(batches, 0), warp, lane);
  for (int i = tid; i < pp / 4; i += MLP_THREADS) cp_async16(W + 4 * i, params + 4 * i);
  cp_async_commit();
  cp_async_wait_all();
  __syncthreads();

  unsigned target = 0, target_a = 0;  // counts of bar[0] (barriers B and 2) and of barrier A's
  double b1t = pow(ad.b1d, (double)t0), b2t = pow(ad.b2d, (double)t0);  // beta^t, t = steps done
  unsigned long long ph[6] = {0, 0, 0, 0, 0, 0};
  unsigned long long clk = clock64();
  float* wloss = sm + d.wloss_off;
  float* red_b = sm + d.red_off;
  float* mypart = partial + (size_t)b * d.pstride;
  float step_loss = 0.f;  // the step's loss, in the loss_owner thread

  for (int s = 0; s < nsteps; ++s) {
    const BatchRef br = batch_ref(batches, s % nb);
    const int tiles = (br.rows + 7) >> 3;
    const int active = min(G, tiles);
    // The forward's units hold one row tile each; the backward's, ngr groups of row tiles as even
    // as possible, at most 2 (5 -> 1 + 2 + 2, 4 -> 2 + 2).
    const int my = my_tiles(br.rows), ngr = (my + 1) / 2;
    // Unit indices without integer division: `u / n` with a run-time n compiles to a dependent
    // chain of ~60 instructions per unit, on the critical path of every layer (removing it saved
    // 2% of the run). For non-negative x, n < 2^12, (int)((x + 0.5f) * (1/n)) == x / n exactly:
    // x / n is at least 1/(2n) away from the next integer, far more than the float error.
    const float rmy = 1.0f / (float)max(my, 1), rngr = 1.0f / (float)max(ngr, 1);
    const float* A0 = sm + ((s & 1) ? d.a0_off1 : d.a0_off0);
    const float scale = 2.0f / (float)(br.rows * out_last);
    b1t *= ad.b1d;
    b2t *= ad.b2d;

    // The next step's rows stream in during this one (their buffer was last read before barrier
    // #1 of the previous step). Always one group, so the wait counts below stay fixed.
    if (s + 1 < nsteps) prefetch_rows(d, sm + ((s & 1) ? d.a0_off0 : d.a0_off1), batch_ref(batches, (s + 1) % nb), warp, lane);
    cp_async_commit();

    // 1. forward. In flight (newest last): W_0, W_1, W_rest refresh groups, the prefetch group.
    float loss = 0.f;
#if defined(MLP_FIXED_DESC)
#pragma unroll
#endif
    for (int l = 0; l < L; ++l) {
      if (l == 0) cp_async_wait<3>();
      else if (l == 1) cp_async_wait<2>();
      else if (l == 2) cp_async_wait<1>();
      __syncthreads();  // W_l has landed (every thread's part) and A_l is written
      const int units = ((d.l[l].out + 15) >> 4) * my;
      for (int u = warp; u < units; u += MLP_WARPS) {
        const int m = (int)(((float)u + 0.5f) * rmy), k = u - m * my;
        fwd_unit<P, 1>(d, sm, A0, l, m, k, br.rows, br.y, scale, loss, g, t);
      }
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) loss += __shfl_xor_sync(0xffffffffu, loss, o);
    if (lane == 0) wloss[warp] = loss;
    __syncthreads();
    if (tid == 0 && my > 0) {
      float sum = 0.f;
      for (int w = 0; w < MLP_WARPS; ++w) sum += wloss[w];
      mypart[pp] = sum;  // the block's loss sum, reduced with region A
    }
    stamp(ph, 0, clk);

    // 2. backward; weight-gradient items fill the warps the backward units leave idle, and the
    //    last backward phase takes every item left of layers >= 1 (region A is complete after it).
    int avail = 0, done = 0;
    for (int l = L - 1; l >= 1; --l) {
      avail += dw_count(d.l[l]);  // D_l is ready: layer l's items are available
      const int units = ((d.l[l].in + 15) >> 4) * ngr;
      const int take = my > 0 ? (l == 1 ? avail - done : min(avail - done, max(0, MLP_WARPS - units))) : 0;
      for (int u = warp; u < units + take; u += MLP_WARPS) {
        if (u < units) {
          const int m = (int)(((float)u + 0.5f) * rngr), q = u - m * ngr;
          const int k = (int)(((float)(q * my) + 0.5f) * rngr), nt = (int)(((float)((q + 1) * my) + 0.5f) * rngr) - k;
          if (nt == 2) bwd_unit<P, 2>(d, sm, l, m, k, g, t);
          else bwd_unit<P, 1>(d, sm, l, m, k, g, t);
        } else {
          dw_work<P>(d, sm, A0, done + u - units, my, mypart, g, t);
        }
      }
      done += take;
      __syncthreads();  // D_{l-1} is written
    }
    // One layer: no backward phase ran, so no block barrier orders tid 0's loss sum (mypart[pp],
    // region A) before the reducer thread's release at barrier A.
    if (L == 1) __syncthreads();
    // 3. the last phase: layer 0's weight gradients on the first warps; on the last MLP_RWARPS,
    //    as soon as every block's region A is in L2 (barrier A on bar[1]), its reduce-scatter
    //    and Adam, the loss of the step included.
    target_a += G;
    if (warp < MLP_WARPS - MLP_RWARPS) {
      if (my > 0) {
        for (int it = done + warp; it < d.dw_items; it += MLP_WARPS - MLP_RWARPS)
          dw_work<P>(d, sm, A0, it, my, mypart, g, t);
      }
    } else {
      // Barrier A, one counter per reducer warp: warp wr of every block arrives on its own counter
      // (lane 0, after the block barrier that ended the backward, so the release covers every
      // region-A write of the block) and all its lanes poll it (one request a poll per warp).
      // Every reducer warp reads every block's row, so each waits for all G arrivals itself; no
      // barrier among the reducer warps is needed (see reduce_adam_a for why there must be none).
      unsigned* bar_a = bar + MLP_BAR_STRIDE * (1 + wr);
      if (lane == 0) arrive_release(bar_a);
      wait_acquire(bar_a, target_a);
      const Slice SA = region_slice(d, true);
      const float l = reduce_adam_a(partial, d.pstride, active, SA, wr, lane, loss_i, pm, mm, vm, params,
                                    (grad_out && s + 1 == nsteps) ? grad_out : nullptr, ad, ad.lr / (float)(1.0 - b1t),
                                    sqrtf((float)(1.0 - b2t)));
      if (loss_owner) step_loss = l * (1.0f / (float)(br.rows * out_last));
    }
    stamp(ph, 1, clk);

    // 4. every block's W_0 gradient is in L2 (barrier B on bar[0]): its reduce-scatter and Adam.
    grid_sync(bar, target);
    stamp(ph, 2, clk);
    const Slice SB = region_slice(d, false);
    if (SB.own_red > 0) {
      reduce_slice(partial, d.pstride, active, SB, red_b, tid, MLP_THREADS);
      __syncthreads();
      adam_slice(SB, red_b, pm, mm, vm, params, (grad_out && s + 1 == nsteps) ? grad_out : nullptr, ad,
                 ad.lr / (float)(1.0 - b1t), sqrtf((float)(1.0 - b2t)), tid, MLP_THREADS);
    }
    stamp(ph, 3, clk);

    // 5. every slice is updated: the loss to the host, then refresh this block's copy of W.
    grid_sync(bar, target);
    stamp(ph, 4, clk);
    if (loss_owner) *reinterpret_cast<volatile float*>(loss_ring + s) = step_loss;
    if (s + 1 < nsteps) {
      refresh(W, params, 0, w1);
      refresh(W, params, w1, w2);
      refresh(W, params, w2, pp);
    }
    stamp(ph, 5, clk);
  }
  cp_async_wait_all();
  for (int r = 0; r < 2; ++r) {
    const Slice S = region_slice(d, r == 0);
    for (int i = tid; i < S.own; i += MLP_THREADS) {
      m_io[S.g0 + i] = mm[S.ad + i];
      v_io[S.g0 + i] = vm[S.ad + i];
    }
  }
  if (prof && tid == 0) {
    for (int i = 0; i < 6; ++i) prof[b * 8 + i] = ph[i];
    prof[b * 8 + 6] = (unsigned long long)nsteps;
    prof[b * 8 + 7] = 0;
  }
}

#define MLP_KERNEL(NAME, P)                                                                                  \
  extern "C" __global__ void __launch_bounds__(MLP_THREADS, 1)                                              \
      NAME(const int* desc, const unsigned* batches, int nb, int nsteps, int t0, float* params, float* m_io, \
           float* v_io, float* partial, unsigned* bar, float* loss_ring, float* grad_out,                   \
           unsigned long long* prof, AdamArgs ad) {                                                         \
    mlp_train<P>(desc, batches, nb, nsteps, t0, params, m_io, v_io, partial, bar, loss_ring, grad_out, prof, \
                 ad);                                                                                       \
  }

// One NVRTC module per precision (`-D MLP_PREC=<PREC_*>`, persistent/trainer.rs MODULES): the
// three kernels in one module took 6-8 s of NVRTC, the longest pole of a cold precompile; apart
// they compile in parallel, and a run compiles only its own precision.
#if !defined(MLP_PREC)
#error "MLP_PREC comes from Rust (src/persistent/trainer.rs MODULES)"
#elif MLP_PREC == PREC_F32
MLP_KERNEL(mlp_persistent_f32, PREC_F32)
#elif MLP_PREC == PREC_TF32
MLP_KERNEL(mlp_persistent_tf32, PREC_TF32)
#elif MLP_PREC == PREC_BF16
MLP_KERNEL(mlp_persistent_bf16, PREC_BF16)
#else
#error "MLP_PREC is PREC_F32, PREC_TF32 or PREC_BF16"
#endif
