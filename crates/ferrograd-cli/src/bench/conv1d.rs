//! `ferrograd bench conv1d`: the causal depthwise conv1d (`ferrograd_core::fused::conv1d_causal`,
//! Mamba's `causal_conv1d_fn`) forward and forward + backward time, effective GB/s and peak memory,
//! at Mamba's shapes (batch 4, 1536 channels, width 4) and lengths 256 .. 4096. The workload is the
//! op's own (`ferrograd_core::fused::conv1d_causal::bench`); this file times it and reports. Twin:
//! `bench/torch_conv1d.py` (`F.conv1d(x, w[:, None], b, padding=k-1, groups=C)[..., :L]`, as
//! mamba_ssm's reference path computes it; same shapes, same row names).
//!
//! Before timing, once per length the forward (computed into poisoned memory) and the three
//! gradients of a small problem (batch 1, 8 channels, the same length) are checked against the
//! float64 CPU op. Timing: CUDA events, warm-up, batches, median per call
//! (`timing::measure_device`). Peak memory: the allocator's peak over one forward + backward,
//! inputs included.

use super::check::{poisoned, require};
use super::{cuda_device, finish_json, seq_op, write_head, Environment, Report, EVENT_TIMING};
use crate::timing::Clock;
use crate::CliResult;
use ferrograd_core::fused::conv1d_causal::bench::{tolerance, Workload};
use ferrograd_core::fused::conv1d_causal::MAX_CUDA_K;
use ferrograd_core::{DType, Device, Rng};
use std::io::Write;
use std::path::PathBuf;

#[derive(Debug, Clone)]
pub struct Config {
    pub device: Device,
    pub dtype: DType,
    pub batch: usize,
    pub dim: usize,
    pub k: usize,
    pub seqs: Vec<usize>,
    pub json: Option<PathBuf>,
    pub seed: u64,
}

/// `fwd bf16 B=4 D=1536 K=4 L=1024`: the row name both sides use.
pub fn row_name(mode: &str, dtype: DType, (b, d, k, l): (usize, usize, usize, usize)) -> String {
    format!("{mode} {} B={b} D={d} K={k} L={l}", dtype.as_str())
}

/// The flags, and the largest problem's byte count checked for overflow (issue 11): x, y, dy, dx
/// and the copies a step makes, counted as eight `[batch, dim, len]` tensors.
pub fn check(cfg: &Config) -> CliResult<()> {
    if !matches!(cfg.dtype, DType::BF16 | DType::F32) {
        return Err(format!("--dtype {}: the conv1d bench runs bf16 or f32", cfg.dtype).into());
    }
    if cfg.batch == 0 || cfg.dim == 0 || cfg.seqs.is_empty() {
        return Err("--batch, --dim and --seqs need positive values".into());
    }
    if cfg.k == 0 || cfg.k > MAX_CUDA_K {
        return Err(format!("--k {} out of range (1..={MAX_CUDA_K})", cfg.k).into());
    }
    if let Some(l) = cfg.seqs.iter().find(|&&l| l == 0 || l > 1 << 24) {
        return Err(format!("sequence length {l} out of range (1..=16777216)").into());
    }
    let l = cfg.seqs.iter().max().copied().unwrap_or(1);
    if [cfg.dim, l, cfg.dtype.size_in_bytes(), 8].iter().try_fold(cfg.batch, |a, &v| a.checked_mul(v)).is_none() {
        return Err(format!(
            "bench conv1d: B={} D={} L={l} is too large: its byte count overflows",
            cfg.batch, cfg.dim
        )
        .into());
    }
    Ok(())
}

pub fn run(cfg: &Config, out: &mut dyn Write) -> CliResult<()> {
    check(cfg)?;
    let dev = cuda_device("conv1d", cfg.device)?;
    let env = Environment::for_device(cfg.device);
    let clock = Clock::new(cfg.device)?;
    let (b, d, k, dtype) = (cfg.batch, cfg.dim, cfg.k, cfg.dtype);
    writeln!(
        out,
        "causal depthwise conv1d (mamba causal_conv1d_fn), {dtype}, B={b} D={d} K={k}, with bias, on {} ({})",
        cfg.device,
        env.gpu.as_deref().unwrap_or("?")
    )?;
    writeln!(out, "GB/s = minimal bytes moved / time; CUDA events, median")?;
    writeln!(out)?;
    write_head(out, &seq_op::head())?;
    let mut rng = Rng::new(cfg.seed);
    let mut report = Report::new("conv1d", cfg.device, env, EVENT_TIMING);
    for &l in &cfg.seqs {
        let small = Workload::new(&mut rng, (1, 8, l, k), dtype, cfg.device)?;
        let y = poisoned(|| Ok(small.forward()?))?;
        let fwd_err = small.check_forward(&y)?;
        require(&format!("conv1d {dtype} L={l} forward (8 channels)"), fwd_err, tolerance(dtype))?;
        let bwd_err = poisoned(|| Ok(small.check_backward()?))?;
        require(&format!("conv1d {dtype} L={l} backward (8 channels)"), bwd_err, tolerance(dtype) * 2.0)?;
        drop((small, y));
        let w = Workload::new(&mut rng, (b, d, l, k), dtype, cfg.device)?;
        let m = seq_op::measure(&clock, &dev, || w.forward(), || w.forward_backward())?;
        let shape = (b, d, k, l);
        let name = |mode: &str| row_name(mode, dtype, shape);
        seq_op::record(out, &mut report, name, &m, (w.bytes(false), w.bytes(true)), (fwd_err, bwd_err))?;
    }
    report.notes.push(format!(
        "B={b} D={d} K={k} with bias; x, dy N(0,1), w, b U(-1/sqrt(K), 1/sqrt(K)) from Philox (seed {}); \
         fwd+bwd = recorded forward + the op's backward with dy (dx, dw, db)",
        cfg.seed
    ));
    report
        .notes
        .push("forward one elementwise kernel; backward a dx kernel and one block per channel for dw, db".into());
    finish_json(&cfg.json, &report, out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg() -> Config {
        Config {
            device: Device::Cpu,
            dtype: DType::BF16,
            batch: 4,
            dim: 1536,
            k: 4,
            seqs: vec![256, 1024, 4096],
            json: None,
            seed: 1,
        }
    }

    #[test]
    fn names_and_validation() {
        assert_eq!(row_name("fwd", DType::BF16, (4, 1536, 4, 1024)), "fwd bf16 B=4 D=1536 K=4 L=1024");
        assert!(check(&cfg()).is_ok());
        assert!(check(&Config { dtype: DType::F16, ..cfg() }).is_err());
        assert!(check(&Config { seqs: vec![0], ..cfg() }).is_err());
        assert!(check(&Config { k: 0, ..cfg() }).is_err());
        assert!(check(&Config { k: MAX_CUDA_K + 1, ..cfg() }).is_err());
        let e = check(&Config { batch: usize::MAX, ..cfg() }).unwrap_err().to_string();
        assert!(e.contains("overflows"), "{e}");
        let e = run(&cfg(), &mut Vec::new()).unwrap_err().to_string();
        assert!(e.contains("measures a CUDA device"), "{e}");
    }
}
