//! The model's building blocks, each one function: the places where a fused kernel replaces
//! today's primitives without touching the model.
//!
//! | function        | today                                    | fused replacement                          |
//! |-----------------|------------------------------------------|--------------------------------------------|
//! | [`linear`]      | matmul + bias add                        | cuBLASLt `linear(x, w, b, Activation::None)` |
//! | [`linear_gelu`] | matmul + bias add + `gelu_tanh`          | cuBLASLt `linear(.., Activation::Gelu)`    |
//! | [`attention`]   | `Tensor::scaled_dot_product_attention`   | (done: FlashAttention-2 style on CUDA)     |
//! | [`layer_norm`]  | `Tensor::layer_norm`                     | (same method, moved into `fused/`)          |
//! | [`lm_logits`] | `x wte^T` over the padded vocabulary, real columns viewed | (same; a fused classifier takes the view) |
//! | [`lm_loss`]     | cast to f32 + `cross_entropy`            | fused classifier: loss and dlogits in one pass |
//!
//! Weights are in Hugging Face's Conv1D layout, `[in, out]` (`y = x W + b`); a fused linear that
//! takes PyTorch's `[out, in]` is called with `w.t()` (a view, no copy).
//!
//! Precision follows `ferrograd_nn::amp`: under an autocast scope the matmuls run in the low
//! dtype (inputs and weights cast down, f32 accumulation) and come back as f32; attention reads
//! q, k, v in the low dtype and its output stays there (it feeds the output projection's GEMM);
//! norms, the loss and the residual stream stay in f32. Without autocast everything runs in the input's
//! dtype (f32, or f64 in gradient checks).

use ferrograd_core::fused::attention::CUDA_HEAD_DIMS;
use ferrograd_core::{AttentionOpts, DType, Result, Tensor};
use ferrograd_nn::amp::autocast_dtype;

/// The dtype matmuls run in: the autocast dtype for float inputs, else the input's own.
fn matmul_dtype(x: &Tensor) -> Option<DType> {
    autocast_dtype().filter(|_| x.dtype().is_float() && x.dtype() != DType::F64)
}

/// `x W + b` over the last dim of `x` (any leading dims), `w` `[in, out]`.
pub fn linear(x: &Tensor, w: &Tensor, b: Option<&Tensor>) -> Result<Tensor> {
    let dims = x.dims().to_vec();
    let (k, n) = (w.dims()[0], w.dims()[1]);
    let rows = x.elem_count() / k.max(1);
    // One [rows, in] x [in, out] GEMM (and one for each gradient), not a batched matmul over a
    // broadcast weight whose gradient would then be reduced over the batch.
    let x2 = x.reshape((rows, k))?;
    let y = match matmul_dtype(x) {
        Some(low) => x2.to_dtype(low)?.matmul(&w.to_dtype(low)?)?.to_dtype(DType::F32)?,
        None => x2.matmul(w)?,
    };
    let y = match b {
        Some(b) => y.add(b)?,
        None => y,
    };
    let mut out = dims;
    if let Some(last) = out.last_mut() {
        *last = n;
    }
    y.reshape(out)
}

/// `gelu_tanh(x W + b)`: GPT-2's MLP up-projection.
pub fn linear_gelu(x: &Tensor, w: &Tensor, b: &Tensor) -> Result<Tensor> {
    linear(x, w, Some(b))?.gelu_tanh()
}

/// Layer norm over the last dim; a low-precision input is cast to f32 first (as autocast does).
pub fn layer_norm(x: &Tensor, w: &Tensor, b: &Tensor, eps: f64) -> Result<Tensor> {
    let x = if matches!(x.dtype(), DType::BF16 | DType::F16) { x.to_dtype(DType::F32)? } else { x.clone() };
    x.layer_norm(Some(w), Some(b), eps)
}

/// Causal self-attention of queries at positions `start..start + Tq` over the keys of positions
/// `0..Tk` (`Tk = start + Tq`): `q` `[B, H, Tq, D]`, `k` and `v` `[B, H, Tk, D]`, any strides,
/// `scale = 1/sqrt(D)`, no dropout. Training passes `start = 0` (`Tq = Tk`); the KV cache passes
/// the cached length. Under autocast q, k and v are cast to the low dtype (a no-op when the caller
/// cast the packed QKV buffer already) and the output stays in it: it only feeds the output
/// projection, whose GEMM runs in that dtype anyway.
///
/// Runs `Tensor::scaled_dot_product_attention` (FlashAttention-2 style on CUDA: no `Tq x Tk`
/// matrix is stored, forward or backward) whenever it can express the problem: PyTorch's
/// `is_causal` is top-left aligned, which is this mask for `start == 0`, and a single query
/// (`Tq == 1`) sees every key. The two remaining cases fall back to [`materialized_attention`]
/// with the `[Tq, Tk]` mask that `mask` builds (called only then): a prompt chunk appended to a
/// non-empty KV cache, and, on CUDA, a head dim the kernels are not built for
/// (`CUDA_HEAD_DIMS`: GPT-2's 64 is; toy configs with other head dims still run).
pub fn attention(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    start: usize,
    mask: impl FnOnce() -> Result<Tensor>,
) -> Result<Tensor> {
    let (tq, d) = (q.dims().get(2).copied().unwrap_or(0), q.dims().last().copied().unwrap_or(0));
    let expressible = start == 0 || tq == 1;
    let kernels = q.device().is_cpu() || CUDA_HEAD_DIMS.contains(&d);
    if !(expressible && kernels) {
        return materialized_attention(q, k, v, &mask()?);
    }
    let (q, k, v) = (to_matmul_dtype(q)?, to_matmul_dtype(k)?, to_matmul_dtype(v)?);
    Tensor::scaled_dot_product_attention(&q, &k, &v, AttentionOpts { causal: start == 0, ..Default::default() })
}

/// `x` in the dtype matmuls run in (see [`matmul_dtype`]): under autocast, the packed QKV buffer
/// is cast once here so that attention reads bf16 views of it instead of casting q, k, v apart.
pub fn to_matmul_dtype(x: &Tensor) -> Result<Tensor> {
    match matmul_dtype(x) {
        Some(low) => x.to_dtype(low),
        None => Ok(x.clone()),
    }
}

/// Attention through the `Tq x Tk` scores (`q k^T`, `masked_fill`, softmax, `@ v`): the fallback
/// of [`attention`]; `mask` `[Tq, Tk]` u8, non-zero entries masked out. Under autocast the scores
/// stay in the low dtype, as in FlashAttention: `q` is scaled before the product, the mask and
/// softmax (f32 math inside the kernel) read and write bf16, and the probabilities enter `@ v` in
/// bf16. The output is in the low dtype too, as [`attention`]'s.
pub fn materialized_attention(q: &Tensor, k: &Tensor, v: &Tensor, mask: &Tensor) -> Result<Tensor> {
    let d = *q.dims().last().unwrap_or(&1);
    let scale = 1.0 / (d as f64).sqrt();
    let scores = to_matmul_dtype(q)?.mul_scalar(scale)?.matmul(&to_matmul_dtype(k)?.transpose(-2, -1)?)?;
    scores.masked_fill(mask, f64::NEG_INFINITY)?.softmax(-1)?.matmul(&to_matmul_dtype(v)?)
}

/// Mean cross entropy of `logits` `[N, vocab]` (the real vocabulary: [`lm_logits`]'s output)
/// against `targets` `[N]`. Low-precision logits are cast to f32 first (in one pass that also
/// makes a column view contiguous), as autocast runs the loss.
pub fn lm_loss(logits: &Tensor, targets: &Tensor) -> Result<Tensor> {
    let l =
        if matches!(logits.dtype(), DType::BF16 | DType::F16) { logits.to_dtype(DType::F32)? } else { logits.clone() };
    l.cross_entropy(targets, None)
}

/// The `[t, t]` causal mask (1 above the diagonal: key after query) for queries at positions
/// `start..start + t_q` over keys `0..start + t_q`, as a u8 tensor on `device`.
pub fn causal_mask(t_q: usize, start: usize, device: ferrograd_core::Device) -> Result<Tensor> {
    let t_k = start + t_q;
    let v: Vec<u8> = (0..t_q).flat_map(|i| (0..t_k).map(move |j| u8::from(j > start + i))).collect();
    Tensor::from_vec(v, (t_q, t_k), device)
}

/// Logits `[N, vocab]` of hidden states `x` `[.., C]` (flattened to `N` rows) against the tied
/// embedding `wte` `[Vp, C]`, over the real vocabulary only: the padded rows take no probability
/// and get no gradient. On a GPU the product runs over all `Vp` rows (a GEMM whose width is a
/// multiple of 64) and the padded columns are cut off as a view; on the CPU, where alignment buys
/// nothing, only the real rows are multiplied and the logits come out contiguous. Under autocast
/// they stay in the low dtype ([`lm_loss`] casts them up).
pub fn lm_logits(x: &Tensor, wte: &Tensor, vocab: usize) -> Result<Tensor> {
    let c = wte.dims()[1];
    let rows = x.elem_count() / c.max(1);
    let x2 = x.reshape((rows, c))?;
    let w = if x.device().is_cpu() { wte.narrow(0, 0, vocab)? } else { wte.clone() };
    let logits = match matmul_dtype(x) {
        Some(low) => x2.to_dtype(low)?.matmul(&w.to_dtype(low)?.t()?)?,
        None => x2.matmul(&w.t()?)?,
    };
    logits.narrow(1, 0, vocab)
}
