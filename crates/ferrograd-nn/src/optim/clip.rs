//! Clipping by global norm, entirely on the device: the norm is a 0-d tensor and the clip factor
//! `min(1, max_norm / (norm + 1e-6))` is multiplied in as a device scalar, so clipping never waits
//! for the GPU. (PyTorch's `clip_grad_norm_` formula and epsilon.) CUDA f32 gradients take the
//! fused multi-tensor kernels (`ferrograd_core::optim::clip_global_norm_fused`, PyTorch's
//! `foreach` path); everything else is composed from tensor ops, which is also their reference.

use ferrograd_core::{no_grad, DType, Device, GradStore, Result, Tensor};

/// The L2 norm over all gradients of `params` (those present in `grads`) as a 0-d f32 tensor on
/// the parameters' device; zero when none has a gradient.
pub fn grad_norm(grads: &GradStore, params: &[Tensor]) -> Result<Tensor> {
    let _g = no_grad();
    let present: Vec<Tensor> = params.iter().filter_map(|p| grads.get(p)).cloned().collect();
    if let Some(norm) = ferrograd_core::optim::global_norm_fused(&present)? {
        return Ok(norm);
    }
    let sums = params
        .iter()
        .filter_map(|p| grads.get(p))
        .map(|g| g.to_dtype(DType::F32)?.sqr()?.sum_all())
        .collect::<Result<Vec<_>>>()?;
    if sums.is_empty() {
        let device = params.first().map_or(Device::Cpu, |p| p.device());
        return Tensor::zeros((), DType::F32, device);
    }
    Tensor::stack(&sums, 0)?.sum_all()?.sqrt()
}

/// Scale the gradients of `params` in `grads` so their global norm is at most `max_norm`;
/// returns the norm before clipping (a device scalar: read it only when you log it).
pub fn clip_grad_norm(grads: &mut GradStore, params: &[Tensor], max_norm: f64) -> Result<Tensor> {
    if max_norm.is_nan() || max_norm < 0.0 {
        return Err(ferrograd_core::Error::InvalidArgument(format!("clip_grad_norm: max_norm {max_norm} < 0")));
    }
    let _g = no_grad();
    // CUDA f32 gradients: the norm, the factor and every scaled gradient in a few fused launches
    // (composed, a GPT-2 step spent ~4 ms of an H200's time in 450 small kernels here).
    let present: Vec<&Tensor> = params.iter().filter(|p| grads.get(p).is_some()).collect();
    let gs: Vec<Tensor> = present.iter().filter_map(|p| grads.get(p)).cloned().collect();
    if let Some((norm, scaled)) = ferrograd_core::optim::clip_global_norm_fused(&gs, max_norm)? {
        for (p, g) in present.into_iter().zip(scaled) {
            grads.insert(p, g);
        }
        return Ok(norm);
    }
    let norm = grad_norm(grads, params)?;
    let scale = norm.add_scalar(1e-6)?.recip()?.mul_scalar(max_norm)?.clamp(f64::NEG_INFINITY, 1.0)?;
    for p in params {
        if let Some(g) = grads.get(p) {
            let scaled = g.mul(&scale.to_dtype(g.dtype())?)?;
            grads.insert(p, scaled);
        }
    }
    Ok(norm)
}

/// [`clip_grad_norm`] for an optimizer that takes a gradient factor (`Adam::step_scheduled`'s
/// `grad_scale`): where the fused kernels apply (CUDA f32 gradients) the gradients are left as
/// they are and the factor `min(1, max_norm / (norm + 1e-6))` is returned as a `[1]` f32 device
/// tensor, saving a pass that writes every gradient; elsewhere the gradients are scaled as
/// [`clip_grad_norm`] does and the factor is `None`. Returns the norm before clipping too.
pub fn clip_grad_factor(grads: &mut GradStore, params: &[Tensor], max_norm: f64) -> Result<(Tensor, Option<Tensor>)> {
    let _g = no_grad();
    let gs: Vec<Tensor> = params.iter().filter_map(|p| grads.get(p)).cloned().collect();
    if let Some((norm, factor)) = ferrograd_core::optim::clip_factor_fused(&gs, max_norm)? {
        return Ok((norm, Some(factor)));
    }
    Ok((clip_grad_norm(grads, params, max_norm)?, None))
}
