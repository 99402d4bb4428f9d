//! `Linear` trained with fake quantization (QAT, PyTorch's `torch.ao.nn.qat.Linear` with its
//! default int8 qconfig in symmetric form): `y = fq_a(x) fq_w(W)^T + b`, the weight quantized per
//! output channel (symmetric int8 on `[-127, 127]`, a min-max observer), the input per tensor
//! (symmetric int8, a moving-average min-max observer). Gradients pass through the rounding by the
//! straight-through estimator (`Tensor::fake_quantize`). `freeze_observers` keeps the last ranges
//! (PyTorch's `disable_observer`, done for the last part of a QAT fine-tune).

use super::observer::Observer;
use crate::layers::{Linear, LinearActivation};
use crate::Module;
use ferrograd_core::{FakeQuant, Result, Tensor};
use std::sync::{Mutex, MutexGuard};

/// A `Linear` trained with fake quantization: weights per output channel, the input per tensor
/// (symmetric int8), observed until frozen, straight-through gradients.
#[derive(Debug)]
pub struct QatLinear {
    /// The float layer whose weights are trained.
    pub linear: Linear,
    weight_obs: Mutex<Observer>,
    input_obs: Mutex<Observer>,
    observing: bool,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl QatLinear {
    /// QAT around a float layer (its parameters are shared, not copied).
    pub fn new(linear: Linear) -> QatLinear {
        QatLinear::with_observers(linear, Observer::weight_int8(0), Observer::activation_int8())
    }

    /// With explicit observers (the weight's must be per channel on axis 0 or per tensor).
    pub fn with_observers(linear: Linear, weight: Observer, input: Observer) -> QatLinear {
        QatLinear { linear, weight_obs: Mutex::new(weight), input_obs: Mutex::new(input), observing: true }
    }

    /// Stop (or resume) updating the ranges; fake quantization goes on with the last ones.
    pub fn freeze_observers(&mut self, frozen: bool) {
        self.observing = !frozen;
    }

    /// The weight's and the input's observers, as they stand.
    pub fn observers(&self) -> (Observer, Observer) {
        (lock(&self.weight_obs).clone(), lock(&self.input_obs).clone())
    }

    fn fake_quant(obs: &Mutex<Observer>, x: &Tensor, observing: bool) -> Result<Tensor> {
        let mut o = lock(obs);
        if observing || o.range().is_none() {
            o.observe(x)?;
        }
        let p = o.qparams()?;
        let q = FakeQuant { qmin: o.qmin, qmax: o.qmax, axis: o.axis, grad_factor: None };
        x.fake_quantize(&p.scale, &p.zero_point, q)
    }

    /// `act(fq(x) fq(W)^T + b)` through the float layer's fused op.
    pub fn forward_act(&self, x: &Tensor, act: LinearActivation) -> Result<Tensor> {
        let w = Self::fake_quant(&self.weight_obs, &self.linear.weight, self.observing)?;
        let xq = Self::fake_quant(&self.input_obs, x, self.observing)?;
        Linear { weight: w, bias: self.linear.bias.clone() }.forward_act(&xq, act)
    }
}

impl Module for QatLinear {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        self.forward_act(x, LinearActivation::None)
    }

    fn visit_parameters(&self, prefix: &str, f: &mut dyn FnMut(String, &Tensor)) {
        self.linear.visit_parameters(prefix, f)
    }
}
