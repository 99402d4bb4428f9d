//! Modules applied in order; children are named "0", "1", ... as in `nn.Sequential`.

use crate::module::join_name;
use crate::Module;
use ferrograd_core::{Result, Tensor};

/// Layers applied in order (`nn.Sequential`); children are named `0`, `1`, ...
#[derive(Default)]
pub struct Sequential {
    layers: Vec<Box<dyn Module>>,
}

impl std::fmt::Debug for Sequential {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Sequential({} layers)", self.layers.len())
    }
}

impl Sequential {
    /// An empty container.
    pub fn new() -> Self {
        Self::default()
    }

    /// Append a layer (builder style).
    #[allow(clippy::should_implement_trait)]
    pub fn add<M: Module + 'static>(mut self, m: M) -> Self {
        self.layers.push(Box::new(m));
        self
    }

    /// Append a boxed layer.
    pub fn push(&mut self, m: Box<dyn Module>) {
        self.layers.push(m);
    }

    /// Number of layers.
    pub fn len(&self) -> usize {
        self.layers.len()
    }

    /// Whether it has no layer.
    pub fn is_empty(&self) -> bool {
        self.layers.is_empty()
    }

    /// Layer `i`.
    pub fn get(&self, i: usize) -> Option<&dyn Module> {
        self.layers.get(i).map(|b| &**b)
    }
}

impl Module for Sequential {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let mut h = x.clone();
        for l in &self.layers {
            h = l.forward(&h)?;
        }
        Ok(h)
    }

    fn visit_parameters(&self, prefix: &str, f: &mut dyn FnMut(String, &Tensor)) {
        for (i, l) in self.layers.iter().enumerate() {
            l.visit_parameters(&join_name(prefix, &i.to_string()), f);
        }
    }

    fn set_training(&mut self, training: bool) {
        self.layers.iter_mut().for_each(|l| l.set_training(training));
    }
}
