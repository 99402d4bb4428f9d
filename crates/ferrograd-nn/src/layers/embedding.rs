//! A lookup table of `num_embeddings` rows, N(0, 1) initialised like `nn.Embedding`.

use crate::{init, Module};
use ferrograd_core::{Device, Result, Rng, Tensor};

/// A lookup table (`nn.Embedding`): row `i` of `weight` for id `i`.
#[derive(Debug, Clone)]
pub struct Embedding {
    /// `[num_embeddings, embedding_dim]`
    pub weight: Tensor,
}

impl Embedding {
    /// A table of N(0, 1) rows (PyTorch's initialisation), f32 on `device`.
    pub fn new(num_embeddings: usize, embedding_dim: usize, rng: &mut Rng, device: Device) -> Result<Self> {
        Ok(Embedding { weight: init::normal(rng, 0.0, 1.0, (num_embeddings, embedding_dim), device)? })
    }
}

impl Module for Embedding {
    /// Rows for integer ids of any shape: output `ids.shape + [embedding_dim]`.
    fn forward(&self, ids: &Tensor) -> Result<Tensor> {
        self.weight.embedding(ids)
    }

    fn visit_parameters(&self, prefix: &str, f: &mut dyn FnMut(String, &Tensor)) {
        f(crate::module::join_name(prefix, "weight"), &self.weight);
    }
}
