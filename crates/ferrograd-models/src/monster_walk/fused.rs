//! The fused CUDA training step (`kernels/monster_walk.cu`): two launches per step, no host
//! transfer, no allocation. The weights live in one packed buffer during training and are
//! written back to the model's tensors at the end.

use super::model::{Autoencoder, LAYERS};
use super::walk::RINGS;
use ferrograd_core::cuda::modules::Module;
use ferrograd_core::cuda::CudaDevice;
use ferrograd_core::optim::AdamConfig;
use ferrograd_core::{DType, Device, Error, Result, Tensor};
use std::ffi::c_void;
use std::sync::Arc;

pub const MODULE: Module = Module::new("monster_walk", include_str!("../../kernels/monster_walk.cu")).with_cost_ms(200);

/// Parameters of the autoencoder (the kernel's MW_P).
pub const PARAMS: usize = 9_690;
/// Activations a row keeps (MW_A) and the widest layer (MW_W).
const ACTS: usize = 309;
const WIDE: usize = 71;
const THREADS: u32 = 256;

pub struct FusedTrainer {
    dev: Arc<CudaDevice>,
    params: Tensor,
    m: Tensor,
    v: Tensor,
    partial: Tensor,
    loss_partial: Tensor,
    loss: Tensor,
    rows: usize,
    max_blocks: usize,
    adam: AdamConfig,
    step: u64,
}

/// A kernel argument: the address of the value the driver copies into the launch.
fn arg<T>(v: &mut T) -> *mut c_void {
    v as *mut T as *mut c_void
}

fn smem_bytes(rows: usize) -> usize {
    4 * (2 * PARAMS + rows * (ACTS + 2 * WIDE) + 32)
}

impl FusedTrainer {
    /// Pack `model`'s weights for steps over batches of at most `max_rows` rows.
    pub fn new(model: &Autoencoder, device: Device, max_rows: usize, adam: AdamConfig) -> Result<FusedTrainer> {
        let Device::Cuda(o) = device else {
            return Err(Error::InvalidArgument("the fused Monster Walk step runs on CUDA only".into()));
        };
        let dev = CudaDevice::get(o)?;
        let flat: Vec<Tensor> = model.parameters().iter().map(|t| t.detach().flatten_all()).collect::<Result<_>>()?;
        let params = Tensor::cat(&flat, 0)?.to_device(device)?.contiguous()?;
        if params.elem_count() != PARAMS {
            return Err(Error::InvalidArgument(format!(
                "fused step expects {PARAMS} parameters, got {}",
                params.elem_count()
            )));
        }
        // One tile per multiprocessor where shared memory allows: the step is one wave.
        let sms = dev.info.multiprocessors.max(1) as usize;
        let limit = dev.max_shared_memory_per_block()?;
        let mut rows = max_rows.div_ceil(sms).max(1);
        while rows > 1 && smem_bytes(rows) > limit {
            rows -= 1;
        }
        if smem_bytes(rows) > limit {
            return Err(Error::Cuda(format!(
                "the fused step needs {} bytes of shared memory, the GPU allows {limit}",
                smem_bytes(1)
            )));
        }
        let max_blocks = max_rows.div_ceil(rows);
        let z = |n: usize| Tensor::zeros(n, DType::F32, device);
        Ok(FusedTrainer {
            dev,
            m: z(PARAMS)?,
            v: z(PARAMS)?,
            partial: z(max_blocks * PARAMS)?,
            loss_partial: z(max_blocks)?,
            loss: z(1)?,
            params,
            rows,
            max_blocks,
            adam,
            step: 0,
        })
    }

    /// One Adam step on the rows of `x` ([n, 71], contiguous f32 on the device).
    pub fn step(&mut self, x: &Tensor) -> Result<()> {
        let (n, blocks) = self.launch_grads(x)?;
        let (part, lpart) = (self.partial.cuda_ptr()?, self.loss_partial.cuda_ptr()?);
        self.launch_adam(part, blocks, lpart, 1.0 / (n * RINGS) as f32)
    }

    /// A data-parallel step: this rank's gradient of the rows of `x` and its loss, as one flat
    /// [9690 + 1] f32 tensor, are averaged over all ranks by `reduce` (in place, compute ordered
    /// after it), then Adam applies the average, so every rank takes the same step. The loss of
    /// the step is then the mean over ranks.
    pub fn step_reduced(&mut self, x: &Tensor, reduce: &dyn Fn(&Tensor) -> Result<()>) -> Result<()> {
        let (n, blocks) = self.launch_grads(x)?;
        // mw_grads leaves one scaled gradient per block; their sum is this rank's gradient.
        let grad = self.partial.narrow(0, 0, blocks * PARAMS)?.reshape((blocks, PARAMS))?.sum(0, false)?;
        let loss = self.loss_partial.narrow(0, 0, blocks)?.sum_all()?.mul_scalar(1.0 / (n * RINGS) as f64)?;
        let flat = Tensor::cat(&[grad, loss.reshape(1)?], 0)?;
        reduce(&flat)?;
        // mw_adam over one "block" of partials (the averaged gradient); its loss reduction reads
        // the averaged loss behind it with a scale of 1.
        let p = flat.cuda_ptr()?;
        self.launch_adam(p, 1, p + 4 * PARAMS as u64, 1.0)
    }

    /// Launch `mw_grads` for the rows of `x`: per-block gradients in `partial`, per-block losses in
    /// `loss_partial`. Returns the rows and the blocks used.
    fn launch_grads(&mut self, x: &Tensor) -> Result<(usize, usize)> {
        let n = x.dims().first().copied().unwrap_or(0);
        if x.dims() != [n, RINGS] || x.dtype() != DType::F32 || n == 0 {
            return Err(Error::InvalidArgument(format!(
                "fused step: batch {:?} {} is not [n, 71] f32",
                x.dims(),
                x.dtype()
            )));
        }
        let blocks = n.div_ceil(self.rows);
        if blocks > self.max_blocks {
            return Err(Error::InvalidArgument(format!("fused step: {n} rows exceed the planned batch")));
        }
        let mut xp = x.cuda_ptr()?;
        let mut n_i = n as i32;
        let mut pp = self.params.cuda_ptr()?;
        let mut part = self.partial.cuda_ptr()?;
        let mut lpart = self.loss_partial.cuda_ptr()?;
        let mut scale = 2.0f32 / (n * RINGS) as f32;
        let mut rows = self.rows as i32;
        let mut a1: Vec<*mut c_void> = vec![
            arg(&mut xp),
            arg(&mut n_i),
            arg(&mut pp),
            arg(&mut part),
            arg(&mut lpart),
            arg(&mut scale),
            arg(&mut rows),
        ];
        // SAFETY: the arguments match `mw_grads` in kernels/monster_walk.cu one for one; x holds
        // n x 71 floats, params 9690, partial and loss_partial room for `blocks` blocks.
        unsafe {
            self.dev.launch_raw(&MODULE, "mw_grads", blocks as u32, THREADS, smem_bytes(self.rows) as u32, &mut a1)?
        };
        Ok((n, blocks))
    }

    /// Launch `mw_adam`: sum `nb` partial gradients at `partial` (9690 floats each), one Adam step,
    /// and the loss as `inv_count` times the sum of `nb` floats at `loss_partial`.
    fn launch_adam(&mut self, partial: u64, nb: usize, loss_partial: u64, inv_count: f32) -> Result<()> {
        self.step += 1;
        let c = &self.adam;
        let t = self.step.min(i32::MAX as u64) as i32;
        let (bc1, bc2) = ((1.0 - c.beta1.powi(t)) as f32, (1.0 - c.beta2.powi(t)) as f32);
        let (mut part, mut lpart, mut nb) = (partial, loss_partial, nb as i32);
        let mut pp = self.params.cuda_ptr()?;
        let (mut mp, mut vp, mut lp) = (self.m.cuda_ptr()?, self.v.cuda_ptr()?, self.loss.cuda_ptr()?);
        let mut inv = inv_count;
        let (mut lr, mut b1, mut b2) = (c.lr as f32, c.beta1 as f32, c.beta2 as f32);
        let (mut omb1, mut omb2, mut eps) = ((1.0 - c.beta1) as f32, (1.0 - c.beta2) as f32, c.eps as f32);
        let (mut bc1, mut bc2) = (bc1, bc2);
        let mut a2: Vec<*mut c_void> = vec![
            arg(&mut part),
            arg(&mut nb),
            arg(&mut pp),
            arg(&mut mp),
            arg(&mut vp),
            arg(&mut lpart),
            arg(&mut lp),
            arg(&mut inv),
            arg(&mut lr),
            arg(&mut b1),
            arg(&mut b2),
            arg(&mut omb1),
            arg(&mut omb2),
            arg(&mut eps),
            arg(&mut bc1),
            arg(&mut bc2),
        ];
        let grid = PARAMS.div_ceil(THREADS as usize) as u32;
        // SAFETY: the arguments match `mw_adam`; `partial` holds nb x 9690 floats and
        // `loss_partial` nb floats (the caller's buffers, alive until the launch is queued and
        // kept alive by the caller until compute passes it), m and v 9690 floats, loss one.
        unsafe { self.dev.launch_raw(&MODULE, "mw_adam", grid, THREADS, 0, &mut a2) }
    }

    /// The loss of the last step (before its update), on the device.
    pub fn loss(&self) -> &Tensor {
        &self.loss
    }

    /// Copy the trained weights back into the model's tensors.
    pub fn write_back(&self, model: &Autoencoder) -> Result<()> {
        let mut off = 0;
        for ((w, b), &(fan_in, fan_out)) in model.weights_and_biases()?.into_iter().zip(&LAYERS) {
            let nw = fan_in * fan_out;
            w.set(&self.params.narrow(0, off, nw)?.reshape((fan_out, fan_in))?)?;
            b.set(&self.params.narrow(0, off + nw, fan_out)?)?;
            off += nw + fan_out;
        }
        Ok(())
    }

    /// What a step changes (packed weights, Adam moments) and the step count: what the training
    /// loop snapshots to replay an epoch that ended in a non-finite loss (`train.rs`).
    pub fn state(&self) -> (Vec<Tensor>, u64) {
        (vec![self.params.clone(), self.m.clone(), self.v.clone()], self.step)
    }

    pub fn set_step_count(&mut self, step: u64) {
        self.step = step;
    }

    pub fn rows_per_block(&self) -> usize {
        self.rows
    }
}
