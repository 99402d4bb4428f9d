//! The model's building blocks, each one function: the places where a fused kernel replaces
//! today's primitives without touching the model.
//!
//! | function          | what runs                                                                |
//! |-------------------|--------------------------------------------------------------------------|
//! | [`linear`]        | the fused cuBLASLt `linear(x, w, b)`: the bias in the GEMM's epilogue    |
//! | [`mlp`]           | the fused `mlp`: GELU_AUX_BIAS then BIAS forward, DGELU_BGRAD backward   |
//! | [`self_attention`] | `Tensor::attention_packed` on the QKV buffer: its gradient written in place |
//! | [`attention`]     | `Tensor::scaled_dot_product_attention` (FlashAttention-2 style on CUDA)  |
//! | [`residual_norm`] | `add_layer_norm`: the residual add and the next layer norm, one kernel   |
//! | [`gemm_norm`]     | [`residual_norm`] for a norm that feeds a GEMM: its output in the GEMM's dtype |
//! | [`layer_norm`]    | `Tensor::layer_norm` (the first block's, which has no residual to add)   |
//! | [`lm_logits`]     | `x wte^T` over the padded vocabulary (on CUDA the fused linear, `wte` a master weight), real columns viewed |
//! | [`lm_loss`]       | `cross_entropy_acc` on the bf16 logits (the training step uses the fused classifier, `train.rs`) |
//!
//! Weights are in Hugging Face's Conv1D layout, `[in, out]` (`y = x W + b`); a fused linear that
//! takes PyTorch's `[out, in]` is called with `w.t()` (a view, no copy).
//!
//! Precision follows `ferrograd_nn::amp` as PyTorch's autocast does: under an autocast scope the
//! matmuls run in the low dtype (inputs and weights cast down, f32 accumulation; the projections'
//! f32 weights and biases go to the fused ops as they are, which cast them down themselves and
//! return their gradients in f32: no cast kernels in the backward) and their outputs stay there, bias and GELU included (each linear's output feeds the next GEMM or attention, so
//! nothing is cast back and forth, and the activations autograd keeps are half the size); norms,
//! the loss (computed from the low-dtype logits, see [`lm_loss`]) and the residual stream are f32.
//! Without autocast everything runs in the input's dtype (f32, or f64 in gradient checks).

use ferrograd_core::fused::attention::CUDA_HEAD_DIMS;
use ferrograd_core::fused::linear::{self as fused, Activation};
use ferrograd_core::{AttentionOpts, DType, Result, Tensor};
use ferrograd_nn::amp::autocast_dtype;

/// The dtype matmuls run in: the autocast dtype for float inputs, else the input's own.
fn matmul_dtype(x: &Tensor) -> Option<DType> {
    autocast_dtype().filter(|_| x.dtype().is_float() && x.dtype() != DType::F64)
}

/// The operands of a fused linear / mlp: `x` in the dtype the GEMM runs in (see
/// [`matmul_dtype`]), the parameters as they are when they are all f32 (master weights: the fused
/// op casts them down itself and returns f32 gradients, in the weights' own layout), else cast to
/// that dtype too.
fn gemm_operands(x: &Tensor, ws: &[&Tensor]) -> Result<(Tensor, Vec<Tensor>)> {
    match matmul_dtype(x) {
        Some(low) => {
            let master = ws.iter().all(|w| w.dtype() == DType::F32);
            let cast = |w: &&Tensor| if master { Ok((*w).clone()) } else { w.to_dtype(low) };
            Ok((x.to_dtype(low)?, ws.iter().map(cast).collect::<Result<_>>()?))
        }
        None => Ok((x.clone(), ws.iter().map(|w| (*w).clone()).collect())),
    }
}

/// `x W + b` over the last dim of `x` (any leading dims), `w` `[in, out]`: one fused cuBLASLt
/// linear (bias in the epilogue; its gradient from the dW GEMM's BGRADB epilogue), reading
/// `w.t()` (PyTorch's `[out, in]`) as a transposed view, never a copy (its gradient comes back
/// written transposed, so `w`'s is contiguous). Under autocast the output stays in the low dtype,
/// bias included (rounded to it first, as autocast casts it), as PyTorch's bias epilogue does.
pub fn linear(x: &Tensor, w: &Tensor, b: Option<&Tensor>) -> Result<Tensor> {
    let ws: Vec<&Tensor> = std::iter::once(w).chain(b).collect();
    let (x, ws) = gemm_operands(x, &ws)?;
    fused::linear(&x, &ws[0].t()?, ws.get(1), Activation::None)
}

/// `gelu_tanh(x W1 + b1) W2 + b2`: GPT-2's MLP block as the fused `mlp` op (two cuBLASLt calls
/// forward, the GELU and both biases in their epilogues; the backward's `dz` comes out of the
/// DGELU_BGRAD epilogue of the `dh` GEMM: no elementwise kernel either way). Weights `[in, out]`.
/// `recompute`: the backward recomputes the hidden activation instead of keeping it
/// (`fused::mlp_recompute`, `gpt train --recompute-gelu`).
pub fn mlp(x: &Tensor, w1: &Tensor, b1: &Tensor, w2: &Tensor, b2: &Tensor, recompute: bool) -> Result<Tensor> {
    let (x, ws) = gemm_operands(x, &[w1, b1, w2, b2])?;
    let f = if recompute { fused::mlp_recompute } else { fused::mlp };
    f(&x, &ws[0].t()?, Some(&ws[1]), &ws[2].t()?, Some(&ws[3]))
}

/// `(h, layer_norm(h))` with `h = x + branch`: the residual stream `x` keeps its dtype (f32 under
/// autocast; a low-dtype branch output is cast up to it) and the add and the norm are one kernel
/// (`add_layer_norm`). Without a branch (the first block) `h` is `x`.
pub fn residual_norm(
    x: &Tensor,
    branch: Option<&Tensor>,
    w: &Tensor,
    b: &Tensor,
    eps: f64,
) -> Result<(Tensor, Tensor)> {
    match branch {
        None => Ok((x.clone(), layer_norm(x, w, b, eps)?)),
        Some(r) => x.add_layer_norm(&r.to_dtype(x.dtype())?, Some(w), Some(b), eps),
    }
}

/// [`residual_norm`] for a layer norm whose output only feeds a GEMM (GPT's `ln_1`, `ln_2`, `ln_f`):
/// under a bf16 autocast with the f32 residual stream, the norm writes its output in bf16 itself
/// and takes the bf16 branch as it is (`add_layer_norm_mixed`, `layer_norm_to`), where autocast
/// would cast the branch up and the output down around it: the same values, without the two cast
/// kernels forward and the gradient's cast backward. Anything else runs [`residual_norm`].
pub fn gemm_norm(x: &Tensor, branch: Option<&Tensor>, w: &Tensor, b: &Tensor, eps: f64) -> Result<(Tensor, Tensor)> {
    let mixed = matmul_dtype(x) == Some(DType::BF16) && x.dtype() == DType::F32 && w.dtype() == DType::F32;
    match branch {
        _ if !mixed => residual_norm(x, branch, w, b, eps),
        None => Ok((x.clone(), x.layer_norm_to(Some(w), Some(b), eps, DType::BF16)?)),
        Some(r) if r.dtype() == DType::BF16 => x.add_layer_norm_mixed(r, Some(w), Some(b), eps),
        Some(_) => residual_norm(x, branch, w, b, eps),
    }
}

/// Layer norm over the last dim; a low-precision input is cast to f32 first (as autocast does).
pub fn layer_norm(x: &Tensor, w: &Tensor, b: &Tensor, eps: f64) -> Result<Tensor> {
    let x = if matches!(x.dtype(), DType::BF16 | DType::F16) { x.to_dtype(DType::F32)? } else { x.clone() };
    x.layer_norm(Some(w), Some(b), eps)
}

/// Causal self-attention of a training step (no KV cache): `qkv` `[B, T, 3, H, D]` (the QKV
/// projection's output) to `[B, T, H, D]`. Through `Tensor::attention_packed` whenever the fused
/// op takes the head dim (its backward writes one packed gradient instead of three that autograd
/// would scatter back through views: 37% of a GPT-2 step's kernel time on an H200 before); else
/// [`attention`] on the three views. Under autocast `qkv` is cast to the low dtype once.
pub fn self_attention(qkv: &Tensor, mask: impl FnOnce() -> Result<Tensor>) -> Result<Tensor> {
    let qkv = to_matmul_dtype(qkv)?;
    let d = qkv.dims().last().copied().unwrap_or(0);
    if qkv.device().is_cpu() || CUDA_HEAD_DIMS.contains(&d) {
        return Tensor::attention_packed(&qkv, AttentionOpts::causal());
    }
    let part = |i: usize| qkv.narrow(2, i, 1)?.squeeze(2)?.permute(&[0, 2, 1, 3]);
    attention(&part(0)?, &part(1)?, &part(2)?, 0, mask)?.permute(&[0, 2, 1, 3])
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

/// `x` in the dtype matmuls run in (see `matmul_dtype`): under autocast, the packed QKV buffer
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
/// against `targets` `[N]`. Low-precision logits are read as they are, in f32 inside the kernel,
/// and the loss comes back in f32, as autocast runs it, but without the f32 copy of the logits
/// (`[16384, 50257]` f32 is 3.3 GB, and its gradient as much again); their gradient is in their
/// own dtype, which the classifier's GEMM reads anyway.
pub fn lm_loss(logits: &Tensor, targets: &Tensor) -> Result<Tensor> {
    logits.cross_entropy_acc(targets, None)
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
    lm_logits_padded(x, wte, vocab)?.narrow(1, 0, vocab)
}

/// [`lm_logits`] before the padded columns are cut off: `[N, Vp]` on a GPU, `[N, vocab]` on the
/// CPU; the real classes are the first `vocab` columns either way (what the fused classifier takes).
pub fn lm_logits_padded(x: &Tensor, wte: &Tensor, vocab: usize) -> Result<Tensor> {
    let c = wte.dims()[1];
    let rows = x.elem_count() / c.max(1);
    let x2 = x.reshape((rows, c))?;
    let w = if x.device().is_cpu() { wte.narrow(0, 0, vocab)? } else { wte.clone() };
    let logits = match matmul_dtype(x) {
        // On a GPU the f32 table goes to the fused linear as a master weight (`[out, in]` is its
        // own layout): its bf16 copy read (the run's kept copy, `cuda::ShadowSet`, else one cast)
        // and its gradient written in f32 by the GEMM. Through autocast's matmul it was a cast of
        // 38.6M elements forward and a strided cast of a bf16 gradient backward (0.3 ms of an H200
        // step), and a gradient rounded to bf16.
        Some(low) if !x.device().is_cpu() && w.dtype() == DType::F32 => {
            fused::linear(&x2.to_dtype(low)?, &w, None, Activation::None)?
        }
        Some(low) => x2.to_dtype(low)?.matmul(&w.to_dtype(low)?.t()?)?,
        None => x2.matmul(&w.t()?)?,
    };
    Ok(logits)
}
