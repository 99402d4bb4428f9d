//! The four representations of one copy, built on the target device from its 71x71 digit sums
//! (the only host->device transfer, 20 KB a copy).

use super::walk::{digit_sums, BASES, CLASSES, ENTRIES, RINGS, STEPS};
use ferrograd_core::{DType, Device, Result, Tensor};
use std::f64::consts::PI;

/// One copy, resident on its device.
#[derive(Clone, Debug)]
pub struct CopyData {
    /// `T` as u8, [71, 71, 71].
    pub residues: Tensor,
    /// `T / (r + 1)` in [0, 1], f32 [71, 71, 71].
    pub values: Tensor,
    /// `(cos θ, sin θ)`, `θ = 2π T / (r + 2)`, f32 [71, 71, 71, 2].
    pub complex: Tensor,
    /// One-hot of `T` over 72 classes, f32 [357911, 72].
    pub ring_onehot: Tensor,
}

impl CopyData {
    /// Build copy `copy` on `device`.
    pub fn build(copy: usize, device: Device) -> Result<CopyData> {
        let d: Vec<f32> = digit_sums(copy).into_iter().map(|x| x as f32).collect();
        let d = Tensor::from_vec(d, (STEPS, BASES, 1), device)?;
        // r + 2 for r in 0..71; digit sums stay far below 2^24, so f32 arithmetic is exact here.
        let modulus = Tensor::arange(2.0, (RINGS + 2) as f64, 1.0, DType::F32, device)?.reshape((1, 1, RINGS))?;
        let t = d.remainder(&modulus)?;
        let residues = t.to_dtype(DType::U8)?;
        let values = t.div(&modulus.add_scalar(-1.0)?)?;
        let theta = t.mul_scalar(2.0 * PI)?.div(&modulus)?;
        let complex = Tensor::stack(&[theta.cos()?, theta.sin()?], -1)?;
        let classes = Tensor::arange(0.0, CLASSES as f64, 1.0, DType::F32, device)?.reshape((1, CLASSES))?;
        let ring_onehot = t.reshape((ENTRIES, 1))?.eq(&classes)?.to_dtype(DType::F32)?;
        Ok(CopyData { residues, values, complex, ring_onehot })
    }

    /// The copy's training batch: its 5041 rows of 71 values.
    pub fn samples(&self) -> Result<Tensor> {
        self.values.reshape((STEPS * BASES, RINGS))
    }

    /// Bytes the four tensors hold (what the planner's arithmetic expects).
    pub fn bytes(&self) -> usize {
        [&self.residues, &self.values, &self.complex, &self.ring_onehot]
            .iter()
            .map(|t| t.elem_count() * t.dtype().size_in_bytes())
            .sum()
    }

    /// The four tensors by their export names.
    pub fn named(&self) -> [(&'static str, &Tensor); 4] {
        [
            ("residues", &self.residues),
            ("values", &self.values),
            ("complex", &self.complex),
            ("ring_onehot", &self.ring_onehot),
        ]
    }
}

/// Bytes of one copy by arithmetic: u8 residues, f32 values, complex and one-hot.
pub const COPY_BYTES: usize = ENTRIES + 4 * ENTRIES + 4 * 2 * ENTRIES + 4 * ENTRIES * CLASSES;

#[cfg(test)]
mod tests {
    use super::super::walk::residues_reference;
    use super::*;

    #[test]
    fn cpu_copy_matches_the_integer_reference() -> Result<()> {
        let c = CopyData::build(5, Device::Cpu)?;
        assert_eq!(c.residues.to_vec::<u8>()?, residues_reference(5));
        assert_eq!(c.bytes(), COPY_BYTES);
        let v = c.values.to_vec::<f32>()?;
        let t = residues_reference(5);
        for (i, (&x, &r)) in v.iter().zip(&t).enumerate().step_by(997) {
            assert_eq!(x, r as f32 / ((i % RINGS) as f32 + 1.0));
        }
        let oh = c.ring_onehot.to_vec::<f32>()?;
        for (i, &r) in t.iter().enumerate().step_by(1013) {
            let row = &oh[i * CLASSES..(i + 1) * CLASSES];
            assert_eq!(row.iter().sum::<f32>(), 1.0);
            assert_eq!(row[r as usize], 1.0);
        }
        let z = c.complex.sqr()?.sum(-1, false)?.to_vec::<f32>()?;
        assert!(z.iter().all(|&m| (m - 1.0).abs() < 1e-5));
        Ok(())
    }
}
