// optim.cu: fused multi-tensor optimizer steps. One launch updates up to FG_OPT_MAX tensors,
// their pointers passed by value in the kernel parameters (no host->device copy per step), the way
// PyTorch's multi_tensor_apply does. CPU twin: src/optim.rs (`adam_cpu`, `sgd_cpu`), same formulas
// and operation order, in f32.

#include "common.cuh"

#ifndef FG_OPT_MAX
#error "FG_OPT_MAX comes from Rust (src/cuda/ops/optim.rs MAX)"
#endif

// Mirrored by `OptTable` in src/cuda/ops/optim.rs: 5 * FG_OPT_MAX * 8 + 8 bytes (1608 for 40).
struct OptTable {
  unsigned long long p[FG_OPT_MAX];   // parameters (updated in place)
  unsigned long long g[FG_OPT_MAX];   // gradients
  unsigned long long s1[FG_OPT_MAX];  // Adam: first moment; SGD: momentum buffer
  unsigned long long s2[FG_OPT_MAX];  // Adam: second moment; SGD: unused
  unsigned long long n[FG_OPT_MAX];   // elements
  unsigned int count;
  unsigned int pad;
};

// Adam / AdamW (decoupled != 0), PyTorch's update:
//   g += wd * p (Adam)  |  p *= 1 - lr * wd (AdamW)
//   m = b1 m + (1 - b1) g;  v = b2 v + (1 - b2) g^2
//   p -= (lr / bc1) * m / (sqrt(v) / sqrt(bc2) + eps)
// omb1 = 1 - b1 and omb2 = 1 - b2 come from the host, formed in f64 as PyTorch forms them.
FG_KERNEL adam_f32(OptTable t, float lr, float b1, float b2, float omb1, float omb2, float eps, float wd, float bc1,
                   float bc2, int decoupled) {
  const fg_u64 tid = fg_tid(), stride = fg_nthreads();
  const float step = lr / bc1, sbc2 = sqrtf(bc2);
  for (unsigned int k = 0; k < t.count; ++k) {
    float* p = (float*)t.p[k];
    const float* g = (const float*)t.g[k];
    float* m = (float*)t.s1[k];
    float* v = (float*)t.s2[k];
    const fg_u64 n = t.n[k];
    for (fg_u64 i = tid; i < n; i += stride) {
      float pi = p[i], gi = g[i];
      if (decoupled) {
        pi = pi * (1.0f - lr * wd);
      } else {
        gi = gi + wd * pi;
      }
      const float mi = b1 * m[i] + omb1 * gi;
      const float vi = b2 * v[i] + omb2 * (gi * gi);
      m[i] = mi;
      v[i] = vi;
      p[i] = pi - step * (mi / (sqrtf(vi) / sbc2 + eps));
    }
  }
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
