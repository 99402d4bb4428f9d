// monster_walk.cu: the Monster Walk training step fused into two kernels (forward, backward and
// the weight gradients in one; the gradient reduction and Adam in the other), so a step costs two
// launches instead of ~80. CPU twin: the autograd path of src/monster_walk/model.rs
// (`Autoencoder::loss` + `backward` + `optim::adam_step`), which the tests compare it against.
//
// Parameters are one packed f32 buffer in PyTorch's order: for each Linear layer, W [out, in]
// row-major, then b [out]. A block keeps all of them (38.8 KB), its gradient accumulator, and the
// activations of its rows in shared memory; each block handles `rows` rows per tile.

#define MW_LAYERS 8
#define MW_P 9690  // parameters
#define MW_A 309   // activations per row: input 71 + every layer's output
#define MW_W 71    // widest layer

__constant__ int MW_IN[MW_LAYERS] = {71, 47, 23, 11, 5, 11, 23, 47};
__constant__ int MW_OUT[MW_LAYERS] = {47, 23, 11, 5, 11, 23, 47, 71};
__constant__ int MW_WOFF[MW_LAYERS] = {0, 3384, 4488, 4752, 4812, 4878, 5154, 6282};
__constant__ int MW_AOFF[MW_LAYERS + 1] = {0, 71, 118, 141, 152, 157, 168, 191, 238};

// Shared memory floats a block needs for `rows` rows.
// params + grads + activations + two delta buffers + 32 for the loss reduction.

// Gradients of the mean squared reconstruction error for the rows of `x` ([n, 71]) that this
// block's tiles cover; `partial[blockIdx.x * MW_P + i]` receives the block's sum for parameter i,
// `loss_partial[blockIdx.x]` its sum of squared errors. grad_scale = 2 / (n * 71).
extern "C" __global__ void __launch_bounds__(256) mw_grads(const float* __restrict__ x, int n,
                                                           const float* __restrict__ params,
                                                           float* __restrict__ partial,
                                                           float* __restrict__ loss_partial, float grad_scale,
                                                           int rows) {
  extern __shared__ float sm[];
  float* sp = sm;
  float* sg = sp + MW_P;
  float* sa = sg + MW_P;
  float* d0 = sa + rows * MW_A;
  float* d1 = d0 + rows * MW_W;
  float* sred = d1 + rows * MW_W;
  const int tid = threadIdx.x, bd = blockDim.x;
  for (int i = tid; i < MW_P; i += bd) {
    sp[i] = params[i];
    sg[i] = 0.f;
  }
  float loss = 0.f;
  const int tiles = (n + rows - 1) / rows;
  for (int tile = blockIdx.x; tile < tiles; tile += gridDim.x) {
    const int r0 = tile * rows;
    const int nr = min(rows, n - r0);
    __syncthreads();
    for (int i = tid; i < nr * MW_W; i += bd) {
      const int r = i / MW_W, k = i - r * MW_W;
      sa[r * MW_A + k] = x[(size_t)(r0 + r) * MW_W + k];
    }
    __syncthreads();
    // Forward: z = W a + b, ReLU on every layer but the last.
    for (int l = 0; l < MW_LAYERS; ++l) {
      const int in = MW_IN[l], out = MW_OUT[l], ai = MW_AOFF[l], ao = MW_AOFF[l + 1];
      const float* W = sp + MW_WOFF[l];
      const float* b = W + in * out;
      for (int i = tid; i < nr * out; i += bd) {
        const int r = i / out, j = i - r * out;
        const float* a = sa + r * MW_A + ai;
        const float* w = W + j * in;
        float s = b[j];
        for (int k = 0; k < in; ++k) s = fmaf(w[k], a[k], s);
        sa[r * MW_A + ao + j] = (l < MW_LAYERS - 1) ? fmaxf(s, 0.f) : s;
      }
      __syncthreads();
    }
    // Loss and the gradient at the output: d(mean (y - x)^2)/dy = 2 (y - x) / (n * 71).
    for (int i = tid; i < nr * MW_W; i += bd) {
      const int r = i / MW_W, j = i - r * MW_W;
      const float diff = sa[r * MW_A + MW_AOFF[MW_LAYERS] + j] - sa[r * MW_A + j];
      loss = fmaf(diff, diff, loss);
      d0[r * MW_W + j] = grad_scale * diff;
    }
    __syncthreads();
    float* dcur = d0;
    float* dnext = d1;
    for (int l = MW_LAYERS - 1; l >= 0; --l) {
      const int in = MW_IN[l], out = MW_OUT[l], ai = MW_AOFF[l];
      const float* W = sp + MW_WOFF[l];
      float* gW = sg + MW_WOFF[l];
      // dW[j][k] += sum_r delta[r][j] a[r][k]; db[j] += sum_r delta[r][j] (k == in). One thread
      // owns each (j, k), so the shared accumulator needs no atomics.
      for (int i = tid; i < out * (in + 1); i += bd) {
        const int j = i / (in + 1), k = i - j * (in + 1);
        float s = 0.f;
        if (k < in) {
          for (int r = 0; r < nr; ++r) s = fmaf(dcur[r * MW_W + j], sa[r * MW_A + ai + k], s);
          gW[j * in + k] += s;
        } else {
          for (int r = 0; r < nr; ++r) s += dcur[r * MW_W + j];
          gW[in * out + j] += s;
        }
      }
      // delta of the layer below: (W^T delta) masked by ReLU' of its output (a > 0).
      if (l > 0) {
        for (int i = tid; i < nr * in; i += bd) {
          const int r = i / in, k = i - r * in;
          float s = 0.f;
          for (int j = 0; j < out; ++j) s = fmaf(W[j * in + k], dcur[r * MW_W + j], s);
          dnext[r * MW_W + k] = sa[r * MW_A + ai + k] > 0.f ? s : 0.f;
        }
      }
      __syncthreads();
      float* t = dcur;
      dcur = dnext;
      dnext = t;
    }
  }
  __syncthreads();
  for (int i = tid; i < MW_P; i += bd) partial[(size_t)blockIdx.x * MW_P + i] = sg[i];
  for (int o = 16; o > 0; o >>= 1) loss += __shfl_xor_sync(0xffffffffu, loss, o);
  if ((tid & 31) == 0) sred[tid >> 5] = loss;
  __syncthreads();
  if (tid == 0) {
    float s = 0.f;
    for (int w = 0; w < (bd + 31) / 32; ++w) s += sred[w];
    loss_partial[blockIdx.x] = s;
  }
}

// Sum the blocks' gradients and take one Adam step (the formula of kernels/optim.cu `adam_f32`);
// block 0 also writes the step's loss (mean over n * 71 entries) to loss_out[0].
extern "C" __global__ void __launch_bounds__(256) mw_adam(const float* __restrict__ partial, int nb,
                                                          float* __restrict__ p, float* __restrict__ m,
                                                          float* __restrict__ v, const float* __restrict__ loss_partial,
                                                          float* __restrict__ loss_out, float inv_count, float lr,
                                                          float b1, float b2, float omb1, float omb2, float eps,
                                                          float bc1, float bc2) {
  const float step = lr / bc1, sbc2 = sqrtf(bc2);
  for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < MW_P; i += gridDim.x * blockDim.x) {
    float g = 0.f;
    for (int b = 0; b < nb; ++b) g += partial[(size_t)b * MW_P + i];
    const float mi = b1 * m[i] + omb1 * g;
    const float vi = b2 * v[i] + omb2 * (g * g);
    m[i] = mi;
    v[i] = vi;
    p[i] = p[i] - step * (mi / (sqrtf(vi) / sbc2 + eps));
  }
  if (blockIdx.x == 0) {
    __shared__ float red[32];
    float s = 0.f;
    for (int b = threadIdx.x; b < nb; b += blockDim.x) s += loss_partial[b];
    for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
    if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = s;
    __syncthreads();
    if (threadIdx.x == 0) {
      float t = 0.f;
      for (int w = 0; w < (blockDim.x + 31) / 32; ++w) t += red[w];
      loss_out[0] = t * inv_count;
    }
  }
}
