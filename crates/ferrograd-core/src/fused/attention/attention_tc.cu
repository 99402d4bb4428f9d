// attention_tc.cu: the tensor-core forward and backward of attention (bf16 / f16; see the
// module's header, attention_common.cuh, for the ABI and the algorithm). Included by attention.cu
// after common.cuh and attention_common.cuh (declared as a header of the module in mod.rs).

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

    // Dropout (attention_common.cuh): only P V sees the mask.
    if (p.drop_thr) {
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) fg_attn_dropout_fwd<NT>(s[mt], p, bh, i0 + wrow + mt * 16 + g, j0, t);
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
    fg_attn_stage_stats<BQ, FG_ATTN_THREADS>(lse2s + stage * BQ, dls + stage * BQ, lseg, dlg, i0, Tq);
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
  // Small head dims keep this warp's K and V rows (the A operands of S^T and dP^T) in registers
  // for the whole loop: shared-memory bandwidth is what the backward runs short of.
  constexpr bool KV_REGS = D <= 64;
  unsigned int kreg[KV_REGS ? KC : 1][4], vreg[KV_REGS ? KC : 1][4];
  if constexpr (KV_REGS) {
    if (nit > 0) {
      fg_cp_wait<0>();
      __syncthreads();
#pragma unroll
      for (int kc = 0; kc < KC; ++kc) {
        fg_ldsm4(kreg[kc], ks + (wkv * DP + kc * 16) * SZ + a_off);
        fg_ldsm4(vreg[kc], vs + (wkv * DP + kc * 16) * SZ + a_off);
      }
    }
  }

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
      if constexpr (KV_REGS) {
#pragma unroll
        for (int r = 0; r < 4; ++r) {
          ka[r] = kreg[kc][r];
          va[r] = vreg[kc][r];
        }
      } else {
        fg_ldsm4(ka, ks + (wkv * DP + kc * 16) * SZ + a_off);
        fg_ldsm4(va, vs + (wkv * DP + kc * 16) * SZ + a_off);
      }
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
    static_assert(NQ % 2 == 0, "dropout's keep bits come a pair of n-tiles at a time");
#pragma unroll
    for (int np = 0; np < NQ; np += 2) {
      unsigned int keep = 0u;  // bit 4 n + e: element e of n-tile np + n (attention_common.cuh)
      if (p.drop_thr) keep = fg_attn_keep_bwd(p, bh, i0 + np * 8, j0 + wkv, g, t);
#pragma unroll
      for (int b = 0; b < 8; ++b) {
        const int nt = np + (b >> 2), e = b & 3;
        const int ql = nt * 8 + 2 * t + (e & 1);
        const int kv = j0 + wkv + g + (e >> 1) * 8;
        float pv = fg_exp2(fmaf(sa[nt][e], p.scale_log2, -l2[ql]));
        if (need_mask && (kv >= Tk || (p.causal && kv > i0 + ql))) pv = 0.f;
        float dpv = dpa[nt][e], pk = pv;
        if (p.drop_thr) {
          const bool kept = (keep >> b) & 1u;
          dpv = kept ? dpv * p.rp_keep : 0.f;
          pk = kept ? pv * p.rp_keep : 0.f;
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
