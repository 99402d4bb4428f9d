// rng.cu: Philox 4x32-10 uniform and normal samples.
// CPU twins: src/rng.rs (`philox4x32_10`, `block`, `to_uniform`, `uniform_at`, `normal_at`) and the
// callers in src/tensor.rs: uniform `lo + (hi - lo) * u`, normal `mean + std * z`, each in f64, then
// `T::from_f64`. The u32 stream is bit-identical to the CPU's; uniform samples are bit-identical
// too (only exact operations: the f64 multiply / add are explicitly unfused, as in Rust). Normal
// samples use the GPU's f64 log / sin / cos, within an ulp or so of the CPU's libm in f64, which
// almost always rounds to the same f32 / f16 / bf16.
//
// rand_uniform_{f32,f64,f16,bf16}(T* y, u64 n, u64 seed, u64 offset, double lo, double hi)
// rand_normal_{f32,f64,f16,bf16}(T* y, u64 n, u64 seed, u64 offset, double mean, double std)
// Element i reads block offset + i / 4, lane i % 4. Each thread computes whole blocks (grid-stride
// over the ceil(n / 4) blocks) and writes their 4 elements, with one vector store when aligned.

#include "common.cuh"

#define FG_PHILOX_M0 0xD2511F53u
#define FG_PHILOX_M1 0xCD9E8D57u
#define FG_PHILOX_W0 0x9E3779B9u
#define FG_PHILOX_W1 0xBB67AE85u

struct FgU4 {
  unsigned int x[4];
};

// rng.rs `philox4x32_10`: ten rounds, the key bumped before every round but the first.
static __device__ __forceinline__ FgU4 fg_philox4x32_10(unsigned int c0, unsigned int c1, unsigned int c2,
                                                        unsigned int c3, unsigned int k0, unsigned int k1) {
#pragma unroll
  for (int round = 0; round < 10; ++round) {
    if (round > 0) {
      k0 += FG_PHILOX_W0;
      k1 += FG_PHILOX_W1;
    }
    const unsigned int hi0 = __umulhi(FG_PHILOX_M0, c0), lo0 = FG_PHILOX_M0 * c0;
    const unsigned int hi1 = __umulhi(FG_PHILOX_M1, c2), lo1 = FG_PHILOX_M1 * c2;
    const unsigned int n0 = hi1 ^ c1 ^ k0, n1 = lo1, n2 = hi0 ^ c3 ^ k1, n3 = lo0;
    c0 = n0;
    c1 = n1;
    c2 = n2;
    c3 = n3;
  }
  FgU4 r;
  r.x[0] = c0;
  r.x[1] = c1;
  r.x[2] = c2;
  r.x[3] = c3;
  return r;
}

// rng.rs `block(seed, index)`: counter [index lo, index hi, 0, 0], key [seed lo, seed hi].
static __device__ __forceinline__ FgU4 fg_philox_block(fg_u64 seed, fg_u64 index) {
  return fg_philox4x32_10((unsigned int)index, (unsigned int)(index >> 32), 0u, 0u, (unsigned int)seed,
                          (unsigned int)(seed >> 32));
}

// rng.rs `to_uniform`: (x >> 8) * 2^-24, in [0, 1).
static __device__ __forceinline__ double fg_to_uniform(unsigned int x) {
  return (double)(x >> 8) * (1.0 / 16777216.0);
}

// The four samples of one block, in f64, before the dtype rounding.
static __device__ __forceinline__ void fg_uniform4(const FgU4& b, double lo, double hi, double out[4]) {
  const double span = hi - lo;
#pragma unroll
  for (int l = 0; l < 4; ++l) out[l] = __dadd_rn(lo, __dmul_rn(span, fg_to_uniform(b.x[l])));
}

// rng.rs `normal_at`: Box-Muller on lanes (0, 1) and (2, 3); even lanes r cos(theta), odd lanes
// r sin(theta), with u_a = ((x >> 8) + 1) 2^-24 in (0, 1].
static __device__ __forceinline__ void fg_normal4(const FgU4& b, double mean, double std, double out[4]) {
#pragma unroll
  for (int pair = 0; pair < 4; pair += 2) {
    const double ua = ((double)(b.x[pair] >> 8) + 1.0) * (1.0 / 16777216.0);
    const double ub = fg_to_uniform(b.x[pair + 1]);
    const double r = sqrt(-2.0 * log(ua));
    const double theta = (2.0 * 3.14159265358979323846) * ub;  // 2.0 * PI * ub, left to right
    double s, c;
    sincos(theta, &s, &c);
    out[pair] = __dadd_rn(mean, __dmul_rn(std, r * c));
    out[pair + 1] = __dadd_rn(mean, __dmul_rn(std, r * s));
  }
}

template <typename T, bool NORMAL>
static __device__ __forceinline__ void fg_rand(T* __restrict__ y, fg_u64 n, fg_u64 seed, fg_u64 offset, double a,
                                               double b) {
  const fg_u64 nblocks = (n + 3) / 4;
  const bool vec = fg_aligned(y, 4 * sizeof(T));
  for (fg_u64 k = fg_tid(); k < nblocks; k += fg_nthreads()) {
    const FgU4 bits = fg_philox_block(seed, offset + k);
    double v[4];
    if (NORMAL)
      fg_normal4(bits, a, b, v);
    else
      fg_uniform4(bits, a, b, v);
    const fg_u64 i0 = 4 * k;
    if (vec && i0 + 4 <= n) {
      FgPack<T, 4> p;
#pragma unroll
      for (int l = 0; l < 4; ++l) p.v[l] = fg_from_f64<T>(v[l]);
      *reinterpret_cast<FgPack<T, 4>*>(y + i0) = p;
    } else {
#pragma unroll
      for (int l = 0; l < 4; ++l)
        if (i0 + l < n) y[i0 + l] = fg_from_f64<T>(v[l]);
    }
  }
}

#define FG_RAND(SUF, T)                                                                        \
  FG_KERNEL rand_uniform_##SUF(T* y, fg_u64 n, fg_u64 seed, fg_u64 offset, double lo, double hi) { \
    fg_rand<T, false>(y, n, seed, offset, lo, hi);                                             \
  }                                                                                            \
  FG_KERNEL rand_normal_##SUF(T* y, fg_u64 n, fg_u64 seed, fg_u64 offset, double mean, double std) { \
    fg_rand<T, true>(y, n, seed, offset, mean, std);                                           \
  }
FG_FOR_FLOAT(FG_RAND)
