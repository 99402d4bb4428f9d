//! Launch sites of the fused optimizer kernels (`kernels/optim.cu`): tensors go in batches of 40
//! whose pointers ride in the kernel parameters.

use crate::cuda::device::CudaDevice;
use crate::cuda::launch::{cfg_1d, launch};
use crate::cuda::modules;
use crate::cuda::storage::CudaStorage;
use crate::optim::{AdamConfig, SgdConfig};
use crate::storage::Storage;
use crate::{DType, Error, Result, Tensor};
use cudarc::driver::DeviceRepr;
use std::sync::Arc;

/// Tensors one launch updates (`FG_OPT_MAX` in kernels/optim.cu, passed as a define).
pub(crate) const MAX: usize = 40;

#[repr(C)]
#[derive(Clone, Copy)]
struct OptTable {
    p: [u64; MAX],
    g: [u64; MAX],
    s1: [u64; MAX],
    s2: [u64; MAX],
    n: [u64; MAX],
    /// Adam: each parameter's kept low-precision copy (`cuda/shadow.rs`), or 0.
    lo: [u64; MAX],
    /// Bit k: `lo[k]` is f16 (else bf16).
    lo_f16: u64,
    count: u32,
    pad: u32,
}

// SAFETY: plain-old-data with the C layout `kernels/optim.cu` declares.
unsafe impl DeviceRepr for OptTable {}

fn ptr(t: &Tensor) -> Result<u64> {
    match &*t.storage() {
        Storage::Cuda(c) => Ok(c.buf.ptr_at(t.layout().offset())),
        Storage::Cpu(_) => Err(Error::DeviceMismatch { op: "optimizer", lhs: crate::Device::Cpu, rhs: t.device() }),
    }
}

/// The kept low-precision copy of parameter `t`, if a `ShadowSet` holds one: the optimizer writes it
/// with the parameter (only Adam's kernels read `lo`; every other table leaves it unread).
fn shadow_of(t: &Tensor) -> Result<Option<(u64, bool)>> {
    let crate::Device::Cuda(o) = t.device() else { return Ok(None) };
    if t.dtype() != DType::F32 || !t.is_contiguous() {
        return Ok(None);
    }
    Ok(crate::cuda::shadow::copy_ptr(o, ptr(t)?, t.elem_count()))
}

/// Fill tables of up to 40 tensors and hand each to `run` with its largest tensor size. `copies`:
/// fill `lo` with the first tensors' kept copies (the optimizer steps, which write or refuse them;
/// the norm and scale tables over gradients skip the registry lookups).
fn batches(ts: [&[Tensor]; 4], copies: bool, mut run: impl FnMut(OptTable, usize) -> Result<()>) -> Result<()> {
    let n = ts[0].len();
    for start in (0..n).step_by(MAX) {
        let mut t = OptTable {
            p: [0; MAX],
            g: [0; MAX],
            s1: [0; MAX],
            s2: [0; MAX],
            n: [0; MAX],
            lo: [0; MAX],
            lo_f16: 0,
            count: 0,
            pad: 0,
        };
        let mut widest = 0;
        for (k, i) in (start..n.min(start + MAX)).enumerate() {
            t.p[k] = ptr(&ts[0][i])?;
            t.g[k] = ptr(&ts[1][i])?;
            t.s1[k] = if ts[2].is_empty() { 0 } else { ptr(&ts[2][i])? };
            t.s2[k] = if ts[3].is_empty() { 0 } else { ptr(&ts[3][i])? };
            t.n[k] = ts[0][i].elem_count() as u64;
            if let Some((lo, f16)) = if copies { shadow_of(&ts[0][i])? } else { None } {
                t.lo[k] = lo;
                t.lo_f16 |= (f16 as u64) << k;
            }
            widest = widest.max(ts[0][i].elem_count());
            t.count += 1;
        }
        run(t, widest)?;
    }
    Ok(())
}

#[allow(clippy::too_many_arguments)]
pub(crate) fn adam(
    dev: &CudaDevice,
    params: &[Tensor],
    grads: &[Tensor],
    m: &[Tensor],
    v: &[Tensor],
    c: &AdamConfig,
    bc1: f32,
    bc2: f32,
) -> Result<()> {
    batches([params, grads, m, v], true, |t, widest| {
        launch!(dev, modules::OPTIM, "adam_f32", cfg_1d(dev, widest);
            t, c.lr as f32, c.beta1 as f32, c.beta2 as f32, (1.0 - c.beta1) as f32, (1.0 - c.beta2) as f32,
            c.eps as f32, c.weight_decay as f32, bc1, bc2,
            c.decoupled as i32);
        Ok(())
    })
}

/// Adam whose bias corrections come from the device: `step` (f64, on the device) is incremented
/// and the corrections formed there, so the launches can be replayed by a CUDA graph.
#[allow(clippy::too_many_arguments)]
pub(crate) fn adam_counted(
    dev: &Arc<CudaDevice>,
    params: &[Tensor],
    grads: &[Tensor],
    m: &[Tensor],
    v: &[Tensor],
    c: &AdamConfig,
    step: &Tensor,
    lr: Option<&Tensor>,
    grad_scale: Option<&Tensor>,
) -> Result<()> {
    let bc = CudaStorage::uninit(dev, 2, DType::F32)?;
    launch!(dev, modules::OPTIM, "adam_bias_correction", cfg_1d(dev, 1); ptr(step)?, bc.buf.ptr(), c.beta1, c.beta2);
    let lr_ptr = lr.map(ptr).transpose()?;
    // The graph-replayable kernel takes the clip factor; the others have no caller that clips.
    let scale_ptr = grad_scale.map(ptr).transpose()?.unwrap_or(0);
    if lr_ptr.is_none() && scale_ptr != 0 {
        return Err(Error::InvalidArgument("adam: a gradient scale needs the learning rate on the device".into()));
    }
    batches([params, grads, m, v], true, |t, widest| {
        let (b1, b2, omb1, omb2) = (c.beta1 as f32, c.beta2 as f32, (1.0 - c.beta1) as f32, (1.0 - c.beta2) as f32);
        match lr_ptr {
            Some(lp) => launch!(dev, modules::OPTIM, "adam_f32_devlr", cfg_1d(dev, widest);
                t, lp, b1, b2, omb1, omb2, c.eps as f32, c.weight_decay as f32, bc.buf.ptr(), c.decoupled as i32,
                scale_ptr),
            None => launch!(dev, modules::OPTIM, "adam_f32_dev", cfg_1d(dev, widest);
                t, c.lr as f32, b1, b2, omb1, omb2, c.eps as f32, c.weight_decay as f32, bc.buf.ptr(),
                c.decoupled as i32),
        }
        Ok(())
    })
}

pub(crate) fn sgd(
    dev: &CudaDevice,
    params: &[Tensor],
    grads: &[Tensor],
    bufs: &[Tensor],
    c: &SgdConfig,
    first: bool,
) -> Result<()> {
    let bufs = if c.momentum != 0.0 { bufs } else { &[] };
    batches([params, grads, bufs, &[]], true, |t, widest| {
        if t.lo[..t.count as usize].iter().any(|&lo| lo != 0) {
            // Its kernel would leave the copy stale (only Adam's write it).
            return Err(Error::InvalidArgument(
                "sgd: a parameter has a kept low-precision copy (a ShadowSet), which only Adam updates".into(),
            ));
        }
        launch!(dev, modules::OPTIM, "sgd_f32", cfg_1d(dev, widest);
            t, c.lr as f32, c.momentum as f32, c.dampening as f32, c.weight_decay as f32, c.nesterov as i32,
            first as i32);
        Ok(())
    })
}

/// `[norm, factor]` (f32, on the device) of `tensors` (contiguous f32, on `dev`): their joint L2
/// norm and the clip factor `min(1, max_norm / (norm + 1e-6))`, in three launches at most per 40
/// tensors plus one, deterministic (see `kernels/optim.cu`).
pub(crate) fn norm_and_clip_factor(dev: &Arc<CudaDevice>, tensors: &[Tensor], max_norm: f32) -> Result<CudaStorage> {
    let cfg = cfg_1d(dev, usize::MAX);
    let blocks = cfg.grid_dim.0 as usize;
    let part = CudaStorage::uninit(dev, blocks * tensors.len().div_ceil(MAX).max(1), DType::F32)?;
    if tensors.is_empty() {
        launch!(dev, modules::COPY, "fill_b32", cfg_1d(dev, part.len()); part.buf.ptr(), 0u64, part.len() as u64);
    }
    let mut slot = 0u32;
    batches([tensors, tensors, &[], &[]], false, |t, _| {
        launch!(dev, modules::OPTIM, "sq_norm_part_f32", cfg; t, part.buf.ptr(), slot);
        slot += 1;
        Ok(())
    })?;
    let out = CudaStorage::uninit(dev, 2, DType::F32)?;
    let one = cudarc::driver::LaunchConfig { grid_dim: (1, 1, 1), block_dim: (256, 1, 1), shared_mem_bytes: 0 };
    launch!(dev, modules::OPTIM, "sq_norm_finish", one; part.buf.ptr(), part.len() as u64, max_norm, out.buf.ptr());
    Ok(out)
}

/// `g * factor` for every tensor (contiguous f32 on `dev`), `factor` one f32 on the device, in one
/// launch per 40 tensors; the outputs are new tensors.
pub(crate) fn scale_all(dev: &Arc<CudaDevice>, tensors: &[Tensor], factor: u64) -> Result<Vec<Tensor>> {
    let outs = tensors
        .iter()
        .map(|t| {
            let s = CudaStorage::uninit(dev, t.elem_count(), DType::F32)?;
            Ok(Tensor::from_storage(Storage::Cuda(s), t.shape().clone(), None))
        })
        .collect::<Result<Vec<_>>>()?;
    batches([&outs, tensors, &[], &[]], false, |t, widest| {
        launch!(dev, modules::OPTIM, "scale_dev_f32", cfg_1d(dev, widest); t, factor);
        Ok(())
    })?;
    Ok(outs)
}
