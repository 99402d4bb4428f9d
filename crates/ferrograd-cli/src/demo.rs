//! `ferrograd demo`: the first thing to run. It says whether CUDA was found (and if not, why),
//! moves memory (a 1000x1000 zeros tensor on the device, its sum read back; a random tensor to the
//! device and back), checks a 2x2 matmul against the values worked out by hand, and times a
//! 1024x1024 f32 matmul on the GPU against ferrograd's CPU backend and a naive CPU triple loop.
//!
//! Every figure is measured in this run: random N(0, 1) inputs (never zeros), warm-up first,
//! medians; on the GPU CUDA events around batches of calls (`timing::measure_device`, the matmul
//! bench's procedure), on the CPU the host clock. Each of the three products is checked against
//! the naive loop before any time is printed. Without a GPU the CPU parts run and the first line
//! says that CUDA was not found and why.

use crate::bench::matmul::{max_rel_diff, measure_cpu_matmul, naive_matmul, FERROGRAD_PLAN, NAIVE_PLAN, TOLERANCE};
use crate::memory::bytes;
use crate::timing::{measure, measure_device, Clock, DevicePlan};
use crate::CliResult;
use ferrograd_core::cuda::{self, set_matmul_precision, CudaDevice, MatmulPrecision};
use ferrograd_core::{DType, Device, Rng, Tensor};
use std::io::Write;

/// Largest `--size`: the naive loop at 4096 takes about a minute per run.
pub const MAX_SIZE: usize = 4096;

#[derive(Debug, Clone)]
pub struct Config {
    /// None: the best device (`Device::best_with_reason`, which honours FERROGRAD_DEVICE).
    pub device: Option<Device>,
    /// n of the timed n x n matmul.
    pub size: usize,
    pub seed: u64,
}

pub fn check(cfg: &Config) -> CliResult<()> {
    if cfg.size == 0 || cfg.size > MAX_SIZE {
        return Err(format!("--size {}: expected 1 to {MAX_SIZE}", cfg.size).into());
    }
    Ok(())
}

pub fn run(cfg: &Config, out: &mut dyn Write) -> CliResult<()> {
    check(cfg)?;
    writeln!(out, "ferrograd {} demo", env!("CARGO_PKG_VERSION"))?;
    let (device, cuda_found) = find_device(cfg, out)?;
    writeln!(out)?;
    memory(device, out)?;
    small_matmul(device, out)?;
    writeln!(out)?;
    timed_matmul(cfg, device, cuda_found.as_deref(), out)?;
    writeln!(out, "\ndemo: all checks passed")?;
    Ok(())
}

/// Say what CUDA offers and pick the device. Returns the device and, when CUDA was not found,
/// the reason.
fn find_device(cfg: &Config, out: &mut dyn Write) -> CliResult<(Device, Option<String>)> {
    let not_found = match cuda::devices() {
        Ok(devs) if !devs.is_empty() => {
            writeln!(out, "cuda: found {} device(s)", devs.len())?;
            for d in &devs {
                let (ma, mi) = d.compute_capability;
                writeln!(
                    out,
                    "  cuda:{}  {}, {}, sm_{ma}{mi}, {} SMs",
                    d.ordinal,
                    d.name,
                    bytes(d.total_memory),
                    d.multiprocessors
                )?;
            }
            None
        }
        Ok(_) => Some("the CUDA driver loaded but sees no device".to_string()),
        Err(e) => Some(e.to_string()),
    };
    if let Some(why) = &not_found {
        writeln!(out, "cuda: not found ({why}); running the CPU parts only")?;
    }
    let (device, why) = match cfg.device {
        Some(d) => {
            if let Device::Cuda(n) = d {
                CudaDevice::get(n).map_err(|e| format!("demo --device {d}: {e}; use --device cpu"))?;
            }
            (d, "--device".to_string())
        }
        None => Device::best_with_reason()?,
    };
    match &not_found {
        // The reason was given on the line above.
        Some(nf) if why.contains(nf.as_str()) => writeln!(out, "device: {device}")?,
        _ => writeln!(out, "device: {device} ({why})")?,
    }
    Ok((device, not_found))
}

/// Zeros on the device and their sum read back; a random tensor there and back, bit for bit.
fn memory(device: Device, out: &mut dyn Write) -> CliResult<()> {
    const N: usize = 1000;
    let z = Tensor::zeros((N, N), DType::F32, device)?;
    let sum = z.sum_all()?.item_f64()?;
    if sum != 0.0 {
        return Err(format!("memory: the sum of {N}x{N} zeros on {device} came back as {sum}, not 0").into());
    }
    writeln!(out, "memory: zeros {N}x{N} f32 on {device} ({}); sum read back: {sum} (ok)", bytes(N * N * 4))?;
    drop(z);

    if let Device::Cuda(n) = device {
        let mut rng = Rng::new(7);
        let x = Tensor::rand_with(&mut rng, -1.0, 1.0, (N, N), DType::F32, Device::Cpu)?;
        let back = x.to_device(device)?.to_device(Device::Cpu)?;
        let (a, b) = (x.to_vec::<f32>()?, back.to_vec::<f32>()?);
        if a.iter().zip(&b).any(|(p, q)| p.to_bits() != q.to_bits()) {
            return Err(format!("memory: a random {N}x{N} tensor came back from {device} changed").into());
        }
        writeln!(out, "memory: random {N}x{N} f32 host -> {device} -> host: bit-exact (ok)")?;
        let st = CudaDevice::get(n)?.memory_stats();
        writeln!(
            out,
            "memory: ferrograd's allocator on {device}: {} allocated, {} reserved (peak {}), {} driver allocation(s) \
             so far; `ferrograd memory` shows more",
            bytes(st.allocated_bytes.current),
            bytes(st.reserved_bytes.current),
            bytes(st.reserved_bytes.peak),
            st.device_allocs
        )?;
    }
    Ok(())
}

/// [[1, 2], [3, 4]] x [[5, 6], [7, 8]] = [[19, 22], [43, 50]], exactly.
fn small_matmul(device: Device, out: &mut dyn Write) -> CliResult<()> {
    let a = Tensor::from_vec(vec![1f32, 2., 3., 4.], (2, 2), device)?;
    let b = Tensor::from_vec(vec![5f32, 6., 7., 8.], (2, 2), device)?;
    let got = a.matmul(&b)?.to_vec2::<f32>()?;
    let want = vec![vec![19f32, 22.], vec![43., 50.]];
    let show = |m: &[Vec<f32>]| {
        let rows: Vec<String> = m.iter().map(|r| format!("[{}, {}]", r[0], r[1])).collect();
        format!("[{}]", rows.join(", "))
    };
    if got != want {
        return Err(format!("matmul 2x2 on {device}: got {}, expected {}", show(&got), show(&want)).into());
    }
    writeln!(
        out,
        "matmul 2x2 on {device}: [[1, 2], [3, 4]] x [[5, 6], [7, 8]] = {}, expected {} (ok)",
        show(&got),
        show(&want)
    )?;
    Ok(())
}

/// One timed line: who, median time, GFLOPS, how it was timed.
fn line(out: &mut dyn Write, who: &str, median_s: f64, flops: f64, how: &str) -> CliResult<f64> {
    let gflops = flops / median_s / 1e9;
    writeln!(out, "  {who:<34} {:>10.3} ms {:>10.1} GFLOPS   {how}", median_s * 1e3, gflops)?;
    out.flush()?;
    Ok(gflops)
}

fn timed_matmul(cfg: &Config, device: Device, no_cuda: Option<&str>, out: &mut dyn Write) -> CliResult<()> {
    let n = cfg.size;
    let flops = 2.0 * (n as f64).powi(3);
    let mut rng = Rng::new(cfg.seed);
    let a = Tensor::randn_with(&mut rng, 0.0, 1.0, (n, n), DType::F32, Device::Cpu)?;
    let b = Tensor::randn_with(&mut rng, 0.0, 1.0, (n, n), DType::F32, Device::Cpu)?;
    let (av, bv) = (a.to_vec::<f32>()?, b.to_vec::<f32>()?);
    writeln!(
        out,
        "matmul {n}x{n} f32, C = A B, inputs N(0,1) (seed {}); each result checked against the naive loop, \
         then timed (median after warm-up)",
        cfg.seed
    )?;
    out.flush()?;

    // The reference every other result must match.
    let want = naive_matmul(&av, &bv, n);
    let check = |who: &str, got: &[f32]| -> CliResult<()> {
        let d = max_rel_diff(got, &want);
        if d.is_nan() || d > TOLERANCE {
            return Err(format!(
                "matmul {n}x{n} on {who} disagrees with the naive loop (max relative difference {d:e} > {TOLERANCE:e})"
            )
            .into());
        }
        Ok(())
    };

    let gpu = match device {
        Device::Cuda(_) => {
            // Exact f32, as the CPU computes it (TF32 would be faster and less exact).
            set_matmul_precision(MatmulPrecision::Highest);
            let (ag, bg) = (a.to_device(device)?, b.to_device(device)?);
            check(&device.to_string(), &ag.matmul(&bg)?.to_vec::<f32>()?)?;
            let t = measure_device(&Clock::new(device)?, DevicePlan::GPU, || ag.matmul(&bg))?;
            let name = CudaDevice::get(device_ordinal(device))?.info.name.clone();
            let how = format!(
                "CUDA events, median of {} batches of {} calls after {} warm-up calls",
                t.reps(),
                t.inner,
                DevicePlan::GPU.warmup
            );
            Some(line(out, &format!("{device} {name} (cuBLAS, exact f32)"), t.median_s(), flops, &how)?)
        }
        Device::Cpu => None,
    };

    check("the CPU backend", &a.matmul(&b)?.to_vec::<f32>()?)?;
    let t = measure_cpu_matmul(&a, &b)?;
    let how = format!("host clock, median of {} runs after {} warm-up runs", t.reps(), FERROGRAD_PLAN.warmup);
    let threads = rayon::current_num_threads();
    let cpu = line(out, &format!("CPU backend (gemm, {threads} threads)"), t.median().as_secs_f64(), flops, &how)?;

    let t = measure(NAIVE_PLAN, || naive_matmul(&av, &bv, n));
    let how = format!("host clock, median of {} runs after {} warm-up run", t.reps(), NAIVE_PLAN.warmup);
    let naive = line(out, "naive loop (i-k-j, 1 thread)", t.median().as_secs_f64(), flops, &how)?;

    writeln!(out)?;
    match gpu {
        Some(g) => {
            writeln!(out, "speedup: {device} is {:.1}x the CPU backend and {:.1}x the naive loop", g / cpu, g / naive)?
        }
        None => {
            writeln!(out, "speedup: the CPU backend is {:.1}x the naive loop", cpu / naive)?;
            match no_cuda {
                Some(why) => writeln!(out, "no GPU speedup to show: CUDA was not found ({why})")?,
                None => writeln!(out, "no GPU speedup to show: the demo ran on {device} (pass --device cuda)")?,
            }
        }
    }
    Ok(())
}

fn device_ordinal(d: Device) -> usize {
    match d {
        Device::Cuda(n) => n,
        Device::Cpu => 0,
    }
}
