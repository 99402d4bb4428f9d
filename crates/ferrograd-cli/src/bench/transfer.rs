//! `ferrograd bench transfer`: host <-> device copies. Twin: `bench/torch_transfer.py`.
//!
//! - **h2d pageable**: `Tensor::to_device` of a plain CPU tensor (a `Vec`); ferrograd stages it
//!   through pinned chunks, double-buffered. PyTorch: `x.to("cuda")`.
//! - **h2d pinned**: the same from `x.pin_memory()`: one asynchronous DMA. PyTorch:
//!   `x.pin_memory().to("cuda", non_blocking=True)`.
//! - **d2h pageable**: `Tensor::to_device(Device::Cpu)` of a CUDA tensor, into a new `Vec`.
//!   PyTorch: `x.to("cpu")`.
//! - **d2h pinned**: `copy_to_pinned_async` into a pinned tensor made once (`Tensor::empty_pinned`),
//!   then `HostCopy::wait`. PyTorch: `pinned.copy_(xd, non_blocking=True)`.
//! - **h2d compressed bf16/f16**: `to_device_compressed` of the pageable f32 tensor: narrowed on the
//!   host into pinned memory, half the bytes copied, widened to f32 on the GPU; GB/s are f32 bytes
//!   delivered per second (effective bandwidth). Checked bit-exact against the CPU cast.
//!   PyTorch (bf16 only): `x.to(torch.bfloat16).pin_memory().to(dev, non_blocking=True).float()`.
//!   Beside it, the host's narrowing throughput and the rule's verdict (`CompressionRule`).
//! - **h2d unified**: `to_unified`: the host writes the data straight into managed memory, the
//!   pages are prefetched to the GPU. No PyTorch partner (it has no managed tensors).
//! - **d2d** (where a second GPU is visible): `Tensor::to_device(Device::Cuda(j))` from GPU i,
//!   peer to peer when the driver allows the pair (`peer_access` in the JSON), else staged through
//!   the host. PyTorch: `x.to("cuda:1")`.
//! - **many small**: 100 tensors of 4 KiB each, moved with 100 `to_device` calls, against one
//!   `Tensor::to_device_many` (one packed copy). PyTorch: 100 `.to("cuda")` against
//!   `torch.cat` + one `.to("cuda")` + `split`.
//!
//! Every figure is host wall-clock time around the call and the `Device::synchronize()` after it
//! (the destination's allocation is inside, as it is for PyTorch; freeing it is not), median
//! over repetitions after warm-up. GB/s are decimal (1e9 bytes/s). Each path is checked once for
//! a bit-exact round trip before it is timed. Inputs are uniform random, never zeros.

use super::{check_bytes, cuda_device, finish_json, finish_plot, print_rows, Environment, Report, Row};
use crate::timing::{measure_self_timed, Plan};
use crate::CliResult;
use ferrograd_core::{DType, Device, Rng, Tensor};
use std::io::Write;
use std::path::PathBuf;
use std::time::{Duration, Instant};

const BIG_PLAN: Plan = Plan { warmup: 2, min_reps: 10, max_reps: 30, budget: Duration::from_millis(1500) };
const SMALL_PLAN: Plan = Plan { warmup: 5, min_reps: 20, max_reps: 500, budget: Duration::from_millis(400) };

#[derive(Debug, Clone)]
pub struct Config {
    pub device: Device,
    /// Size of the large transfer, MiB.
    pub mib: usize,
    /// The many-small case: `count` tensors of `kib` KiB each.
    pub count: usize,
    pub kib: usize,
    pub json: Option<PathBuf>,
    /// Also draw the rows as a bar chart (PNG) here.
    pub plot: Option<PathBuf>,
    pub seed: u64,
}

/// The flags, and the host buffers (the source, its pinned copy and the copy back) against the
/// host's memory.
pub fn check(cfg: &Config) -> CliResult<()> {
    if cfg.mib == 0 || cfg.count == 0 || cfg.kib == 0 {
        return Err("--mib, --count and --kib must be at least 1".into());
    }
    let big = cfg.mib.checked_mul(1 << 20).and_then(|b| b.checked_mul(3));
    check_bytes(Device::Cpu, || format!("bench transfer --mib {} (host buffers)", cfg.mib), big)?;
    let small = cfg.count.checked_mul(cfg.kib).and_then(|k| k.checked_mul(1024 * 3));
    check_bytes(Device::Cpu, || format!("bench transfer --count {} --kib {}", cfg.count, cfg.kib), small)
}

pub fn run(cfg: &Config, out: &mut dyn Write) -> CliResult<()> {
    check(cfg)?;
    let dev = cuda_device("transfer", cfg.device)?;
    let env = Environment::for_device(cfg.device);
    let device = cfg.device;
    let mut rng = Rng::new(cfg.seed);

    writeln!(out, "host <-> device copies on {device} ({})", env.gpu.as_deref().unwrap_or("?"))?;
    writeln!(out, "host clock around the copy and Device::synchronize(); median after warm-up; GB/s = 1e9 B/s")?;
    writeln!(out)?;
    out.flush()?;

    let n = cfg.mib * (1 << 20) / 4;
    let bytes = (n * 4) as f64;
    let x = Tensor::rand_with(&mut rng, -1.0, 1.0, n, DType::F32, Device::Cpu)?;
    let want = x.to_vec::<f32>()?;
    let sync = || dev.synchronize();

    // One copy of `src` to `to`, timed on the host up to the device being idle again; the result is
    // dropped outside the timed part.
    let timed_copy = |src: &Tensor, to: Device| {
        measure_self_timed(BIG_PLAN, || {
            let t0 = Instant::now();
            let d = src.to_device(to)?;
            sync()?;
            let el = t0.elapsed();
            drop(d);
            Ok(el)
        })
    };
    let timed_copy_with = |f: &dyn Fn() -> ferrograd_core::Result<Tensor>| {
        measure_self_timed(BIG_PLAN, || {
            let t0 = Instant::now();
            let d = f()?;
            sync()?;
            let el = t0.elapsed();
            drop(d);
            Ok(el)
        })
    };
    let mut rows = Vec::new();
    let gbps = |name: String, t: &crate::timing::Timing| {
        let m = t.median().as_secs_f64();
        Row::new(name, bytes / m / 1e9, "GB/s", true).with("median_s", m).with("reps", t.reps())
    };

    // h2d pageable.
    let d = x.to_device(device)?;
    same("h2d pageable", &d.to_vec::<f32>()?, &want)?;
    drop(d);
    let t = timed_copy(&x, device)?;
    rows.push(gbps(format!("h2d pageable {} MiB", cfg.mib), &t));

    // h2d pinned.
    let xp = x.pin_memory()?;
    let d = xp.to_device(device)?;
    same("h2d pinned", &d.to_vec::<f32>()?, &want)?;
    drop(d);
    let t = timed_copy(&xp, device)?;
    rows.push(gbps(format!("h2d pinned {} MiB", cfg.mib), &t));
    drop(xp);

    // d2h pageable.
    let xd = x.to_device(device)?;
    sync()?;
    same("d2h pageable", &xd.to_device(Device::Cpu)?.to_vec::<f32>()?, &want)?;
    let t = timed_copy(&xd, Device::Cpu)?;
    rows.push(gbps(format!("d2h pageable {} MiB", cfg.mib), &t));

    // d2h pinned: into one pinned destination, reused.
    let hp = Tensor::empty_pinned(n, DType::F32)?;
    same("d2h pinned", &xd.copy_to_pinned_async(&hp)?.wait()?.to_vec::<f32>()?, &want)?;
    let t = measure_self_timed(BIG_PLAN, || {
        let t0 = Instant::now();
        xd.copy_to_pinned_async(&hp)?.wait()?;
        sync()?;
        Ok(t0.elapsed())
    })?;
    rows.push(gbps(format!("d2h pinned {} MiB", cfg.mib), &t));
    drop(hp);

    // Compressed h2d: f32 delivered, half the bytes moved.
    let mut copy_gbps = 0.0;
    if let Some(r) = rows.iter().find(|r| r.name.starts_with("h2d pinned")) {
        copy_gbps = r.value;
    }
    for via in [DType::BF16, DType::F16] {
        let cpu = x.to_dtype(via)?.to_dtype(DType::F32)?.to_vec::<f32>()?;
        same(&format!("h2d compressed {via}"), &x.to_device_compressed(device, via)?.to_vec::<f32>()?, &cpu)?;
        let t = measure_self_timed(BIG_PLAN, || {
            let t0 = Instant::now();
            let d = x.to_device_compressed(device, via)?;
            sync()?;
            let el = t0.elapsed();
            drop(d);
            Ok(el)
        })?;
        let rule = ferrograd_core::CompressionRule::measure(copy_gbps, n, via)?;
        rows.push(
            gbps(format!("h2d compressed {via} {} MiB (effective)", cfg.mib), &t)
                .with("host_narrow_gbps", rule.narrow_gbps)
                .with("rule_speedup", rule.speedup(n as f64 * 4.0))
                .with("rule_pays", rule.pays(n as f64 * 4.0)),
        );
    }

    // Unified: the host writes managed memory, the pages move to the GPU on a prefetch.
    same("h2d unified", &x.to_unified(dev.ordinal)?.to_vec::<f32>()?, &want)?;
    let t = timed_copy_with(&|| x.to_unified(dev.ordinal))?;
    rows.push(gbps(format!("h2d unified {} MiB (to_unified)", cfg.mib), &t));

    // GPU to GPU, where a second GPU is visible: peer to peer when the pair allows it.
    let count = ferrograd_core::cuda::device_count().unwrap_or(0);
    if let (Device::Cuda(i), true) = (device, count > 1) {
        let other = Device::Cuda((i + 1) % count);
        let od = ferrograd_core::cuda::CudaDevice::get((i + 1) % count)?;
        same(&format!("d2d {device}->{other}"), &xd.to_device(other)?.to_vec::<f32>()?, &want)?;
        let peer = ferrograd_core::cuda::peer::peer_access(&dev, &od)?;
        let t = measure_self_timed(BIG_PLAN, || {
            let t0 = Instant::now();
            let d = xd.to_device(other)?;
            sync()?;
            od.synchronize()?;
            let el = t0.elapsed();
            drop(d);
            Ok(el)
        })?;
        rows.push(gbps(format!("d2d {device}->{other} {} MiB", cfg.mib), &t).with("peer_access", peer));
    }
    drop(xd);
    drop(want);
    drop(x);

    // Many small tensors: one call each against one coalesced copy.
    let elems = cfg.kib * 1024 / 4;
    let smalls = (0..cfg.count)
        .map(|_| Tensor::rand_with(&mut rng, -1.0, 1.0, elems, DType::F32, Device::Cpu))
        .collect::<ferrograd_core::Result<Vec<_>>>()?;
    let wants = smalls.iter().map(|t| t.to_vec::<f32>()).collect::<ferrograd_core::Result<Vec<_>>>()?;
    let sep = smalls.iter().map(|t| t.to_device(device)).collect::<ferrograd_core::Result<Vec<_>>>()?;
    let one = Tensor::to_device_many(&smalls, device)?;
    for ((s, o), w) in sep.iter().zip(&one).zip(&wants) {
        same("separate small copies", &s.to_vec::<f32>()?, w)?;
        same("coalesced copy", &o.to_vec::<f32>()?, w)?;
    }
    drop((sep, one));
    let label = format!("{} x {} KiB h2d", cfg.count, cfg.kib);
    let t = measure_self_timed(SMALL_PLAN, || {
        let t0 = Instant::now();
        let v = smalls.iter().map(|t| t.to_device(device)).collect::<ferrograd_core::Result<Vec<_>>>()?;
        sync()?;
        let el = t0.elapsed();
        drop(v);
        Ok(el)
    })?;
    let m = t.median().as_secs_f64();
    rows.push(
        Row::new(format!("{label}: separate copies"), m * 1e6, "µs", false).with("median_s", m).with("reps", t.reps()),
    );
    let t = measure_self_timed(SMALL_PLAN, || {
        let t0 = Instant::now();
        let v = Tensor::to_device_many(&smalls, device)?;
        sync()?;
        let el = t0.elapsed();
        drop(v);
        Ok(el)
    })?;
    let m = t.median().as_secs_f64();
    rows.push(
        Row::new(format!("{label}: one coalesced copy"), m * 1e6, "µs", false)
            .with("median_s", m)
            .with("reps", t.reps()),
    );

    print_rows(out, &rows, None)?;
    let mut report = Report::new(
        "transfer",
        device,
        env,
        "host clock around the copy plus Device::synchronize(); median of repetitions after warm-up",
    );
    report.rows = rows;
    report.notes.push(
        "h2d compressed: GB/s of f32 delivered; host_narrow_gbps is the host's f32 -> narrow throughput (all cores); \
         rule_speedup is CompressionRule's prediction over h2d pinned: the longer of narrowing then the last wave's copy, \
         and the first piece's narrowing then copying half the bytes"
            .into(),
    );
    report.notes.push(format!("seed {}; f32 uniform in [-1, 1); every path checked bit-exact once", cfg.seed));
    finish_plot(&cfg.plot, &report, None, out)?;
    finish_json(&cfg.json, &report, out)
}

fn same(what: &str, got: &[f32], want: &[f32]) -> CliResult<()> {
    let bad = got.len() != want.len() || got.iter().zip(want).any(|(a, b)| a.to_bits() != b.to_bits());
    if bad {
        return Err(
            format!("{what}: the data that arrived differs from what was sent; not timing a broken copy").into()
        );
    }
    Ok(())
}
