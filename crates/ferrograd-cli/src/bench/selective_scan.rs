//! `ferrograd bench selective-scan`: the fused selective scan (`ferrograd_core::fused::selective_scan`)
//! forward and forward + backward time, effective GB/s and peak memory, Mamba's shapes (batch 4,
//! d_inner 1536, state 16, one group, D, z, delta_bias, softplus) at lengths 256 .. 4096. The
//! workload is the op's own (`ferrograd_core::fused::selective_scan::bench`); this file times it and
//! reports. Twin: `bench/torch_selective_scan.py` (mamba_ssm's `selective_scan_ref`, the sequential
//! recurrence in plain PyTorch, eager and with a compiled step; same shapes, same row names).
//!
//! Before timing, once per length the forward (computed into poisoned memory) and all eight
//! gradients of a small problem (batch 1, 8 channels, the same length) are checked against the
//! float64 CPU op. Timing: CUDA events, warm-up, batches, median per call
//! (`timing::measure_device`). Peak memory: the allocator's peak over one forward + backward,
//! inputs included.

use super::check::{poisoned, require};
use super::{cuda_device, finish_json, seq_op, write_head, Environment, Report, EVENT_TIMING};
use crate::timing::Clock;
use crate::CliResult;
use ferrograd_core::fused::selective_scan::bench::{tolerance, Workload};
use ferrograd_core::fused::selective_scan::MAX_CUDA_STATE;
use ferrograd_core::{DType, Device, Rng};
use std::io::Write;
use std::path::PathBuf;

#[derive(Debug, Clone)]
pub struct Config {
    pub device: Device,
    pub dtype: DType,
    pub batch: usize,
    pub dim: usize,
    pub state: usize,
    pub seqs: Vec<usize>,
    pub json: Option<PathBuf>,
    pub seed: u64,
}

/// `fwd bf16 B=4 D=1536 N=16 L=1024`: the row name both sides use.
pub fn row_name(mode: &str, dtype: DType, (b, d, n, l): (usize, usize, usize, usize)) -> String {
    format!("{mode} {} B={b} D={d} N={n} L={l}", dtype.as_str())
}

/// The flags, and the largest problem's byte count checked for overflow (issue 11): the
/// `[batch, dim, len]` tensors (u, delta, z, out, dout and the gradients: a dozen copies counted
/// as sixteen) and the `[batch, state, len]` ones (B, C and theirs, counted as eight).
pub fn check(cfg: &Config) -> CliResult<()> {
    if !matches!(cfg.dtype, DType::BF16 | DType::F32) {
        return Err(format!("--dtype {}: the selective-scan bench runs bf16 or f32", cfg.dtype).into());
    }
    if cfg.batch == 0 || cfg.dim == 0 || cfg.seqs.is_empty() {
        return Err("--batch, --dim and --seqs need positive values".into());
    }
    if cfg.state == 0 || cfg.state > MAX_CUDA_STATE {
        return Err(format!("--state {} out of range (1..={MAX_CUDA_STATE})", cfg.state).into());
    }
    if let Some(l) = cfg.seqs.iter().find(|&&l| l == 0 || l > 1 << 20) {
        return Err(format!("sequence length {l} out of range (1..=1048576)").into());
    }
    let l = cfg.seqs.iter().max().copied().unwrap_or(1);
    let e = cfg.dtype.size_in_bytes();
    let x = [cfg.dim, l, e, 16].iter().try_fold(cfg.batch, |a, &v| a.checked_mul(v));
    let bc = [cfg.state, l, e, 8].iter().try_fold(cfg.batch, |a, &v| a.checked_mul(v));
    if x.zip(bc).and_then(|(x, bc)| x.checked_add(bc)).is_none() {
        return Err(format!(
            "bench selective-scan: B={} D={} N={} L={l} is too large: its byte count overflows",
            cfg.batch, cfg.dim, cfg.state
        )
        .into());
    }
    Ok(())
}

pub fn run(cfg: &Config, out: &mut dyn Write) -> CliResult<()> {
    check(cfg)?;
    let dev = cuda_device("selective-scan", cfg.device)?;
    let env = Environment::for_device(cfg.device);
    let clock = Clock::new(cfg.device)?;
    let (b, d, n, dtype) = (cfg.batch, cfg.dim, cfg.state, cfg.dtype);
    writeln!(
        out,
        "selective scan (mamba selective_scan_fn), {dtype}, B={b} D={d} N={n}, on {} ({})",
        cfg.device,
        env.gpu.as_deref().unwrap_or("?")
    )?;
    writeln!(
        out,
        "D, z, delta_bias, softplus; one group of B/C; GB/s = minimal bytes moved / time; CUDA events, median"
    )?;
    writeln!(out)?;
    write_head(out, &seq_op::head())?;
    let mut rng = Rng::new(cfg.seed);
    let mut report = Report::new("selective_scan", cfg.device, env, EVENT_TIMING);
    for &l in &cfg.seqs {
        let small = Workload::new(&mut rng, (1, 8, l, n), dtype, cfg.device)?;
        let o = poisoned(|| Ok(small.forward()?))?;
        let fwd_err = small.check_forward(&o)?;
        require(&format!("selective scan {dtype} L={l} forward (8 channels)"), fwd_err, tolerance(dtype))?;
        let bwd_err = poisoned(|| Ok(small.check_backward()?))?;
        require(&format!("selective scan {dtype} L={l} backward (8 channels)"), bwd_err, tolerance(dtype) * 2.0)?;
        drop((small, o));
        let w = Workload::new(&mut rng, (b, d, l, n), dtype, cfg.device)?;
        let m = seq_op::measure(&clock, &dev, || w.forward(), || w.forward_backward())?;
        let shape = (b, d, n, l);
        let name = |mode: &str| row_name(mode, dtype, shape);
        seq_op::record(out, &mut report, name, &m, (w.bytes(false), w.bytes(true)), (fwd_err, bwd_err))?;
    }
    report.notes.push(format!(
        "B={b} D={d} N={n}, one group; u, delta/2, z, B, C, dout N(0,1) from Philox (seed {}); A[d,n] = -(n+1); D = 1; \
         delta_bias = -3; softplus; fwd+bwd = recorded forward + the op's backward with dout",
        cfg.seed
    ));
    report
        .notes
        .push("one block per (batch, channel), chunks of up to 2048 steps, warp-shuffle scan; f32 state".into());
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
            state: 16,
            seqs: vec![256, 1024, 4096],
            json: None,
            seed: 1,
        }
    }

    #[test]
    fn names_and_validation() {
        assert_eq!(row_name("fwd", DType::BF16, (4, 1536, 16, 1024)), "fwd bf16 B=4 D=1536 N=16 L=1024");
        assert!(check(&cfg()).is_ok());
        assert!(check(&Config { dtype: DType::F16, ..cfg() }).is_err());
        assert!(check(&Config { seqs: vec![0], ..cfg() }).is_err());
        assert!(check(&Config { state: 0, ..cfg() }).is_err());
        assert!(check(&Config { state: 257, ..cfg() }).is_err());
        let e = check(&Config { batch: usize::MAX, ..cfg() }).unwrap_err().to_string();
        assert!(e.contains("overflows"), "{e}");
        let e = run(&cfg(), &mut Vec::new()).unwrap_err().to_string();
        assert!(e.contains("measures a CUDA device"), "{e}");
    }
}
