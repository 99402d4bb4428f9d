// optim.cu: fused multi-tensor optimizer steps. One launch updates up to FG_OPT_MAX tensors,
// their pointers passed by value in the kernel parameters (no host->device copy per step), the way
// PyTorch's multi_tensor_apply does. CPU twin: src/optim.rs (`adam_cpu`, `sgd_cpu`), same formulas
// and operation order, in f32.

#include "common.cuh"

#ifndef FG_OPT_MAX
#error "FG_OPT_MAX comes from Rust (src/cuda/ops/optim.rs MAX)"
#endif

// Mirrored by `OptTable` in src/cuda/ops/optim.rs: 6 * FG_OPT_MAX * 8 + 16 bytes (1936 for 40).
struct OptTable {
  unsigned long long p[FG_OPT_MAX];   // parameters (updated in place)
  unsigned long long g[FG_OPT_MAX];   // gradients
  unsigned long long s1[FG_OPT_MAX];  // Adam: first moment; SGD: momentum buffer
  unsigned long long s2[FG_OPT_MAX];  // Adam: second moment; SGD: unused
  unsigned long long n[FG_OPT_MAX];   // elements
  unsigned long long lo[FG_OPT_MAX];  // Adam: the parameter's kept bf16/f16 copy, or 0 (src/cuda/shadow.rs)
  unsigned long long lo_f16;          // bit k: lo[k] is f16 (else bf16)
  unsigned int count;
  unsigned int pad;
};

// Adam / AdamW (decoupled != 0), PyTorch's update:
//   g += wd * p (Adam)  |  p *= 1 - lr * wd (AdamW)
//   m = b1 m + (1 - b1) g;  v = b2 v + (1 - b2) g^2
//   p -= (lr / bc1) * m / (sqrt(v) / sqrt(bc2) + eps)
// omb1 = 1 - b1 and omb2 = 1 - b2 come from the host, formed in f64 as PyTorch forms them.
// `gs`: the gradients' factor (clip_grad_norm's, read from the device), `g * gs` being the
// product the separate scale kernel forms, so clipping here or there gives the same bits (1 when
// not clipping: exact). A parameter with a kept copy (`lo[k]`) gets it rewritten as the cast
// kernel would round the new value.
// One element of the update, shared by the scalar and the 16-byte paths so both round alike.
struct AdamK {
  float lr, b1, b2, omb1, omb2, eps, wd, step, sbc2, gs;
  int decoupled;
  __device__ __forceinline__ float apply(float pi, float g, float& m, float& v) const {
    float gi = __fmul_rn(g, gs);  // _rn: never contracted into an FMA
    if (decoupled) {
      pi = pi * (1.0f - lr * wd);
    } else {
      gi = gi + wd * pi;
    }
    m = b1 * m + omb1 * gi;
    v = b2 * v + omb2 * (gi * gi);
    return pi - step * (m / (sqrtf(v) / sbc2 + eps));
  }
};

__device__ __forceinline__ void adam_store_lo(fg_u64 lo, bool half, fg_u64 i, float pn) {
  if (half) {
    ((__half*)lo)[i] = __float2half_rn(pn);
  } else {
    ((__nv_bfloat16*)lo)[i] = __float2bfloat16_rn(pn);
  }
}

__device__ __forceinline__ void adam_apply(const OptTable& t, float lr, float b1, float b2, float omb1, float omb2,
                                           float eps, float wd, float bc1, float bc2, int decoupled, float gs) {
  const fg_u64 tid = fg_tid(), stride = fg_nthreads();
  const AdamK a{lr, b1, b2, omb1, omb2, eps, wd, lr / bc1, sqrtf(bc2), gs, decoupled};
  for (unsigned int k = 0; k < t.count; ++k) {
    float* p = (float*)t.p[k];
    const float* g = (const float*)t.g[k];
    float* m = (float*)t.s1[k];
    float* v = (float*)t.s2[k];
    const fg_u64 n = t.n[k];
    const fg_u64 lo = t.lo[k];
    const bool half = (t.lo_f16 >> k) & 1ull;
    // Four elements a thread through 16-byte accesses where every stream allows them (the kept
    // copy: 8 bytes): 4 f32 streams of 124M elements moved at ~2.4 TB/s one element at a time on
    // an H100 (GPT-2's step, BENCHMARKS.md 2026-11-25). The rest, one at a time.
    const bool vec = ((t.p[k] | t.g[k] | t.s1[k] | t.s2[k]) & 15ull) == 0 && (lo & 7ull) == 0;
    const fg_u64 n4 = vec ? n / 4 : 0;
    for (fg_u64 q = tid; q < n4; q += stride) {
      const float4 pv = ((const float4*)p)[q], gv = ((const float4*)g)[q];
      float4 mv = ((const float4*)m)[q], vv = ((const float4*)v)[q];
      float4 pn;
      pn.x = a.apply(pv.x, gv.x, mv.x, vv.x);
      pn.y = a.apply(pv.y, gv.y, mv.y, vv.y);
      pn.z = a.apply(pv.z, gv.z, mv.z, vv.z);
      pn.w = a.apply(pv.w, gv.w, mv.w, vv.w);
      ((float4*)m)[q] = mv;
      ((float4*)v)[q] = vv;
      ((float4*)p)[q] = pn;
      if (lo != 0) {
        if (half) {
          const __half2 h0 = __floats2half2_rn(pn.x, pn.y), h1 = __floats2half2_rn(pn.z, pn.w);
          uint2 w;
          w.x = *(const unsigned int*)&h0;
          w.y = *(const unsigned int*)&h1;
          ((uint2*)lo)[q] = w;
        } else {
          const __nv_bfloat162 h0 = __floats2bfloat162_rn(pn.x, pn.y), h1 = __floats2bfloat162_rn(pn.z, pn.w);
          uint2 w;
          w.x = *(const unsigned int*)&h0;
          w.y = *(const unsigned int*)&h1;
          ((uint2*)lo)[q] = w;
        }
      }
    }
    for (fg_u64 i = 4 * n4 + tid; i < n; i += stride) {
      float mi = m[i], vi = v[i];
      const float pn = a.apply(p[i], g[i], mi, vi);
      m[i] = mi;
      v[i] = vi;
      p[i] = pn;
      if (lo != 0) adam_store_lo(lo, half, i, pn);
    }
  }
}

// The bias corrections bc1 = 1 - b1^step, bc2 = 1 - b2^step come from the host...
FG_KERNEL adam_f32(OptTable t, float lr, float b1, float b2, float omb1, float omb2, float eps, float wd, float bc1,
                   float bc2, int decoupled) {
  adam_apply(t, lr, b1, b2, omb1, omb2, eps, wd, bc1, bc2, decoupled, 1.0f);
}

// ... or from device memory (`bc` = [bc1, bc2], written by adam_bias_correction), so that a CUDA
// graph replaying the step applies each step's own correction (PyTorch's capturable Adam). CPU
// twin: `adam_step_counted` in src/optim.rs.
FG_KERNEL adam_f32_dev(OptTable t, float lr, float b1, float b2, float omb1, float omb2, float eps, float wd,
                       const float* bc, int decoupled) {
  adam_apply(t, lr, b1, b2, omb1, omb2, eps, wd, bc[0], bc[1], decoupled, 1.0f);
}

// ... and the learning rate from device memory too (`lr` = one float, written before each step by
// the host), so that a graph replaying a scheduled step applies each step's own rate; `gscale`
// (nullable) is the clip factor on the device. CPU twin: `adam_step_scheduled` in src/optim.rs.
FG_KERNEL adam_f32_devlr(OptTable t, const float* lr, float b1, float b2, float omb1, float omb2, float eps, float wd,
                         const float* bc, int decoupled, const float* gscale) {
  adam_apply(t, lr[0], b1, b2, omb1, omb2, eps, wd, bc[0], bc[1], decoupled, gscale ? gscale[0] : 1.0f);
}

// Rust's f64::powi (compiler-builtins' __powidf2: square and multiply), so that the device's bias
// corrections equal, bit for bit, those `adam_step` forms on the host for the same step. The _rn
// intrinsics keep the compiler from contracting a product and the subtraction below into an FMA
// (one rounding instead of two), which the host never does.
__device__ double fg_powi(double a, int b) {
  const bool recip = b < 0;
  unsigned int n = recip ? 0u - (unsigned int)b : (unsigned int)b;
  double r = 1.0;
  for (;;) {
    if (n & 1u) r = __dmul_rn(r, a);
    n >>= 1;
    if (n == 0u) break;
    a = __dmul_rn(a, a);
  }
  return recip ? __ddiv_rn(1.0, r) : r;
}

// One thread: step += 1, then bc = [1 - b1^step, 1 - b2^step] in f64, rounded to f32 (the host's
// `1.0 - beta.powi(step)` as f32).
FG_KERNEL adam_bias_correction(double* step, float* bc, double b1, double b2) {
  if (fg_tid() != 0) return;
  const double s = __dadd_rn(*step, 1.0);
  *step = s;
  const int e = s < 2147483647.0 ? (int)s : 2147483647;
  bc[0] = __double2float_rn(__dsub_rn(1.0, fg_powi(b1, e)));
  bc[1] = __double2float_rn(__dsub_rn(1.0, fg_powi(b2, e)));
}

// SGD with momentum / Nesterov / weight decay, PyTorch's update:
//   g += wd * p; buf = first ? g : mu buf + (1 - dampening) g; g = nesterov ? g + mu buf : buf
//   p -= lr g
FG_KERNEL sgd_f32(OptTable t, float lr, float mu, float dampening, float wd, int nesterov, int first) {
  const fg_u64 tid = fg_tid(), stride = fg_nthreads();
  for (unsigned int k = 0; k < t.count; ++k) {
    float* p = (float*)t.p[k];
    const float* g = (const float*)t.g[k];
    float* buf = (float*)t.s1[k];
    const fg_u64 n = t.n[k];
    for (fg_u64 i = tid; i < n; i += stride) {
      float pi = p[i];
      float gi = g[i] + wd * pi;
      if (mu != 0.0f) {
        const float bi = first ? gi : mu * buf[i] + (1.0f - dampening) * gi;
        buf[i] = bi;
        gi = nesterov ? gi + mu * bi : bi;
      }
      p[i] = pi - lr * gi;
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Clipping by global norm in three launches whatever the tensor count (CPU twin: the composed
// `clip_grad_norm` of ferrograd-nn, optim/clip.rs): the sum of squares in two passes whose order
// does not depend on timing (no atomics: a replayed step is bit-identical), the clip factor on the
// device, then the scaled copies. The `g` pointers are the tensors read, `p` the outputs.
// ---------------------------------------------------------------------------------------------

// Pass 1: block b of the launch for table `slot` writes the sum of squares of its grid-stride share
// of the table's tensors to part[slot * gridDim.x + b].
FG_KERNEL sq_norm_part_f32(OptTable t, float* part, unsigned int slot) {
  __shared__ float sh[32];
  const fg_u64 tid = fg_tid(), stride = fg_nthreads();
  // 16-byte loads into four chains where the tensor allows (one scalar chain read GPT-2's 124M
  // gradients at ~1.7 TB/s on an H100); the order still depends only on the launch shape.
  float a0 = 0.0f, a1 = 0.0f, a2 = 0.0f, a3 = 0.0f;
  for (unsigned int k = 0; k < t.count; ++k) {
    const float* g = (const float*)t.g[k];
    const fg_u64 n = t.n[k], n4 = (t.g[k] & 15ull) == 0 ? n / 4 : 0;
    for (fg_u64 q = tid; q < n4; q += stride) {
      const float4 x = ((const float4*)g)[q];
      a0 = fmaf(x.x, x.x, a0);
      a1 = fmaf(x.y, x.y, a1);
      a2 = fmaf(x.z, x.z, a2);
      a3 = fmaf(x.w, x.w, a3);
    }
    for (fg_u64 i = 4 * n4 + tid; i < n; i += stride) a0 = fmaf(g[i], g[i], a0);
  }
  float acc = (a0 + a1) + (a2 + a3);
  acc = fg_block_reduce(acc, FgSum(), sh);
  if (threadIdx.x == 0) part[(fg_u64)slot * gridDim.x + blockIdx.x] = acc;
}

// Pass 2, one block: out = [norm, factor], norm = sqrt(sum of the n partials, added in f64) and
// factor = min(1, max_norm * (1 / (norm + 1e-6))) as the composed CPU twin forms it (PyTorch's
// clip_grad_norm_ formula); a NaN norm gives a NaN factor, as there.
FG_KERNEL sq_norm_finish(const float* part, fg_u64 n, float max_norm, float* out) {
  __shared__ double sh[32];
  double acc = 0.0;
  for (fg_u64 i = threadIdx.x; i < n; i += blockDim.x) acc += (double)part[i];
  acc = fg_block_reduce(acc, FgSum(), sh);
  if (threadIdx.x == 0) {
    const float norm = sqrtf((float)acc);
    const float ratio = max_norm * (1.0f / (norm + 1e-6f));
    out[0] = norm;
    out[1] = ratio >= 1.0f ? 1.0f : ratio;
  }
}

// p_k = g_k * f[0] for every tensor of the table.
FG_KERNEL scale_dev_f32(OptTable t, const float* f) {
  const fg_u64 tid = fg_tid(), stride = fg_nthreads();
  const float s = f[0];
  for (unsigned int k = 0; k < t.count; ++k) {
    float* p = (float*)t.p[k];
    const float* g = (const float*)t.g[k];
    for (fg_u64 i = tid; i < t.n[k]; i += stride) p[i] = g[i] * s;
  }
}
