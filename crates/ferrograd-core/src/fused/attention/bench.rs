//! The workload of `ferrograd bench attention` (the CLI's `bench/attention.rs` times it; its twin
//! `bench/torch_attention.py` does the same work with `F.scaled_dot_product_attention`).
//!
//! q, k and v are the `[B, H, T, D]` views of one `[B, T, 3, H, D]` buffer of N(0, 1) samples (a
//! GPT-2 style fused QKV projection), read in place; dO is N(0, 1) `[B, H, T, D]`. The backward
//! is the recorded op's own backward called with dO, as `backward()` would call it for this node
//! (PyTorch: `torch.autograd.grad(o, (q, k, v), dO)`). FLOPs follow FlashAttention's benchmark:
//! forward `4 B H T^2 D` (two matmuls), halved when causal; forward + backward 3.5 times that
//! (the backward's five matmuls count 2.5 forwards). With dropout (`with_dropout`) every call
//! draws the same mask, from `Rng::new(DROPOUT_SEED)`, and the checks apply it too.

use super::{AttentionOpts, Dropout};
use crate::fused::bench::{fused_backward, rel_err};
use crate::op::Op;
use crate::{DType, Device, Error, Result, Rng, Tensor};

/// The attention workload of `ferrograd bench attention`: q, k, v as views of one packed
/// `[B, T, 3, H, D]` buffer (as GPT-2 produces them), and an output gradient.
#[derive(Debug, Clone)]
pub struct Workload {
    /// Batch.
    pub b: usize,
    /// Heads.
    pub h: usize,
    /// Sequence length.
    pub t: usize,
    /// Head dim.
    pub d: usize,
    /// Causal mask.
    pub causal: bool,
    /// The packed `[B, T, 3, H, D]` buffer.
    pub qkv: Tensor,
    /// Queries, `[B, H, T, D]` (a view of `qkv`).
    pub q: Tensor,
    /// Keys, `[B, H, T, D]`.
    pub k: Tensor,
    /// Values, `[B, H, T, D]`.
    pub v: Tensor,
    /// Gradient of the output, `[B, H, T, D]`.
    pub dout: Tensor,
    /// Dropout probability (0: none).
    pub dropout_p: f64,
}

/// The generator every dropout call of a workload draws from, fresh each call: one mask, which
/// the float64 checks reproduce.
pub const DROPOUT_SEED: u64 = 0xD20F;

/// The `[B, H, T, D]` view of slot `i` (0 = q, 1 = k, 2 = v) of a `[B, T, 3, H, D]` buffer.
fn slot(qkv: &Tensor, i: usize) -> Result<Tensor> {
    qkv.narrow(2, i, 1)?.squeeze(2)?.permute(&[0, 2, 1, 3])
}

impl Workload {
    /// N(0, 1) inputs of the given sizes.
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        rng: &mut Rng,
        b: usize,
        h: usize,
        t: usize,
        d: usize,
        dtype: DType,
        device: Device,
        causal: bool,
    ) -> Result<Workload> {
        let qkv = Tensor::randn_with(rng, 0.0, 1.0, (b, t, 3, h, d), dtype, device)?;
        let dout = Tensor::randn_with(rng, 0.0, 1.0, (b, h, t, d), dtype, device)?;
        Self::from_parts(qkv, dout, causal)
    }

    fn from_parts(qkv: Tensor, dout: Tensor, causal: bool) -> Result<Workload> {
        let dims = qkv.dims().to_vec();
        let (b, t, h, d) = (dims[0], dims[1], dims[3], dims[4]);
        Ok(Workload {
            b,
            h,
            t,
            d,
            causal,
            q: slot(&qkv, 0)?,
            k: slot(&qkv, 1)?,
            v: slot(&qkv, 2)?,
            qkv,
            dout,
            dropout_p: 0.0,
        })
    }

    /// The same workload with dropout `p` (the mask drawn from [`DROPOUT_SEED`]).
    pub fn with_dropout(self, p: f64) -> Workload {
        Workload { dropout_p: p, ..self }
    }

    /// The same inputs on `device` in `dtype` (the float64 CPU reference of a check).
    pub fn to(&self, device: Device, dtype: DType) -> Result<Workload> {
        let conv = |x: &Tensor| x.to_device(device)?.to_dtype(dtype);
        Ok(Self::from_parts(conv(&self.qkv)?, conv(&self.dout)?, self.causal)?.with_dropout(self.dropout_p))
    }

    /// The attention options of this workload (causal or not, default scale, its dropout).
    pub fn opts(&self) -> AttentionOpts {
        AttentionOpts { causal: self.causal, dropout_p: self.dropout_p, ..Default::default() }
    }

    fn sdpa(&self, q: &Tensor, k: &Tensor, v: &Tensor) -> Result<Tensor> {
        Tensor::scaled_dot_product_attention_with(&mut Rng::new(DROPOUT_SEED), q, k, v, self.opts())
    }

    /// The forward alone (nothing recorded).
    pub fn forward(&self) -> Result<Tensor> {
        let _g = crate::no_grad();
        self.sdpa(&self.q, &self.k, &self.v)
    }

    /// Forward (recorded) and the op's backward with dO: (O, [dq, dk, dv]).
    pub fn forward_backward(&self) -> Result<(Tensor, Vec<Tensor>)> {
        let (q, k, v) = (self.q.requires_grad(), self.k.requires_grad(), self.v.requires_grad());
        let o = self.sdpa(&q, &k, &v)?;
        let node = match o.op() {
            Some(Op::Permute(node, _)) => node.clone(),
            _ => return Err(Error::Backward("attention bench: the output is not the op's permuted view".into())),
        };
        let grads = fused_backward(&node, &self.dout.permute(&[0, 2, 1, 3])?, "attention")?;
        Ok((o, grads))
    }

    /// Floating-point operations of the forward, or of forward and backward.
    pub fn flops(&self, backward: bool) -> f64 {
        let f = 4.0 * (self.b * self.h) as f64 * (self.t as f64).powi(2) * self.d as f64;
        let f = if self.causal { f / 2.0 } else { f };
        if backward {
            3.5 * f
        } else {
            f
        }
    }

    /// Norm-wise relative error of sampled output rows (the first, the last and `extra` random
    /// ones, each of a random head) against a float64 computation on the host.
    pub fn check_forward(&self, o: &Tensor, rng: &mut Rng, extra: usize) -> Result<f64> {
        let (seed, off) = rng.advance(3 * extra);
        let pick = |i: u64, n: usize| ((crate::rng::uniform_at(seed, off, i) * n as f64) as usize).min(n - 1);
        let mut rows = vec![(0, 0, 0), (self.b - 1, self.h - 1, self.t - 1)];
        rows.extend((0..extra as u64).map(|i| (pick(3 * i, self.b), pick(3 * i + 1, self.h), pick(3 * i + 2, self.t))));
        let scale = 1.0 / (self.d as f64).sqrt();
        // The mask the op drew: `Rng::new(DROPOUT_SEED)` starts at offset 0 (mod.rs `Dropout`).
        let drop = (self.dropout_p > 0.0).then(|| Dropout::new(self.dropout_p, DROPOUT_SEED, 0));
        let (mut got, mut want) = (vec![], vec![]);
        for (b, h, i) in rows {
            let head = |x: &Tensor| x.narrow(0, b, 1)?.narrow(1, h, 1)?.to_f64_vec();
            let (k, v) = (head(&self.k)?, head(&self.v)?);
            let q = self.q.narrow(0, b, 1)?.narrow(1, h, 1)?.narrow(2, i, 1)?.to_f64_vec()?;
            let n = if self.causal { i + 1 } else { self.t };
            let s: Vec<f64> =
                (0..n).map(|j| scale * q.iter().zip(&k[j * self.d..]).map(|(a, b)| a * b).sum::<f64>()).collect();
            let m = s.iter().copied().fold(f64::NEG_INFINITY, f64::max);
            let e: Vec<f64> = s.iter().map(|x| (x - m).exp()).collect();
            let l: f64 = e.iter().sum();
            // Dropout after the softmax: its row sum stays the undropped one.
            let e: Vec<f64> = match &drop {
                Some(dr) => (0..n)
                    .map(|j| {
                        if dr.keeps(&dr.words(b * self.h + h, self.t, self.t, i, j / 8), j) {
                            e[j] / (1.0 - dr.p)
                        } else {
                            0.0
                        }
                    })
                    .collect(),
                None => e,
            };
            want.extend((0..self.d).map(|c| (0..n).map(|j| e[j] * v[j * self.d + c]).sum::<f64>() / l));
            got.extend(o.narrow(0, b, 1)?.narrow(1, h, 1)?.narrow(2, i, 1)?.to_f64_vec()?);
        }
        Ok(rel_err(&got, &want))
    }

    /// The largest norm-wise relative error of O, dq, dk, dv against the float64 CPU op on the
    /// same inputs (for small problems: the reference costs `O(B H T^2 D)` host work).
    pub fn check_backward(&self) -> Result<f64> {
        let (o, g) = self.forward_backward()?;
        let (ro, rg) = self.to(Device::Cpu, DType::F64)?.forward_backward()?;
        let mut worst = rel_err(&o.to_f64_vec()?, &ro.to_f64_vec()?);
        for (a, b) in g.iter().zip(&rg) {
            worst = worst.max(rel_err(&a.to_f64_vec()?, &b.to_f64_vec()?));
        }
        Ok(worst)
    }
}

/// Relative error a check tolerates for inputs of `dtype` (the output is rounded to it; f32 is
/// exact f32 arithmetic).
pub fn tolerance(dtype: DType) -> f64 {
    match dtype {
        DType::F32 | DType::F64 => 1e-4,
        DType::F16 => 5e-3,
        _ => 2e-2,
    }
}
