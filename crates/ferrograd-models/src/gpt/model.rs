//! GPT-2 (Radford et al. 2019) with Hugging Face `GPT2LMHeadModel`'s parameter names and layouts:
//! Conv1D weights `[in, out]`, q|k|v packed in `c_attn`, the classifier tied to `wte`. The one
//! difference is inside: `wte` has `padded_vocab()` rows, the extra ones zero (see `config.rs`);
//! [`HfView`] shows the model with the real vocabulary, as files and outputs see it.

use super::config::GptConfig;
use super::ops::{
    attention, causal_mask, gemm_norm, lm_logits, lm_logits_padded, lm_loss, materialized_attention, self_attention,
};
use super::quant::{Linears, Proj};
use ferrograd_core::fused::classifier::ClassifierOpts;
use ferrograd_core::{shape_err, DType, Device, Error, Result, Rng, Tensor};
use ferrograd_nn::module::join_name;
use ferrograd_nn::Module;
use std::sync::Mutex;

/// Name prefix of the transformer's parameters in `GPT2LMHeadModel`'s state dict.
pub const PREFIX: &str = "transformer";

/// One transformer block's parameters (all f32 leaf variables).
#[derive(Debug, Clone)]
pub struct Block {
    pub ln_1_w: Tensor,
    pub ln_1_b: Tensor,
    /// `[C, 3C]`: the q, k and v projections side by side.
    pub c_attn_w: Tensor,
    pub c_attn_b: Tensor,
    /// `[C, C]`
    pub attn_proj_w: Tensor,
    pub attn_proj_b: Tensor,
    pub ln_2_w: Tensor,
    pub ln_2_b: Tensor,
    /// `[C, 4C]`
    pub c_fc_w: Tensor,
    pub c_fc_b: Tensor,
    /// `[4C, C]`
    pub mlp_proj_w: Tensor,
    pub mlp_proj_b: Tensor,
}

impl Block {
    /// The four projections' `(weight, bias)`, in [`super::quant::PROJ_WEIGHTS`]'s order.
    pub(crate) fn projections_mut(&mut self) -> [(&mut Tensor, &mut Tensor); 4] {
        [
            (&mut self.c_attn_w, &mut self.c_attn_b),
            (&mut self.attn_proj_w, &mut self.attn_proj_b),
            (&mut self.c_fc_w, &mut self.c_fc_b),
            (&mut self.mlp_proj_w, &mut self.mlp_proj_b),
        ]
    }

    /// The four projections' weights and biases (what the fused linears read as master weights).
    pub fn projection_tensors(&self) -> [&Tensor; 8] {
        [
            &self.c_attn_w,
            &self.c_attn_b,
            &self.attn_proj_w,
            &self.attn_proj_b,
            &self.c_fc_w,
            &self.c_fc_b,
            &self.mlp_proj_w,
            &self.mlp_proj_b,
        ]
    }

    /// `(name under h.{i}, tensor)` in Hugging Face's state-dict order.
    fn named(&self) -> [(&'static str, &Tensor); 12] {
        [
            ("ln_1.weight", &self.ln_1_w),
            ("ln_1.bias", &self.ln_1_b),
            ("attn.c_attn.weight", &self.c_attn_w),
            ("attn.c_attn.bias", &self.c_attn_b),
            ("attn.c_proj.weight", &self.attn_proj_w),
            ("attn.c_proj.bias", &self.attn_proj_b),
            ("ln_2.weight", &self.ln_2_w),
            ("ln_2.bias", &self.ln_2_b),
            ("mlp.c_fc.weight", &self.c_fc_w),
            ("mlp.c_fc.bias", &self.c_fc_b),
            ("mlp.c_proj.weight", &self.mlp_proj_w),
            ("mlp.c_proj.bias", &self.mlp_proj_b),
        ]
    }
}

/// Where one block's keys and values go when decoding with a cache: per layer `[capacity, H, D]`
/// buffers, the rows before the position already filled by earlier calls.
pub struct LayerCache<'a> {
    pub k: &'a Tensor,
    pub v: &'a Tensor,
    pub at: CacheAt<'a>,
}

/// The position the new tokens take in a KV cache.
#[derive(Clone, Copy)]
pub enum CacheAt<'a> {
    /// Positions `start..start + T`, known on the host (prefill; eager decode).
    Host(usize),
    /// One token at the position held in device memory, `pos` `[1]` u32, with `mask` `[1,
    /// capacity]` u8 non-zero past it: nothing about the step depends on a host value, so a CUDA
    /// graph of it replays at every position. Attention then reads the whole cache through the
    /// mask (the materialized scores; a decode step's `capacity` keys are few).
    Device { pos: &'a Tensor, mask: &'a Tensor },
}

pub struct Gpt {
    pub config: GptConfig,
    /// `[padded_vocab, C]`; rows `vocab_size..` are zero.
    pub wte: Tensor,
    /// `[n_positions, C]`
    pub wpe: Tensor,
    pub blocks: Vec<Block>,
    pub ln_f_w: Tensor,
    pub ln_f_b: Tensor,
    /// How the blocks' projections run: float (default), QAT or int8 (`quant.rs`).
    pub linears: Linears,
    /// The MLPs' backward recomputes their hidden activation instead of keeping it from the
    /// forward (`ops::mlp`): less memory for one more store a block (`gpt train`'s default;
    /// `--keep-gelu` keeps it).
    pub recompute_gelu: bool,
    /// The causal mask of the last training length, kept so that a step does not rebuild it; only
    /// the fallback of `ops::attention` (a head dim the CUDA kernels lack) reads it.
    mask: Mutex<Option<Tensor>>,
}

impl std::fmt::Debug for Gpt {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Gpt({:?}, {})", self.config, self.wte.device())
    }
}

fn leaf(t: Tensor) -> Tensor {
    t.requires_grad()
}

impl Gpt {
    /// GPT-2's initialisation: every weight matrix and embedding N(0, 0.02), the two residual
    /// projections of each block N(0, 0.02 / sqrt(2 L)), biases 0, layer norms 1 and 0; the padded
    /// rows of `wte` 0. Drawn in state-dict order from one Philox stream, so a seed gives the same
    /// weights on every device.
    pub fn new(config: GptConfig, seed: u64, device: Device) -> Result<Gpt> {
        let mut rng = Rng::new(seed);
        Self::build(config, device, &mut |shape, std| Tensor::randn_with(&mut rng, 0.0, std, shape, DType::F32, device))
    }

    /// A model of this shape with zero weights (layer norms 1), to load weights into.
    pub fn zeroed(config: GptConfig, device: Device) -> Result<Gpt> {
        Self::build(config, device, &mut |shape, _| Tensor::zeros(shape, DType::F32, device))
    }

    /// The parameters in state-dict order, each matrix drawn by `normal(shape, std)`.
    fn build(
        config: GptConfig,
        device: Device,
        normal: &mut dyn FnMut((usize, usize), f64) -> Result<Tensor>,
    ) -> Result<Gpt> {
        config.validate()?;
        let c = config.n_embd;
        let std = 0.02;
        let proj_std = std / (2.0 * config.n_layer as f64).sqrt();
        let real = normal((config.vocab_size, c), std)?;
        let wte = pad_rows(&real, config.padded_vocab())?;
        let wpe = normal((config.n_positions, c), std)?;
        let zeros = |n: usize| Tensor::zeros(n, DType::F32, device);
        let ones = |n: usize| Tensor::ones(n, DType::F32, device);
        let mut blocks = Vec::with_capacity(config.n_layer);
        for _ in 0..config.n_layer {
            blocks.push(Block {
                ln_1_w: leaf(ones(c)?),
                ln_1_b: leaf(zeros(c)?),
                c_attn_w: leaf(normal((c, 3 * c), std)?),
                c_attn_b: leaf(zeros(3 * c)?),
                attn_proj_w: leaf(normal((c, c), proj_std)?),
                attn_proj_b: leaf(zeros(c)?),
                ln_2_w: leaf(ones(c)?),
                ln_2_b: leaf(zeros(c)?),
                c_fc_w: leaf(normal((c, 4 * c), std)?),
                c_fc_b: leaf(zeros(4 * c)?),
                mlp_proj_w: leaf(normal((4 * c, c), proj_std)?),
                mlp_proj_b: leaf(zeros(c)?),
            });
        }
        Ok(Gpt {
            config,
            wte: leaf(wte),
            wpe: leaf(wpe),
            blocks,
            ln_f_w: leaf(ones(c)?),
            ln_f_b: leaf(zeros(c)?),
            linears: Linears::Float,
            recompute_gelu: false,
            mask: Mutex::new(None),
        })
    }

    pub fn device(&self) -> Device {
        self.wte.device()
    }

    /// Every parameter under its full Hugging Face name (`transformer.h.0.attn.c_attn.weight`),
    /// in state-dict order: the leaf variables themselves (`wte` with its padded rows).
    pub fn params(&self) -> Vec<(String, Tensor)> {
        let mut out = Vec::with_capacity(4 + 12 * self.blocks.len());
        out.push((format!("{PREFIX}.wte.weight"), self.wte.clone()));
        out.push((format!("{PREFIX}.wpe.weight"), self.wpe.clone()));
        for (i, b) in self.blocks.iter().enumerate() {
            for (n, t) in b.named() {
                out.push((format!("{PREFIX}.h.{i}.{n}"), t.clone()));
            }
        }
        out.push((format!("{PREFIX}.ln_f.weight"), self.ln_f_w.clone()));
        out.push((format!("{PREFIX}.ln_f.bias"), self.ln_f_b.clone()));
        out
    }

    /// The parameters as files hold them: `wte` cut to the real vocabulary (a view sharing the
    /// parameter's storage, so `Tensor::set` on it loads in place).
    pub fn hf_params(&self) -> Result<Vec<(String, Tensor)>> {
        let mut p = self.params();
        p[0].1 = self.wte.narrow(0, 0, self.config.vocab_size)?;
        Ok(p)
    }

    fn check_ids(&self, ids: &Tensor, what: &'static str) -> Result<(usize, usize)> {
        check_token_ids(ids, self.device(), what)
    }

    /// The training-length causal mask, built once per length.
    fn train_mask(&self, t: usize) -> Result<Tensor> {
        let mut g = self.mask.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(m) = g.as_ref().filter(|m| m.dims() == [t, t] && m.device() == self.device()) {
            return Ok(m.clone());
        }
        let m = causal_mask(t, 0, self.device())?;
        *g = Some(m.clone());
        Ok(m)
    }

    /// Token plus position embeddings of `ids` `[B, T]` placed at positions `start..start + T`.
    pub(crate) fn embed(&self, ids: &Tensor, start: usize) -> Result<Tensor> {
        let (_, t) = self.check_ids(ids, "gpt forward")?;
        if start + t > self.config.n_positions {
            return Err(shape_err!(
                "gpt forward",
                "positions {start}..{} exceed the model's context of {} tokens",
                start + t,
                self.config.n_positions
            ));
        }
        self.wte.embedding(ids)?.add(&self.wpe.narrow(0, start, t)?)
    }

    /// One block: `x + attn(ln_1(x))`, then `+ mlp(ln_2(x))`. The residual stream arrives as `x`
    /// plus the previous block's MLP output `branch` (not yet added: the add is fused with `ln_1`),
    /// and leaves the same way, `(x, mlp output)`, for the next block's `ln_1` or `ln_f`. With
    /// `cache`, `x` is `[1, T, C]` at positions `start..start + T` and the keys and values are
    /// written into the cache.
    pub(crate) fn block(
        &self,
        layer: usize,
        blk: &Block,
        x: &Tensor,
        branch: Option<&Tensor>,
        cache: Option<LayerCache<'_>>,
    ) -> Result<(Tensor, Tensor)> {
        let cfg = &self.config;
        let &[b, t, c] = x.dims() else {
            return Err(shape_err!("gpt block", "expected [B, T, C], got {:?}", x.dims()));
        };
        let (h, d) = (cfg.n_head, cfg.head_dim());
        let eps = cfg.layer_norm_epsilon;
        let (x, a) = gemm_norm(x, branch, &blk.ln_1_w, &blk.ln_1_b, eps)?;
        // [B, T, 3, H, D]: q, k and v are permuted views of this one buffer, never copied out
        // (the attention kernels read them in place).
        let qkv = self.linears.linear(layer, Proj::Qkv, &a, &blk.c_attn_w, &blk.c_attn_b)?.reshape((b, t, 3, h, d))?;
        let part = |qkv: &Tensor, i: usize| qkv.narrow(2, i, 1)?.squeeze(2); // [B, T, H, D]
                                                                             // [B, T, H, D]
        let y = match cache {
            None => self_attention(&qkv, || self.train_mask(t))?,
            Some(kv) => {
                if b != 1 {
                    return Err(shape_err!("gpt decode", "the KV cache holds one sequence, got batch {b}"));
                }
                // The cache keeps its own dtype: under autocast the projection wrote bf16 (the
                // attention below casts the cached keys and values as it casts q).
                let cached = |i: usize, cache: &Tensor| part(&qkv, i)?.squeeze(0)?.to_dtype(cache.dtype());
                // [rows, H, D] -> [1, H, rows, D], views of the cache.
                let heads = |c: &Tensor| c.permute(&[1, 0, 2])?.unsqueeze(0);
                let q = part(&qkv, 0)?.permute(&[0, 2, 1, 3])?;
                match kv.at {
                    CacheAt::Host(start) => {
                        let end = start + t;
                        kv.k.narrow(0, start, t)?.set(&cached(1, kv.k)?)?;
                        kv.v.narrow(0, start, t)?.set(&cached(2, kv.v)?)?;
                        let (keys, vals) = (heads(&kv.k.narrow(0, 0, end)?)?, heads(&kv.v.narrow(0, 0, end)?)?);
                        attention(&q, &keys, &vals, start, || causal_mask(t, start, self.device()))?
                    }
                    CacheAt::Device { pos, mask } => {
                        if t != 1 {
                            return Err(shape_err!("gpt decode", "a device-positioned step takes 1 token, got {t}"));
                        }
                        kv.k.index_copy_(0, pos, &cached(1, kv.k)?)?;
                        kv.v.index_copy_(0, pos, &cached(2, kv.v)?)?;
                        materialized_attention(&q, &heads(kv.k)?, &heads(kv.v)?, mask)?
                    }
                }
                .permute(&[0, 2, 1, 3])?
            }
        };
        let y = y.reshape((b, t, c))?;
        let proj = self.linears.linear(layer, Proj::AttnOut, &y, &blk.attn_proj_w, &blk.attn_proj_b)?;
        let (x, m) = gemm_norm(&x, Some(&proj), &blk.ln_2_w, &blk.ln_2_b, eps)?;
        let out = self.linears.mlp(layer, &m, blk, self.recompute_gelu)?;
        Ok((x, out))
    }

    /// The blocks and `ln_f` over the embeddings `x` `[B, T, C]`, with each block's cache.
    fn run_blocks(&self, x: Tensor, caches: Option<(&[Tensor], &[Tensor], CacheAt<'_>)>) -> Result<Tensor> {
        let (mut x, mut branch) = (x, None);
        for (i, blk) in self.blocks.iter().enumerate() {
            let cache = caches.map(|(k, v, at)| LayerCache { k: &k[i], v: &v[i], at });
            let (nx, out) = self.block(i, blk, &x, branch.as_ref(), cache)?;
            (x, branch) = (nx, Some(out));
        }
        let eps = self.config.layer_norm_epsilon;
        Ok(gemm_norm(&x, branch.as_ref(), &self.ln_f_w, &self.ln_f_b, eps)?.1)
    }

    /// The final hidden states `[B, T, C]` (after `ln_f`) of `ids` `[B, T]`: f32, or bf16 under a bf16
    /// autocast (they only feed the classifier GEMM: `ops::gemm_norm`).
    pub fn hidden(&self, ids: &Tensor) -> Result<Tensor> {
        self.run_blocks(self.embed(ids, 0)?, None)
    }

    /// Logits `[B, T, vocab_size]` (f32): what `GPT2LMHeadModel` returns.
    pub fn logits(&self, ids: &Tensor) -> Result<Tensor> {
        let (b, t) = self.check_ids(ids, "gpt logits")?;
        let l = lm_logits(&self.hidden(ids)?, &self.wte, self.config.vocab_size)?;
        let l = if matches!(l.dtype(), DType::BF16 | DType::F16) { l.to_dtype(DType::F32)? } else { l };
        l.contiguous()?.reshape((b, t, self.config.vocab_size))
    }

    /// Mean next-token cross entropy of `ids` `[B, T]` against `targets` `[B, T]`.
    pub fn loss(&self, ids: &Tensor, targets: &Tensor) -> Result<Tensor> {
        let (b, t) = self.check_ids(ids, "gpt loss")?;
        if targets.dims() != [b, t] {
            return Err(Error::ShapeMismatch { op: "gpt loss", lhs: vec![b, t], rhs: targets.dims().to_vec() });
        }
        let logits = lm_logits(&self.hidden(ids)?, &self.wte, self.config.vocab_size)?;
        lm_loss(&logits, &targets.reshape(b * t)?)
    }

    /// The training forward with the fused classifier: `(mean loss, logits, dlogits)` where
    /// `dlogits` is the gradient of `grad_scale * loss` with respect to `logits` (over the padded
    /// vocabulary on a GPU, 0 in the padded columns), written over the logits themselves on CUDA
    /// (they are dead once the loss is known). Backpropagate with
    /// `GradAccumulator::backward_seeded(logits, &dlogits)`. The loss is cut from the graph.
    pub fn loss_and_logits_grad(
        &self,
        ids: &Tensor,
        targets: &Tensor,
        grad_scale: f64,
    ) -> Result<(Tensor, Tensor, Tensor)> {
        let (b, t) = self.check_ids(ids, "gpt loss")?;
        if targets.dims() != [b, t] {
            return Err(Error::ShapeMismatch { op: "gpt loss", lhs: vec![b, t], rhs: targets.dims().to_vec() });
        }
        let vocab = self.config.vocab_size;
        let logits = lm_logits_padded(&self.hidden(ids)?, &self.wte, vocab)?;
        let opts = ClassifierOpts { classes: Some(vocab), ignore_index: None, grad_scale, in_place: true };
        let (loss, dlogits) = logits.classifier_loss_grad(&targets.reshape(b * t)?, opts)?;
        Ok((loss, logits, dlogits))
    }

    /// Every block's projection weights and biases, block by block.
    pub fn projection_params(&self) -> Vec<Tensor> {
        self.blocks.iter().flat_map(|b| b.projection_tensors().map(Tensor::clone)).collect()
    }

    /// For generation under a `dtype` autocast (bf16 or f16): the float block projections' weights
    /// and biases cast to `dtype` once, where autocast would cast them again at every decode step
    /// (GPT-2: 96 tensors, about half of a bf16 decode step's kernel time on an H200). The values
    /// are the same as the per-call casts; the layer norms, embeddings and the tied classifier stay
    /// f32. Inference only: the f32 masters of the projections are dropped (a training step or a
    /// forward outside autocast would then meet mixed dtypes). Int8 projections are left as they are.
    pub fn cast_projections(&mut self, dtype: DType) -> Result<()> {
        if !matches!(dtype, DType::BF16 | DType::F16) {
            return Err(Error::InvalidArgument(format!("cast_projections: bf16 or f16, not {dtype}")));
        }
        if !matches!(self.linears, Linears::Float) {
            return Ok(());
        }
        let _g = ferrograd_core::no_grad();
        for b in &mut self.blocks {
            for (w, bias) in b.projections_mut() {
                *w = w.detach().to_dtype(dtype)?;
                *bias = bias.detach().to_dtype(dtype)?;
            }
        }
        Ok(())
    }

    /// Run `ids` `[1, T]` at positions `start..start + T` through the model, writing their keys and
    /// values into `k_cache`/`v_cache` (per layer `[capacity, H, D]`), and return the logits of the
    /// last position over the real vocabulary, `[vocab_size]` in f32.
    pub fn forward_cached(&self, ids: &Tensor, start: usize, k_cache: &[Tensor], v_cache: &[Tensor]) -> Result<Tensor> {
        let (_, t) = self.check_ids(ids, "gpt decode")?;
        if k_cache.len() != self.blocks.len() || v_cache.len() != self.blocks.len() {
            return Err(Error::InvalidArgument(format!(
                "gpt decode: {} key and {} value caches for {} layers",
                k_cache.len(),
                v_cache.len(),
                self.blocks.len()
            )));
        }
        if let Some(k) = k_cache.first() {
            if start + t > k.dims()[0] {
                return Err(shape_err!(
                    "gpt decode",
                    "positions up to {} exceed the cache of {}",
                    start + t,
                    k.dims()[0]
                ));
            }
        }
        let h = self.run_blocks(self.embed(ids, start)?, Some((k_cache, v_cache, CacheAt::Host(start))))?;
        self.last_logits(&h)
    }

    /// One decode step at a position held in device memory: `id` `[1, 1]`, `pos` `[1]` (u32, below
    /// the caches' capacity; checked on the device), `mask` `[1, capacity]` u8, non-zero at the
    /// positions after `pos`. Writes the token's keys and values at row `pos` of every layer's
    /// cache and returns the logits `[vocab_size]` (f32). Nothing is read back to the host, so a
    /// CUDA graph of this call replays at any position (`sample::Decoder`).
    pub fn forward_at(
        &self,
        id: &Tensor,
        pos: &Tensor,
        mask: &Tensor,
        k_cache: &[Tensor],
        v_cache: &[Tensor],
    ) -> Result<Tensor> {
        let (_, t) = self.check_ids(id, "gpt decode")?;
        if t != 1 || k_cache.len() != self.blocks.len() || v_cache.len() != self.blocks.len() {
            return Err(shape_err!(
                "gpt decode",
                "one token and a cache per layer: got {t} tokens, {} key and {} value caches for {} layers",
                k_cache.len(),
                v_cache.len(),
                self.blocks.len()
            ));
        }
        let capacity = k_cache.first().map_or(0, |k| k.dims()[0]);
        if capacity > self.config.n_positions || mask.dims() != [1, capacity] {
            return Err(shape_err!(
                "gpt decode",
                "a cache of {capacity} rows (context {}) with a [1, {capacity}] mask, got mask {:?}",
                self.config.n_positions,
                mask.dims()
            ));
        }
        let x = self.wte.embedding(id)?.add(&self.wpe.index_select(pos, 0)?)?;
        let h = self.run_blocks(x, Some((k_cache, v_cache, CacheAt::Device { pos, mask })))?;
        self.last_logits(&h)
    }

    /// The logits `[vocab_size]` (f32, contiguous) of the last position of `h` `[1, T, C]`.
    fn last_logits(&self, h: &Tensor) -> Result<Tensor> {
        let t = h.dims()[1];
        let l = lm_logits(&h.narrow(1, t - 1, 1)?, &self.wte, self.config.vocab_size)?.flatten_all()?;
        l.to_dtype(DType::F32)?.contiguous()
    }
}

/// `(batch, time)` of token ids `[B, T]` (an integer dtype) on the model's `device`, else the
/// error naming `what` (the language models' forwards: GPT-2 and Mamba).
pub(crate) fn check_token_ids(ids: &Tensor, device: Device, what: &'static str) -> Result<(usize, usize)> {
    if ids.dtype().is_float() {
        return Err(Error::UnsupportedDType { op: what, dtype: ids.dtype() });
    }
    if ids.device() != device {
        return Err(Error::DeviceMismatch { op: what, lhs: device, rhs: ids.device() });
    }
    let &[b, t] = ids.dims() else {
        return Err(shape_err!(what, "token ids must be [batch, time], got {:?}", ids.dims()));
    };
    Ok((b, t))
}

/// `t` `[V, C]` with zero rows appended up to `rows`, contiguous.
pub(crate) fn pad_rows(t: &Tensor, rows: usize) -> Result<Tensor> {
    let (v, c) = (t.dims()[0], t.dims()[1]);
    if rows == v {
        return t.contiguous();
    }
    let pad = Tensor::zeros((rows - v, c), t.dtype(), t.device())?;
    Tensor::cat(&[t.detach(), pad], 0)
}

impl Module for Gpt {
    /// Logits `[B, T, vocab_size]` of token ids `[B, T]`.
    fn forward(&self, ids: &Tensor) -> Result<Tensor> {
        self.logits(ids)
    }

    /// The leaf variables (what optimizers update), `wte` with its padded rows.
    fn visit_parameters(&self, prefix: &str, f: &mut dyn FnMut(String, &Tensor)) {
        for (n, t) in self.params() {
            f(join_name(prefix, &n), &t);
        }
    }
}

/// The model as files see it: Hugging Face names, `wte` with `vocab_size` rows. Checkpoints are
/// written and read through this view (`ferrograd_nn::checkpoint::save(path, &HfView(&model), ..)`).
pub struct HfView<'a>(pub &'a Gpt);

impl Module for HfView<'_> {
    fn forward(&self, ids: &Tensor) -> Result<Tensor> {
        self.0.logits(ids)
    }

    fn visit_parameters(&self, prefix: &str, f: &mut dyn FnMut(String, &Tensor)) {
        // Narrowing a 2-d parameter to fewer rows cannot fail; fall back to the full tensor if the
        // impossible happens rather than dropping a parameter from the file.
        let params = self.0.hf_params().unwrap_or_else(|_| self.0.params());
        for (n, t) in params {
            f(join_name(prefix, &n), &t);
        }
    }
}
