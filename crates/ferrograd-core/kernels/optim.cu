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
__device__ __forceinline__ void adam_apply(const OptTable& t, float lr, float b1, float b2, float omb1, float omb2,
                                           float eps, float wd, float bc1, float bc2, int decoupled, float gs) {
  const fg_u64 tid = fg_tid(), stride = fg_nthreads();
  const float step = lr / bc1, sbc2 = sqrtf(bc2);
  for (unsigned int k = 0; k < t.count; ++k) {
    float* p = (float*)t.p[k];
    const float* g = (const float*)t.g[k];
    float* m = (float*)t.s1[k];
    float* v = (float*)t.s2[k];
    const fg_u64 n = t.n[k];
    const fg_u64 lo = t.lo[k];
    const bool half = (t.lo_f16 >> k) & 1ull;
    for (fg_u64 i = tid; i < n; i += stride) {
      float pi = p[i], gi = __fmul_rn(g[i], gs);  // _rn: never contracted into an FMA
      if (decoupled) {
        pi = pi * (1.0f - lr * wd);
      } else {
        gi = gi + wd * pi;
      }
      const float mi = b1 * m[i] + omb1 * gi;
      const float vi = b2 * v[i] + omb2 * (gi * gi);
      m[i] = mi;
      v[i] = vi;
      const float pn = pi - step * (mi / (sqrtf(vi) / sbc2 + eps));
      p[i] = pn;
      if (lo != 0) {
        if (half) {
          ((__half*)lo)[i] = __float2half_rn(pn);
        } else {
          ((__nv_bfloat16*)lo)[i] = __float2bfloat16_rn(pn);
        }
      }
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
  float acc = 0.0f;
  for (unsigned int k = 0; k < t.count; ++k) {
    const float* g = (const float*)t.g[k];
    for (fg_u64 i = tid; i < t.n[k]; i += stride) acc = fmaf(g[i], g[i], acc);
  }
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
