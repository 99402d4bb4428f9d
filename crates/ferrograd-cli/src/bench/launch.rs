//! `ferrograd bench launch`: per-op host overhead. A chain of small adds, `x = x.add(&y)`, on a
//! 1024-element f32 tensor: the kernels are tiny, so what is measured is what one op costs the
//! host (dispatch, allocation, launch). Twin: `bench/torch_launch.py` (`x = torch.add(x, y)`).
//!
//! On CUDA two figures: the host time per op while enqueueing the chain (no synchronize inside),
//! and ops per second including the final synchronize (whichever of host and GPU is slower sets
//! it). On the CPU, where ops run synchronously, time per op and ops per second. `--device cuda`
//! reports both devices, `--device cpu` the CPU only. Medians over repetitions of the chain after
//! a warm-up chain; the chain's result is checked against x0 + ops * y in float64.
//!
//! On CUDA two more rows, without a twin, say where an add's host time goes: the same number of
//! bare launches of a one-argument-list kernel (`fill_b32` through `CudaDevice::launch_raw`: the
//! function lookup and the driver's `cuLaunchKernel`, no allocation, no tensor) and of
//! `Tensor::full` (an allocation, a tensor and a fill launch). An add's time above the bare
//! launch is ferrograd's own dispatch.

use super::check::{rel_err, require};
use super::{check_bytes, f32_bytes, finish_json, finish_plot, print_rows, Environment, Report, Row};
use crate::timing::median;
use crate::CliResult;
use ferrograd_core::{DType, Device, Rng, Tensor};
use std::io::Write;
use std::path::PathBuf;
use std::time::{Duration, Instant};

#[derive(Debug, Clone)]
pub struct Config {
    pub device: Device,
    /// Length of the chain.
    pub ops: usize,
    /// Elements of x and y.
    pub elems: usize,
    /// Timed repetitions of the chain.
    pub repeats: usize,
    pub json: Option<PathBuf>,
    /// Also draw the rows as a bar chart (PNG) here.
    pub plot: Option<PathBuf>,
    pub seed: u64,
}

/// The flags, and the chain's tensors (x0, y, two live results, the f64 check) against the
/// host's memory; the CPU runs the chain on every device choice. Issue 11: `--elems u64::MAX`
/// panicked with "capacity overflow".
pub fn check(cfg: &Config) -> CliResult<()> {
    if cfg.ops == 0 || cfg.elems == 0 || cfg.repeats == 0 {
        return Err("--ops, --elems and --repeats must be at least 1".into());
    }
    check_bytes(Device::Cpu, || format!("bench launch --elems {}", cfg.elems), f32_bytes(cfg.elems, 10))
}

pub fn run(cfg: &Config, out: &mut dyn Write) -> CliResult<()> {
    check(cfg)?;
    super::open_device("launch", cfg.device)?;
    let env = Environment::for_device(cfg.device);
    writeln!(
        out,
        "chain of {} adds x = x.add(&y) on {} f32 elements; median of {} chains after a warm-up chain",
        cfg.ops, cfg.elems, cfg.repeats
    )?;
    writeln!(out)?;
    out.flush()?;

    let mut rng = Rng::new(cfg.seed);
    let mut rows = Vec::new();
    let mut devices = vec![cfg.device];
    if cfg.device.is_cuda() {
        devices.push(Device::Cpu);
    }
    for device in devices {
        let r = chain(cfg, device, &mut rng)?;
        let tag = if device.is_cuda() { "cuda" } else { "cpu" };
        let per_op = r.enqueue.as_secs_f64() / cfg.ops as f64;
        let ops_s = cfg.ops as f64 / r.total.as_secs_f64();
        if device.is_cuda() {
            rows.push(
                Row::new(format!("{tag}: host time per add (enqueue)"), per_op * 1e6, "µs/op", false)
                    .with("reps", cfg.repeats),
            );
            rows.push(
                Row::new(format!("{tag}: adds per second (incl. final sync)"), ops_s, "ops/s", true)
                    .with("reps", cfg.repeats)
                    .with("median_s", r.total.as_secs_f64()),
            );
            let (bare, full) = floors(cfg, device)?;
            for (what, t) in [("bare launch (fill_b32, launch_raw)", bare), ("Tensor::full (alloc + fill)", full)] {
                let us = t.as_secs_f64() / cfg.ops as f64 * 1e6;
                rows.push(
                    Row::new(format!("{tag}: host time per {what}"), us, "µs/op", false).with("reps", cfg.repeats),
                );
            }
        } else {
            rows.push(Row::new(format!("{tag}: time per add"), per_op * 1e6, "µs/op", false).with("reps", cfg.repeats));
            rows.push(
                Row::new(format!("{tag}: adds per second"), ops_s, "ops/s", true)
                    .with("reps", cfg.repeats)
                    .with("median_s", r.total.as_secs_f64()),
            );
        }
    }
    print_rows(out, &rows, None)?;

    let mut report = Report::new(
        "launch",
        cfg.device,
        env,
        "host clock around the chain (enqueue) and around the chain plus Device::synchronize() (total); medians",
    );
    report.rows = rows;
    report.notes.push(format!("{} adds per chain on {} f32 elements; seed {}", cfg.ops, cfg.elems, cfg.seed));
    finish_plot(&cfg.plot, &report, None, out)?;
    finish_json(&cfg.json, &report, out)
}

/// Median host times to enqueue `cfg.ops` bare launches of `fill_b32` and `cfg.ops`
/// `Tensor::full` calls, after a warm-up of each; both checked (the filled value read back).
fn floors(cfg: &Config, device: Device) -> CliResult<(Duration, Duration)> {
    use ferrograd_core::cuda::modules;
    let dev = super::cuda_device("launch", device)?;
    let x = Tensor::zeros(cfg.elems, DType::F32, device)?;
    let mut ptr = x.cuda_ptr()?;
    let mut bits = u64::from(1.5f32.to_bits());
    let mut n = cfg.elems as u64;
    let blocks = cfg.elems.div_ceil(256).min(1024) as u32;
    let mut bare = || -> CliResult<Duration> {
        let mut args: [*mut std::ffi::c_void; 3] =
            [(&mut ptr as *mut u64).cast(), (&mut bits as *mut u64).cast(), (&mut n as *mut u64).cast()];
        let t0 = Instant::now();
        for _ in 0..cfg.ops {
            // SAFETY: fill_b32(u32* dst, u64 bits, u64 n) (kernels/copy.cu), dst holding n f32.
            unsafe { dev.launch_raw(&modules::COPY, "fill_b32", blocks, 256, 0, &mut args) }?;
        }
        let t = t0.elapsed();
        device.synchronize()?;
        Ok(t)
    };
    bare()?;
    require("bare fill launches", rel_err(&x.to_f64_vec()?, &vec![1.5; cfg.elems]), 0.0)?;
    let bare_t = median(&(0..cfg.repeats).map(|_| bare()).collect::<CliResult<Vec<_>>>()?);
    let full = || -> CliResult<Duration> {
        let t0 = Instant::now();
        let mut last = None;
        for _ in 0..cfg.ops {
            last = Some(Tensor::full(2.5, cfg.elems, DType::F32, device)?);
        }
        let t = t0.elapsed();
        device.synchronize()?;
        if let Some(l) = last {
            require("Tensor::full", rel_err(&l.to_f64_vec()?, &vec![2.5; cfg.elems]), 0.0)?;
        }
        Ok(t)
    };
    full()?;
    let full_t = median(&(0..cfg.repeats).map(|_| full()).collect::<CliResult<Vec<_>>>()?);
    Ok((bare_t, full_t))
}

struct ChainTimes {
    /// Median host time to issue the chain.
    enqueue: Duration,
    /// Median time to issue it and wait for the device.
    total: Duration,
}

fn chain(cfg: &Config, device: Device, rng: &mut Rng) -> CliResult<ChainTimes> {
    let x0 = Tensor::randn_with(rng, 0.0, 1.0, cfg.elems, DType::F32, device)?;
    let y = Tensor::randn_with(rng, 0.0, 1.0, cfg.elems, DType::F32, device)?;
    let run = || -> CliResult<(Duration, Duration, Tensor)> {
        let t0 = Instant::now();
        let mut x = x0.clone();
        for _ in 0..cfg.ops {
            x = x.add(&y)?;
        }
        let enqueue = t0.elapsed();
        device.synchronize()?;
        Ok((enqueue, t0.elapsed(), x))
    };
    // Warm-up chain, checked: x0 + ops * y.
    let (_, _, x) = run()?;
    let (xs, ys) = (x0.to_f64_vec()?, y.to_f64_vec()?);
    let want: Vec<f64> = xs.iter().zip(&ys).map(|(a, b)| a + cfg.ops as f64 * b).collect();
    require(&format!("chain of adds on {device}"), rel_err(&x.to_f64_vec()?, &want), 1e-3)?;
    drop(x);
    let (mut enq, mut tot) = (Vec::new(), Vec::new());
    for _ in 0..cfg.repeats {
        let (e, t, x) = run()?;
        drop(x);
        enq.push(e);
        tot.push(t);
    }
    Ok(ChainTimes { enqueue: median(&enq), total: median(&tot) })
}
