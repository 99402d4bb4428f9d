//! [`PersistentMlp`]: plan the kernel for a spec and a GPU, keep the padded weights and the Adam
//! state on the device between runs, launch a whole training run cooperatively and follow its
//! progress through mapped host memory while it runs.

use super::layout::{Layout, BAR_WORDS, THREADS};
use super::{HostWeights, MlpSpec, Precision};
use ferrograd_core::cuda::modules::{Define, Module};
use ferrograd_core::cuda::{CudaDevice, MappedF32};
use ferrograd_core::optim::AdamConfig;
use ferrograd_core::{DType, Device, Error, Result, Tensor};
use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::{Arc, Mutex, OnceLock, PoisonError};
use std::time::{Duration, Instant};

/// `kernels/mlp_persistent.cu`, one module per precision (`-D MLP_PREC`, the kernel's `PREC_*`):
/// the three kernels in one module were the longest NVRTC compile of a cold precompile (6-8 s);
/// apart they compile in parallel, and a run compiles only its own. [`module`] picks one.
macro_rules! mlp_module {
    ($id:ident, $name:literal, $prec:literal, $ms:literal) => {
        pub const $id: Module = Module::new($name, include_str!("../../kernels/mlp_persistent.cu"))
            .with_defines(&[Define::int("MLP_PREC", $prec)])
            .with_cost_ms($ms);
    };
}
mlp_module!(MODULE_F32, "mlp_persistent_f32", 0, 2800);
mlp_module!(MODULE_TF32, "mlp_persistent_tf32", 1, 2600);
mlp_module!(MODULE_BF16, "mlp_persistent_bf16", 2, 2500);

/// Every precision's general module (the kernel reads its descriptor at run time): what the
/// compile tests check. Launches use [`specialized`] modules.
pub const MODULES: [&Module; 3] = [&MODULE_F32, &MODULE_TF32, &MODULE_BF16];

/// The general module that holds `precision`'s kernel ([`Precision::kernel`]).
pub fn module(precision: Precision) -> &'static Module {
    match precision {
        Precision::F32 => &MODULE_F32,
        Precision::Tf32 => &MODULE_TF32,
        Precision::Bf16 => &MODULE_BF16,
    }
}

/// The layout of `spec` on a GPU of `sms` SMs for batches of up to `max_rows` rows: one block per
/// SM (fewer for small batches; every block holds all the weights, so more blocks per SM would
/// only multiply the per-step reduction), 8-row tiles dealt round-robin.
pub fn layout_for(spec: &MlpSpec, sms: usize, max_rows: usize) -> Layout {
    let tiles = max_rows.div_ceil(8).max(1);
    let grid = sms.max(1).min(tiles);
    Layout::new(spec, grid, 8 * tiles.div_ceil(grid))
}

/// The module a run of `spec` in batches of up to `max_rows` rows launches on `dev` (the one
/// [`PersistentMlp::new`] loads): what a warm start compiles ahead.
pub fn module_on(spec: &MlpSpec, dev: &CudaDevice, max_rows: usize, precision: Precision) -> &'static Module {
    specialized(precision, &layout_for(spec, dev.info.multiprocessors.max(1) as usize, max_rows))
}

/// `precision`'s module with `layout`'s descriptor compiled in as constants (`MLP_FIXED_DESC`;
/// the kernel says why: 16% of a Monster Walk run). One module per layout and precision, named
/// `mlp_persistent_<precision>_<16 hex digits of the descriptor's FNV-1a hash>` (loaded modules
/// are keyed by name) and kept for the life of the process, as the built-in modules are
/// `'static`: a process sees a few layouts, ~45 KB of source text each. The CUBIN goes to the
/// disk cache like any module's, so a layout compiles once per machine.
pub fn specialized(precision: Precision, layout: &Layout) -> &'static Module {
    type Key = (&'static str, Vec<i32>);
    static MADE: OnceLock<Mutex<HashMap<Key, &'static Module>>> = OnceLock::new();
    let base = module(precision);
    let words = layout.desc_words();
    let mut made = MADE.get_or_init(Default::default).lock().unwrap_or_else(PoisonError::into_inner);
    let key = (base.name, words);
    if let Some(m) = made.get(&key) {
        return m;
    }
    let text: Vec<String> = key.1.iter().map(i32::to_string).collect();
    let src = format!("#define MLP_FIXED_DESC {}\n{}", text.join(", "), base.src);
    let hash = key.1.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, &w| {
        w.to_le_bytes().iter().fold(h, |h, &b| (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3))
    });
    let name = format!("{}_{hash:016x}", base.name);
    let m: &'static Module = Box::leak(Box::new(Module {
        name: Box::leak(name.into_boxed_str()),
        src: Box::leak(src.into_boxed_str()),
        ..*base
    }));
    made.insert(key, m);
    m
}

/// A NaN the kernel never writes: a ring slot still holding it has not been reached yet.
const PENDING: u32 = 0x7fba_dbad;
/// Phases the kernel times with clock64() (in its order).
const PHASES: [&str; 6] = [
    "forward (+ refresh wait)",
    "backward + dW (+ reduce A)",
    "grid barrier B (dW_0 in L2)",
    "reduce W_0 + Adam",
    "grid barrier 2 (Adam done)",
    "refresh issue + loss ring",
];

/// The kernel's `struct AdamArgs` (doubles first: no padding on either side).
#[repr(C)]
#[derive(Clone, Copy)]
struct AdamArgs {
    b1d: f64,
    b2d: f64,
    lr: f32,
    b1: f32,
    b2: f32,
    omb1: f32,
    omb2: f32,
    eps: f32,
}

/// Where the time of a step goes, from the kernel's own clock64() stamps (thread 0 of each block).
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct PhaseProfile {
    /// The launch: blocks (one per SM), threads per block, dynamic shared memory per block.
    pub grid: usize,
    pub block: usize,
    pub smem_bytes: usize,
    /// The SM clock the cycles are converted at (MHz): the one measured over the run.
    pub clock_mhz: f64,
    pub phases: Vec<Phase>,
}

#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Phase {
    pub name: String,
    /// Per step, mean over blocks.
    pub mean_us: f64,
    /// Per step, the slowest block.
    pub max_us: f64,
}

/// What one launch did.
#[derive(Clone, Debug)]
pub struct TrainRun {
    /// The loss of every step (before its update), as the kernel computed it.
    pub losses: Vec<f32>,
    /// Launch to completion, host wall clock.
    pub seconds: f64,
    pub phases: PhaseProfile,
}

pub struct PersistentMlp {
    dev: Arc<CudaDevice>,
    device: Device,
    spec: MlpSpec,
    layout: Layout,
    precision: Precision,
    desc: Tensor,
    params: Tensor,
    m: Tensor,
    v: Tensor,
    partial: Tensor,
    max_rows: usize,
    steps_done: u64,
}

fn arg<T>(v: &mut T) -> *mut c_void {
    v as *mut T as *mut c_void
}

impl PersistentMlp {
    /// Why the persistent kernel cannot train `spec` on `device` with batches of up to `max_rows`
    /// rows, or `None` when it can. Compiles the kernel (to ask the driver about occupancy).
    pub fn unavailable(
        spec: &MlpSpec,
        device: Device,
        max_rows: usize,
        precision: Precision,
    ) -> Result<Option<String>> {
        Ok(Self::plan(spec, device, max_rows, precision)?.err())
    }

    fn plan(
        spec: &MlpSpec,
        device: Device,
        max_rows: usize,
        precision: Precision,
    ) -> Result<std::result::Result<(Arc<CudaDevice>, Layout), String>> {
        let Device::Cuda(o) = device else {
            return Ok(Err("the persistent kernel runs on CUDA only".into()));
        };
        if max_rows == 0 {
            return Err(Error::InvalidArgument("persistent MLP: batches need at least one row".into()));
        }
        let dev = CudaDevice::get(o)?;
        if !dev.supports_cooperative_launch()? {
            return Ok(Err(format!("{} does not support cooperative launch", dev.info.name)));
        }
        let layout = layout_for(spec, dev.info.multiprocessors.max(1) as usize, max_rows);
        let limit = dev.max_shared_memory_per_block()?;
        if layout.smem_bytes > limit {
            return Ok(Err(format!(
                "{} weights and {} rows per block need {} KiB of shared memory per block; {} allows {} KiB",
                spec.parameter_count(),
                layout.rows_cap,
                layout.smem_bytes.div_ceil(1024),
                dev.info.name,
                limit / 1024
            )));
        }
        let occ = dev.max_active_blocks_per_sm(
            specialized(precision, &layout),
            precision.kernel(),
            THREADS as u32,
            layout.smem_bytes as u32,
        )?;
        if occ == 0 {
            return Ok(Err(format!(
                "a block of {THREADS} threads with {} KiB of shared memory does not fit on an SM of {}",
                layout.smem_bytes.div_ceil(1024),
                dev.info.name
            )));
        }
        Ok(Ok((dev, layout)))
    }

    /// Upload `weights` (per layer: W `[out, in]` and b `[out]`, on any device) for batches of at
    /// most `max_rows` rows. An error (with the reason) where the kernel cannot run.
    pub fn new(
        spec: MlpSpec,
        weights: &[(Tensor, Tensor)],
        device: Device,
        max_rows: usize,
        precision: Precision,
    ) -> Result<PersistentMlp> {
        let (dev, layout) = Self::plan(&spec, device, max_rows, precision)?
            .map_err(|why| Error::InvalidArgument(format!("persistent kernel unavailable: {why}")))?;
        if weights.len() != spec.layers() {
            return Err(Error::InvalidArgument(format!(
                "persistent MLP: {} weight pairs for {} layers",
                weights.len(),
                spec.layers()
            )));
        }
        let mut host = Vec::with_capacity(weights.len());
        for (l, (w, b)) in weights.iter().enumerate() {
            let (inp, out) = (spec.widths()[l], spec.widths()[l + 1]);
            if w.dims() != [out, inp] || b.dims() != [out] || w.dtype() != DType::F32 || b.dtype() != DType::F32 {
                return Err(Error::InvalidArgument(format!(
                    "persistent MLP layer {l}: weight {:?} {} and bias {:?} {}, expected [{out}, {inp}] and [{out}] f32",
                    w.dims(),
                    w.dtype(),
                    b.dims(),
                    b.dtype()
                )));
            }
            host.push((w.to_vec::<f32>()?, b.to_vec::<f32>()?));
        }
        let pp = layout.pp;
        let params = Tensor::from_vec(layout.pack(&host), pp, device)?;
        let desc = Tensor::from_vec(layout.desc_words(), layout.desc_words().len(), device)?;
        let z = |n: usize| Tensor::zeros(n, DType::F32, device);
        Ok(PersistentMlp {
            m: z(pp)?,
            v: z(pp)?,
            // Never-written padding of the partial rows must read as zero: allocate zeroed once.
            partial: z(layout.grid * layout.pstride())?,
            dev,
            device,
            spec,
            precision,
            desc,
            params,
            layout,
            max_rows,
            steps_done: 0,
        })
    }

    pub fn layout(&self) -> &Layout {
        &self.layout
    }

    pub fn precision(&self) -> Precision {
        self.precision
    }

    /// Adam steps taken so far (they continue across `train` calls).
    pub fn steps_done(&self) -> u64 {
        self.steps_done
    }

    /// `steps` Adam steps in one launch, step s on batch `s % batches.len()` (x [n, in] and an
    /// optional target [n, out]; no target: an autoencoder, the target is x). `on_report(s,
    /// loss)` is called for every step s with (s + 1) % report_every == 0 while the kernel runs.
    pub fn train(
        &mut self,
        batches: &[(Tensor, Option<Tensor>)],
        steps: usize,
        adam: &AdamConfig,
        report_every: usize,
        on_report: impl FnMut(usize, f32),
    ) -> Result<TrainRun> {
        self.launch(batches, steps, adam, report_every, on_report, None)
    }

    /// Like `train`, and also return the summed gradient of the last step (per layer (dW, db)).
    pub fn train_with_last_gradient(
        &mut self,
        batches: &[(Tensor, Option<Tensor>)],
        steps: usize,
        adam: &AdamConfig,
    ) -> Result<(TrainRun, HostWeights)> {
        let grad = Tensor::zeros(self.layout.pp, DType::F32, self.device)?;
        let run = self.launch(batches, steps, adam, usize::MAX, |_, _| {}, Some(&grad))?;
        Ok((run, self.layout.unpack(&grad.to_vec::<f32>()?)))
    }

    /// The current weights, per layer (W `[out][in]` row-major, b `[out]`).
    pub fn weights(&self) -> Result<HostWeights> {
        Ok(self.layout.unpack(&self.params.to_vec::<f32>()?))
    }

    /// Copy the current weights into `layers` (W `[out, in]`, b `[out]` tensors, any device).
    pub fn write_into(&self, layers: &[(Tensor, Tensor)]) -> Result<()> {
        for ((w, b), (wv, bv)) in layers.iter().zip(self.weights()?) {
            w.set(&Tensor::from_vec(wv, w.dims().to_vec(), w.device())?)?;
            b.set(&Tensor::from_vec(bv, b.dims().to_vec(), b.device())?)?;
        }
        Ok(())
    }

    fn batch_table(&self, batches: &[(Tensor, Option<Tensor>)]) -> Result<Tensor> {
        let (inp, out) = (self.spec.widths()[0], self.spec.widths()[self.spec.layers()]);
        if batches.is_empty() {
            return Err(Error::InvalidArgument("persistent MLP: no batches".into()));
        }
        let mut tab = Vec::with_capacity(batches.len() * 8);
        for (i, (x, y)) in batches.iter().enumerate() {
            let n = x.dims().first().copied().unwrap_or(0);
            if x.dims() != [n, inp] || x.dtype() != DType::F32 || x.device() != self.device || n == 0 {
                return Err(Error::InvalidArgument(format!(
                    "persistent MLP batch {i}: x {:?} {} on {}, expected [n >= 1, {inp}] f32 on {}",
                    x.dims(),
                    x.dtype(),
                    x.device(),
                    self.device
                )));
            }
            if n > self.max_rows {
                return Err(Error::InvalidArgument(format!(
                    "persistent MLP batch {i}: {n} rows, planned for at most {}",
                    self.max_rows
                )));
            }
            let yp = match y {
                Some(y) if y.dims() == [n, out] && y.dtype() == DType::F32 && y.device() == self.device => {
                    y.cuda_ptr()?
                }
                Some(y) => {
                    return Err(Error::InvalidArgument(format!(
                        "persistent MLP batch {i}: target {:?} {}, expected [{n}, {out}] f32 on {}",
                        y.dims(),
                        y.dtype(),
                        self.device
                    )))
                }
                None if out == inp => 0,
                None => {
                    return Err(Error::InvalidArgument(format!(
                        "persistent MLP batch {i}: no target, and the output ({out}) is not the input ({inp})"
                    )))
                }
            };
            let xp = x.cuda_ptr()?;
            tab.extend([xp as u32, (xp >> 32) as u32, yp as u32, (yp >> 32) as u32, n as u32, 0, 0, 0]);
        }
        Tensor::from_vec(tab, (batches.len(), 8), self.device)
    }

    fn launch(
        &mut self,
        batches: &[(Tensor, Option<Tensor>)],
        steps: usize,
        adam: &AdamConfig,
        report_every: usize,
        mut on_report: impl FnMut(usize, f32),
        grad: Option<&Tensor>,
    ) -> Result<TrainRun> {
        if adam.weight_decay != 0.0 {
            return Err(Error::InvalidArgument("the persistent kernel's Adam has no weight decay".into()));
        }
        let (t0, nsteps) = match (i32::try_from(self.steps_done), i32::try_from(steps)) {
            (Ok(a), Ok(b)) if a.checked_add(b).is_some() => (a, b),
            _ => {
                return Err(Error::InvalidArgument(format!("persistent MLP: {steps} steps after {}", self.steps_done)))
            }
        };
        let table = self.batch_table(batches)?;
        let dev = self.dev.clone();
        let grid = self.layout.grid;
        // The grid-barrier counters, one L2 line each: barriers B and 2 of every step, then
        // barrier A of each reducer warp.
        let bar = Tensor::zeros(BAR_WORDS, DType::U32, self.device)?;
        let prof = Tensor::zeros(grid * 16, DType::U32, self.device)?;
        let ring = MappedF32::new(&dev, steps, f32::from_bits(PENDING))?;
        let c = adam;
        let mut ad = AdamArgs {
            b1d: c.beta1,
            b2d: c.beta2,
            lr: c.lr as f32,
            b1: c.beta1 as f32,
            b2: c.beta2 as f32,
            // 1 - beta in f64, as the other Adam paths form it.
            omb1: (1.0 - c.beta1) as f32,
            omb2: (1.0 - c.beta2) as f32,
            eps: c.eps as f32,
        };
        let (mut descp, mut tabp) = (self.desc.cuda_ptr()?, table.cuda_ptr()?);
        let (mut nb, mut ns, mut t0) = (batches.len() as i32, nsteps, t0);
        let (mut pp, mut mp, mut vp) = (self.params.cuda_ptr()?, self.m.cuda_ptr()?, self.v.cuda_ptr()?);
        let (mut part, mut barp, mut ringp) = (self.partial.cuda_ptr()?, bar.cuda_ptr()?, ring.device_ptr());
        let mut gradp = match grad {
            Some(g) if g.elem_count() == self.layout.pp => g.cuda_ptr()?,
            Some(_) => return Err(Error::InvalidArgument("persistent MLP: gradient buffer size".into())),
            None => 0u64,
        };
        let mut profp = prof.cuda_ptr()?;
        let mut args: Vec<*mut c_void> = vec![
            arg(&mut descp),
            arg(&mut tabp),
            arg(&mut nb),
            arg(&mut ns),
            arg(&mut t0),
            arg(&mut pp),
            arg(&mut mp),
            arg(&mut vp),
            arg(&mut part),
            arg(&mut barp),
            arg(&mut ringp),
            arg(&mut gradp),
            arg(&mut profp),
            arg(&mut ad),
        ];
        let start = Instant::now();
        // SAFETY: the arguments match MLP_KERNEL in kernels/mlp_persistent.cu one for one; desc
        // holds the descriptor words, the table nb rows of 8 u32 naming live batches of at most
        // rows_cap x grid rows, params/m/v/grad pp floats, partial grid x pstride floats, bar
        // u32 counters (BAR_WORDS), the ring `steps` mapped floats, prof grid x 8 u64.
        unsafe {
            dev.launch_cooperative_raw(
                specialized(self.precision, &self.layout),
                self.precision.kernel(),
                grid as u32,
                THREADS as u32,
                self.layout.smem_bytes as u32,
                &mut args,
            )?
        };
        let every = report_every.max(1);
        let mut next = every - 1;
        let mut drain = |ring: &MappedF32| -> Result<()> {
            while next < steps {
                let bits = ring.read_bits(next)?;
                if bits == PENDING {
                    break;
                }
                on_report(next, f32::from_bits(bits));
                next = next.saturating_add(every);
            }
            Ok(())
        };
        loop {
            let done = match dev.compute_stream_done() {
                Ok(d) => d,
                Err(e) => {
                    let _ = dev.synchronize();
                    return Err(e);
                }
            };
            drain(&ring)?;
            if done {
                break;
            }
            std::thread::sleep(Duration::from_micros(200));
        }
        dev.synchronize()?;
        let seconds = start.elapsed().as_secs_f64();
        drain(&ring)?;
        self.steps_done += steps as u64;
        let mut losses = Vec::with_capacity(steps);
        for s in 0..steps {
            let bits = ring.read_bits(s)?;
            if bits == PENDING {
                return Err(Error::Cuda(format!("the persistent kernel finished without the loss of step {s}")));
            }
            losses.push(f32::from_bits(bits));
        }
        Ok(TrainRun { losses, seconds, phases: self.phases(&prof, steps, seconds)? })
    }

    /// Cycles to microseconds at the clock the SMs actually ran at: the blocks' mean total cycles
    /// over the run's wall time (the nominal clock overstates it when the GPU runs below boost).
    fn phases(&self, prof: &Tensor, steps: usize, seconds: f64) -> Result<PhaseProfile> {
        let words = prof.to_vec::<u32>()?;
        let blocks: Vec<[u64; 6]> = words
            .chunks_exact(16)
            .map(|b| std::array::from_fn(|i| b[2 * i] as u64 | (b[2 * i + 1] as u64) << 32))
            .collect();
        let mean_total = blocks.iter().map(|b| b.iter().sum::<u64>() as f64).sum::<f64>() / blocks.len().max(1) as f64;
        let khz = match mean_total / seconds {
            hz if hz.is_finite() && hz > 1e6 => hz / 1e3,
            _ => self.dev.clock_rate_khz()?.max(1) as f64,
        };
        let per_step_us = |cycles: u64| cycles as f64 / steps.max(1) as f64 / khz * 1e3;
        let phases = PHASES
            .iter()
            .enumerate()
            .map(|(i, name)| Phase {
                name: name.to_string(),
                mean_us: blocks.iter().map(|b| per_step_us(b[i])).sum::<f64>() / blocks.len().max(1) as f64,
                max_us: blocks.iter().map(|b| per_step_us(b[i])).fold(0.0, f64::max),
            })
            .collect();
        Ok(PhaseProfile {
            grid: self.layout.grid,
            block: THREADS,
            smem_bytes: self.layout.smem_bytes,
            clock_mhz: khz / 1e3,
            phases,
        })
    }
}
