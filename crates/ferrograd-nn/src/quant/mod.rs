//! Quantization: observers that turn the range of what they see into a scale and zero point
//! ([`observer`]), and a `Linear` layer trained with fake quantization ([`QatLinear`], QAT: the
//! weights quantized per output channel, the input per tensor, both with the straight-through
//! estimator of `ferrograd_core`'s `fake_quantize`).

pub mod observer;
mod qat_linear;

pub use observer::{Observer, ObserverKind, QParams, QScheme};
pub use qat_linear::QatLinear;
