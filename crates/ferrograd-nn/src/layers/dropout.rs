//! Inverted dropout drawing its masks from a shared, checkpointable generator; the identity in
//! eval mode.

use crate::{Module, SharedRng};
use ferrograd_core::{Error, Result, Tensor};

/// Inverted dropout (`nn.Dropout(p)`): in training mode each element is zeroed with probability
/// `p` and the rest scaled by `1 / (1 - p)`; the identity in eval mode.
#[derive(Debug, Clone)]
pub struct Dropout {
    /// Drop probability, in `[0, 1)`.
    pub p: f64,
    /// The generator its masks come from (shared so that a checkpoint can save it).
    pub rng: SharedRng,
    training: bool,
}

impl Dropout {
    /// Starts in training mode, like PyTorch modules.
    pub fn new(p: f64, rng: SharedRng) -> Result<Self> {
        if !(0.0..1.0).contains(&p) {
            return Err(Error::InvalidArgument(format!("dropout probability {p} not in [0, 1)")));
        }
        Ok(Dropout { p, rng, training: true })
    }

    /// Whether it drops (training mode).
    pub fn is_training(&self) -> bool {
        self.training
    }
}

impl Module for Dropout {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        if !self.training || self.p == 0.0 {
            return Ok(x.clone());
        }
        x.dropout_with(&mut self.rng.lock(), self.p, true)
    }

    fn visit_parameters(&self, _prefix: &str, _f: &mut dyn FnMut(String, &Tensor)) {}

    fn set_training(&mut self, training: bool) {
        self.training = training;
    }
}
