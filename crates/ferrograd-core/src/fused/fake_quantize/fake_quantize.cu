// fake_quantize.cu: fake quantization (QAT) and its straight-through / LSQ backward
// (src/fused/fake_quantize/). CPU twin: src/fused/fake_quantize/cpu.rs (same formula, every step
// rounded to ACC: float for f32 / f16 / bf16, double for f64).
//
// Element i of x uses channel ch = (i / inner) % channels (per tensor: channels = inner = 1) with
// scale s = scale[ch] and zero point zp = clamp(rint(zero_point[ch]), qmin, qmax) (both f32):
//   raw = rint(x * (1 / s)) + zp;  y = (clamp(raw, qmin, qmax) - zp) * s;  inside = qmin <= raw <= qmax
// rint rounds half to even (the default rounding mode), as PyTorch's std::nearbyint.
//
// fake_quant_fwd_{dt}(const T* x, const float* scale, const float* zp, T* y, u64 n, u64 channels,
//                     u64 inner, int qmin, int qmax)                      grid-stride over n
// fake_quant_bwd_{dt}(const T* dy, const T* x, const float* scale, const float* zp, T* dx, u64 n,
//                     u64 channels, u64 inner, int qmin, int qmax)       dx = inside ? dy : 0
// fake_quant_bwd_lsq_{dt}(const T* dy, const T* x, const float* scale, const float* zp, T* dx,
//                         ACC* part_s, ACC* part_z, u64 outer, u64 channels, u64 inner, u64 per,
//                         int qmin, int qmax, float gf)
//   grid (channels, splits): block (c, s) takes the elements j in [s * per, (s + 1) * per) of
//   channel c (j < outer * inner; element (j / inner * channels + c) * inner + j % inner), writes
//   their dx and the block sums of LSQ's dscale / dzp terms (times gf) to part_{s,z}[s * channels + c].
// fake_quant_sum_parts_{f32,f64}(const ACC* part, float* out, u64 splits, u64 channels)
//   out[c] = the sum of the splits partial rows of column c, rounded once to f32.

#include "common.cuh"

template <typename A> static __device__ __forceinline__ A fq_rint(A v);
template <> __device__ __forceinline__ float fq_rint<float>(float v) { return rintf(v); }
template <> __device__ __forceinline__ double fq_rint<double>(double v) { return rint(v); }

// Products rounded on their own (never contracted into an FMA with a neighbouring add), so that
// every step rounds as the CPU twin's.
static __device__ __forceinline__ float fq_mul(float a, float b) { return __fmul_rn(a, b); }
static __device__ __forceinline__ double fq_mul(double a, double b) { return __dmul_rn(a, b); }

template <typename A>
static __device__ __forceinline__ A fq_zp(const float* zp, fg_u64 ch, int qmin, int qmax) {
  return fmin(fmax(fq_rint<A>((A)zp[ch]), (A)qmin), (A)qmax);
}

// raw and y of one element (in A).
template <typename A>
static __device__ __forceinline__ void fq_elem(A x, A s, A z, int qmin, int qmax, A& raw, A& y) {
  const A inv = (A)1 / s;
  raw = fq_rint<A>(fq_mul(x, inv)) + z;
  const A c = fmin(fmax(raw, (A)qmin), (A)qmax);
  y = fq_mul(c - z, s);
}

static __device__ __forceinline__ fg_u64 fq_channel(fg_u64 i, fg_u64 channels, fg_u64 inner) {
  if (channels == 1) return 0;
  fg_u64 q, r;
  fg_divmod(i, inner, q, r);
  fg_divmod(q, channels, q, r);
  return r;
}

template <typename T>
static __device__ __forceinline__ void fq_fwd(const T* __restrict__ x, const float* __restrict__ scale,
                                              const float* __restrict__ zp, T* __restrict__ y, fg_u64 n,
                                              fg_u64 channels, fg_u64 inner, int qmin, int qmax) {
  typedef typename FgAcc<T>::type A;
  FG_GRID_STRIDE(i, n) {
    const fg_u64 ch = fq_channel(i, channels, inner);
    A raw, v;
    fq_elem<A>(fg_to_acc(x[i]), (A)scale[ch], fq_zp<A>(zp, ch, qmin, qmax), qmin, qmax, raw, v);
    y[i] = fg_from_acc<T>(v);
  }
}

template <typename T>
static __device__ __forceinline__ void fq_bwd(const T* __restrict__ dy, const T* __restrict__ x,
                                              const float* __restrict__ scale, const float* __restrict__ zp,
                                              T* __restrict__ dx, fg_u64 n, fg_u64 channels, fg_u64 inner, int qmin,
                                              int qmax) {
  typedef typename FgAcc<T>::type A;
  FG_GRID_STRIDE(i, n) {
    const fg_u64 ch = fq_channel(i, channels, inner);
    A raw, v;
    fq_elem<A>(fg_to_acc(x[i]), (A)scale[ch], fq_zp<A>(zp, ch, qmin, qmax), qmin, qmax, raw, v);
    dx[i] = (raw >= (A)qmin && raw <= (A)qmax) ? dy[i] : fg_from_acc<T>((A)0);
  }
}

template <typename T>
static __device__ __forceinline__ void fq_bwd_lsq(const T* __restrict__ dy, const T* __restrict__ x,
                                                  const float* __restrict__ scale, const float* __restrict__ zp,
                                                  T* __restrict__ dx, typename FgAcc<T>::type* __restrict__ part_s,
                                                  typename FgAcc<T>::type* __restrict__ part_z, fg_u64 outer,
                                                  fg_u64 channels, fg_u64 inner, fg_u64 per, int qmin, int qmax,
                                                  float gf) {
  typedef typename FgAcc<T>::type A;
  __shared__ A sh[64];
  const fg_u64 c = blockIdx.x, split = blockIdx.y, count = outer * inner;
  const fg_u64 j0 = split * per, j1 = j0 + per < count ? j0 + per : count;
  const A s = (A)scale[c], z = fq_zp<A>(zp, c, qmin, qmax), inv = (A)1 / s, g = (A)gf;
  A ds = (A)0, dz = (A)0;
  for (fg_u64 j = j0 + threadIdx.x; j < j1; j += blockDim.x) {
    fg_u64 i;
    if (outer == 1) {
      i = c * inner + j;
    } else {
      fg_u64 o, r;
      fg_divmod(j, inner, o, r);
      i = (o * channels + c) * inner + r;
    }
    const A xv = fg_to_acc(x[i]), d = fg_to_acc(dy[i]);
    A raw, y;
    fq_elem<A>(xv, s, z, qmin, qmax, raw, y);
    const bool inside = raw >= (A)qmin && raw <= (A)qmax;
    dx[i] = inside ? dy[i] : fg_from_acc<T>((A)0);
    if (inside) {
      ds += fq_mul(fq_mul(fq_mul(d, y - xv), inv), g);
    } else {
      const A edge = raw < (A)qmin ? (A)qmin : (A)qmax;
      ds += fq_mul(fq_mul(d, edge - z), g);
      dz += fq_mul(fq_mul(-d, s), g);
    }
  }
  fg_block_sum2(ds, dz, sh);
  if (threadIdx.x == 0) {
    part_s[split * channels + c] = ds;
    part_z[split * channels + c] = dz;
  }
}

template <typename A>
static __device__ __forceinline__ void fq_sum_parts(const A* __restrict__ part, float* __restrict__ out,
                                                    fg_u64 splits, fg_u64 channels) {
  FG_GRID_STRIDE(c, channels) {
    A acc = (A)0;
    for (fg_u64 s = 0; s < splits; ++s) acc += part[s * channels + c];
    out[c] = (float)acc;
  }
}

#define FG_FAKE_QUANT(SUF, T)                                                                                    \
  FG_KERNEL fake_quant_fwd_##SUF(const T* x, const float* scale, const float* zp, T* y, fg_u64 n,                \
                                 fg_u64 channels, fg_u64 inner, int qmin, int qmax) {                            \
    fq_fwd<T>(x, scale, zp, y, n, channels, inner, qmin, qmax);                                                  \
  }                                                                                                              \
  FG_KERNEL fake_quant_bwd_##SUF(const T* dy, const T* x, const float* scale, const float* zp, T* dx, fg_u64 n,  \
                                 fg_u64 channels, fg_u64 inner, int qmin, int qmax) {                            \
    fq_bwd<T>(dy, x, scale, zp, dx, n, channels, inner, qmin, qmax);                                             \
  }                                                                                                              \
  FG_KERNEL fake_quant_bwd_lsq_##SUF(const T* dy, const T* x, const float* scale, const float* zp, T* dx,        \
                                     FgAcc<T>::type* part_s, FgAcc<T>::type* part_z, fg_u64 outer,               \
                                     fg_u64 channels, fg_u64 inner, fg_u64 per, int qmin, int qmax, float gf) {  \
    fq_bwd_lsq<T>(dy, x, scale, zp, dx, part_s, part_z, outer, channels, inner, per, qmin, qmax, gf);            \
  }
FG_FOR_FLOAT(FG_FAKE_QUANT)

FG_KERNEL fake_quant_sum_parts_f32(const float* part, float* out, fg_u64 splits, fg_u64 channels) {
  fq_sum_parts<float>(part, out, splits, channels);
}
FG_KERNEL fake_quant_sum_parts_f64(const double* part, float* out, fg_u64 splits, fg_u64 channels) {
  fq_sum_parts<double>(part, out, splits, channels);
}
