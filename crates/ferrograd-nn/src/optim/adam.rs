//! Adam and AdamW (decoupled weight decay), PyTorch's formulas, via core's fused `adam_step`.

use super::{check_params, gather_grads, meta_f64, meta_u64, Optimizer};
use ferrograd_core::optim::{adam_step, adam_step_scheduled, AdamConfig};
use ferrograd_core::{Error, GradStore, Result, Tensor};

/// Adam or AdamW (`torch.optim.Adam` / `AdamW`), one fused multi-tensor step per call; the moments
/// `m` and `v` have each parameter's shape and device (parameters are f32).
#[derive(Debug)]
pub struct Adam {
    params: Vec<(String, Tensor)>,
    m: Vec<Tensor>,
    v: Vec<Tensor>,
    /// Hyperparameters; `decoupled` makes it AdamW.
    pub config: AdamConfig,
    steps: u64,
}

/// AdamW with PyTorch's defaults apart from `lr` and `weight_decay`.
pub fn adamw(params: Vec<(String, Tensor)>, lr: f64, weight_decay: f64) -> Result<Adam> {
    Adam::new_adamw(params, AdamConfig { lr, weight_decay, ..Default::default() })
}

impl Adam {
    /// Moments start at zero, allocated now beside each parameter (so a checkpoint of a fresh
    /// optimizer already has its full state).
    pub fn new(params: Vec<(String, Tensor)>, config: AdamConfig) -> Result<Self> {
        check_params(&params)?;
        for (k, v) in [("lr", config.lr), ("eps", config.eps), ("weight_decay", config.weight_decay)] {
            if v.is_nan() || v < 0.0 {
                return Err(Error::InvalidArgument(format!("Adam: {k} = {v} must be >= 0")));
            }
        }
        for (k, b) in [("beta1", config.beta1), ("beta2", config.beta2)] {
            if !(0.0..1.0).contains(&b) {
                return Err(Error::InvalidArgument(format!("Adam: {k} = {b} must be in [0, 1)")));
            }
        }
        let zeros = |p: &Tensor| p.zeros_like();
        let m = params.iter().map(|(_, p)| zeros(p)).collect::<Result<Vec<_>>>()?;
        let v = params.iter().map(|(_, p)| zeros(p)).collect::<Result<Vec<_>>>()?;
        Ok(Adam { params, m, v, config, steps: 0 })
    }

    /// One step whose count and learning rate live on the device (`adam_step_scheduled`): `step`
    /// (one f64, incremented by the call) and `lr` (one f32, written by the caller), so that a
    /// CUDA graph replaying the call applies each step's own bias correction and rate. The host
    /// count is not touched: the caller advances it with [`Adam::count_step`] once per step that
    /// ran (a captured call runs only when replayed). `grad_scale`: a device factor the gradients
    /// are read times (`clip_grad_factor`'s), instead of a pass that scales them.
    pub fn step_scheduled(
        &self,
        grads: &GradStore,
        step: &Tensor,
        lr: &Tensor,
        grad_scale: Option<&Tensor>,
    ) -> Result<()> {
        let (idx, gs) = gather_grads(&self.params, grads)?;
        if idx.is_empty() {
            return Ok(());
        }
        let pick = |v: &[Tensor]| idx.iter().map(|&i| v[i].clone()).collect::<Vec<_>>();
        let ps: Vec<Tensor> = idx.iter().map(|&i| self.params[i].1.clone()).collect();
        adam_step_scheduled(&ps, &gs, &pick(&self.m), &pick(&self.v), &self.config, step, lr, grad_scale)
    }

    /// Advance the host step count by one (see [`Adam::step_scheduled`]).
    pub fn count_step(&mut self) {
        self.steps += 1;
    }

    /// AdamW: the same update with weight decay applied to the weights directly.
    pub fn new_adamw(params: Vec<(String, Tensor)>, config: AdamConfig) -> Result<Self> {
        Self::new(params, AdamConfig { decoupled: true, ..config })
    }
}

impl Optimizer for Adam {
    fn step(&mut self, grads: &GradStore) -> Result<()> {
        let (idx, gs) = gather_grads(&self.params, grads)?;
        if idx.is_empty() {
            return Ok(());
        }
        let pick = |v: &[Tensor]| idx.iter().map(|&i| v[i].clone()).collect::<Vec<_>>();
        let ps: Vec<Tensor> = idx.iter().map(|&i| self.params[i].1.clone()).collect();
        self.steps += 1;
        adam_step(&ps, &gs, &pick(&self.m), &pick(&self.v), &self.config, self.steps)
    }

    fn lr(&self) -> f64 {
        self.config.lr
    }

    fn set_lr(&mut self, lr: f64) {
        self.config.lr = lr;
    }

    fn params(&self) -> &[(String, Tensor)] {
        &self.params
    }

    fn step_count(&self) -> u64 {
        self.steps
    }

    fn kind(&self) -> &'static str {
        if self.config.decoupled {
            "adamw"
        } else {
            "adam"
        }
    }

    fn state_tensors(&self) -> Vec<(String, Tensor)> {
        let mut out = Vec::with_capacity(2 * self.params.len());
        for (i, (name, _)) in self.params.iter().enumerate() {
            out.push((format!("{name}.m"), self.m[i].clone()));
            out.push((format!("{name}.v"), self.v[i].clone()));
        }
        out
    }

    fn state_meta(&self) -> serde_json::Value {
        serde_json::json!({ "steps": self.steps, "lr": self.config.lr })
    }

    fn load_state_meta(&mut self, meta: &serde_json::Value) -> Result<()> {
        self.steps = meta_u64(meta, "steps")?;
        self.config.lr = meta_f64(meta, "lr")?;
        Ok(())
    }
}
