//! The fake-quantize workload of `ferrograd bench fused` (twin: `torch.fake_quantize_per_channel_affine`
//! in bench/torch_fused.py): a weight `[rows, cols]` quantized per row (int8), reading x and writing
//! y.

use super::FakeQuant;
use crate::fused::bench::{row_f64, Workload};
use crate::{Result, Tensor};

/// The fake-quantize workload of the fused-op benches: one input with its scale and zero point.
pub struct FakeQuantizeBench {
    x: Tensor,
    scale: Tensor,
    zero_point: Tensor,
}

impl FakeQuantizeBench {
    /// `x [rows, cols]`, per-row f32 `scale [rows]` and `zero_point [rows]`.
    pub fn new(x: Tensor, scale: Tensor, zero_point: Tensor) -> FakeQuantizeBench {
        FakeQuantizeBench { x, scale, zero_point }
    }

    const Q: FakeQuant = FakeQuant::int8().per_channel(0);
}

impl Workload for FakeQuantizeBench {
    fn name(&self) -> &'static str {
        "fake_quantize"
    }

    fn bytes(&self) -> usize {
        2 * self.x.elem_count() * self.x.dtype().size_in_bytes()
    }

    fn run(&self) -> Result<Tensor> {
        self.x.fake_quantize(&self.scale, &self.zero_point, Self::Q)
    }

    /// The CPU twin's formula on one row, in the op's precision, rounded to the dtype.
    fn reference(&self, row: usize) -> Result<Vec<f64>> {
        let x = row_f64(&self.x, row)?;
        let (s, z) = (self.scale.to_f64_vec()?[row], self.zero_point.to_f64_vec()?[row]);
        let q = Self::Q;
        let z = super::cpu::zero_point(z, &q);
        let r = |v: f64| if self.x.dtype() == crate::DType::F64 { v } else { v as f32 as f64 };
        let y: Vec<f64> = x.iter().map(|&v| super::cpu::quantize(v, s, z, &q, r).y).collect();
        let n = y.len();
        let st = super::cpu::from_acc(y, self.x.dtype())?;
        Tensor::from_storage(crate::storage::Storage::Cpu(st), n, None).to_f64_vec()
    }
}
