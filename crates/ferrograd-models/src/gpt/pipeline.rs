//! GPT-2 cut into pipeline stages (issue 16): the blocks split evenly, the embeddings with the
//! first stage, `ln_f`, the tied head and the loss with the last. A stage maps the residual
//! stream `[B, T, C]` to the residual stream (or, last, to the micro-batch's weighted loss); the
//! model's blocks hand on a `(residual, branch)` pair whose add is fused into the next layer norm,
//! so a stage adds the pair before sending it (one tensor between stages) and its successor's
//! first block starts with no branch: the same sum the unsplit model's fused add computes.
//!
//! The classifier is tied to the token embedding: the first and the last stage each train their
//! own copy of `wte` (equal at the start), and before each optimizer step their gradients are
//! exchanged and summed ([`GptStage::tied`]), `g_first + g_last` on both, so the two AdamW steps
//! are the same and the copies stay equal, as the unsplit model's one `wte` would be.
//!
//! Used by `ferrograd gpt train --pipeline N` (`ferrograd-cli/src/gpt/pipeline.rs`) over
//! `ferrograd_dist::pipeline` (NCCL ranks or one process).

use super::model::Gpt;
use super::ops::{lm_logits, lm_loss, residual_norm};
use ferrograd_core::{shape_err, Error, Result, Tensor};
use std::ops::Range;
use std::sync::Arc;

/// The blocks of rank `rank` of `ranks` when the `n_layer` blocks are cut into `groups` even stage
/// groups and each rank holds `groups / ranks` consecutive ones (one pipeline stage).
pub fn block_range(n_layer: usize, groups: usize, rank: usize, ranks: usize) -> Result<Range<usize>> {
    if groups == 0 || ranks == 0 || !groups.is_multiple_of(ranks) || rank >= ranks {
        return Err(Error::InvalidArgument(format!(
            "--pipeline {groups}: {ranks} rank(s) cannot hold the stage groups evenly (use a rank count dividing it)"
        )));
    }
    if groups > n_layer {
        return Err(Error::InvalidArgument(format!(
            "--pipeline {groups}: the model has only {n_layer} blocks (at least one per stage)"
        )));
    }
    let per = groups / ranks;
    Ok(n_layer * rank * per / groups..n_layer * (rank + 1) * per / groups)
}

/// One stage of a pipelined GPT: a view of the model's parameters that this stage trains.
pub struct GptStage {
    model: Arc<Gpt>,
    blocks: Range<usize>,
    first: bool,
    last: bool,
    /// The last stage's own copy of `wte` (the head) when it is not also the first.
    head: Option<Tensor>,
}

impl GptStage {
    /// Stage `rank` of `ranks` (`groups` stage groups, see [`block_range`]) of `model`, whose
    /// whole parameter set every stage builds from the same seed and keeps only its part of.
    pub fn new(model: Arc<Gpt>, groups: usize, rank: usize, ranks: usize) -> Result<GptStage> {
        let blocks = block_range(model.config.n_layer, groups, rank, ranks)?;
        let (first, last) = (rank == 0, rank + 1 == ranks);
        let head = if last && !first {
            // A fresh leaf with wte's values (not its storage): this stage's copy.
            let w = model.wte.detach();
            Some(w.zeros_like()?.add(&w)?.requires_grad())
        } else {
            None
        };
        Ok(GptStage { model, blocks, first, last, head })
    }

    pub fn blocks(&self) -> Range<usize> {
        self.blocks.clone()
    }

    pub fn is_first(&self) -> bool {
        self.first
    }

    pub fn is_last(&self) -> bool {
        self.last
    }

    /// The copy of the tied embedding this stage trains (first and last stage), whose gradient
    /// must be summed with the other end's before the step; `None` on middle stages and on a
    /// single stage (which holds the one `wte` and sums both uses itself).
    pub fn tied(&self) -> Option<&Tensor> {
        match (self.first, self.last) {
            (true, false) => Some(&self.model.wte),
            (false, true) => self.head.as_ref(),
            _ => None,
        }
    }

    /// The parameters this stage trains, named as `Gpt::params` names them, in its order
    /// (`wte` first where the stage has it, which `GptAdamW::with_groups` expects).
    pub fn params(&self) -> Vec<(String, Tensor)> {
        let all = self.model.params();
        let wte_name = all[0].0.clone();
        let mut out = vec![];
        if self.first {
            out.push(all[0].clone());
            out.push(all[1].clone());
        } else if let Some(h) = &self.head {
            out.push((wte_name, h.clone()));
        }
        // Blocks' parameters follow wte and wpe, 12 per block; ln_f closes the list.
        out.extend(all[2 + 12 * self.blocks.start..2 + 12 * self.blocks.end].iter().cloned());
        if self.last {
            out.extend(all[all.len() - 2..].iter().cloned());
        }
        out
    }

    /// The stage's forward for one micro-batch: the first stage embeds `ids` `[B, T]`, the others
    /// continue the residual stream `input` `[B, T, C]`; the last returns `weight x` the mean
    /// next-token cross entropy against `targets` `[B, T]`, the others the residual stream.
    pub fn forward(
        &self,
        input: Option<&Tensor>,
        ids: Option<&Tensor>,
        targets: Option<&Tensor>,
        weight: f64,
    ) -> Result<Tensor> {
        let m = &self.model;
        let x = match (self.first, input, ids) {
            (true, _, Some(ids)) => m.embed(ids, 0)?,
            (false, Some(x), _) => x.clone(),
            _ => {
                return Err(Error::InvalidArgument("gpt stage: the first stage takes ids, the others an input".into()))
            }
        };
        let (mut x, mut branch) = (x, None);
        for (layer, blk) in self.blocks.clone().zip(&m.blocks[self.blocks.clone()]) {
            let (nx, out) = m.block(layer, blk, &x, branch.as_ref(), None)?;
            (x, branch) = (nx, Some(out));
        }
        if !self.last {
            return match branch {
                Some(b) => x.add(&b),
                None => Ok(x),
            };
        }
        let targets =
            targets.ok_or_else(|| Error::InvalidArgument("gpt stage: the last stage needs targets".into()))?;
        let &[b, t] = targets.dims() else {
            return Err(shape_err!("gpt stage", "targets must be [batch, time], got {:?}", targets.dims()));
        };
        let eps = m.config.layer_norm_epsilon;
        let h = residual_norm(&x, branch.as_ref(), &m.ln_f_w, &m.ln_f_b, eps)?.1;
        let wte = self.head.as_ref().unwrap_or(&m.wte);
        let logits = lm_logits(&h, wte, m.config.vocab_size)?;
        lm_loss(&logits, &targets.reshape(b * t)?)?.mul_scalar(weight)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gpt::GptConfig;
    use ferrograd_core::rng::uniform_at;
    use ferrograd_core::{DType, Device, GradStore};

    fn tiny() -> GptConfig {
        GptConfig { n_positions: 16, n_layer: 4, n_head: 2, n_embd: 16, vocab_size: 50, ..GptConfig::gpt2() }
    }

    fn ids(seed: u64, b: usize, t: usize) -> Tensor {
        let v: Vec<u32> = (0..b * t).map(|i| (uniform_at(seed, 0, i as u64) * 50.0) as u32 % 50).collect();
        Tensor::from_vec(v, (b, t), Device::Cpu).unwrap()
    }

    #[test]
    fn blocks_split_evenly_and_bad_splits_are_refused() {
        let r = |g, k, n| block_range(12, g, k, n).unwrap();
        assert_eq!((r(2, 0, 2), r(2, 1, 2)), (0..6, 6..12));
        assert_eq!((r(4, 0, 2), r(4, 1, 2)), (0..6, 6..12));
        assert_eq!((r(3, 0, 3), r(3, 2, 3)), (0..4, 8..12));
        assert_eq!(r(4, 0, 1), 0..12);
        assert!(block_range(12, 4, 0, 3).is_err() && block_range(2, 4, 0, 4).is_err());
    }

    /// The stages chained by hand give the unsplit model's loss and the same gradients (the tied
    /// embedding's as the sum of both ends').
    #[test]
    fn chained_stages_give_the_unsplit_loss_and_gradients() {
        let model = Arc::new(Gpt::new(tiny(), 3, Device::Cpu).unwrap());
        let (x, y) = (ids(1, 2, 8), ids(2, 2, 8));
        let want = model.loss(&x, &y).unwrap();
        let mut g_want = GradStore::default();
        want.backward_into(&mut g_want).unwrap();
        let stages: Vec<GptStage> = (0..3).map(|s| GptStage::new(model.clone(), 3, s, 3).unwrap()).collect();
        assert_eq!(stages.iter().map(|s| s.blocks()).collect::<Vec<_>>(), vec![0..1, 1..2, 2..4]);
        let mut grads = GradStore::default();
        let h0 = stages[0].forward(None, Some(&x), None, 1.0).unwrap();
        let i1 = h0.detach().requires_grad();
        let h1 = stages[1].forward(Some(&i1), None, None, 1.0).unwrap();
        let i2 = h1.detach().requires_grad();
        let loss = stages[2].forward(Some(&i2), None, Some(&y), 1.0).unwrap();
        let (a, b) = (loss.item_f64().unwrap(), want.item_f64().unwrap());
        assert!((a - b).abs() <= 1e-6 * b, "{a} vs {b}");
        loss.backward_into(&mut grads).unwrap();
        let d2 = grads.remove(&i2).unwrap();
        h1.backward_into_with(&d2, &mut grads).unwrap();
        let d1 = grads.remove(&i1).unwrap();
        h0.backward_into_with(&d1, &mut grads).unwrap();
        let tied = grads.get(stages[0].tied().unwrap()).unwrap().add(grads.get(stages[2].tied().unwrap()).unwrap());
        let close = |got: &Tensor, want: &Tensor, what: &str| {
            let (g, w) = (got.to_vec::<f32>().unwrap(), want.to_vec::<f32>().unwrap());
            let scale = w.iter().fold(1e-6f32, |m, v| m.max(v.abs()));
            for (p, q) in g.iter().zip(&w) {
                assert!((p - q).abs() <= 1e-5 * scale, "{what}: {p} vs {q}");
            }
        };
        close(&tied.unwrap(), g_want.get(&model.wte).unwrap(), "wte");
        let names: Vec<String> = stages.iter().flat_map(|s| s.params()).map(|(n, _)| n).collect();
        // Every parameter once, wte twice (first and last stage).
        assert_eq!(names.len(), model.params().len() + 1);
        for s in &stages {
            for (n, p) in s.params().iter().skip(usize::from(s.tied().is_some())) {
                let w = model.params().into_iter().find(|(m, _)| m == n).unwrap().1;
                close(grads.get(p).unwrap(), g_want.get(&w).unwrap(), n);
            }
        }
        assert_eq!(h0.dtype(), DType::F32);
    }
}
