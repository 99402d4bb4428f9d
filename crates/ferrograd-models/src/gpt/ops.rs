//! The model's building blocks, each one function: the places where a fused kernel replaces
//! today's primitives without touching the model.
//!
//! | function        | today                                    | fused replacement                          |
//! |-----------------|------------------------------------------|--------------------------------------------|
//! | [`linear`]      | matmul + bias add                        | cuBLASLt `linear(x, w, b, Activation::None)` |
//! | [`linear_gelu`] | matmul + bias add + `gelu_tanh`          | cuBLASLt `linear(.., Activation::Gelu)`    |
//! | [`attention`]   | `q k^T`, causal mask, softmax, `@ v`     | `Tensor::scaled_dot_product_attention`      |
//! | [`layer_norm`]  | `Tensor::layer_norm`                     | (same method, moved into `fused/`)          |
//! | [`lm_logits`] | `x wte^T` over the padded vocabulary, real columns viewed | (same; a fused classifier takes the view) |
//! | [`lm_loss`]     | cast to f32 + `cross_entropy`            | fused classifier: loss and dlogits in one pass |
//!
//! Weights are in Hugging Face's Conv1D layout, `[in, out]` (`y = x W + b`); a fused linear that
//! takes PyTorch's `[out, in]` is called with `w.t()` (a view, no copy).
//!
//! Precision follows `ferrograd_nn::amp`: under an autocast scope the matmuls run in the low
//! dtype (inputs and weights cast down, f32 accumulation) and come back as f32; norms, softmax,
//! the loss and the residual stream stay in f32. Without autocast everything runs in the input's
//! dtype (f32, or f64 in gradient checks).

use ferrograd_core::{DType, Result, Tensor};
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

/// Scaled dot-product attention with PyTorch's semantics (`F.scaled_dot_product_attention` with
/// `scale = 1/sqrt(D)`, no dropout): `q` `[B, H, Tq, D]`, `k` and `v` `[B, H, Tk, D]`, any strides.
/// `mask`, when given, is a `[Tq, Tk]` u8 tensor whose non-zero entries are masked out (the causal
/// mask for training; the KV cache passes an offset one).
///
/// Materializes the `Tq x Tk` scores (the fused kernel will not). Under autocast they stay in the
/// low dtype, as in FlashAttention: `q` is scaled before the product, the mask and softmax (f32
/// math inside the kernel) read and write bf16, and the probabilities enter `@ v` in bf16; three
/// `T x T` buffers per layer instead of six f32 ones.
pub fn attention(q: &Tensor, k: &Tensor, v: &Tensor, mask: Option<&Tensor>) -> Result<Tensor> {
    let d = *q.dims().last().unwrap_or(&1);
    let scale = 1.0 / (d as f64).sqrt();
    let low = matmul_dtype(q);
    let cast = |t: &Tensor| match low {
        Some(l) => t.to_dtype(l),
        None => Ok(t.clone()),
    };
    let scores = cast(q)?.mul_scalar(scale)?.matmul(&cast(k)?.transpose(-2, -1)?)?;
    let scores = match mask {
        Some(m) => scores.masked_fill(m, f64::NEG_INFINITY)?,
        None => scores,
    };
    let y = scores.softmax(-1)?.matmul(&cast(v)?)?;
    if low.is_some() {
        y.to_dtype(DType::F32)
    } else {
        Ok(y)
    }
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
