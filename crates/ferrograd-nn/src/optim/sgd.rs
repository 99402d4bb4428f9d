//! SGD with momentum, dampening, Nesterov and (coupled) weight decay, via core's fused `sgd_step`.
//! As in PyTorch, a momentum buffer starts as the first gradient its parameter receives.

use super::{check_params, gather_grads, meta_f64, meta_u64, Optimizer};
use ferrograd_core::optim::{sgd_step, SgdConfig};
use ferrograd_core::{Error, GradStore, Result, Tensor};

/// SGD with momentum, dampening, Nesterov and weight decay (`torch.optim.SGD`).
#[derive(Debug)]
pub struct Sgd {
    params: Vec<(String, Tensor)>,
    /// Momentum buffers (empty when momentum is 0).
    bufs: Vec<Tensor>,
    /// Whether each buffer has been seeded by a first gradient.
    started: Vec<bool>,
    /// Hyperparameters.
    pub config: SgdConfig,
    steps: u64,
}

impl Sgd {
    /// An optimizer over `params` (f32, contiguous); errors for a negative or NaN lr, momentum or
    /// weight decay, and for a parameter that is not f32 or not contiguous.
    pub fn new(params: Vec<(String, Tensor)>, config: SgdConfig) -> Result<Self> {
        check_params(&params)?;
        let bad = |v: f64| v.is_nan() || v < 0.0;
        if bad(config.lr) || bad(config.momentum) || bad(config.weight_decay) {
            return Err(Error::InvalidArgument(format!("SGD: bad config {config:?}")));
        }
        if config.nesterov && (config.momentum <= 0.0 || config.dampening != 0.0) {
            return Err(Error::InvalidArgument("SGD: Nesterov momentum needs momentum > 0 and no dampening".into()));
        }
        let bufs = if config.momentum != 0.0 {
            params.iter().map(|(_, p)| p.zeros_like()).collect::<Result<Vec<_>>>()?
        } else {
            Vec::new()
        };
        let started = vec![false; params.len()];
        Ok(Sgd { params, bufs, started, config, steps: 0 })
    }
}

impl Optimizer for Sgd {
    fn step(&mut self, grads: &GradStore) -> Result<()> {
        let (idx, gs) = gather_grads(&self.params, grads)?;
        if idx.is_empty() {
            return Ok(());
        }
        self.steps += 1;
        let momentum = self.config.momentum != 0.0;
        // Buffers seeded this step and buffers already running take the two variants of the
        // fused step (at most two launches per 40 parameters).
        for first in [true, false] {
            let sel: Vec<usize> = (0..idx.len()).filter(|&k| !momentum || self.started[idx[k]] != first).collect();
            if sel.is_empty() || (!momentum && first) {
                continue;
            }
            let ps: Vec<Tensor> = sel.iter().map(|&k| self.params[idx[k]].1.clone()).collect();
            let g: Vec<Tensor> = sel.iter().map(|&k| gs[k].clone()).collect();
            let b: Vec<Tensor> =
                if momentum { sel.iter().map(|&k| self.bufs[idx[k]].clone()).collect() } else { vec![] };
            sgd_step(&ps, &g, &b, &self.config, first)?;
        }
        for &i in &idx {
            self.started[i] = true;
        }
        Ok(())
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
        "sgd"
    }

    fn state_tensors(&self) -> Vec<(String, Tensor)> {
        self.params.iter().zip(&self.bufs).map(|((n, _), b)| (format!("{n}.momentum_buffer"), b.clone())).collect()
    }

    fn state_meta(&self) -> serde_json::Value {
        serde_json::json!({ "steps": self.steps, "lr": self.config.lr, "started": self.started })
    }

    fn load_state_meta(&mut self, meta: &serde_json::Value) -> Result<()> {
        let started: Vec<bool> = meta
            .get("started")
            .and_then(|v| serde_json::from_value(v.clone()).ok())
            .ok_or_else(|| Error::InvalidArgument("optimizer state: missing or bad \"started\"".into()))?;
        if started.len() != self.params.len() {
            return Err(Error::InvalidArgument(format!(
                "optimizer state: {} momentum flags for {} parameters",
                started.len(),
                self.params.len()
            )));
        }
        self.steps = meta_u64(meta, "steps")?;
        self.config.lr = meta_f64(meta, "lr")?;
        self.started = started;
        Ok(())
    }
}
