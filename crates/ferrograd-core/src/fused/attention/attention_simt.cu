// attention_simt.cu: the f32 forward and backward of attention, exact f32 FMAs on the CUDA
// cores (see attention_common.cuh for the ABI). Part of the attention module (mod.rs).

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
      if (p.drop_thr) {  // keys j0 + 2 tx, + 1: the two halves of one word (attention_common.cuh)
        const int j = j0 + 2 * tx;
        const unsigned int w = fg_attn_word(fg_attn_philox(p.seed, fg_attn_block(p, bh, i, j / 8)), (j & 7) >> 1);
        if (!fg_attn_kept(w, 0, p)) k0 = 0.f;
        if (!fg_attn_kept(w, 1, p)) k1 = 0.f;
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
      // Keys j0 + 4 ty + r: words 2 (ty & 1) + (r >> 1) of one block (j0 is a multiple of 8).
      FgAttnU4 w = {{0u, 0u, 0u, 0u}};
      if (p.drop_thr) w = fg_attn_philox(p.seed, fg_attn_block(p, bh, i, (j0 + 4 * ty) / 8));
#pragma unroll
      for (int r = 0; r < 4; ++r) {
        const int j = j0 + 4 * ty + r;
        float pv = exp2f(fmaf(s[r][c], p.scale_log2, -l2[ql]));
        if (j >= Tk || (p.causal && j > i)) pv = 0.f;
        float dp = dpv[r][c], pk = pv;
        if (p.drop_thr) {
          const bool keep = fg_attn_kept(w.x[2 * (ty & 1) + (r >> 1)], r & 1, p);
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
