//! The `Module` trait: a forward function plus named parameters. Names are the ones PyTorch's
//! `state_dict()` gives the same structure (`encoder.0.weight`), so checkpoints line up with
//! PyTorch's by name.

use ferrograd_core::{Result, Tensor};

/// `prefix.name`, or `name` at the root.
pub fn join_name(prefix: &str, name: &str) -> String {
    if prefix.is_empty() {
        name.to_string()
    } else {
        format!("{prefix}.{name}")
    }
}

/// A layer or model: `forward` plus named parameters (PyTorch's `nn.Module`). Implement
/// `forward` and `visit_parameters`; the rest has defaults.
pub trait Module {
    /// The layer's output for input `x` (`module(x)` in PyTorch).
    fn forward(&self, x: &Tensor) -> Result<Tensor>;

    /// Call `f(full_name, parameter)` for each parameter, in definition order, with names under
    /// `prefix` (empty at the root). Containers call their children with `join_name(prefix, child)`.
    fn visit_parameters(&self, prefix: &str, f: &mut dyn FnMut(String, &Tensor));

    /// Switch training-time behaviour (dropout) on or off; containers forward it to children.
    /// Layers that behave the same in both modes keep this default.
    fn set_training(&mut self, _training: bool) {}

    /// Every parameter with its hierarchical name: the handles themselves (leaf variables), so
    /// in-place updates through them change the module.
    fn named_parameters(&self) -> Vec<(String, Tensor)> {
        let mut out = Vec::new();
        self.visit_parameters("", &mut |n, t| out.push((n, t.clone())));
        out
    }

    /// Every parameter, in definition order, without names.
    fn parameters(&self) -> Vec<Tensor> {
        self.named_parameters().into_iter().map(|(_, t)| t).collect()
    }

    /// Total number of scalar parameters.
    fn num_parameters(&self) -> usize {
        let mut n = 0;
        self.visit_parameters("", &mut |_, t| n += t.elem_count());
        n
    }

    /// Training mode (`module.train()`): dropout is active.
    fn train(&mut self) {
        self.set_training(true)
    }

    /// Evaluation mode (`module.eval()`): dropout is the identity.
    fn eval(&mut self) {
        self.set_training(false)
    }
}

impl<M: Module + ?Sized> Module for Box<M> {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        (**self).forward(x)
    }
    fn visit_parameters(&self, prefix: &str, f: &mut dyn FnMut(String, &Tensor)) {
        (**self).visit_parameters(prefix, f)
    }
    fn set_training(&mut self, training: bool) {
        (**self).set_training(training)
    }
}
