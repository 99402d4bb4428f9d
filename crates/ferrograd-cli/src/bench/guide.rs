//! `ferrograd bench guide`: the GPU memory guide's "Expected Improvements" table, measured on this
//! machine. Each row times the technique against its baseline through ferrograd's public API and
//! prints the document's claim beside our speedup, and PyTorch's where PyTorch has the technique
//! (`--torch FILE`: the JSON of the twin, `bench/torch_guide.py`, run first in the same call).
//!
//! Rows (speedup = baseline time / technique time, median host time up to `synchronize`):
//! - pinned memory: h2d from `pin_memory()` against a pageable tensor.
//! - memory pooling: caching-allocator alloc+free against raw `cuMemAlloc`+`cuMemFree`.
//! - transfer coalescing: 100 x 4 KiB in one `to_device_many` against 100 `to_device`.
//! - double buffering: our staged pageable copy (two pinned chunks) against one pinned chunk
//!   filled, copied and waited for in turn.
//! - compression: `to_device_compressed(BF16)` of pageable f32 against a pinned f32 copy
//!   (effective bandwidth: f32 delivered).
//! - persistent kernels: Monster Walk's training (113 copies, 71 epochs) in one persistent kernel
//!   against its fused step, two kernel launches a step (training time of each).
//! - NVLink: peer copy between two GPUs against staging through a pinned host buffer (the detail
//!   adds staging through a pageable `Vec`); needs two GPUs.
//! - managed memory: `to_unified` (host writes managed pages, prefetch) against a pinned copy.
//! - GDS: `checkpoint::load_safetensors` (cuFile, else pinned double-buffered) against
//!   `std::fs::read` + `to_device`, of a safetensors file just written (page cache warm, as a
//!   checkpoint loaded twice); the detail adds `safetensors.torch.load_file(.., device="cuda")`'s
//!   GB/s from the twin and our ratio to it (issue 17's target).
//! - d2h pinned: `copy_to_pinned_async` against `to_device(Cpu)`.

use super::{cuda_device, finish_json, finish_plot, Environment, Report, Row};
use crate::timing::{measure_self_timed, Plan};
use crate::CliResult;
use ferrograd_core::cuda::file_read::ReadPath;
use ferrograd_core::{DType, Device, Rng, Tensor};
use ferrograd_nn::checkpoint::{load_safetensors_with, ReadOptions};
use std::io::{Read, Seek, SeekFrom, Write};
use std::path::PathBuf;
use std::time::{Duration, Instant};

const PLAN: Plan = Plan { warmup: 2, min_reps: 5, max_reps: 15, budget: Duration::from_millis(800) };
const SMALL: Plan = Plan { warmup: 5, min_reps: 20, max_reps: 300, budget: Duration::from_millis(300) };

#[derive(Debug, Clone)]
pub struct Config {
    pub device: Device,
    /// Size of the large transfers, MiB.
    pub mib: usize,
    /// The twin's JSON, for the PyTorch column.
    pub torch: Option<PathBuf>,
    pub json: Option<PathBuf>,
    pub plot: Option<PathBuf>,
    pub seed: u64,
}

/// The document's rows: technique and its claimed speedup.
const CLAIMS: [(&str, &str); 10] = [
    ("pinned memory", "2x"),
    ("memory pooling", "1.5x"),
    ("transfer coalescing", "5-10x"),
    ("double buffering", "1.8x"),
    ("compression", "1.5-2x"),
    ("persistent kernels", "10-100x"),
    ("nvlink (multi-gpu)", "10x"),
    ("managed memory", "-"),
    ("gds reads", "-"),
    ("d2h pinned", "2x"),
];

pub fn check(cfg: &Config) -> CliResult<()> {
    if cfg.mib == 0 {
        return Err("--mib must be at least 1".into());
    }
    let big = cfg.mib.checked_mul(1 << 20).and_then(|b| b.checked_mul(4));
    super::check_bytes(Device::Cpu, || format!("bench guide --mib {} (host buffers)", cfg.mib), big)
}

fn time(
    plan: Plan,
    sync: &dyn Fn() -> ferrograd_core::Result<()>,
    f: &mut dyn FnMut() -> CliResult<()>,
) -> CliResult<f64> {
    let t = measure_self_timed(plan, || {
        let t0 = Instant::now();
        f()?;
        sync()?;
        Ok(t0.elapsed())
    })?;
    Ok(t.median().as_secs_f64())
}

/// PyTorch's speedup for `technique` from the twin's JSON rows (`value` of the row so named).
fn torch_speedup(torch: &Option<serde_json::Value>, technique: &str) -> Option<f64> {
    torch_field(torch, technique, "value")
}

/// A number of the twin's row `technique` (its speedup `value`, or an extra field).
fn torch_field(torch: &Option<serde_json::Value>, technique: &str, field: &str) -> Option<f64> {
    torch
        .as_ref()?
        .get("rows")?
        .as_array()?
        .iter()
        .find_map(|r| (r.get("name")?.as_str()? == technique).then(|| r.get(field)?.as_f64()).flatten())
}

pub fn run(cfg: &Config, out: &mut dyn Write) -> CliResult<()> {
    check(cfg)?;
    let dev = cuda_device("guide", cfg.device)?;
    let env = Environment::for_device(cfg.device);
    let device = cfg.device;
    let torch: Option<serde_json::Value> = match &cfg.torch {
        Some(p) => Some(
            serde_json::from_slice(&std::fs::read(p).map_err(|e| format!("{}: {e}", p.display()))?)
                .map_err(|e| format!("{}: {e}", p.display()))?,
        ),
        None => None,
    };
    let sync = || dev.synchronize();
    let mut rng = Rng::new(cfg.seed);
    let n = cfg.mib * (1 << 20) / 4;
    let x = Tensor::rand_with(&mut rng, -1.0, 1.0, n, DType::F32, Device::Cpu)?;
    let mut measured: Vec<(f64, f64, String)> = Vec::new(); // (baseline s, technique s, detail)

    // Pinned memory.
    let xp = x.pin_memory()?;
    let base = time(PLAN, &sync, &mut || {
        drop(x.to_device(device)?);
        Ok(())
    })?;
    let pinned = time(PLAN, &sync, &mut || {
        drop(xp.to_device(device)?);
        Ok(())
    })?;
    measured.push((
        base,
        pinned,
        format!("h2d {} MiB: pageable {:.1} GB/s, pinned {:.1} GB/s", cfg.mib, gb(n, base), gb(n, pinned)),
    ));

    // Pooling.
    let bytes = 1 << 20;
    let raw = time(SMALL, &sync, &mut || Ok(dev.raw_alloc_free(bytes)?))?;
    let cached = time(SMALL, &sync, &mut || Ok(dev.cached_alloc_free(bytes)?))?;
    measured.push((raw, cached, format!("1 MiB alloc+free: raw {:.1} µs, cached {:.2} µs", raw * 1e6, cached * 1e6)));

    // Coalescing.
    let smalls = (0..100)
        .map(|_| Tensor::rand_with(&mut rng, -1.0, 1.0, 1024, DType::F32, Device::Cpu))
        .collect::<ferrograd_core::Result<Vec<_>>>()?;
    let sep = time(SMALL, &sync, &mut || {
        drop(smalls.iter().map(|t| t.to_device(device)).collect::<ferrograd_core::Result<Vec<_>>>()?);
        Ok(())
    })?;
    let one = time(SMALL, &sync, &mut || {
        drop(Tensor::to_device_many(&smalls, device)?);
        Ok(())
    })?;
    measured.push((sep, one, format!("100 x 4 KiB: separate {:.0} µs, one copy {:.0} µs", sep * 1e6, one * 1e6)));

    // Double buffering: one pinned chunk, filled, copied and waited for in turn.
    let chunk = (8 << 20) / 4;
    let staging = Tensor::empty_pinned(chunk, DType::F32)?;
    let single = time(PLAN, &sync, &mut || {
        let mut parts = Vec::new();
        for s in (0..n).step_by(chunk) {
            let len = chunk.min(n - s);
            let piece = if len == chunk { staging.clone() } else { staging.narrow(0, 0, len)? };
            piece.set(&x.narrow(0, s, len)?)?;
            parts.push(piece.to_device(device)?);
            sync()?;
        }
        {
            drop(parts);
            Ok(())
        }
    })?;
    measured.push((
        single,
        base,
        format!(
            "h2d {} MiB pageable: single-buffered {:.1} GB/s, double-buffered {:.1} GB/s",
            cfg.mib,
            gb(n, single),
            gb(n, base)
        ),
    ));

    // Compression.
    let comp = time(PLAN, &sync, &mut || {
        drop(x.to_device_compressed(device, DType::BF16)?);
        Ok(())
    })?;
    let rule = ferrograd_core::CompressionRule::measure(gb(n, pinned), n, DType::BF16)?;
    measured.push((
        pinned,
        comp,
        format!(
            "f32 via bf16: {:.1} GB/s effective vs pinned {:.1}; host narrows {:.1} GB/s on {} cores, rule predicts {:.2}x",
            gb(n, comp),
            gb(n, pinned),
            rule.narrow_gbps,
            rule.cores,
            rule.speedup(n as f64 * 4.0)
        ),
    ));

    // Persistent kernels: Monster Walk as its spec trains it (113 copies, 71 epochs), the whole
    // training in one kernel against the fused step's two launches a step.
    let walk = |persistent: bool| -> CliResult<ferrograd_models::monster_walk::train::Report> {
        let mut c = ferrograd_models::monster_walk::train::TrainConfig::spec_defaults(device);
        c.persistent = persistent;
        Ok(ferrograd_models::monster_walk::train::run(&c, |_| {})?.0)
    };
    let per_step = walk(false)?;
    let one_kernel = walk(true)?;
    measured.push((
        per_step.training_time_s,
        one_kernel.training_time_s,
        match &one_kernel.step_fallback {
            None => format!(
                "Monster Walk 113 x 71: one persistent kernel {:.3} s, fused step ({} steps, 2 launches each) {:.3} s",
                one_kernel.training_time_s, per_step.steps, per_step.training_time_s
            ),
            Some(why) => {
                format!("the persistent kernel did not run on this GPU ({why}): both sides are the fused step")
            }
        },
    ));

    // NVLink / peer.
    let count = ferrograd_core::cuda::device_count().unwrap_or(0);
    let xd = x.to_device(device)?;
    if let (Device::Cuda(i), true) = (device, count > 1) {
        let other = Device::Cuda((i + 1) % count);
        let od = ferrograd_core::cuda::CudaDevice::get((i + 1) % count)?;
        let both = || -> ferrograd_core::Result<()> {
            dev.synchronize()?;
            od.synchronize()
        };
        // Host-staged two ways: through a new pageable Vec (to_device(Cpu)), and through one
        // reused pinned buffer (two DMAs at the link's speed), the baseline the speedup uses: the
        // pageable read alone runs at the host's memcpy speed (1.5 GB/s on the lent H200 host).
        let staged = time(PLAN, &both, &mut || {
            drop(xd.to_device(Device::Cpu)?.to_device(other)?);
            Ok(())
        })?;
        let pin = Tensor::empty_pinned(xd.shape().clone(), xd.dtype())?;
        let staged_pinned = time(PLAN, &both, &mut || {
            xd.copy_to_pinned_async(&pin)?.wait()?;
            drop(pin.to_device(other)?);
            Ok(())
        })?;
        let peer = time(PLAN, &both, &mut || {
            drop(xd.to_device(other)?);
            Ok(())
        })?;
        measured.push((
            staged_pinned,
            peer,
            format!(
                "{device}->{other}: staged through pinned memory {:.1} GB/s (through a pageable Vec {:.1}), direct {:.1} GB/s",
                gb(n, staged_pinned),
                gb(n, staged),
                gb(n, peer)
            ),
        ));
    } else {
        measured.push((f64::NAN, f64::NAN, "needs two GPUs".into()));
    }

    // Managed against an explicit pinned copy.
    let Device::Cuda(ord) = device else { return Err("bench guide measures a CUDA device".into()) };
    let uni = time(PLAN, &sync, &mut || {
        drop(x.to_unified(ord)?);
        Ok(())
    })?;
    measured.push((
        pinned,
        uni,
        format!("h2d {} MiB: pinned copy {:.1} GB/s, to_unified {:.1} GB/s", cfg.mib, gb(n, pinned), gb(n, uni)),
    ));

    // File reads: a safetensors checkpoint of one tensor, written by save_safetensors, read the
    // way a naive loader does (the whole file into pageable memory, then to the device) against
    // load_safetensors (cuFile, else pinned double-buffered reads straight into device memory).
    // The PyTorch comparison the issue sets is safetensors.torch.load_file(..., device="cuda")
    // of the same size, from the twin's row (`load_file_gbps`).
    let path = std::env::temp_dir().join(format!("ferrograd-guide-{}.safetensors", std::process::id()));
    ferrograd_nn::checkpoint::save_safetensors(&path, &[("x", &x)], Default::default())?;
    let staged = time(PLAN, &sync, &mut || {
        // The header's length, the header skipped, the tensor's bytes read into pageable memory.
        let mut f = std::fs::File::open(&path)?;
        let mut len = [0u8; 8];
        f.read_exact(&mut len)?;
        f.seek(SeekFrom::Current(i64::try_from(u64::from_le_bytes(len)).map_err(|e| e.to_string())?))?;
        let mut b = vec![0u8; n * 4];
        f.read_exact(&mut b)?;
        drop(Tensor::from_vec(b, n * 4, Device::Cpu)?.to_device(device)?);
        Ok(())
    })?;
    let mut how = ReadPath::Pinned;
    let opts = ReadOptions { log: false, ..Default::default() };
    let direct = time(PLAN, &sync, &mut || {
        let loaded = load_safetensors_with(&path, device, opts)?;
        how = loaded.read;
        Ok(())
    })?;
    let mut detail = format!(
        "{} MiB safetensors: read+to_device {:.1} GB/s, load_safetensors ({how}) {:.1} GB/s",
        cfg.mib,
        gb(n, staged),
        gb(n, direct)
    );
    if let Some(theirs) = torch_field(&torch, "gds reads", "load_file_gbps") {
        detail += &format!("; torch load_file {theirs:.1} GB/s (ours {:.2}x)", gb(n, direct) / theirs);
    }
    measured.push((staged, direct, detail));
    let _ = std::fs::remove_file(&path);
    if let (Err(why), Some(last)) = (ferrograd_core::cuda::file_read::cufile_status(), measured.last_mut()) {
        last.2 += &format!(" (cuFile not used: {why})");
    }

    // d2h pinned.
    let hp = Tensor::empty_pinned(n, DType::F32)?;
    let pageable = time(PLAN, &sync, &mut || {
        drop(xd.to_device(Device::Cpu)?);
        Ok(())
    })?;
    let d2h = time(PLAN, &sync, &mut || {
        drop(xd.copy_to_pinned_async(&hp)?.wait()?);
        Ok(())
    })?;
    measured.push((
        pageable,
        d2h,
        format!("d2h {} MiB: pageable {:.1} GB/s, pinned {:.1} GB/s", cfg.mib, gb(n, pageable), gb(n, d2h)),
    ));

    writeln!(
        out,
        "the memory guide's table on {device} ({}): speedup = baseline time / technique time",
        env.gpu.as_deref().unwrap_or("?")
    )?;
    writeln!(out, "{:<22} {:>8} {:>9} {:>9}  detail", "technique", "claim", "ours", "pytorch")?;
    let mut rows = Vec::new();
    for ((name, claim), (b, t, detail)) in CLAIMS.iter().zip(&measured) {
        let ours = b / t;
        let th = torch_speedup(&torch, name);
        let fmt = |v: Option<f64>| v.filter(|v| v.is_finite()).map_or("-".to_string(), |v| format!("{v:.2}x"));
        writeln!(out, "{name:<22} {claim:>8} {:>9} {:>9}  {detail}", fmt(Some(ours)), fmt(th))?;
        let mut r = Row::new(name.to_string(), if ours.is_finite() { ours } else { 0.0 }, "x", true)
            .with("claim", *claim)
            .with("detail", detail.clone());
        if let Some(v) = th {
            r = r.with("pytorch", v);
        }
        rows.push(r);
    }
    let mut report =
        Report::new("guide", device, env, "median host time up to synchronize; speedup = baseline / technique");
    report.rows = rows;
    report.notes.push(format!("seed {}; {} MiB of f32 uniform in [-1, 1)", cfg.seed, cfg.mib));
    finish_plot(&cfg.plot, &report, None, out)?;
    finish_json(&cfg.json, &report, out)
}

fn gb(n: usize, s: f64) -> f64 {
    n as f64 * 4.0 / s / 1e9
}
