//! Fused, in-place optimizer steps over many tensors at once. On CUDA one kernel launch updates up
//! to 40 tensors (their pointers travel in the launch parameters, so a step needs no host->device
//! copy); on the CPU each tensor is one parallel loop. The formulas are PyTorch's, applied in f32
//! in the same order on both backends (`kernels/optim.cu` is the device twin).

use crate::storage::Storage;
use crate::{DType, Error, Result, Tensor};
use rayon::prelude::*;

/// Hyperparameters of [`adam_step`]-style fused Adam/AdamW updates (PyTorch's `torch.optim.Adam` /
/// `AdamW` arguments, same defaults as Adam: lr 1e-3, betas (0.9, 0.999), eps 1e-8, no decay).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AdamConfig {
    /// Learning rate.
    pub lr: f64,
    /// Decay of the first-moment (mean) estimate.
    pub beta1: f64,
    /// Decay of the second-moment estimate.
    pub beta2: f64,
    /// Added to the denominator for stability.
    pub eps: f64,
    /// L2 penalty (Adam) or decoupled decay (AdamW), see `decoupled`.
    pub weight_decay: f64,
    /// AdamW: decay the weights directly instead of adding `wd * p` to the gradient.
    pub decoupled: bool,
}

impl Default for AdamConfig {
    fn default() -> Self {
        AdamConfig { lr: 1e-3, beta1: 0.9, beta2: 0.999, eps: 1e-8, weight_decay: 0.0, decoupled: false }
    }
}

/// Hyperparameters of [`sgd_step`] (PyTorch's `torch.optim.SGD` arguments and defaults, lr 1e-2).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SgdConfig {
    /// Learning rate.
    pub lr: f64,
    /// Momentum factor (0 disables the buffer).
    pub momentum: f64,
    /// Dampening of the momentum.
    pub dampening: f64,
    /// Nesterov momentum.
    pub nesterov: bool,
    /// L2 penalty added to the gradient.
    pub weight_decay: f64,
}

impl Default for SgdConfig {
    fn default() -> Self {
        SgdConfig { lr: 1e-2, momentum: 0.0, dampening: 0.0, nesterov: false, weight_decay: 0.0 }
    }
}

/// Every tensor must be an f32 buffer with the parameter's shape, on its device; all but the
/// gradients (`groups[0]`, read through `contiguous_grads`) must be contiguous, being written in place.
fn check(op: &'static str, params: &[Tensor], groups: &[&[Tensor]]) -> Result<()> {
    for g in groups {
        if g.len() != params.len() {
            return Err(Error::InvalidArgument(format!(
                "{op}: {} parameters but {} state tensors",
                params.len(),
                g.len()
            )));
        }
    }
    for (i, p) in params.iter().enumerate() {
        for (j, t) in std::iter::once(p).chain(groups.iter().map(|g| &g[i])).enumerate() {
            if t.dtype() != DType::F32 {
                return Err(Error::UnsupportedDType { op, dtype: t.dtype() });
            }
            if t.dims() != p.dims() {
                return Err(Error::ShapeMismatch { op, lhs: p.dims().to_vec(), rhs: t.dims().to_vec() });
            }
            if t.device() != p.device() {
                return Err(Error::DeviceMismatch { op, lhs: p.device(), rhs: t.device() });
            }
            if j != 1 && !t.is_contiguous() {
                return Err(crate::shape_err!(op, "tensor {i} is not contiguous"));
            }
        }
    }
    Ok(())
}

/// Gradients of transposed uses (a weight used as `w.t()`) arrive as transposed views; the fused
/// kernels read flat buffers.
fn contiguous_grads(grads: &[Tensor]) -> Result<Vec<Tensor>> {
    grads.iter().map(|g| g.contiguous()).collect()
}

/// Run `f` over the f32 slices of `p`, `g` and up to two state tensors, updating `p` and the
/// states in their own buffers (no copy in or out). Absent states get a zeroed scratch slice.
fn with_cpu(
    p: &Tensor,
    g: &Tensor,
    s1: Option<&Tensor>,
    s2: Option<&Tensor>,
    f: impl Fn(&mut [f32], &[f32], &mut [f32], &mut [f32]) + Sync,
) -> Result<()> {
    // Each written tensor is locked for writing; two of them on one storage would deadlock.
    let written: Vec<&Tensor> = [Some(p), s1, s2].into_iter().flatten().collect();
    for (i, a) in written.iter().enumerate() {
        if written[..i].iter().any(|b| b.same_storage(a)) {
            return Err(Error::InvalidArgument("optimizer: parameter and state tensors must not share storage".into()));
        }
    }
    let gv = g.to_vec::<f32>()?;
    let range = |t: &Tensor| t.layout().offset()..t.layout().offset() + t.elem_count();
    let mut guards: Vec<_> = written.iter().map(|t| t.storage_mut()).collect();
    let mut slices: Vec<&mut [f32]> = Vec::with_capacity(3);
    for (guard, t) in guards.iter_mut().zip(&written) {
        let Storage::Cpu(crate::cpu::CpuStorage::F32(v)) = &mut **guard else {
            return Err(Error::UnsupportedDType { op: "optimizer", dtype: t.dtype() });
        };
        slices.push(&mut v[range(t)]);
    }
    let mut scratch1 = vec![0.0f32; if s1.is_none() { gv.len() } else { 0 }];
    let mut scratch2 = vec![0.0f32; if s2.is_none() { gv.len() } else { 0 }];
    let mut it = slices.into_iter();
    let pv = it.next().ok_or_else(|| Error::InvalidArgument("optimizer: no parameter".into()))?;
    let a = if s1.is_some() { it.next() } else { None }.unwrap_or(&mut scratch1);
    let b = if s2.is_some() { it.next() } else { None }.unwrap_or(&mut scratch2);
    f(pv, &gv, a, b);
    Ok(())
}

/// One Adam/AdamW step (`step` counts from 1), updating `params`, `m` and `v` in place.
pub fn adam_step(
    params: &[Tensor],
    grads: &[Tensor],
    m: &[Tensor],
    v: &[Tensor],
    c: &AdamConfig,
    step: u64,
) -> Result<()> {
    check("adam_step", params, &[grads, m, v])?;
    if step == 0 {
        return Err(Error::InvalidArgument("adam_step: step counts from 1".into()));
    }
    let bc1 = 1.0 - c.beta1.powi(step.min(i32::MAX as u64) as i32);
    let bc2 = 1.0 - c.beta2.powi(step.min(i32::MAX as u64) as i32);
    if let Some(crate::Device::Cuda(o)) = params.first().map(|p| p.device()) {
        let dev = crate::cuda::CudaDevice::get(o)?;
        let grads = contiguous_grads(grads)?;
        return crate::cuda::ops::optim::adam(&dev, params, &grads, m, v, c, bc1 as f32, bc2 as f32);
    }
    let (lr, b1, b2, eps, wd) = (c.lr as f32, c.beta1 as f32, c.beta2 as f32, c.eps as f32, c.weight_decay as f32);
    // 1 - beta in f64, as PyTorch forms it (0.999f32 would make 1 - b2 off by 1e-5 relative).
    let (omb1, omb2) = ((1.0 - c.beta1) as f32, (1.0 - c.beta2) as f32);
    let (step_size, sbc2) = (lr / bc1 as f32, (bc2 as f32).sqrt());
    for i in 0..params.len() {
        with_cpu(&params[i], &grads[i], Some(&m[i]), Some(&v[i]), |p, g, m, v| {
            p.par_iter_mut().zip(g).zip(m.par_iter_mut()).zip(v.par_iter_mut()).for_each(|(((p, &g), m), v)| {
                let (mut pi, mut gi) = (*p, g);
                if c.decoupled {
                    pi *= 1.0 - lr * wd;
                } else {
                    gi += wd * pi;
                }
                *m = b1 * *m + omb1 * gi;
                *v = b2 * *v + omb2 * (gi * gi);
                *p = pi - step_size * (*m / ((*v).sqrt() / sbc2 + eps));
            })
        })?;
    }
    Ok(())
}

/// One Adam/AdamW step whose count lives in `step`, a one-element f64 tensor on the parameters'
/// device that this call increments: on CUDA the increment and the bias corrections happen on the
/// device, so a CUDA graph that captured the call applies each replay's own step (PyTorch's
/// `capturable=True`). The update equals `adam_step`'s for the same count, bit for bit.
pub fn adam_step_counted(
    params: &[Tensor],
    grads: &[Tensor],
    m: &[Tensor],
    v: &[Tensor],
    c: &AdamConfig,
    step: &Tensor,
) -> Result<()> {
    check("adam_step_counted", params, &[grads, m, v])?;
    if step.dtype() != DType::F64 || step.elem_count() != 1 || !step.is_contiguous() {
        return Err(Error::InvalidArgument(format!(
            "adam_step_counted: the step must be one contiguous f64 element, got {:?} {}",
            step.dims(),
            step.dtype()
        )));
    }
    let device = params.first().map_or(step.device(), |p| p.device());
    if step.device() != device {
        return Err(Error::DeviceMismatch { op: "adam_step_counted", lhs: device, rhs: step.device() });
    }
    if let crate::Device::Cuda(o) = device {
        let dev = crate::cuda::CudaDevice::get(o)?;
        let grads = contiguous_grads(grads)?;
        return crate::cuda::ops::optim::adam_counted(&dev, params, &grads, m, v, c, step, None, None);
    }
    let n = step.to_vec::<f64>()?[0] + 1.0;
    step.set(&Tensor::full(n, step.shape().clone(), DType::F64, device)?)?;
    adam_step(params, grads, m, v, c, n as u64)
}

/// [`adam_step_counted`] whose learning rate is read from `lr` too (one contiguous f32 element on
/// the parameters' device; `c.lr` is ignored): a CUDA graph that captured the call applies the rate
/// the host wrote into `lr` before each replay (a scheduled learning rate). The update equals
/// `adam_step`'s with `c.lr = lr` (as f32), bit for bit.
///
/// `grad_scale` (one contiguous f32 element on the device, e.g. [`clip_factor_fused`]'s factor):
/// the gradients are read times it, the same product a separate scaling would write, so clipping
/// costs no pass over the gradients. On CUDA, parameters with a kept low-precision copy
/// (`cuda::ShadowSet`) get the copy rewritten in the same kernel.
#[allow(clippy::too_many_arguments)]
pub fn adam_step_scheduled(
    params: &[Tensor],
    grads: &[Tensor],
    m: &[Tensor],
    v: &[Tensor],
    c: &AdamConfig,
    step: &Tensor,
    lr: &Tensor,
    grad_scale: Option<&Tensor>,
) -> Result<()> {
    let device = params.first().map_or(step.device(), |p| p.device());
    for (what, t) in std::iter::once(("learning rate", lr)).chain(grad_scale.map(|g| ("gradient scale", g))) {
        if t.dtype() != DType::F32 || t.elem_count() != 1 || !t.is_contiguous() {
            return Err(Error::InvalidArgument(format!(
                "adam_step_scheduled: the {what} must be one contiguous f32 element, got {:?} {}",
                t.dims(),
                t.dtype()
            )));
        }
        if t.device() != device {
            return Err(Error::DeviceMismatch { op: "adam_step_scheduled", lhs: device, rhs: t.device() });
        }
    }
    if let crate::Device::Cuda(o) = device {
        check("adam_step_scheduled", params, &[grads, m, v])?;
        if step.dtype() != DType::F64 || step.elem_count() != 1 || !step.is_contiguous() || step.device() != device {
            return Err(Error::InvalidArgument(
                "adam_step_scheduled: the step must be one contiguous f64 element on the parameters' device".into(),
            ));
        }
        let dev = crate::cuda::CudaDevice::get(o)?;
        let grads = contiguous_grads(grads)?;
        return crate::cuda::ops::optim::adam_counted(&dev, params, &grads, m, v, c, step, Some(lr), grad_scale);
    }
    let rate = lr.to_vec::<f32>()?[0] as f64;
    let scaled;
    let grads = match grad_scale {
        Some(f) => {
            let f = f.reshape(())?;
            scaled = grads.iter().map(|g| g.mul(&f.broadcast_as(g.shape().clone())?)).collect::<Result<Vec<_>>>()?;
            &scaled[..]
        }
        None => grads,
    };
    adam_step_counted(params, grads, m, v, &AdamConfig { lr: rate, ..*c }, step)
}

/// One SGD step; `bufs` are the momentum buffers (ignored when momentum is 0), initialised from
/// the gradient on the `first` step.
pub fn sgd_step(params: &[Tensor], grads: &[Tensor], bufs: &[Tensor], c: &SgdConfig, first: bool) -> Result<()> {
    let groups: Vec<&[Tensor]> = if c.momentum != 0.0 { vec![grads, bufs] } else { vec![grads] };
    check("sgd_step", params, &groups)?;
    if c.nesterov && (c.momentum <= 0.0 || c.dampening != 0.0) {
        return Err(Error::InvalidArgument("Nesterov momentum needs momentum > 0 and no dampening".into()));
    }
    if let Some(crate::Device::Cuda(o)) = params.first().map(|p| p.device()) {
        let dev = crate::cuda::CudaDevice::get(o)?;
        let grads = contiguous_grads(grads)?;
        return crate::cuda::ops::optim::sgd(&dev, params, &grads, bufs, c, first);
    }
    let (lr, mu, damp, wd) = (c.lr as f32, c.momentum as f32, c.dampening as f32, c.weight_decay as f32);
    for i in 0..params.len() {
        let buf = (mu != 0.0).then(|| &bufs[i]);
        with_cpu(&params[i], &grads[i], buf, None, |p, g, b, _| {
            p.par_iter_mut().zip(g).zip(b.par_iter_mut()).for_each(|((p, &g), b)| {
                let mut gi = g + wd * *p;
                if mu != 0.0 {
                    let bi = if first { gi } else { mu * *b + (1.0 - damp) * gi };
                    *b = bi;
                    gi = if c.nesterov { gi + mu * bi } else { bi };
                }
                *p -= lr * gi;
            })
        })?;
    }
    Ok(())
}

/// The CUDA device all of `tensors` live on as contiguous f32 buffers, if they do (the fused
/// norm and scale kernels' domain).
fn fused_domain(tensors: &[Tensor]) -> Result<Option<std::sync::Arc<crate::cuda::CudaDevice>>> {
    let Some(crate::Device::Cuda(o)) = tensors.first().map(|t| t.device()) else { return Ok(None) };
    let fits = |t: &Tensor| t.device() == crate::Device::Cuda(o) && t.dtype() == DType::F32 && t.is_contiguous();
    if !tensors.iter().all(fits) {
        return Ok(None);
    }
    Ok(Some(crate::cuda::CudaDevice::get(o)?))
}

/// The joint L2 norm of `tensors` (a 0-d f32 tensor on their device), computed by the fused,
/// deterministic multi-tensor kernels where every tensor is a contiguous f32 CUDA buffer of one
/// device (`None` otherwise: compose it from `sqr` and `sum_all`). No host synchronization.
pub fn global_norm_fused(tensors: &[Tensor]) -> Result<Option<Tensor>> {
    let Some(dev) = fused_domain(tensors)? else { return Ok(None) };
    let nf = crate::cuda::ops::optim::norm_and_clip_factor(&dev, tensors, 0.0)?;
    let nf = Tensor::from_storage(Storage::Cuda(nf), 2, None);
    Ok(Some(nf.narrow(0, 0, 1)?.squeeze(0)?))
}

/// The joint norm of `tensors` (0-d f32) and PyTorch's clip factor `min(1, max_norm / (norm +
/// 1e-6))` (`[1]` f32), on the device, where every tensor is a contiguous f32 CUDA buffer of one
/// device (`None` otherwise): [`clip_global_norm_fused`] for an optimizer that applies the factor
/// as it reads the gradients ([`adam_step_scheduled`]'s `grad_scale`).
pub fn clip_factor_fused(tensors: &[Tensor], max_norm: f64) -> Result<Option<(Tensor, Tensor)>> {
    if max_norm.is_nan() || max_norm < 0.0 {
        return Err(Error::InvalidArgument(format!("clip_grad_norm: max_norm {max_norm} < 0")));
    }
    let Some(dev) = fused_domain(tensors)? else { return Ok(None) };
    let nf = crate::cuda::ops::optim::norm_and_clip_factor(&dev, tensors, max_norm as f32)?;
    let nf = Tensor::from_storage(Storage::Cuda(nf), 2, None);
    Ok(Some((nf.narrow(0, 0, 1)?.squeeze(0)?, nf.narrow(0, 1, 1)?)))
}

/// PyTorch's `clip_grad_norm_` on the device in three fused launches (plus one per 40 tensors):
/// the joint norm of `tensors` (0-d f32) and each tensor times `min(1, max_norm / (norm + 1e-6))`
/// (new tensors), where every tensor is a contiguous f32 CUDA buffer of one device; `None`
/// otherwise. The norm's summation order does not depend on timing, so replays are bit-identical.
pub fn clip_global_norm_fused(tensors: &[Tensor], max_norm: f64) -> Result<Option<(Tensor, Vec<Tensor>)>> {
    if max_norm.is_nan() || max_norm < 0.0 {
        return Err(Error::InvalidArgument(format!("clip_grad_norm: max_norm {max_norm} < 0")));
    }
    let Some(dev) = fused_domain(tensors)? else { return Ok(None) };
    let nf = crate::cuda::ops::optim::norm_and_clip_factor(&dev, tensors, max_norm as f32)?;
    let factor = nf.buf.ptr_at(1);
    let scaled = crate::cuda::ops::optim::scale_all(&dev, tensors, factor)?;
    let nf = Tensor::from_storage(Storage::Cuda(nf), 2, None);
    Ok(Some((nf.narrow(0, 0, 1)?.squeeze(0)?, scaled)))
}
