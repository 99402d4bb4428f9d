//! The workload of `ferrograd bench conv1d` (the CLI's `bench/conv1d.rs` times it; its twin
//! `bench/torch_conv1d.py` runs `F.conv1d` depthwise with left padding, as mamba_ssm's reference
//! path does).
//!
//! Mamba's configuration: `x` `[batch, channels, len]` N(0, 1), `w` `[channels, k]` and `b`
//! `[channels]` U(-1/sqrt(k), 1/sqrt(k)) (`nn.Conv1d`'s init bound for one input channel per
//! group), dy N(0, 1). The backward is the recorded op's own backward called with dy (PyTorch:
//! `torch.autograd.grad(y, (x, w, b), dy)`).

use crate::fused::bench::{fused_backward, rel_err};
use crate::{DType, Device, Result, Rng, Tensor};

/// The conv1d workload (see the module documentation).
#[derive(Debug, Clone)]
pub struct Workload {
    /// Batch.
    pub batch: usize,
    /// Channels.
    pub channels: usize,
    /// Sequence length.
    pub len: usize,
    /// Kernel width.
    pub k: usize,
    /// x, w, b.
    pub inputs: Vec<Tensor>,
    /// Gradient of the output.
    pub dy: Tensor,
}

impl Workload {
    /// Draw the inputs (module documentation) for `(batch, channels, len, k)`.
    pub fn new(
        rng: &mut Rng,
        (batch, channels, len, k): (usize, usize, usize, usize),
        dtype: DType,
        device: Device,
    ) -> Result<Workload> {
        let bound = 1.0 / (k.max(1) as f64).sqrt();
        let x = Tensor::randn_with(rng, 0.0, 1.0, vec![batch, channels, len], dtype, device)?;
        let w = Tensor::rand_with(rng, -bound, bound, vec![channels, k], dtype, device)?;
        let b = Tensor::rand_with(rng, -bound, bound, vec![channels], dtype, device)?;
        let dy = Tensor::randn_with(rng, 0.0, 1.0, vec![batch, channels, len], dtype, device)?;
        Ok(Workload { batch, channels, len, k, inputs: vec![x, w, b], dy })
    }

    /// The same inputs on `device` in `dtype` (the float64 CPU reference of a check).
    pub fn to(&self, device: Device, dtype: DType) -> Result<Workload> {
        let conv = |x: &Tensor| x.to_device(device)?.to_dtype(dtype);
        Ok(Workload {
            inputs: self.inputs.iter().map(conv).collect::<Result<_>>()?,
            dy: conv(&self.dy)?,
            ..self.clone()
        })
    }

    /// The forward alone (nothing recorded).
    pub fn forward(&self) -> Result<Tensor> {
        let _g = crate::no_grad();
        self.inputs[0].conv1d_causal(&self.inputs[1], Some(&self.inputs[2]))
    }

    /// Forward (recorded) and the op's backward with dy: (y, [dx, dw, db]).
    pub fn forward_backward(&self) -> Result<(Tensor, Vec<Tensor>)> {
        let v: Vec<Tensor> = self.inputs.iter().map(|t| t.requires_grad()).collect();
        let y = v[0].conv1d_causal(&v[1], Some(&v[2]))?;
        let grads = fused_backward(&y, &self.dy, "conv1d")?;
        Ok((y, grads))
    }

    /// Bytes the forward must move at least: x read and y written; the backward also reads dy and
    /// x again and writes dx (w, b and their gradients are negligible).
    pub fn bytes(&self, backward: bool) -> f64 {
        let x = (self.batch * self.channels * self.len * self.inputs[0].dtype().size_in_bytes()) as f64;
        if backward {
            2.0 * x + 3.0 * x
        } else {
            2.0 * x
        }
    }

    /// The largest norm-wise relative error of y, dx, dw and db against the float64 CPU op on the
    /// same inputs (for small problems).
    pub fn check_backward(&self) -> Result<f64> {
        let (y, g) = self.forward_backward()?;
        let (ry, rg) = self.to(Device::Cpu, DType::F64)?.forward_backward()?;
        let mut worst = rel_err(&y.to_f64_vec()?, &ry.to_f64_vec()?);
        for (a, b) in g.iter().zip(&rg) {
            worst = worst.max(rel_err(&a.to_f64_vec()?, &b.to_f64_vec()?));
        }
        Ok(worst)
    }

    /// The relative error of the forward against the float64 CPU op on the same inputs.
    pub fn check_forward(&self, y: &Tensor) -> Result<f64> {
        let want = self.to(Device::Cpu, DType::F64)?.forward()?;
        Ok(rel_err(&y.to_f64_vec()?, &want.to_f64_vec()?))
    }
}

/// Relative error a check tolerates for inputs of `dtype` (the output is rounded to it).
pub fn tolerance(dtype: DType) -> f64 {
    match dtype {
        DType::F32 | DType::F64 => 1e-5,
        _ => 1e-2,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The workload's check passes on the CPU (f32 against the f64 reference) and the byte count
    /// is what the documentation says.
    #[test]
    fn cpu_workload_checks_and_counts() -> Result<()> {
        let w = Workload::new(&mut Rng::new(1), (2, 8, 33, 4), DType::F32, Device::Cpu)?;
        let y = w.forward()?;
        assert_eq!(y.dims(), &[2, 8, 33]);
        assert!(w.check_forward(&y)? < tolerance(DType::F32));
        assert!(w.check_backward()? < tolerance(DType::F32));
        assert_eq!(w.bytes(false), (2 * 8 * 33 * 4 * 2) as f64);
        Ok(())
    }
}
