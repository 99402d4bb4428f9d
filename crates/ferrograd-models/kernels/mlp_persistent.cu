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
// backward twice that) = 2.3 TFLOP, and 40.4M x 71 x 4 B = 11.5 GB of input reads. At H200 peaks
// (4.8 TB/s; ~60 TFLOP/s FFMA, ~400 TFLOP/s dense TF32 with mma.sync) the reads take 2.4 ms and
// the math 6-40 ms, but neither dominates: 8,023 dependent steps do, because every step needs
// every SM's gradient before any SM can take the next one. At <= 0.1 s a step has 12.5 us, so
// the design is about per-step latency: few grid-wide barriers, no host round trip, all operands
// on chip.
//
// What lives where (one block of 256 threads per SM, G = #SMs blocks, all co-resident):
//   shared memory, per block (Monster Walk: ~170 KB)
//     W   all weights, augmented: layer l is [out_pad8][ks_in] row-major with the bias as column
//         `in` (the activations carry a constant 1 there, so bias and weight gradients come out of
//         one matrix product); rows padded to 8, ks(w) = roundup(w + 1, 8) + 4 (== 4 mod 8 so
//         that fragment loads hit 32 different banks). The same layout is the global `params`
//         buffer, so the per-step refresh is a straight 16-byte cp.async copy.
//     A_l activations (inputs of every layer) of the block's rows; A_0 double-buffered so the
//         next step's rows stream in (cp.async, zero-filled past the batch) during the barrier.
//     D_l the loss gradient w.r.t. every layer's pre-activation, for the weight gradients.
//     Adam master weights, m and v of the block's slice of the parameters (never in global).
//   global memory (L2-resident): params (11,264 padded floats), one partial gradient row per
//     block (G x 45 KB = 5.9 MB), the barrier counter.
//   mapped pinned host memory: the loss of every step (the host polls it; the kernel never waits).
//
// Per step, per block (rows are split in 8-row tiles, tile i -> block i mod G; 631 tiles of
// Monster Walk -> 4 or 5 tiles = <= 40 rows per block):
//   1. chain: warp w takes tile w through all layers forward, the loss, and back (dX) with
//      m16n8k8 mma.sync (N = the 8 rows, M = output features, K = input features); a warp only
//      touches its own rows, so layers are separated by __syncwarp, not block barriers.
//   2. weight gradients dW_l = D_l^T A_l (K = the block's rows), split in 31 items over 8 warps,
//      written to the block's partial row in global memory (st.cg: L2).
//   3. grid barrier #1.
//   4. reduce-scatter + Adam: block b sums its slice (88 floats) over the G partial rows in a
//      fixed order (deterministic), updates its m, v and master weights in shared memory and
//      writes the new weights to `params`; block G-1 also sums the G loss partials -> host ring.
//   5. grid barrier #2, then every block copies `params` (45 KB, L2) into its W.
// Synchronization per step: 2 grid barriers, 4 block barriers, ~12 warp barriers per warp.
// Work per SM per step (Monster Walk, 40 rows): 2.3 MFLOP of useful math (x1.19 for padding,
// x3 for the 3xTF32 split), ~600 KB of shared-memory fragment reads, 45 KB written and ~100 KB
// read from L2, 11 KB read from HBM.
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
// rows that are discarded, and slack after W and D keeps every read inside the allocation.
// --------------------------------------------------------------------------------------------------

#define MLP_MAX_LAYERS 16
#define MLP_THREADS 256
#define MLP_WARPS 8
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
  int slice, ngroups, w_base, a0_off0;
  int a0_off1, red_off, adam_off, wloss_off;
  int smem_floats, dw_items, unused0, unused1;
  MlpLayer l[MLP_MAX_LAYERS];
};
struct AdamArgs {
  double b1d, b2d;
  float lr, b1, b2, omb1, omb2, eps;
};
#define MLP_DESC_FLOATS ((int)(sizeof(MlpDesc) / 4))

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
// Loads of data other blocks wrote in this launch: L2 only (L1 is not coherent across SMs).
__device__ __forceinline__ float4 ld_cg4(const float* p) {
  float4 v;
  asm volatile("ld.global.cg.v4.f32 {%0,%1,%2,%3}, [%4];\n" : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w) : "l"(p));
  return v;
}
__device__ __forceinline__ float ld_cg(const float* p) {
  float v;
  asm volatile("ld.global.cg.f32 %0, [%1];\n" : "=f"(v) : "l"(p));
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

// Grid-wide barrier (every block is resident: cooperative launch). The counter only grows; each
// barrier adds gridDim.x, and `target` is this block's count of barriers x gridDim.x. The fences
// around it make every write before the barrier (by any thread of any block) visible to every
// read after it, as cooperative_groups' grid.sync() does.
__device__ __forceinline__ void grid_sync(unsigned* bar, unsigned& target) {
  __syncthreads();
  target += gridDim.x;
  if (threadIdx.x == 0) {
    __threadfence();
    atomicAdd(bar, 1u);
    while (static_cast<int>(ld_acquire(bar) - target) < 0) {
    }
    __threadfence();
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

// ---- the per-warp chain: one 8-row tile forward through every layer and back -------------------

// Z^T (M = out features in MT tiles of 16, N = the 8 rows) = W_aug (M x K) * X_aug^T (K = in + 1).
template <int P, int MT>
__device__ __forceinline__ void fwd_mma(Acc<P, MT>& c, const float* __restrict__ W, int ksw, int ksteps,
                                        const float* __restrict__ X, int ksx, int g, int t) {
  c.zero();
  const float* xr = X + g * ksx + t;
  const float* wr = W + g * ksw + t;
#pragma unroll 2
  for (int kk = 0; kk < ksteps; ++kk) {
    const int k0 = kk * 8;
    const FragB<P> b = frag_b<P>(xr[k0], xr[k0 + 4]);
#pragma unroll
    for (int m = 0; m < MT; ++m) {
      const float* w = wr + m * 16 * ksw + k0;
      const FragA<P> a = frag_a<P>(w[0], w[8 * ksw], w[4], w[8 * ksw + 4]);
      c.mma(m, a, b);
    }
  }
}

// A hidden layer: Y[r][j] = act(z) for j < out (the ones column j == out and the padding were
// set once and are never written).
template <int P, int MT>
__device__ void fwd_hidden(const float* W, int ksw, int ksteps, const float* X, int ksx, float* Y, int ksy, int out,
                           int relu, int g, int t) {
  Acc<P, MT> c;
  fwd_mma<P, MT>(c, W, ksw, ksteps, X, ksx, g, t);
#pragma unroll
  for (int m = 0; m < MT; ++m) {
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int j = m * 16 + g + (e >> 1) * 8, r = 2 * t + (e & 1);
      if (j < out) {
        const float z = c.get(m, e);
        Y[r * ksy + j] = relu ? fmaxf(z, 0.f) : z;
      }
    }
  }
}

// The output layer: the loss and D = dLoss/dz. `nv` rows of the tile are real; the target is
// `y` (global, rows of `out`) or, for an autoencoder (y == nullptr), the input tile X0.
template <int P, int MT>
__device__ void fwd_output(const float* W, int ksw, int ksteps, const float* X, int ksx, float* D, int ksd, int out,
                           int relu, const float* __restrict__ y, const float* X0, int ks0, int nv, float scale,
                           float& loss, int g, int t) {
  Acc<P, MT> c;
  fwd_mma<P, MT>(c, W, ksw, ksteps, X, ksx, g, t);
#pragma unroll
  for (int m = 0; m < MT; ++m) {
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int j = m * 16 + g + (e >> 1) * 8, r = 2 * t + (e & 1);
      if (j < out) {
        const float z = c.get(m, e);
        const float yv = relu ? fmaxf(z, 0.f) : z;
        float diff = 0.f;
        if (r < nv) diff = yv - (y ? __ldg(y + (size_t)r * out + j) : X0[r * ks0 + j]);
        loss = fmaf(diff, diff, loss);
        D[r * ksd + j] = (relu && !(z > 0.f)) ? 0.f : scale * diff;
      }
    }
  }
}

// Dn[r][i] = (W^T D)[i][r] masked by ReLU' of the layer below (A > 0), for i < in.
// M = in features (tiles of 16), N = the 8 rows, K = out features (ksteps of 8).
template <int P, int MT>
__device__ void bwd_layer(const float* __restrict__ W, int ksw, int ksteps, const float* __restrict__ D, int ksd,
                          float* Dn, const float* __restrict__ Aact, int ksn, int in, int relu, int g, int t) {
  Acc<P, MT> c;
  c.zero();
  const float* dr = D + g * ksd + t;
#pragma unroll 2
  for (int kk = 0; kk < ksteps; ++kk) {
    const int k0 = kk * 8;
    const FragB<P> b = frag_b<P>(dr[k0], dr[k0 + 4]);
    const float* w0 = W + (k0 + t) * ksw + g;
    const float* w1 = w0 + 4 * ksw;
#pragma unroll
    for (int m = 0; m < MT; ++m) {
      const FragA<P> a = frag_a<P>(w0[m * 16], w0[m * 16 + 8], w1[m * 16], w1[m * 16 + 8]);
      c.mma(m, a, b);
    }
  }
#pragma unroll
  for (int m = 0; m < MT; ++m) {
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int i = m * 16 + g + (e >> 1) * 8, r = 2 * t + (e & 1);
      if (i < in) Dn[r * ksn + i] = (relu && !(Aact[r * ksn + i] > 0.f)) ? 0.f : c.get(m, e);
    }
  }
}

#define MLP_MT_SWITCH(mt, FN, ...)     \
  switch (mt) {                        \
    case 1: FN<P, 1>(__VA_ARGS__); break; \
    case 2: FN<P, 2>(__VA_ARGS__); break; \
    case 3: FN<P, 3>(__VA_ARGS__); break; \
    case 4: FN<P, 4>(__VA_ARGS__); break; \
    case 5: FN<P, 5>(__VA_ARGS__); break; \
    case 6: FN<P, 6>(__VA_ARGS__); break; \
    case 7: FN<P, 7>(__VA_ARGS__); break; \
    default: FN<P, 8>(__VA_ARGS__); break; \
  }

// Tile k (rows 8k..8k+7 of the block's buffers) forward, loss, backward. Returns nothing; the
// deltas D_l of the tile are left in shared memory for the weight gradients.
template <int P>
__device__ void chain(const MlpDesc& d, float* sm, const float* A0, int k, int nv, const float* y, float scale,
                      float& loss, int g, int t) {
  const int L = d.layers;
  const float* X0 = A0 + k * 8 * d.l[0].ks_in;
  for (int l = 0; l < L; ++l) {
    const MlpLayer& ly = d.l[l];
    const float* W = sm + d.w_base + ly.woff;
    const float* X = (l == 0) ? X0 : sm + ly.aoff + k * 8 * ly.ks_in;
    const int mt = (ly.out + 15) >> 4, ksteps = (ly.in + 8) >> 3;
    if (l + 1 < L) {
      float* Y = sm + d.l[l + 1].aoff + k * 8 * ly.ks_out;
      MLP_MT_SWITCH(mt, fwd_hidden, W, ly.ks_in, ksteps, X, ly.ks_in, Y, ly.ks_out, ly.out, ly.relu, g, t)
    } else {
      float* D = sm + ly.doff + k * 8 * ly.ks_out;
      MLP_MT_SWITCH(mt, fwd_output, W, ly.ks_in, ksteps, X, ly.ks_in, D, ly.ks_out, ly.out, ly.relu, y, X0,
                    d.l[0].ks_in, nv, scale, loss, g, t)
    }
    __syncwarp();
  }
  for (int l = L - 1; l >= 1; --l) {
    const MlpLayer& ly = d.l[l];
    const float* W = sm + d.w_base + ly.woff;
    const float* D = sm + ly.doff + k * 8 * ly.ks_out;
    float* Dn = sm + d.l[l - 1].doff + k * 8 * ly.ks_in;
    const float* Aact = sm + ly.aoff + k * 8 * ly.ks_in;
    const int mt = (ly.in + 15) >> 4, ksteps = (ly.out + 7) >> 3;
    MLP_MT_SWITCH(mt, bwd_layer, W, ly.ks_in, ksteps, D, ly.ks_out, Dn, Aact, ly.ks_in, ly.in, d.l[l - 1].relu, g, t)
    __syncwarp();
  }
}

// ---- weight gradients ---------------------------------------------------------------------------

// dW_l[j][i] = sum_r D_l[r][j] A_l[r][i] for j in [j0, j0+16) and up to 3 column tiles of 8 from
// nt0: M = out features, N = in features (+ the bias column), K = the block's rows (ktiles x 8).
template <int P>
__device__ void dw_item(const float* __restrict__ D, int ksd, const float* __restrict__ A, int ksa, int ktiles, int j0,
                        int nt0, int cnt, int out, float* dst, int ksw, int g, int t) {
  Acc<P, 3> c;
  c.zero();
  for (int kk = 0; kk < ktiles; ++kk) {
    const int r0 = kk * 8;
    const float* d0 = D + (r0 + t) * ksd + j0 + g;
    const float* d1 = d0 + 4 * ksd;
    const FragA<P> a = frag_a<P>(d0[0], d0[8], d1[0], d1[8]);
    const float* x0 = A + (r0 + t) * ksa + nt0 * 8 + g;
    const float* x1 = x0 + 4 * ksa;
#pragma unroll
    for (int q = 0; q < 3; ++q) {
      if (q < cnt) {
        const FragB<P> b = frag_b<P>(x0[q * 8], x1[q * 8]);
        c.mma(q, a, b);
      }
    }
  }
#pragma unroll
  for (int q = 0; q < 3; ++q) {
    if (q < cnt) {
      const int i = (nt0 + q) * 8 + 2 * t, j = j0 + g;
      // Columns past `in` are exact zeros (A's padding), so pairs are written whole.
      if (j < out) st_cg2(dst + j * ksw + i, c.get(q, 0), c.get(q, 1));
      if (j + 8 < out) st_cg2(dst + (j + 8) * ksw + i, c.get(q, 2), c.get(q, 3));
    }
  }
}

// Item `it` of the block's weight-gradient work: layer, 16-row tile of W, group of <= 3 column tiles.
template <int P>
__device__ void dw_work(const MlpDesc& d, const float* sm, const float* A0, int it, int ktiles, float* part, int g,
                        int t) {
  for (int l = 0; l < d.layers; ++l) {
    const MlpLayer& ly = d.l[l];
    const int mt = (ly.out + 15) >> 4, nt = (ly.in + 8) >> 3, ng = (nt + 2) / 3;
    if (it < mt * ng) {
      const int m = it / ng, q = it - m * ng;
      const float* A = (l == 0) ? A0 : sm + ly.aoff;
      dw_item<P>(sm + ly.doff, ly.ks_out, A, ly.ks_in, ktiles, m * 16, q * 3, min(3, nt - q * 3), ly.out,
                 part + ly.woff, ly.ks_in, g, t);
      return;
    }
    it -= mt * ng;
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

// Start copying this block's rows of batch `br` into A_0 buffer `dst` (zero past the batch).
__device__ __forceinline__ void prefetch_rows(const MlpDesc& d, float* dst, const BatchRef& br) {
  const int G = gridDim.x, b = blockIdx.x, in = d.l[0].in, ks = d.l[0].ks_in;
  const int tiles = (br.rows + 7) >> 3;
  const int my = tiles > b ? (tiles - b + G - 1) / G : 0;
  const int total = my * 8 * in;
  for (int e = threadIdx.x; e < total; e += MLP_THREADS) {
    const int rl = e / in, k = e - rl * in;
    const int row = (b + (rl >> 3) * G) * 8 + (rl & 7);
    const bool valid = row < br.rows;
    cp_async4(dst + rl * ks + k, br.x + (valid ? (size_t)row * in + k : 0), valid);
  }
}

template <int P>
__device__ void mlp_train(const int* __restrict__ desc, const unsigned* __restrict__ batches, int nb, int nsteps,
                          int t0, float* __restrict__ params, float* __restrict__ m_io, float* __restrict__ v_io,
                          float* __restrict__ partial, unsigned* __restrict__ bar, float* __restrict__ loss_ring,
                          float* __restrict__ grad_out, unsigned long long* __restrict__ prof, AdamArgs ad) {
  extern __shared__ float4 smem4[];
  float* sm = reinterpret_cast<float*>(smem4);
  const MlpDesc& d = *reinterpret_cast<const MlpDesc*>(sm);
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
  // This block's slice of the optimizer: master weights, m and v stay in shared memory.
  const int s0 = b * d.slice;
  const int own = max(0, min(d.slice, d.pp - s0));
  float* pm = sm + d.adam_off;
  float* mm = pm + d.slice;
  float* vm = mm + d.slice;
  for (int i = tid; i < own; i += MLP_THREADS) {
    pm[i] = params[s0 + i];
    mm[i] = m_io[s0 + i];
    vm[i] = v_io[s0 + i];
  }
  float* W = sm + d.w_base;
  const int out_last = d.l[d.layers - 1].out;
  if (nsteps > 0) prefetch_rows(d, sm + d.a0_off0, batch_ref(batches, 0));
  for (int i = tid; i < d.pp / 4; i += MLP_THREADS) cp_async16(W + 4 * i, params + 4 * i);
  cp_async_commit();
  cp_async_wait_all();
  __syncthreads();

  unsigned target = 0;
  double b1t = pow(ad.b1d, (double)t0), b2t = pow(ad.b2d, (double)t0);
  unsigned long long ph[7] = {0, 0, 0, 0, 0, 0, 0};
  unsigned long long clk = clock64();
  float* wloss = sm + d.wloss_off;
  float* red = sm + d.red_off;
  float* mypart = partial + (size_t)b * d.pstride;

  for (int s = 0; s < nsteps; ++s) {
    const BatchRef br = batch_ref(batches, s % nb);
    const int tiles = (br.rows + 7) >> 3;
    const int active = min(G, tiles);
    const int my = tiles > b ? (tiles - b + G - 1) / G : 0;
    const float* A0 = sm + ((s & 1) ? d.a0_off1 : d.a0_off0);
    const float scale = 2.0f / (float)(br.rows * out_last);

    // 1. forward + backward chains, one 8-row tile per warp.
    float loss = 0.f;
    for (int k = warp; k < my; k += MLP_WARPS) {
      const int row0 = (b + k * G) * 8;
      const int nv = min(8, br.rows - row0);
      const float* y = br.y ? br.y + (size_t)row0 * out_last : nullptr;
      chain<P>(d, sm, A0, k, nv, y, scale, loss, g, t);
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) loss += __shfl_xor_sync(0xffffffffu, loss, o);
    if (lane == 0) wloss[warp] = loss;
    __syncthreads();
    if (tid == 0) {
      unsigned long long now = clock64();
      ph[0] += now - clk;
      clk = now;
    }

    // 2. weight gradients of this block's rows -> its partial row; its loss sum after them.
    if (my > 0) {
      for (int it = warp; it < d.dw_items; it += MLP_WARPS) dw_work<P>(d, sm, A0, it, my, mypart, g, t);
      if (tid == 0) {
        float sum = 0.f;
        for (int w = 0; w < MLP_WARPS; ++w) sum += wloss[w];
        mypart[d.pp] = sum;
      }
    }
    // The next step's rows stream in during the barriers.
    if (s + 1 < nsteps) {
      prefetch_rows(d, sm + ((s & 1) ? d.a0_off0 : d.a0_off1), batch_ref(batches, (s + 1) % nb));
      cp_async_commit();
    }
    if (tid == 0) {
      unsigned long long now = clock64();
      ph[1] += now - clk;
      clk = now;
    }

    // 3. every block's gradient is in L2.
    grid_sync(bar, target);
    if (tid == 0) {
      unsigned long long now = clock64();
      ph[2] += now - clk;
      clk = now;
    }

    // 4. reduce-scatter and Adam on this block's slice; the loss of the step to the host ring.
    b1t *= ad.b1d;
    b2t *= ad.b2d;
    if (b == G - 1 && warp == 0) {
      float l = 0.f;
      for (int bb = lane; bb < active; bb += 32) l += ld_cg(partial + (size_t)bb * d.pstride + d.pp);
#pragma unroll
      for (int o = 16; o > 0; o >>= 1) l += __shfl_xor_sync(0xffffffffu, l, o);
      if (lane == 0) *reinterpret_cast<volatile float*>(loss_ring + s) = l * (1.0f / (float)(br.rows * out_last));
    }
    if (own > 0) {
      const int q4 = d.slice / 4, ng = d.ngroups;
      for (int w = tid; w < q4 * ng; w += MLP_THREADS) {
        const int c = w % q4, grp = w / q4;
        float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
        if (4 * c < own) {
          const float* src = partial + s0 + 4 * c;
#pragma unroll 4
          for (int bb = grp; bb < active; bb += ng) {
            const float4 v = ld_cg4(src + (size_t)bb * d.pstride);
            acc.x += v.x;
            acc.y += v.y;
            acc.z += v.z;
            acc.w += v.w;
          }
        }
        reinterpret_cast<float4*>(red + grp * d.slice)[c] = acc;
      }
      __syncthreads();
      const float bc1 = (float)(1.0 - b1t), bc2 = (float)(1.0 - b2t);
      const float step = ad.lr / bc1, sbc2 = sqrtf(bc2);
      for (int i = tid; i < own; i += MLP_THREADS) {
        float gsum = 0.f;
        for (int grp = 0; grp < d.ngroups; ++grp) gsum += red[grp * d.slice + i];
        // The formula of kernels/optim.cu adam_f32 (and the fused Monster Walk step).
        const float mi = ad.b1 * mm[i] + ad.omb1 * gsum;
        const float vi = ad.b2 * vm[i] + ad.omb2 * (gsum * gsum);
        const float p = pm[i] - step * (mi / (sqrtf(vi) / sbc2 + ad.eps));
        mm[i] = mi;
        vm[i] = vi;
        pm[i] = p;
        params[s0 + i] = p;
        if (grad_out && s + 1 == nsteps) grad_out[s0 + i] = gsum;
      }
    }
    if (tid == 0) {
      unsigned long long now = clock64();
      ph[3] += now - clk;
      clk = now;
    }

    // 5. every slice is updated: refresh this block's copy of the weights.
    grid_sync(bar, target);
    if (tid == 0) {
      unsigned long long now = clock64();
      ph[4] += now - clk;
      clk = now;
    }
    if (s + 1 < nsteps) {
      for (int i = tid; i < d.pp / 4; i += MLP_THREADS) cp_async16(W + 4 * i, params + 4 * i);
      cp_async_commit();
    }
    cp_async_wait_all();
    __syncthreads();
    if (tid == 0) {
      unsigned long long now = clock64();
      ph[5] += now - clk;
      clk = now;
    }
  }
  for (int i = tid; i < own; i += MLP_THREADS) {
    m_io[s0 + i] = mm[i];
    v_io[s0 + i] = vm[i];
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

MLP_KERNEL(mlp_persistent_f32, PREC_F32)
MLP_KERNEL(mlp_persistent_tf32, PREC_TF32)
MLP_KERNEL(mlp_persistent_bf16, PREC_BF16)
