//! A whole MLP training run in one persistent cooperative kernel (`kernels/mlp_persistent.cu`,
//! whose head comment is the design note): weights and Adam state stay on chip, every step's
//! forward, backward, gradient reduction and update run without returning to the host, and the
//! loss of every step streams to mapped host memory. For small MLPs (widths <= 128, depth <= 16,
//! ReLU or linear, MSE, Adam) whose weights fit in shared memory; Monster Walk is the first user.
//!
//! - `layout`: the padded weight layout and the shared-memory plan (CPU arithmetic).
//! - `trainer`: [`PersistentMlp`], which plans, launches and reports.

pub mod layout;
pub mod trainer;

pub use trainer::{PersistentMlp, PhaseProfile, TrainRun};

/// Per layer: W `[out][in]` row-major and b `[out]`, on the host.
pub type HostWeights = Vec<(Vec<f32>, Vec<f32>)>;

use ferrograd_core::{Error, Result};
use std::fmt;
use std::str::FromStr;

/// The architecture: `widths[0]` inputs, then one Linear layer per following width, each with
/// its activation (`relu[l]`: ReLU, else linear).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MlpSpec {
    widths: Vec<usize>,
    relu: Vec<bool>,
}

impl MlpSpec {
    pub fn new(widths: Vec<usize>, relu: Vec<bool>) -> Result<MlpSpec> {
        let layers = widths.len().saturating_sub(1);
        if layers == 0 || layers > layout::MAX_LAYERS {
            return Err(Error::InvalidArgument(format!(
                "persistent MLP: {layers} layers (widths {widths:?}); 1 to {} are supported",
                layout::MAX_LAYERS
            )));
        }
        if let Some(w) = widths.iter().find(|&&w| w == 0 || w > layout::MAX_WIDTH) {
            return Err(Error::InvalidArgument(format!(
                "persistent MLP: width {w} in {widths:?}; widths 1 to {} are supported",
                layout::MAX_WIDTH
            )));
        }
        if relu.len() != layers {
            return Err(Error::InvalidArgument(format!(
                "persistent MLP: {} activation flags for {layers} layers",
                relu.len()
            )));
        }
        Ok(MlpSpec { widths, relu })
    }

    pub fn widths(&self) -> &[usize] {
        &self.widths
    }

    pub fn relu(&self) -> &[bool] {
        &self.relu
    }

    pub fn layers(&self) -> usize {
        self.relu.len()
    }

    /// Weights and biases: sum of out * (in + 1).
    pub fn parameter_count(&self) -> usize {
        self.widths.windows(2).map(|w| w[1] * (w[0] + 1)).sum()
    }

    /// Multiply-adds of one sample's forward pass (the backward pass is twice as many).
    pub fn macs_per_sample(&self) -> usize {
        self.widths.windows(2).map(|w| w[0] * w[1]).sum()
    }
}

/// How the kernel's matrix products round their inputs (accumulation is f32 in all three).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Precision {
    /// 3xTF32: each f32 operand split into two TF32 parts, three products; f32-accurate (the
    /// exact-f32 mode the correctness tests use).
    #[default]
    F32,
    /// One TF32 product (10-bit mantissas).
    Tf32,
    /// One bf16 product (8-bit mantissas).
    Bf16,
}

impl Precision {
    pub fn kernel(self) -> &'static str {
        match self {
            Precision::F32 => "mlp_persistent_f32",
            Precision::Tf32 => "mlp_persistent_tf32",
            Precision::Bf16 => "mlp_persistent_bf16",
        }
    }

    pub fn describe(self) -> &'static str {
        match self {
            Precision::F32 => "f32 (3xTF32 mma)",
            Precision::Tf32 => "tf32 (mma)",
            Precision::Bf16 => "bf16 inputs (mma)",
        }
    }
}

impl fmt::Display for Precision {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Precision::F32 => "f32",
            Precision::Tf32 => "tf32",
            Precision::Bf16 => "bf16",
        })
    }
}

impl FromStr for Precision {
    type Err = Error;
    fn from_str(s: &str) -> Result<Precision> {
        match s.to_ascii_lowercase().as_str() {
            "f32" | "fp32" | "3xtf32" => Ok(Precision::F32),
            "tf32" => Ok(Precision::Tf32),
            "bf16" => Ok(Precision::Bf16),
            _ => Err(Error::InvalidArgument(format!("precision {s:?}: expected f32, tf32 or bf16"))),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn spec_validation_names_the_problem() {
        assert_eq!(MlpSpec::new(vec![71, 47, 71], vec![true, false]).map(|s| s.parameter_count()).ok(), Some(6_792));
        let e = MlpSpec::new(vec![4, 129, 4], vec![true, false]).unwrap_err().to_string();
        assert!(e.contains("129"), "{e}");
        let e = MlpSpec::new(vec![4], vec![]).unwrap_err().to_string();
        assert!(e.contains("0 layers"), "{e}");
        let e = MlpSpec::new(vec![4; 18], vec![true; 17]).unwrap_err().to_string();
        assert!(e.contains("17 layers"), "{e}");
        assert!(MlpSpec::new(vec![4, 4], vec![true, true]).is_err());
        assert_eq!("TF32".parse::<Precision>().ok(), Some(Precision::Tf32));
        assert!("f16".parse::<Precision>().is_err());
    }
}
