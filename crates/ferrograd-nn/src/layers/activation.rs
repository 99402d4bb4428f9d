//! Parameter-free activations as modules, and the `Activation` enum that names one of them (what
//! the MLP builder takes).

use crate::Module;
use ferrograd_core::{Result, Tensor};

macro_rules! activation {
    ($($(#[$doc:meta])* $name:ident => $f:ident),* $(,)?) => {
        $(
            $(#[$doc])*
            ///
            /// A parameter-free module; elementwise, any shape, float dtypes.
            #[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
            pub struct $name;

            impl Module for $name {
                fn forward(&self, x: &Tensor) -> Result<Tensor> {
                    x.$f()
                }
                fn visit_parameters(&self, _prefix: &str, _f: &mut dyn FnMut(String, &Tensor)) {}
            }
        )*
    };
}

activation! {
    /// `max(x, 0)`
    Relu => relu,
    /// GELU, exact erf form (PyTorch's `nn.GELU()` default).
    Gelu => gelu,
    /// Hyperbolic tangent (`nn.Tanh`).
    Tanh => tanh,
    /// `1 / (1 + e^-x)` (`nn.Sigmoid`).
    Sigmoid => sigmoid,
    /// `x * sigmoid(x)`
    Silu => silu,
}

/// One of the activations by name, itself a [`Module`]: what [`mlp`](crate::mlp) puts between
/// its linear layers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Activation {
    /// [`Relu`].
    Relu,
    /// [`Gelu`] (exact erf form).
    Gelu,
    /// [`Tanh`].
    Tanh,
    /// [`Sigmoid`].
    Sigmoid,
    /// [`Silu`].
    Silu,
}

impl Module for Activation {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        match self {
            Activation::Relu => x.relu(),
            Activation::Gelu => x.gelu(),
            Activation::Tanh => x.tanh(),
            Activation::Sigmoid => x.sigmoid(),
            Activation::Silu => x.silu(),
        }
    }
    fn visit_parameters(&self, _prefix: &str, _f: &mut dyn FnMut(String, &Tensor)) {}
}

impl std::str::FromStr for Activation {
    type Err = ferrograd_core::Error;
    fn from_str(s: &str) -> Result<Self> {
        Ok(match s.to_ascii_lowercase().as_str() {
            "relu" => Activation::Relu,
            "gelu" => Activation::Gelu,
            "tanh" => Activation::Tanh,
            "sigmoid" => Activation::Sigmoid,
            "silu" | "swish" => Activation::Silu,
            _ => {
                return Err(ferrograd_core::Error::InvalidArgument(format!(
                    "unknown activation {s:?}: expected relu, gelu, tanh, sigmoid or silu"
                )))
            }
        })
    }
}
