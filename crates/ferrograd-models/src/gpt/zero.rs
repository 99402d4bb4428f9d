//! ZeRO-1 for `gpt train --zero 1`: GPT's AdamW (`optim.rs`) over this rank's shard of the
//! flattened parameters. The gradient buckets are reduce-scattered (`GradSync::shard`), so each
//! rank holds the averaged gradient of its shard only; per step it
//!
//! 1. clips: the global norm is the norm of the *whole* averaged gradient, so each rank's squared
//!    shard norm is summed over the ranks on the device ([`clip_shards`]), and every rank scales
//!    its shard by the same `min(1, max_norm / (norm + 1e-6))` the one-GPU step uses;
//! 2. steps both AdamW groups over views of the parameter elements its shard covers (a
//!    parameter's part keeps the parameter's group: decay on matrices, none elsewhere; the same
//!    learning rate and step counts on the device as the one-GPU step), with moments for those
//!    elements only: optimizer memory / world size;
//! 3. `GradSync::end_step` all-gathers the updated parameters.
//!
//! AdamW is elementwise, so this is the one-GPU step up to the norm's summation order. Nothing
//! reads back to the host, so the step is captured as a CUDA graph like the replicated one.
//!
//! Checkpoints stay plain GPT AdamW files: before a save every rank gathers the moments into whole
//! per-parameter tensors on the host ([`GptAdamW::gather_state`]) and rank 0 writes them; a
//! resume reads them into host tensors and cuts out this rank's parts. So a ZeRO checkpoint
//! resumes on any number of GPUs, with or without ZeRO, and the other way round.

use super::dp::{GradSync, ShardPart};
use super::model::Gpt;
use super::optim::{gpt_adamw_config, GptAdamW};
use ferrograd_core::{no_grad, DType, Device, Error, GradStore, Result, Tensor};
use ferrograd_nn::optim::{Adam, Optimizer};
use std::sync::Arc;

/// This rank's parts and the views of the parameter elements they cover: each view is the key
/// its part's gradient is stored under for the AdamW groups.
#[derive(Debug)]
pub(crate) struct ShardKeys {
    parts: Vec<ShardPart>,
    keys: Vec<Tensor>,
}

impl ShardKeys {
    /// The gradient store the AdamW groups step on: each part's slice of its shard buffer.
    pub(crate) fn store(&self, shards: &[Tensor]) -> Result<GradStore> {
        let _g = no_grad();
        let mut store = GradStore::default();
        for (q, key) in self.parts.iter().zip(&self.keys) {
            let g = shards.get(q.buffer).ok_or_else(|| {
                Error::InvalidArgument(format!("ZeRO-1: shard buffer {} of {}", q.buffer, shards.len()))
            })?;
            store.insert(key, g.narrow(0, q.offset, q.range.len())?);
        }
        Ok(store)
    }
}

#[derive(Debug)]
pub(crate) struct Shard {
    keys: Arc<ShardKeys>,
    /// Per part: its group (0 decay, 1 no decay) and its index in that group.
    slots: Vec<(usize, usize)>,
    /// Whole per-parameter moments `(m, v)` on the host while a checkpoint is written or read.
    staging: Option<Vec<(Tensor, Tensor)>>,
}

impl Shard {
    /// `<name>.m`, `<name>.v` per parameter while staged; nothing otherwise (a file written without
    /// the gather would lack the moments and fail to load, naming the first).
    pub(super) fn state_tensors(&self, params: &[(String, Tensor)]) -> Vec<(String, Tensor)> {
        let Some(st) = &self.staging else { return vec![] };
        params
            .iter()
            .zip(st)
            .flat_map(|((n, _), (m, v))| [(format!("{n}.m"), m.clone()), (format!("{n}.v"), v.clone())])
            .collect()
    }
}

impl GptAdamW {
    /// GPT's AdamW over this rank's `parts` of `model`'s parameters (ZeRO-1).
    pub fn sharded(model: &Gpt, parts: &[ShardPart], lr: f64, weight_decay: f64) -> Result<GptAdamW> {
        let params = model.params();
        let _g = no_grad();
        let (mut groups, mut slots, mut keys) = ([vec![], vec![]], vec![], vec![]);
        for q in parts {
            let (name, t) = params
                .get(q.param)
                .ok_or_else(|| Error::InvalidArgument(format!("ZeRO-1: part of parameter {}", q.param)))?;
            if q.range.end > t.elem_count() || q.range.is_empty() {
                return Err(Error::InvalidArgument(format!("ZeRO-1: part {:?} of {name}", q.range)));
            }
            let view = t.reshape(t.elem_count())?.narrow(0, q.range.start, q.range.len())?;
            // The whole parameter's group (`GptAdamW::new`'s rule): decay on matrices.
            let g = if t.rank() >= 2 { 0 } else { 1 };
            slots.push((g, groups[g].len()));
            groups[g].push((name.clone(), view.clone()));
            keys.push(view);
        }
        let [decay, no_decay] = groups;
        let wte = params
            .first()
            .map(|(n, _)| n.clone())
            .ok_or_else(|| Error::InvalidArgument("AdamW over no parameters".into()))?;
        Ok(GptAdamW {
            decay: Adam::new_adamw(decay, gpt_adamw_config(lr, weight_decay))?,
            no_decay: Adam::new_adamw(no_decay, gpt_adamw_config(lr, 0.0))?,
            wte: (wte, model.config.vocab_size),
            params,
            device: None,
            shard: Some(Shard { keys: Arc::new(ShardKeys { parts: parts.to_vec(), keys }), slots, staging: None }),
        })
    }

    /// ZeRO-1: the parts and their keys for the step body (`None`: the whole model).
    pub(crate) fn shard_keys(&self) -> Option<Arc<ShardKeys>> {
        self.shard.as_ref().map(|s| s.keys.clone())
    }

    pub fn is_sharded(&self) -> bool {
        self.shard.is_some()
    }

    /// Bytes of AdamW moments this optimizer holds (f32 `m` and `v`).
    pub fn state_bytes(&self) -> usize {
        let elems: usize =
            [&self.decay, &self.no_decay].iter().flat_map(|g| g.params()).map(|(_, t)| t.elem_count()).sum();
        elems * 2 * DType::F32.size_in_bytes()
    }

    /// This rank's part moments `(m, v)`, in part order.
    fn part_moments(&self, s: &Shard) -> (Vec<Tensor>, Vec<Tensor>) {
        let states = [self.decay.state_tensors(), self.no_decay.state_tensors()];
        // Adam's state is (m, v) per parameter, in its parameter order.
        s.slots.iter().map(|&(g, i)| (states[g][2 * i].1.clone(), states[g][2 * i + 1].1.clone())).unzip()
    }

    /// Before a checkpoint is written (every rank calls it: it all-gathers): the whole moments on
    /// the host, what `state_tensors` gives until [`GptAdamW::end_staging`].
    pub(crate) fn gather_state(&mut self, sync: &dyn GradSync) -> Result<()> {
        let Some(s) = &self.shard else { return Ok(()) };
        let (m, v) = self.part_moments(s);
        let (m, v) = (sync.gather_parts(&m)?, sync.gather_parts(&v)?);
        if m.len() != self.params.len() || v.len() != self.params.len() {
            return Err(Error::InvalidArgument("ZeRO-1: gathered moments do not match the parameters".into()));
        }
        if let Some(s) = &mut self.shard {
            s.staging = Some(m.into_iter().zip(v).collect());
        }
        Ok(())
    }

    /// Before a checkpoint is read: zero whole moments on the host for it to fill.
    pub(crate) fn stage_for_load(&mut self) -> Result<()> {
        let Some(s) = &mut self.shard else { return Ok(()) };
        let zeros = |t: &Tensor| Tensor::zeros(t.shape().clone(), DType::F32, Device::Cpu);
        let st = self.params.iter().map(|(_, t)| Ok((zeros(t)?, zeros(t)?))).collect::<Result<Vec<_>>>()?;
        s.staging = Some(st);
        Ok(())
    }

    /// Drop the staged moments; after a successful read (`loaded`) first cut this rank's parts
    /// out of them.
    pub(crate) fn end_staging(&mut self, loaded: bool) -> Result<()> {
        let Some(s) = &self.shard else { return Ok(()) };
        let staged = match (&s.staging, loaded) {
            (Some(st), true) => st.clone(),
            _ => vec![],
        };
        if !staged.is_empty() {
            let _g = no_grad();
            let (m, v) = self.part_moments(s);
            for ((q, pm), pv) in s.keys.parts.iter().zip(&m).zip(&v) {
                let (fm, fv) = &staged[q.param];
                let cut = |f: &Tensor| -> Result<Tensor> {
                    f.reshape(f.elem_count())?.narrow(0, q.range.start, q.range.len())?.to_device(pm.device())
                };
                pm.set(&cut(fm)?)?;
                pv.set(&cut(fv)?)?;
            }
        }
        if let Some(s) = &mut self.shard {
            s.staging = None;
        }
        Ok(())
    }
}

/// ZeRO-1 clipping (see the module doc): `(norm before clipping, this rank's gradient shards,
/// scaled when `max_norm > 0`)`; the norm is the whole averaged gradient's, on every rank.
pub(crate) fn clip_shards(sync: &dyn GradSync, max_norm: f64) -> Result<(Tensor, Vec<Tensor>)> {
    let _g = no_grad();
    let shards = sync.shard_grads()?;
    let first = shards.first().ok_or_else(|| Error::InvalidArgument("ZeRO-1: no gradient shards".into()))?;
    // Squared norm of this rank's shards (padding is zero): the fused norm on CUDA (squared back:
    // a relative 1e-7), summed squares elsewhere. A fresh one-element buffer: the sum writes it.
    let local = match ferrograd_core::optim::global_norm_fused(&shards)? {
        Some(n) => n.sqr()?,
        None => {
            let sums = shards.iter().map(|g| g.sqr()?.sum_all()).collect::<Result<Vec<_>>>()?;
            Tensor::stack(&sums, 0)?.sum_all()?
        }
    };
    let total = local.reshape(1)?.contiguous()?;
    debug_assert_eq!(total.device(), first.device());
    sync.sum_over_ranks(&total)?;
    let norm = total.sqrt()?.reshape(())?;
    if max_norm <= 0.0 {
        return Ok((norm, shards));
    }
    // PyTorch's clip_grad_norm_ factor, as ferrograd-nn's clip_grad_norm forms it.
    let scale = norm.add_scalar(1e-6)?.recip()?.mul_scalar(max_norm)?.clamp(f64::NEG_INFINITY, 1.0)?;
    let scaled = shards.iter().map(|g| g.mul(&scale)).collect::<Result<Vec<_>>>()?;
    Ok((norm, scaled))
}
