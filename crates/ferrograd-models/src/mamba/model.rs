//! The Mamba language model: `embedding` `[padded_vocab, d_model]` (the GPT-2 vocabulary padded to
//! a multiple of 64 as `gpt` pads it: the padded rows stay zero and take no probability), then
//! `n_layer` blocks `h = h + mixer(norm(h))` (LayerNorm; the residual add fused with the next
//! norm as in `gpt`), the final norm, and logits against the embedding (tied head).
//!
//! Parameter names are mamba_ssm's: `backbone.embedding.weight`, `backbone.layers.{i}.norm.*`,
//! `backbone.layers.{i}.mixer.*` (`ferrograd_nn::Mamba`), `backbone.norm_f.*`. Initialisation as
//! `mamba_ssm.models.mixer_seq_simple._init_weights`: embedding N(0, 0.02), each block's
//! `out_proj.weight` divided by `sqrt(n_layer)` after its default init, norms 1 and 0.

use crate::gpt::config::VOCAB_ALIGN;
use crate::gpt::model::pad_rows;
use crate::gpt::ops::{lm_logits, lm_logits_padded, lm_loss, residual_norm};
use ferrograd_core::fused::classifier::ClassifierOpts;
use ferrograd_core::{shape_err, DType, Device, Error, Result, Rng, Tensor};
use ferrograd_nn::module::join_name;
use ferrograd_nn::{Mamba, MambaConfig, MambaState, Module};
use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct MambaLmConfig {
    /// The real vocabulary (GPT-2's 50257 for the token shards).
    pub vocab_size: usize,
    pub d_model: usize,
    pub n_layer: usize,
    pub d_state: usize,
    pub d_conv: usize,
    pub expand: usize,
    pub norm_eps: f64,
}

impl MambaLmConfig {
    /// The small default: 4 blocks of width 256 (d_state 16, d_conv 4, expand 2), GPT-2's vocabulary.
    pub fn small() -> MambaLmConfig {
        MambaLmConfig {
            vocab_size: crate::gpt::GPT2_VOCAB,
            d_model: 256,
            n_layer: 4,
            d_state: 16,
            d_conv: 4,
            expand: 2,
            norm_eps: 1e-5,
        }
    }

    pub fn padded_vocab(&self) -> usize {
        self.vocab_size.next_multiple_of(VOCAB_ALIGN)
    }

    pub fn block(&self) -> MambaConfig {
        MambaConfig {
            d_state: self.d_state,
            d_conv: self.d_conv,
            expand: self.expand,
            ..MambaConfig::new(self.d_model)
        }
    }

    pub fn validate(&self) -> Result<()> {
        if self.vocab_size == 0 || self.n_layer == 0 {
            return Err(Error::InvalidArgument(format!("mamba lm: vocab and layers must be positive, got {self:?}")));
        }
        self.block().validate()
    }

    /// Parameters, counting the padded embedding rows once (the head is tied).
    pub fn num_parameters(&self) -> usize {
        let b = self.block();
        let (d, di, n, r, k) = (self.d_model, b.d_inner(), b.d_state, b.dt_rank(), b.d_conv);
        let block = d * 2 * di + di * k + di + di * (r + 2 * n) + r * di + di + di * n + di + di * d + 2 * d;
        self.padded_vocab() * d + self.n_layer * block + 2 * d
    }

    /// Training FLOPs per token, matmuls only (6 per multiply-add of a parameter matrix, the
    /// tied head included), for MFU; the conv and scan are a few percent at these widths.
    pub fn flops_per_token(&self) -> f64 {
        let b = self.block();
        let (d, di, n, r) = (self.d_model, b.d_inner(), b.d_state, b.dt_rank());
        let per_block = d * 2 * di + di * (r + 2 * n) + r * di + di * d;
        6.0 * (self.n_layer * per_block + self.vocab_size * d) as f64
    }
}

/// One residual block: its norm and its mixer.
#[derive(Debug, Clone)]
pub struct Layer {
    pub norm_w: Tensor,
    pub norm_b: Tensor,
    pub mixer: Mamba,
}

#[derive(Debug, Clone)]
pub struct MambaLm {
    pub config: MambaLmConfig,
    /// `[padded_vocab, d_model]`, rows `vocab_size..` zero.
    pub embedding: Tensor,
    pub layers: Vec<Layer>,
    pub norm_f_w: Tensor,
    pub norm_f_b: Tensor,
}

/// The recurrent state of every block, for [`MambaLm::step`].
#[derive(Debug, Clone)]
pub struct MambaLmState {
    pub layers: Vec<MambaState>,
}

impl MambaLm {
    pub fn new(config: MambaLmConfig, seed: u64, device: Device) -> Result<MambaLm> {
        config.validate()?;
        let mut rng = Rng::new(seed);
        let d = config.d_model;
        let real = Tensor::randn_with(&mut rng, 0.0, 0.02, (config.vocab_size, d), DType::F32, device)?;
        let embedding = pad_rows(&real, config.padded_vocab())?.requires_grad();
        let ones = || Ok::<_, Error>(Tensor::ones(d, DType::F32, device)?.requires_grad());
        let zeros = || Ok::<_, Error>(Tensor::zeros(d, DType::F32, device)?.requires_grad());
        let mut layers = Vec::with_capacity(config.n_layer);
        let scale = 1.0 / (config.n_layer as f64).sqrt();
        for _ in 0..config.n_layer {
            let mut mixer = Mamba::new(config.block(), &mut rng, device)?;
            let w = mixer.out_proj.weight.detach().mul_scalar(scale)?.requires_grad();
            mixer.out_proj.weight = w;
            layers.push(Layer { norm_w: ones()?, norm_b: zeros()?, mixer });
        }
        Ok(MambaLm { config, embedding, layers, norm_f_w: ones()?, norm_f_b: zeros()? })
    }

    pub fn device(&self) -> Device {
        self.embedding.device()
    }

    fn check_ids(&self, ids: &Tensor, what: &'static str) -> Result<(usize, usize)> {
        crate::gpt::model::check_token_ids(ids, self.device(), what)
    }

    /// Final hidden states `[B, T, d_model]` (after `norm_f`) of `ids` `[B, T]`.
    pub fn hidden(&self, ids: &Tensor) -> Result<Tensor> {
        self.check_ids(ids, "mamba forward")?;
        let eps = self.config.norm_eps;
        let (mut h, mut branch): (Tensor, Option<Tensor>) = (self.embedding.embedding(ids)?, None);
        for l in &self.layers {
            let (nh, normed) = residual_norm(&h, branch.as_ref(), &l.norm_w, &l.norm_b, eps)?;
            branch = Some(l.mixer.forward_seq(&normed)?);
            h = nh;
        }
        Ok(residual_norm(&h, branch.as_ref(), &self.norm_f_w, &self.norm_f_b, eps)?.1)
    }

    /// Logits `[B, T, vocab_size]` (f32).
    pub fn logits(&self, ids: &Tensor) -> Result<Tensor> {
        let (b, t) = self.check_ids(ids, "mamba logits")?;
        let l = lm_logits(&self.hidden(ids)?, &self.embedding, self.config.vocab_size)?;
        l.to_dtype(DType::F32)?.contiguous()?.reshape((b, t, self.config.vocab_size))
    }

    /// Mean next-token cross entropy of `ids` `[B, T]` against `targets` `[B, T]`.
    pub fn loss(&self, ids: &Tensor, targets: &Tensor) -> Result<Tensor> {
        let (b, t) = self.check_targets(ids, targets)?;
        let logits = lm_logits(&self.hidden(ids)?, &self.embedding, self.config.vocab_size)?;
        lm_loss(&logits, &targets.reshape(b * t)?)
    }

    fn check_targets(&self, ids: &Tensor, targets: &Tensor) -> Result<(usize, usize)> {
        let (b, t) = self.check_ids(ids, "mamba loss")?;
        if targets.dims() != [b, t] {
            return Err(Error::ShapeMismatch { op: "mamba loss", lhs: vec![b, t], rhs: targets.dims().to_vec() });
        }
        Ok((b, t))
    }

    /// The training forward with the fused classifier, as `Gpt::loss_and_logits_grad`: `(mean
    /// loss, logits, dlogits)`, `dlogits` the gradient of `grad_scale * loss` (written over the
    /// logits on CUDA); backpropagate with `GradAccumulator::backward_seeded(logits, &dlogits)`.
    pub fn loss_and_logits_grad(
        &self,
        ids: &Tensor,
        targets: &Tensor,
        grad_scale: f64,
    ) -> Result<(Tensor, Tensor, Tensor)> {
        let (b, t) = self.check_targets(ids, targets)?;
        let vocab = self.config.vocab_size;
        let logits = lm_logits_padded(&self.hidden(ids)?, &self.embedding, vocab)?;
        let opts = ClassifierOpts { classes: Some(vocab), ignore_index: None, grad_scale, in_place: true };
        let (loss, dlogits) = logits.classifier_loss_grad(&targets.reshape(b * t)?, opts)?;
        Ok((loss, logits, dlogits))
    }

    /// A zero recurrent state for `batch` sequences (f32, or the model's dtype for f64 checks).
    pub fn zero_state(&self, batch: usize) -> Result<MambaLmState> {
        let dtype = self.embedding.dtype();
        Ok(MambaLmState {
            layers: self.layers.iter().map(|l| l.mixer.zero_state(batch, dtype)).collect::<Result<_>>()?,
        })
    }

    /// One token per sequence, `ids` `[B]`, through the recurrence: logits `[B, vocab_size]` of
    /// the next token (f32; f64 for an f64 model), `state` advanced. Equal to [`MambaLm::logits`] at that position.
    pub fn step(&self, ids: &Tensor, state: &mut MambaLmState) -> Result<Tensor> {
        if ids.rank() != 1 || ids.dtype().is_float() {
            return Err(shape_err!("mamba step", "token ids must be [batch] integers, got {:?}", ids.dims()));
        }
        if state.layers.len() != self.layers.len() {
            return Err(Error::InvalidArgument(format!(
                "mamba step: a state of {} layers for {}",
                state.layers.len(),
                self.layers.len()
            )));
        }
        let eps = self.config.norm_eps;
        let (mut h, mut branch): (Tensor, Option<Tensor>) = (self.embedding.embedding(ids)?, None);
        for (l, st) in self.layers.iter().zip(state.layers.iter_mut()) {
            let (nh, normed) = residual_norm(&h, branch.as_ref(), &l.norm_w, &l.norm_b, eps)?;
            branch = Some(l.mixer.step(&normed, st)?);
            h = nh;
        }
        let h = residual_norm(&h, branch.as_ref(), &self.norm_f_w, &self.norm_f_b, eps)?.1;
        let l = lm_logits(&h, &self.embedding, self.config.vocab_size)?;
        if matches!(l.dtype(), DType::BF16 | DType::F16) {
            l.to_dtype(DType::F32)
        } else {
            Ok(l)
        }
    }

    /// Every parameter cast to `dtype` (new leaves): f64 for exact checks.
    pub fn to_dtype(&self, dtype: DType) -> Result<MambaLm> {
        let c = |t: &Tensor| -> Result<Tensor> { Ok(t.detach().to_dtype(dtype)?.requires_grad()) };
        Ok(MambaLm {
            config: self.config,
            embedding: c(&self.embedding)?,
            layers: self
                .layers
                .iter()
                .map(|l| Ok(Layer { norm_w: c(&l.norm_w)?, norm_b: c(&l.norm_b)?, mixer: l.mixer.to_dtype(dtype)? }))
                .collect::<Result<_>>()?,
            norm_f_w: c(&self.norm_f_w)?,
            norm_f_b: c(&self.norm_f_b)?,
        })
    }
}

impl Module for MambaLm {
    /// Logits `[B, T, vocab_size]` of token ids `[B, T]`.
    fn forward(&self, ids: &Tensor) -> Result<Tensor> {
        self.logits(ids)
    }

    fn visit_parameters(&self, prefix: &str, f: &mut dyn FnMut(String, &Tensor)) {
        let p = join_name(prefix, "backbone");
        f(join_name(&p, "embedding.weight"), &self.embedding);
        for (i, l) in self.layers.iter().enumerate() {
            let lp = join_name(&p, &format!("layers.{i}"));
            f(join_name(&lp, "norm.weight"), &l.norm_w);
            f(join_name(&lp, "norm.bias"), &l.norm_b);
            l.mixer.visit_parameters(&join_name(&lp, "mixer"), f);
        }
        f(join_name(&p, "norm_f.weight"), &self.norm_f_w);
        f(join_name(&p, "norm_f.bias"), &self.norm_f_b);
    }
}
