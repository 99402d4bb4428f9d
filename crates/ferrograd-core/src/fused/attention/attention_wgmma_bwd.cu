// attention_wgmma_bwd.cu: the Hopper (sm_90a, wgmma) attention backward, bf16 / f16, head dims 64
// and 128: the kernel, dq_acc's tile layout and its conversion kernel. Included at the end of
// attention_wgmma.cu, whose header describes the algorithm, what was measured and the ordering
// rules, and whose helpers (descriptors, loads, fg_wg_tile) it uses; apart only to keep each file
// to one job and under 600 lines.
// ---------------------------------------------------------------------------------------------
// Backward
// ---------------------------------------------------------------------------------------------

// 64-key m-tiles a warpgroup owns in the backward: two at d = 64 (dQ's reduction traffic per key
// halves), one at d = 128 (registers).
#define FG_WG_BWD_MT(D) ((D) <= 64 ? 2 : 1)
#define FG_WG_BWD_BKVD(D) (64 * FG_WG_BWD_WGS * FG_WG_BWD_MT(D))
#define FG_WG_BWD_BQ 64

// dq_acc of the Hopper backward: [B * H][Tqp][D] f32 with Tqp = Tq rounded up to 64, each 64-row
// tile stored in the order the dQ accumulators come out of the wgmma fragments (warpgroup, warp,
// n8 chunk, row half, lane, pair), so that staging a tile in shared memory is conflict-free
// (a warp writes 256 contiguous bytes) and the tile goes to global memory as ONE bulk reduction
// (cp.reduce.async.bulk .add.f32, as FlashAttention-3 does). Per-thread red.global.add of the
// row-major layout held this backward at ~1 TB/s of dQ traffic, a third of its time at d = 128,
// T = 4096 (measured by leaving the reduction out: 4.48 -> 3.05 ms). fg_attn_dq_wg undoes the
// order. Element (r, c) of a tile: warpgroup c / DH, warp r / 16, chunk (c % DH) / 8, half
// (r / 8) % 2, lane 4 (r % 8) + (c % 8) / 2, pair c % 2.
template <int D>
static __device__ __forceinline__ int fg_wg_dq_pos(int wg, int w4, int dt, int hh, int lane) {
  constexpr int DH = D / FG_WG_BWD_WGS;
  return (((wg * 4 + w4) * (DH / 8) + dt) * 2 + hh) * 64 + lane * 2;
}

template <typename T, int D>
static __device__ __forceinline__ void fg_attn_dq_wg(const float* __restrict__ dq_acc, T* __restrict__ dq,
                                                     const FgAttnParams& p) {
  constexpr int DH = D / FG_WG_BWD_WGS;
  const unsigned long long tqp = ((unsigned long long)p.Tq + 63) / 64 * 64;
  const unsigned long long n = (unsigned long long)p.B * p.H * p.Tq * D;
  FG_GRID_STRIDE(e, n) {
    const unsigned long long r = e / D, c = e - r * D;
    const unsigned long long bh = r / p.Tq, i = r - bh * p.Tq;
    const unsigned long long b = bh / p.H, h = bh - b * p.H;
    const int ri = (int)(i & 63), ci = (int)c, wg = ci / DH, cc = ci - wg * DH;
    const int lane = (ri & 7) * 4 + ((cc & 7) >> 1);
    const unsigned long long tile = (bh * tqp + (i & ~63ull)) * D;
    const float v = dq_acc[tile + fg_wg_dq_pos<D>(wg, ri >> 4, cc >> 3, (ri >> 3) & 1, lane) + (cc & 1)];
    dq[b * p.dq.b + h * p.dq.h + i * p.dq.t + c * p.dq.d] = fg_from_acc<T>(v);
  }
}

template <typename T, int D, bool DROP>
static __device__ __forceinline__ void fg_attn_bwd_wg(const T* __restrict__ q, const T* __restrict__ k,
                                                      const T* __restrict__ v, const T* __restrict__ dout,
                                                      const float* __restrict__ lse,
                                                      const float* __restrict__ delta, float* __restrict__ dq_acc,
                                                      T* __restrict__ dk, T* __restrict__ dv,
                                                      const FgAttnParams& p) {
  typedef FgTc<T> M;
  // dQ = dS K: each warpgroup takes DH columns of the head dim.
  constexpr int MT = FG_WG_BWD_MT(D), BKV = FG_WG_BWD_BKVD(D), BQ = FG_WG_BWD_BQ, NQ = BQ / 8, DT = D / 8, SZ = 2, DH = D / FG_WG_BWD_WGS,
                NTH = FG_WG_BWD_THREADS;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, t = lane & 3;
  const int wg = warp >> 2;
  const int Tq = (int)p.Tq, Tk = (int)p.Tk;
  const FgWgTile tl = fg_wg_tile(p, (Tk + BKV - 1) / BKV);
  const unsigned int b = tl.b, h = tl.h, bh = tl.bh;
  const int j0 = tl.tile * BKV;
  const T* qg = q + (long long)b * p.q.b + (long long)h * p.q.h;
  const T* kg = k + (long long)b * p.k.b + (long long)h * p.k.h;
  const T* vg = v + (long long)b * p.v.b + (long long)h * p.v.h;
  const T* og = dout + (long long)b * p.dout.b + (long long)h * p.dout.h;
  const float* lseg = lse + (unsigned long long)bh * Tq;
  const float* dlg = delta + (unsigned long long)bh * Tq;

  // K, V [BKV][D]; Q, dO [2][BQ][D]; dS^T [BKV][BQ]; then log2(e) * lse and delta, [2][BQ] each.
  const unsigned int base = (fg_smem_addr(fg_smem) + 1023u) & ~1023u;
  const unsigned int ks = base, vs = ks + BKV * D * SZ, qs = vs + BKV * D * SZ, os = qs + 2 * BQ * D * SZ,
                     sts = os + 2 * BQ * D * SZ;
  float* lse2s = reinterpret_cast<float*>(fg_smem + (sts + BKV * BQ * SZ - fg_smem_addr(fg_smem)));  // byte offset
  float* dls = lse2s + 2 * BQ;

  const int nqb = (Tq + BQ - 1) / BQ;
  const int ib0 = p.causal ? j0 / BQ : 0;  // query blocks before this one see none of these keys
  const int nit = nqb > ib0 ? nqb - ib0 : 0;
  // dQ staging: two 64 x D f32 tiles in fragment order (fg_wg_dq_pos), one per step parity.
  float* dqst = dls + 2 * BQ;
  const unsigned long long tqp = ((unsigned long long)Tq + BQ - 1) / BQ * BQ;  // dq_acc's padded rows
  // One thread hands the tile staged by step `it` to the bulk engine; every thread staged its
  // part before the barrier that precedes this call. Before the other buffer is staged again (at
  // the end of the next step, after its middle barrier) the reduction issued one step earlier must
  // have read it: `wait_group.read 1`.
  auto reduce_dq = [&](int it) {
    if (tid == 0) {
      float* dst = dq_acc + ((unsigned long long)bh * tqp + (unsigned long long)(ib0 + it) * BQ) * D;
      asm volatile("cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [%0], [%1], %2;\n" ::"l"(dst),
                   "r"(fg_smem_addr(dqst + (it & 1) * BQ * D)), "n"(BQ * D * 4)
                   : "memory");
      asm volatile("cp.async.bulk.commit_group;\n" ::: "memory");
      asm volatile("cp.async.bulk.wait_group.read 1;\n" ::: "memory");
    }
  };

  auto load_q = [&](int it, int stage) {
    const int i0 = (ib0 + it) * BQ;
    fg_wg_load<T, BQ, D, NTH>(qs + stage * BQ * D * SZ, qg, p.q.t, i0, Tq);
    fg_wg_load<T, BQ, D, NTH>(os + stage * BQ * D * SZ, og, p.dout.t, i0, Tq);
    fg_attn_stage_stats<BQ, NTH>(lse2s + stage * BQ, dls + stage * BQ, lseg, dlg, i0, Tq);
  };

  fg_wg_load<T, BKV, D, NTH>(ks, kg, p.k.t, j0, Tk);
  fg_wg_load<T, BKV, D, NTH>(vs, vg, p.v.t, j0, Tk);
  if (nit > 0) load_q(0, 0);
  fg_cp_commit();

  float dka[MT][DT][4], dva[MT][DT][4];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int dt = 0; dt < DT; ++dt)
#pragma unroll
      for (int e = 0; e < 4; ++e) dka[mt][dt][e] = dva[mt][dt][e] = 0.f;

  for (int it = 0; it < nit; ++it) {
    const int stage = it & 1;
    const int i0 = (ib0 + it) * BQ;
    fg_cp_wait<0>();
    fg_proxy_fence();
    __syncthreads();  // this step's Q / dO are in; every warpgroup is done with the other stage and dS^T
    if (it > 0) reduce_dq(it - 1);
    if (it + 1 < nit) load_q(it + 1, stage ^ 1);
    fg_cp_commit();
    const unsigned int qst = qs + stage * BQ * D * SZ, ost = os + stage * BQ * D * SZ;
    const float* l2 = lse2s + stage * BQ;
    const float* dl = dls + stage * BQ;

    const bool need_mask = j0 + BKV > Tk || (p.causal && j0 + BKV - 1 > i0);
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
    // S^T = K Q^T and dP^T = V dO^T for this m-tile's 64 keys x BQ queries.
    const int mrow = (wg * MT + mt) * 64, wkv = mrow + (warp & 3) * 16;  // this warp's first key row
    float sa[NQ][4], dpa[NQ][4];
    fg_wg_fence();
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk)
      fg_wg_ss<T, BQ, 0, 0>(sa, fg_wg_kmajor(ks + mrow * 128, BKV, kk), fg_wg_kmajor(qst, BQ, kk), kk > 0);
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk)
      fg_wg_ss<T, BQ, 0, 0>(dpa, fg_wg_kmajor(vs + mrow * 128, BKV, kk), fg_wg_kmajor(ost, BQ, kk), kk > 0);
    fg_wg_commit();
    fg_wg_wait<0>();
    fg_wg_pin(sa);
    fg_wg_pin(dpa);

    // P^T = exp(S^T - lse), dS^T = P^T (dP^T - delta); with dropout dP sees the mask and dV the
    // dropped P (attention_tc.cu's backward, whose fragment layout this is: element e of n-tile
    // nt is key wkv + g + 8 (e >> 1), query nt * 8 + 2 t + (e & 1), and its keep bits).
#pragma unroll
    for (int np = 0; np < NQ; np += 2) {
      unsigned int keep = 0u;  // bit 4 n + e: element e of n-tile np + n (attention_common.cuh)
      if constexpr (DROP) keep = fg_attn_keep_bwd(p, bh, i0 + np * 8, j0 + wkv, g, t);
#pragma unroll
      for (int b = 0; b < 8; ++b) {
        const int nt = np + (b >> 2), e = b & 3;
        const int ql = nt * 8 + 2 * t + (e & 1);
        const int kv = j0 + wkv + g + (e >> 1) * 8;
        float pv = fg_exp2(fmaf(sa[nt][e], p.scale_log2, -l2[ql]));
        if (need_mask && (kv >= Tk || (p.causal && kv > i0 + ql))) pv = 0.f;
        float dpv = dpa[nt][e], pk = pv;
        if constexpr (DROP) {
          const bool kept = (keep >> b) & 1u;
          dpv = kept ? dpv * p.rp_keep : 0.f;
          pk = kept ? pv * p.rp_keep : 0.f;
        }
        dpa[nt][e] = pv * (dpv - dl[ql]);
        sa[nt][e] = pk;
      }
    }
    unsigned int pa[BQ / 16][4], da[BQ / 16][4];
    fg_wg_pack_a<T, BQ / 16>(sa, pa);
    fg_wg_pack_a<T, BQ / 16>(dpa, da);

    // dS^T to shared memory (swizzled [key][query], one 64-query atom) for dQ = dS K.
#pragma unroll
    for (int nt = 0; nt < NQ; ++nt)
#pragma unroll
      for (int hh = 0; hh < 2; ++hh) {
        const int r = wkv + g + hh * 8;
        const unsigned int addr = sts + (unsigned int)(r * 128 + ((nt ^ (r & 7)) << 4) + t * 4);
        asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(addr), "r"(M::pack(dpa[nt][2 * hh], dpa[nt][2 * hh + 1]))
                     : "memory");
      }

    // dV += P^T dO and dK += dS^T Q (the softmax scale goes on dK at the end).
    fg_wg_fence();
#pragma unroll
    for (int qc = 0; qc < BQ / 16; ++qc) fg_wg_rs<T, D, 1>(dva[mt], pa[qc], fg_wg_mnmajor(ost, BQ, qc, 0), 1);
#pragma unroll
    for (int qc = 0; qc < BQ / 16; ++qc) fg_wg_rs<T, D, 1>(dka[mt], da[qc], fg_wg_mnmajor(qst, BQ, qc, 0), 1);
    fg_wg_commit();
    }

    fg_proxy_fence();
    __syncthreads();  // all BKV keys' dS^T are in shared memory

    // dQ[:, this warpgroup's columns] = dS K: A = dS^T (keys x queries: transposed), B = K (keys x
    // head dim: transposed).
    float dqa[DH / 8][4];
#pragma unroll
    for (int kc = 0; kc < BKV / 16; ++kc)
      fg_wg_ss<T, DH, 1, 1>(dqa, fg_wg_mnmajor(sts, BKV, kc, 0), fg_wg_mnmajor(ks, BKV, kc, wg * DH), kc > 0);
    fg_wg_commit();
    fg_wg_wait<0>();
    fg_wg_pin(dqa);
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
      fg_wg_pin(dva[mt]);
      fg_wg_pin(dka[mt]);
    }

    // dQ goes out as one bulk asynchronous reduction of the whole 64 x D tile (see the header):
    // staged in fragment order, reduced after the next barrier, double-buffered.
    {
      float* stg = dqst + (it & 1) * BQ * D;
#pragma unroll
      for (int dt = 0; dt < DH / 8; ++dt)
#pragma unroll
        for (int hh = 0; hh < 2; ++hh)
          *reinterpret_cast<float2*>(stg + fg_wg_dq_pos<D>(wg, warp & 3, dt, hh, lane)) =
              make_float2(p.scale * dqa[dt][2 * hh], p.scale * dqa[dt][2 * hh + 1]);
      fg_proxy_fence();
    }
  }
  fg_cp_wait<0>();
  if (nit > 0) {
    __syncthreads();  // the last step's tile is staged
    reduce_dq(nit - 1);
    if (tid == 0) asm volatile("cp.async.bulk.wait_group 0;\n" ::: "memory");
  }

  // dK (times the scale) and dV, 4-byte pairs straight from the accumulators.
  T* dkg = dk + (long long)b * p.dk.b + (long long)h * p.dk.h;
  T* dvg = dv + (long long)b * p.dv.b + (long long)h * p.dv.h;
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
      const int row = j0 + (wg * MT + mt) * 64 + (warp & 3) * 16 + g + hh * 8;
      if (row < Tk) {
        T* krow = dkg + (long long)row * p.dk.t + 2 * t;
        T* vrow = dvg + (long long)row * p.dv.t + 2 * t;
#pragma unroll
        for (int dt = 0; dt < DT; ++dt) {
          *reinterpret_cast<unsigned int*>(krow + dt * 8) =
              M::pack(p.scale * dka[mt][dt][2 * hh], p.scale * dka[mt][dt][2 * hh + 1]);
          *reinterpret_cast<unsigned int*>(vrow + dt * 8) = M::pack(dva[mt][dt][2 * hh], dva[mt][dt][2 * hh + 1]);
        }
      }
    }
}

#define FG_WG_BWD_SMEM(D) ((2 * FG_WG_BWD_BKVD(D) + 4 * FG_WG_BWD_BQ) * (D) * 2 + FG_WG_BWD_BKVD(D) * FG_WG_BWD_BQ * 2 + \
                           4 * FG_WG_BWD_BQ * 4 + 2 * FG_WG_BWD_BQ * (D) * 4 + 1024)
