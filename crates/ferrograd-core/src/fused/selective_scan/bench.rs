//! The workload of `ferrograd bench selective-scan` (the CLI's `bench/selective_scan.rs` times
//! it; its twin `bench/torch_selective_scan.py` runs the same recurrence in plain PyTorch).
//!
//! Mamba's configuration: `u`, `delta`, `z` `[batch, dim, len]` and `B`, `C` `[batch, 1, state,
//! len]` N(0, 1); `A[d, n] = -(n + 1)` (S4D-real), `D = 1`, `delta_bias = -3` (softplus(-3 + N(0, 1)
//! / 2) spans mamba's dt range), `delta_softplus`; dout N(0, 1). The backward is the recorded
//! op's own backward called with dout, as `backward()` would call it for this node (PyTorch:
//! `torch.autograd.grad(out, inputs, dout)`).

use super::{selective_scan, ScanArgs};
use crate::fused::bench::{fused_backward, rel_err};
use crate::{DType, Device, Result, Rng, Tensor};

/// The selective-scan workload (see the module documentation).
#[derive(Debug, Clone)]
pub struct Workload {
    /// Batch.
    pub batch: usize,
    /// Channels.
    pub dim: usize,
    /// Sequence length.
    pub len: usize,
    /// State size.
    pub state: usize,
    /// u, delta, A, B, C, D, z, delta_bias.
    pub inputs: Vec<Tensor>,
    /// Gradient of the output.
    pub dout: Tensor,
}

impl Workload {
    /// Draw the inputs (module documentation) for `(batch, dim, len, state)`.
    pub fn new(
        rng: &mut Rng,
        (batch, dim, len, state): (usize, usize, usize, usize),
        dtype: DType,
        device: Device,
    ) -> Result<Workload> {
        let n = |rng: &mut Rng, dims: Vec<usize>, std: f64| Tensor::randn_with(rng, 0.0, std, dims, dtype, device);
        let u = n(rng, vec![batch, dim, len], 1.0)?;
        let delta = n(rng, vec![batch, dim, len], 0.5)?;
        let a: Vec<f32> = (0..dim * state).map(|i| -((i % state) as f32 + 1.0)).collect();
        let a = Tensor::from_vec(a, vec![dim, state], device)?;
        let b = n(rng, vec![batch, 1, state, len], 1.0)?;
        let c = n(rng, vec![batch, 1, state, len], 1.0)?;
        let d = Tensor::full(1.0, vec![dim], DType::F32, device)?;
        let z = n(rng, vec![batch, dim, len], 1.0)?;
        let bias = Tensor::full(-3.0, vec![dim], DType::F32, device)?;
        let dout = n(rng, vec![batch, dim, len], 1.0)?;
        Ok(Workload { batch, dim, len, state, inputs: vec![u, delta, a, b, c, d, z, bias], dout })
    }

    /// The same inputs on `device` in `dtype` (the float64 CPU reference of a check).
    pub fn to(&self, device: Device, dtype: DType) -> Result<Workload> {
        let conv = |x: &Tensor| x.to_device(device)?.to_dtype(dtype);
        Ok(Workload {
            inputs: self.inputs.iter().map(conv).collect::<Result<_>>()?,
            dout: conv(&self.dout)?,
            ..self.clone()
        })
    }

    fn run(x: &[Tensor]) -> Result<Tensor> {
        let args = ScanArgs { d: Some(&x[5]), z: Some(&x[6]), delta_bias: Some(&x[7]), delta_softplus: true };
        selective_scan(&x[0], &x[1], &x[2], &x[3], &x[4], args)
    }

    /// The forward alone (nothing recorded).
    pub fn forward(&self) -> Result<Tensor> {
        let _g = crate::no_grad();
        Self::run(&self.inputs)
    }

    /// Forward (recorded) and the op's backward with dout: (out, the eight gradients).
    pub fn forward_backward(&self) -> Result<(Tensor, Vec<Tensor>)> {
        let vars: Vec<Tensor> = self.inputs.iter().map(|t| t.requires_grad()).collect();
        let out = Self::run(&vars)?;
        let grads = fused_backward(&out, &self.dout, "selective-scan")?;
        Ok((out, grads))
    }

    /// Bytes the forward must move at least: u, delta, z read and out written (`[batch, dim,
    /// len]` each), B and C read; the backward reads those, dout, and writes du, ddelta, dz, dB, dC.
    pub fn bytes(&self, backward: bool) -> f64 {
        let e = self.inputs[0].dtype().size_in_bytes() as f64;
        let x = (self.batch * self.dim * self.len) as f64 * e;
        let bc = (self.batch * self.state * self.len) as f64 * e;
        if backward {
            (4.0 * x + 2.0 * bc) + (4.0 * x + 2.0 * bc + 3.0 * x + 2.0 * bc)
        } else {
            4.0 * x + 2.0 * bc
        }
    }

    /// The largest norm-wise relative error of out and the eight gradients against the float64
    /// CPU op on the same inputs (for small problems).
    pub fn check_backward(&self) -> Result<f64> {
        let (o, g) = self.forward_backward()?;
        let (ro, rg) = self.to(Device::Cpu, DType::F64)?.forward_backward()?;
        let mut worst = rel_err(&o.to_f64_vec()?, &ro.to_f64_vec()?);
        for (a, b) in g.iter().zip(&rg) {
            worst = worst.max(rel_err(&a.to_f64_vec()?, &b.to_f64_vec()?));
        }
        Ok(worst)
    }

    /// The relative error of the forward against the float64 CPU op on the same inputs.
    pub fn check_forward(&self, out: &Tensor) -> Result<f64> {
        let want = self.to(Device::Cpu, DType::F64)?.forward()?;
        Ok(rel_err(&out.to_f64_vec()?, &want.to_f64_vec()?))
    }
}

/// Relative error a check tolerates for inputs of `dtype` (the output is rounded to it).
pub fn tolerance(dtype: DType) -> f64 {
    match dtype {
        DType::F32 | DType::F64 => 1e-4,
        _ => 2e-2,
    }
}
