//! The workload of `ferrograd bench linear` (timing and report in
//! `crates/ferrograd-cli/src/bench/linear.rs`, PyTorch twin `bench/torch_linear.py`): one linear
//! layer with bias and an activation, forward then backward from a given output gradient, at the
//! shapes of GPT-2's MLP (16 sequences of 1024 tokens).

use super::{linear, Activation};
use crate::{DType, Device, GradStore, Result, Rng, Tensor};

/// One problem: `rows` tokens, `in_features` -> `out_features`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Case {
    /// Tokens (rows of `x`).
    pub rows: usize,
    /// Input features.
    pub in_features: usize,
    /// Output features.
    pub out_features: usize,
}

/// GPT-2 small's MLP (768 -> 3072 and back) and GPT-2 medium's first layer (1024 -> 4096), for
/// 16 x 1024 tokens.
pub const GPT2: &[Case] = &[
    Case { rows: 16 * 1024, in_features: 768, out_features: 3072 },
    Case { rows: 16 * 1024, in_features: 3072, out_features: 768 },
    Case { rows: 16 * 1024, in_features: 1024, out_features: 4096 },
];

impl Case {
    /// `768->3072 rows=16384`: the row name in the table, the JSON and the twin's output.
    pub fn name(&self) -> String {
        format!("{}->{} rows={}", self.in_features, self.out_features, self.rows)
    }

    /// Forward FLOPs (the matmul): 2 rows in out.
    pub fn forward_flops(&self) -> f64 {
        2.0 * self.rows as f64 * self.in_features as f64 * self.out_features as f64
    }

    /// Forward + backward FLOPs: the forward matmul and the two gradient matmuls (dx, dW).
    pub fn step_flops(&self) -> f64 {
        3.0 * self.forward_flops()
    }
}

/// A layer's tensors: `x ~ N(0, 1)`, weight and bias uniform in `±1/sqrt(in)` (nn.Linear's
/// initialisation), output gradient `~ N(0, 1)`. Weight and bias require grad, x does too (a
/// hidden layer's input), so all three gradients are computed.
pub struct Inputs {
    /// Input `[rows, in]`.
    pub x: Tensor,
    /// Weight `[out, in]`.
    pub w: Tensor,
    /// Bias `[out]`.
    pub b: Tensor,
    /// Output gradient `[rows, out]`.
    pub dy: Tensor,
}

impl Inputs {
    /// Draw the tensors of `case`.
    pub fn new(case: Case, dtype: DType, device: Device, rng: &mut Rng) -> Result<Inputs> {
        let Case { rows, in_features: k, out_features: n } = case;
        let bound = 1.0 / (k as f64).sqrt();
        Ok(Inputs {
            x: Tensor::randn_with(rng, 0.0, 1.0, (rows, k), dtype, device)?.requires_grad(),
            w: Tensor::rand_with(rng, -bound, bound, (n, k), dtype, device)?.requires_grad(),
            b: Tensor::rand_with(rng, -bound, bound, n, dtype, device)?.requires_grad(),
            dy: Tensor::randn_with(rng, 0.0, 1.0, (rows, n), dtype, device)?,
        })
    }

    /// The fused op: forward, then backward from `dy`.
    pub fn fused_step(&self, act: Activation) -> Result<(Tensor, GradStore)> {
        let y = linear(&self.x, &self.w, Some(&self.b), act)?;
        let g = y.backward_with(&self.dy)?;
        Ok((y, g))
    }

    /// The same layer from primitive ops (matmul, add, activation), each its own kernel and its
    /// own backward rule: what the fusion saves.
    pub fn unfused_step(&self, act: Activation) -> Result<(Tensor, GradStore)> {
        let z = self.x.matmul(&self.w.t()?)?.add(&self.b)?;
        let y = match act {
            Activation::None => z,
            Activation::GeluTanh => z.gelu_tanh()?,
            Activation::Relu => z.relu()?,
        };
        let g = y.backward_with(&self.dy)?;
        Ok((y, g))
    }
}

/// One piece of the fused step, run alone on tensors saved once (`ferrograd bench linear
/// --breakdown`): where the step's time goes.
pub struct Piece<'a> {
    /// The row name in the breakdown table.
    pub name: &'static str,
    /// Runs the piece once.
    pub run: Box<dyn FnMut() -> Result<()> + 'a>,
}

impl Inputs {
    /// The forward (with and without the saved pre-activation), the activation gradient (with
    /// and without db), and the gradient matmuls (dx; dW; dW with db from the BGRADB epilogue).
    pub fn pieces(&self, act: Activation) -> Result<Vec<Piece<'_>>> {
        use super::{ActBackward, Grads, LinearOp, Need, WGrad};
        use crate::fused::apply_all;
        let (x, w, b) = (self.x.detach(), self.w.detach(), self.b.detach());
        let n = w.dims()[0];
        let saved = apply_all(
            &LinearOp { act, save_pre: act == Activation::GeluTanh, master: false, save_w: false },
            &[&x, &w, &b],
        )?;
        let s = match act {
            Activation::GeluTanh => saved[1].narrow(1, 0, n)?,
            _ => saved[0].clone(),
        };
        let dz = match act {
            Activation::None => self.dy.clone(),
            _ => apply_all(&ActBackward { act, with_db: false, db_dtype: self.dy.dtype() }, &[&self.dy, &s])?.remove(0),
        };
        let run = |op: Box<dyn super::FusedOp>, inputs: Vec<Tensor>| -> Box<dyn FnMut() -> Result<()> + '_> {
            Box::new(move || apply_all(op.as_ref(), &inputs.iter().collect::<Vec<_>>()).map(|_| ()))
        };
        let grads =
            |dx, dw, db| Box::new(Grads { need: Need { dx, dw, db }, wg: WGrad::of(&w) }) as Box<dyn super::FusedOp>;
        let mut pieces = vec![Piece {
            name: "fwd",
            run: run(
                Box::new(LinearOp { act, save_pre: false, master: false, save_w: false }),
                vec![x.clone(), w.clone(), b.clone()],
            ),
        }];
        if act == Activation::GeluTanh {
            pieces.push(Piece {
                name: "fwd keeping z",
                run: run(
                    Box::new(LinearOp { act, save_pre: true, master: false, save_w: false }),
                    vec![x.clone(), w.clone(), b.clone()],
                ),
            });
        }
        if act != Activation::None {
            for (name, with_db) in [("dz", false), ("dz+db", true)] {
                pieces.push(Piece {
                    name,
                    run: run(
                        Box::new(ActBackward { act, with_db, db_dtype: self.dy.dtype() }),
                        vec![self.dy.clone(), s.clone()],
                    ),
                });
            }
        }
        pieces.push(Piece {
            name: "dx matmul",
            run: run(grads(true, false, false), vec![dz.clone(), x.clone(), w.clone()]),
        });
        pieces.push(Piece {
            name: "dW matmul",
            run: run(grads(false, true, false), vec![dz.clone(), x.clone(), w.clone()]),
        });
        pieces.push(Piece { name: "dW+db matmul (BGRADB)", run: run(grads(false, true, true), vec![dz, x, w]) });
        Ok(pieces)
    }
}

/// GPT-2's MLP block: `rows` tokens, `dim -> hidden -> dim` (`ferrograd bench linear`'s `mlp` rows).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MlpCase {
    /// Tokens.
    pub rows: usize,
    /// Model width.
    pub dim: usize,
    /// Hidden width.
    pub hidden: usize,
}

/// GPT-2 small (768 -> 3072 -> 768) and medium (1024 -> 4096 -> 1024), 16 x 1024 tokens.
pub const GPT2_MLP: &[MlpCase] =
    &[MlpCase { rows: 16 * 1024, dim: 768, hidden: 3072 }, MlpCase { rows: 16 * 1024, dim: 1024, hidden: 4096 }];

impl MlpCase {
    /// `768->3072->768 rows=16384`: the row name.
    pub fn name(&self) -> String {
        format!("{}->{}->{} rows={}", self.dim, self.hidden, self.dim, self.rows)
    }

    /// Forward FLOPs: two matmuls of 2 rows dim hidden each.
    pub fn forward_flops(&self) -> f64 {
        4.0 * self.rows as f64 * self.dim as f64 * self.hidden as f64
    }

    /// Forward + backward: six matmuls.
    pub fn step_flops(&self) -> f64 {
        3.0 * self.forward_flops()
    }
}

/// The block's tensors, drawn as [`Inputs`] draws a layer's.
pub struct MlpInputs {
    /// Input `[rows, dim]`.
    pub x: Tensor,
    /// First weight `[hidden, dim]`.
    pub w1: Tensor,
    /// First bias `[hidden]`.
    pub b1: Tensor,
    /// Second weight `[dim, hidden]`.
    pub w2: Tensor,
    /// Second bias `[dim]`.
    pub b2: Tensor,
    /// Output gradient `[rows, dim]`.
    pub dy: Tensor,
}

impl MlpInputs {
    /// Draw the block's tensors.
    pub fn new(case: MlpCase, dtype: DType, device: Device, rng: &mut Rng) -> Result<MlpInputs> {
        let MlpCase { rows, dim, hidden } = case;
        let (b1, b2) = (1.0 / (dim as f64).sqrt(), 1.0 / (hidden as f64).sqrt());
        Ok(MlpInputs {
            x: Tensor::randn_with(rng, 0.0, 1.0, (rows, dim), dtype, device)?.requires_grad(),
            w1: Tensor::rand_with(rng, -b1, b1, (hidden, dim), dtype, device)?.requires_grad(),
            b1: Tensor::rand_with(rng, -b1, b1, hidden, dtype, device)?.requires_grad(),
            w2: Tensor::rand_with(rng, -b2, b2, (dim, hidden), dtype, device)?.requires_grad(),
            b2: Tensor::rand_with(rng, -b2, b2, dim, dtype, device)?.requires_grad(),
            dy: Tensor::randn_with(rng, 0.0, 1.0, (rows, dim), dtype, device)?,
        })
    }

    /// The fused block ([`super::mlp`]): forward, then backward from `dy`.
    pub fn fused_step(&self) -> Result<(Tensor, GradStore)> {
        let y = super::mlp(&self.x, &self.w1, Some(&self.b1), &self.w2, Some(&self.b2))?;
        let g = y.backward_with(&self.dy)?;
        Ok((y, g))
    }

    /// The same block as two fused linears (GELU in the first one's epilogue).
    pub fn two_linears_step(&self) -> Result<(Tensor, GradStore)> {
        let h = linear(&self.x, &self.w1, Some(&self.b1), Activation::GeluTanh)?;
        let y = linear(&h, &self.w2, Some(&self.b2), Activation::None)?;
        let g = y.backward_with(&self.dy)?;
        Ok((y, g))
    }

    /// `x` and the four parameters, whose gradients the step computes.
    pub fn params(&self) -> [&Tensor; 5] {
        [&self.x, &self.w1, &self.b1, &self.w2, &self.b2]
    }
}
