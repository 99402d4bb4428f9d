//! AdamW in two parameter groups, as GPT-2 is trained (nanoGPT, llm.c): weight decay on the
//! matrices and embeddings (rank >= 2), none on biases and layer norms. Each group is one fused
//! multi-tensor step (`ferrograd_core::optim::adam_step`).
//!
//! Checkpoints see the optimizer through [`Optimizer::state_tensors`], which cuts the moments of
//! `wte` to the real vocabulary as [`super::HfView`] cuts the weight: the padded rows' moments are
//! zero forever (their gradient is exactly zero, see `config.rs`), so nothing is lost.
//!
//! ZeRO-1 (`zero.rs`, [`GptAdamW::sharded`]): the same two groups over views of this rank's shard
//! of the parameter elements, with moments for those elements only; checkpoints gather them into
//! the whole-model file this optimizer writes.

use super::model::Gpt;
use ferrograd_core::optim::AdamConfig;
use ferrograd_core::{DType, Error, GradStore, Result, Tensor};
use ferrograd_nn::optim::{Adam, Optimizer};

/// GPT-2's AdamW settings apart from the learning rate.
pub fn gpt_adamw_config(lr: f64, weight_decay: f64) -> AdamConfig {
    AdamConfig { lr, beta1: 0.9, beta2: 0.95, eps: 1e-8, weight_decay, decoupled: true }
}

#[derive(Debug)]
pub struct GptAdamW {
    pub(super) decay: Adam,
    pub(super) no_decay: Adam,
    /// All parameters in model order (the list checkpoints record).
    pub(super) params: Vec<(String, Tensor)>,
    /// Name of the tied embedding and its real row count.
    pub(super) wte: (String, usize),
    /// The device copies of each group's step count (f64) and of the learning rate (f32) that
    /// [`GptAdamW::step_device`] reads, made by [`GptAdamW::prepare_device_step`].
    pub(super) device: Option<DeviceState>,
    /// ZeRO-1: the groups update this rank's shard of the elements (`zero.rs`).
    pub(super) shard: Option<super::zero::Shard>,
}

#[derive(Debug)]
pub(super) struct DeviceState {
    steps: [Tensor; 2],
    lr: Tensor,
}

impl GptAdamW {
    pub fn new(model: &Gpt, lr: f64, weight_decay: f64) -> Result<GptAdamW> {
        Self::with_groups(model.params(), model.config.vocab_size, |_, t| t.rank() >= 2, lr, weight_decay)
    }

    /// The same optimizer over another model's parameters (the Mamba LM's): `params[0]` is the
    /// (padded) embedding, whose moments checkpoints cut to `vocab` rows; `decays(name, tensor)`
    /// picks the weight-decay group.
    pub fn with_groups(
        params: Vec<(String, Tensor)>,
        vocab: usize,
        decays: impl Fn(&str, &Tensor) -> bool,
        lr: f64,
        weight_decay: f64,
    ) -> Result<GptAdamW> {
        let first = params.first().ok_or_else(|| Error::InvalidArgument("AdamW over no parameters".into()))?;
        let wte = (first.0.clone(), vocab);
        let (decay, no_decay): (Vec<_>, Vec<_>) = params.iter().cloned().partition(|(n, t)| decays(n, t));
        Ok(GptAdamW {
            decay: Adam::new_adamw(decay, gpt_adamw_config(lr, weight_decay))?,
            no_decay: Adam::new_adamw(no_decay, gpt_adamw_config(lr, 0.0))?,
            wte,
            params,
            device: None,
            shard: None,
        })
    }

    /// Before each device step (outside any graph capture): the learning rate written into its
    /// device copy, and the step counts' device copies made from the host count when missing
    /// (first step, or after `load_state_meta`). Writes into the same tensors every time, so a
    /// captured step keeps reading them.
    pub fn prepare_device_step(&mut self) -> Result<()> {
        let device = self.params[0].1.device();
        let host = [self.decay.step_count(), self.no_decay.step_count()];
        let lr = Tensor::full(self.decay.lr() as f32 as f64, 1, DType::F32, device)?;
        match &self.device {
            Some(d) => d.lr.set(&lr)?,
            None => {
                let steps = host.map(|n| Tensor::full(n as f64, 1, DType::F64, device));
                let [a, b] = steps;
                self.device = Some(DeviceState { steps: [a?, b?], lr });
            }
        }
        Ok(())
    }

    /// One AdamW step of both groups reading the step counts and the learning rate from the
    /// device (see [`GptAdamW::prepare_device_step`]): what a CUDA graph captures. The host counts
    /// advance with [`GptAdamW::count_step`], once per step that ran.
    /// `grad_scale`: the clip factor on the device (`clip_grad_factor`), applied as the kernel reads
    /// the gradients.
    pub fn step_device(&self, grads: &GradStore, grad_scale: Option<&Tensor>) -> Result<()> {
        let d = self
            .device
            .as_ref()
            .ok_or_else(|| Error::InvalidArgument("step_device before prepare_device_step".into()))?;
        self.decay.step_scheduled(grads, &d.steps[0], &d.lr, grad_scale)?;
        self.no_decay.step_scheduled(grads, &d.steps[1], &d.lr, grad_scale)
    }

    /// The host-counted step ([`Optimizer::step`]) for a step body that hands its update a clip
    /// factor: off CUDA it has none (`clip_grad_factor` scaled the gradients itself).
    pub fn step_host(&mut self, grads: &GradStore, grad_scale: Option<&Tensor>) -> Result<()> {
        if grad_scale.is_some() {
            return Err(Error::InvalidArgument("the host-counted AdamW step takes no gradient factor".into()));
        }
        self.step(grads)
    }

    /// Advance the host step counts after a device step ran (a group with no parameters, which a
    /// ZeRO-1 shard can leave, counts too: its count is the run's and checkpoints record it).
    pub fn count_step(&mut self) {
        self.decay.count_step();
        self.no_decay.count_step();
    }

    pub fn weight_decay(&self) -> f64 {
        self.decay.config.weight_decay
    }
}

impl GptAdamW {
    /// The moments of the tied embedding cut to its real rows (see the module doc).
    fn cut_wte(&self, state: Vec<(String, Tensor)>) -> Vec<(String, Tensor)> {
        let (name, rows) = &self.wte;
        let cut = |(n, t): (String, Tensor)| -> (String, Tensor) {
            if n.strip_suffix(".m").or_else(|| n.strip_suffix(".v")) == Some(name.as_str()) {
                // A narrow of the leading dim of a 2-d buffer cannot fail for rows <= its length.
                let t = t.narrow(0, 0, *rows).unwrap_or(t);
                return (n, t);
            }
            (n, t)
        };
        state.into_iter().map(cut).collect()
    }
}

impl Optimizer for GptAdamW {
    fn step(&mut self, grads: &GradStore) -> Result<()> {
        for g in [&mut self.decay, &mut self.no_decay] {
            // An empty group (a ZeRO-1 shard without biases, say) still counts the step.
            if g.params().is_empty() {
                g.count_step();
            } else {
                g.step(grads)?;
            }
        }
        Ok(())
    }

    fn lr(&self) -> f64 {
        self.decay.lr()
    }

    fn set_lr(&mut self, lr: f64) {
        self.decay.set_lr(lr);
        self.no_decay.set_lr(lr);
    }

    fn params(&self) -> &[(String, Tensor)] {
        &self.params
    }

    fn step_count(&self) -> u64 {
        self.decay.step_count()
    }

    fn kind(&self) -> &'static str {
        "gpt-adamw"
    }

    fn state_tensors(&self) -> Vec<(String, Tensor)> {
        if let Some(s) = &self.shard {
            // Whole-model moments only while a checkpoint is written or read (`zero.rs`).
            return self.cut_wte(s.state_tensors(&self.params));
        }
        self.cut_wte(self.decay.state_tensors().into_iter().chain(self.no_decay.state_tensors()).collect())
    }

    fn state_meta(&self) -> serde_json::Value {
        serde_json::json!({ "decay": self.decay.state_meta(), "no_decay": self.no_decay.state_meta() })
    }

    fn load_state_meta(&mut self, meta: &serde_json::Value) -> Result<()> {
        let part = |k: &str| {
            meta.get(k).ok_or_else(|| Error::InvalidArgument(format!("optimizer state: missing group {k:?}")))
        };
        let (d, n) = (part("decay")?, part("no_decay")?);
        self.decay.load_state_meta(d)?;
        self.no_decay.load_state_meta(n)?;
        // The device counts follow the loaded host counts (in place: a captured step reads them).
        if let Some(dev) = &self.device {
            for (t, n) in dev.steps.iter().zip([self.decay.step_count(), self.no_decay.step_count()]) {
                t.set(&Tensor::full(n as f64, 1, DType::F64, t.device())?)?;
            }
        }
        Ok(())
    }
}
