//! `ferrograd bench attention`: `Tensor::scaled_dot_product_attention` forward and forward +
//! backward TFLOP/s and peak memory, B * H = 64 (B = 4, H = 16), T = 512 .. 8192, head dims 64
//! and 128, causal and not. The workload (inputs, FLOP count, checks) is the op's own
//! (`ferrograd_core::fused::attention::bench`); this file times it and reports. Twin:
//! `bench/torch_attention.py` (`F.scaled_dot_product_attention`, same shapes, same layouts).
//!
//! Before timing each configuration the forward is computed into poisoned memory and sampled rows
//! are checked against a float64 host computation; once per (head dim, causal) the forward and
//! all three gradients of a small problem (B = 1, H = 4, T = 256) are checked against the float64
//! CPU op. Timing: CUDA events, warm-up, batches, median per call (`timing::measure_device`).
//! Peak memory: the allocator's peak of allocated bytes over one forward + backward, inputs
//! included (PyTorch: `torch.cuda.max_memory_allocated`).
//!
//! `--dropout P` times every row with dropout (the same mask each call; the checks apply it;
//! row names gain ` p=P`). `--backend auto|flash|cudnn|math` picks the implementation (`fused::attention::select`); each
//! row reports which one ran (the op's counters over the timed calls), so a cuDNN plan that fell
//! back to our kernels shows as `flash`.

use super::check::{poisoned, require};
use super::{cuda_device, finish_json, plot_title, write_head, Environment, Report, Row, EVENT_TIMING};
use crate::plot::{line_chart, Series};
use crate::timing::{measure_device, Clock, DevicePlan};
use crate::CliResult;
use ferrograd_core::fused::attention::bench::{tolerance, Workload};
use ferrograd_core::fused::attention::select::{self, counters_on_this_thread, Backend, Counters};
use ferrograd_core::{DType, Device, Rng};
use std::io::Write;
use std::path::PathBuf;

#[derive(Debug, Clone)]
pub struct Config {
    pub device: Device,
    pub dtype: DType,
    pub batch: usize,
    pub heads: usize,
    pub seqs: Vec<usize>,
    pub head_dims: Vec<usize>,
    /// Causal settings to run, in order.
    pub causal: Vec<bool>,
    /// Dropout probability of every call (0: none).
    pub dropout: f64,
    /// The implementation asked for (each row reports which ran).
    pub backend: Backend,
    pub json: Option<PathBuf>,
    pub plot: Option<PathBuf>,
    pub seed: u64,
}

/// `fwd bf16 d=64 causal T=1024` (and ` p=0.1` with dropout): the row name both sides use.
pub fn row_name(mode: &str, dtype: DType, d: usize, causal: bool, t: usize, dropout: f64) -> String {
    let p = if dropout > 0.0 { format!(" p={dropout}") } else { String::new() };
    format!("{mode} {} d={d} {} T={t}{p}", dtype.as_str(), if causal { "causal" } else { "full" })
}

/// The flags, and the largest problem's byte count (q/k/v, output and their gradients: about
/// four copies of the packed `[B, T, 3, H, D]` buffer) checked for overflow (issue 11).
pub fn check(cfg: &Config) -> CliResult<()> {
    if !matches!(cfg.dtype, DType::BF16 | DType::F16 | DType::F32) {
        return Err(format!("--dtype {}: the attention bench runs bf16, f16 or f32", cfg.dtype).into());
    }
    if cfg.batch == 0 || cfg.heads == 0 || cfg.seqs.is_empty() || cfg.head_dims.is_empty() || cfg.causal.is_empty() {
        return Err("--batch, --heads, --seqs, --head-dims and --causal need at least one positive value".into());
    }
    if !(0.0..1.0).contains(&cfg.dropout) {
        return Err(format!("--dropout {}: expected a probability in [0, 1)", cfg.dropout).into());
    }
    if let Some(t) = cfg.seqs.iter().find(|&&t| t == 0 || t > 65536) {
        return Err(format!("sequence length {t} out of range (1..=65536)").into());
    }
    let (t, d) = (cfg.seqs.iter().max().copied().unwrap_or(1), cfg.head_dims.iter().max().copied().unwrap_or(1));
    let bytes = [cfg.heads, t, 3, d, cfg.dtype.size_in_bytes(), 4].iter().try_fold(cfg.batch, |a, &x| a.checked_mul(x));
    if bytes.is_none() {
        return Err(format!(
            "bench attention: B={} H={} T={t} D={d} is too large: its byte count overflows",
            cfg.batch, cfg.heads
        )
        .into());
    }
    Ok(())
}

/// Which implementation ran the calls counted between `before` and now: `cudnn`, `flash`, `math`,
/// or both names when the forward and the backward differed (or a plan fell back).
fn ran_since(before: Counters) -> String {
    let a = counters_on_this_thread();
    let mut names = vec![];
    if a.cudnn_fwd + a.cudnn_bwd > before.cudnn_fwd + before.cudnn_bwd {
        names.push("cudnn");
    }
    if a.flash_fwd + a.flash_bwd > before.flash_fwd + before.flash_bwd {
        names.push("flash");
    }
    if a.math > before.math {
        names.push("math");
    }
    if names.is_empty() {
        "?".into()
    } else {
        names.join("+")
    }
}

pub fn run(cfg: &Config, out: &mut dyn Write) -> CliResult<()> {
    check(cfg)?;
    select::set_backend(Some(cfg.backend));
    let r = run_with(cfg, out);
    select::set_backend(None);
    r
}

fn run_with(cfg: &Config, out: &mut dyn Write) -> CliResult<()> {
    let dev = cuda_device("attention", cfg.device)?;
    let env = Environment::for_device(cfg.device);
    let clock = Clock::new(cfg.device)?;
    let (b, h, dtype) = (cfg.batch, cfg.heads, cfg.dtype);
    writeln!(
        out,
        "scaled dot-product attention, {dtype}, B={b} H={h}{}, on {} ({})",
        if cfg.dropout > 0.0 { format!(", dropout p={}", cfg.dropout) } else { String::new() },
        cfg.device,
        env.gpu.as_deref().unwrap_or("?")
    )?;
    writeln!(
        out,
        "q, k, v: views of one [B, T, 3, H, D] buffer; FLOPs 4 B H T^2 D (halved when causal), fwd+bwd 3.5x; \
         CUDA events, median over batches"
    )?;
    let cudnn = match ferrograd_core::fused::attention::cudnn::library() {
        Ok(l) => format!("cuDNN {} ({})", l.version_string(), l.path),
        Err(e) => format!("no cuDNN: {e}"),
    };
    writeln!(out, "backend asked: {}; {cudnn}", cfg.backend.as_str())?;
    writeln!(out)?;
    let head = format!(
        "{:32} | {:>10} | {:>8} | {:>10} | {:>8} | {:>9} | {:>9} | {:>11}",
        "what", "fwd ms", "TFLOP/s", "f+b ms", "TFLOP/s", "peak MiB", "rel err", "ran"
    );
    write_head(out, &head)?;

    let mut rng = Rng::new(cfg.seed);
    let mut report = Report::new("attention", cfg.device, env, EVENT_TIMING);
    let mut series: Vec<Series> = Vec::new();
    for &d in &cfg.head_dims {
        for &causal in &cfg.causal {
            // The backward first, on a problem small enough for a float64 CPU reference.
            let small = Workload::new(&mut rng, 1, 4, 256, d, dtype, cfg.device, causal)?.with_dropout(cfg.dropout);
            let bwd_err = poisoned(|| Ok(small.check_backward()?))?;
            require(
                &format!("attention {dtype} d={d} causal={causal} dropout={} backward (T=256)", cfg.dropout),
                bwd_err,
                tolerance(dtype) * 2.0,
            )?;
            drop(small);
            let (mut fwd_pts, mut fb_pts) = (vec![], vec![]);
            for &t in &cfg.seqs {
                let w = Workload::new(&mut rng, b, h, t, d, dtype, cfg.device, causal)?.with_dropout(cfg.dropout);
                let o = poisoned(|| Ok(w.forward()?))?;
                let err = w.check_forward(&o, &mut rng, 6)?;
                drop(o);
                let what = row_name("fwd", dtype, d, causal, t, cfg.dropout);
                require(&what, err, tolerance(dtype))?;
                let c0 = counters_on_this_thread();
                let tf = measure_device(&clock, DevicePlan::GPU, || w.forward())?;
                let ran_f = ran_since(c0);
                let c0 = counters_on_this_thread();
                let tb = measure_device(&clock, DevicePlan::GPU, || w.forward_backward())?;
                let ran_b = ran_since(c0);
                clock.synchronize()?;
                dev.reset_peak_stats();
                drop(w.forward_backward()?);
                clock.synchronize()?;
                let peak = dev.memory_stats().allocated_bytes.peak as f64 / (1 << 20) as f64;
                let (ff, fb) = (w.flops(false) / tf.median_s() / 1e12, w.flops(true) / tb.median_s() / 1e12);
                writeln!(
                    out,
                    "{:32} | {:>10.4} | {:>8.1} | {:>10.4} | {:>8.1} | {:>9.1} | {:>9.2e} | {:>11}",
                    format!("{} d={d} {} T={t}", dtype.as_str(), if causal { "causal" } else { "full" }),
                    tf.median_s() * 1e3,
                    ff,
                    tb.median_s() * 1e3,
                    fb,
                    peak,
                    err,
                    if ran_f == ran_b { ran_f.clone() } else { format!("{ran_f}/{ran_b}") }
                )?;
                out.flush()?;
                report.rows.push(
                    Row::new(what, ff, "TFLOP/s", true)
                        .with("median_s", tf.median_s())
                        .with("reps", tf.reps())
                        .with("rel_err", err)
                        .with("backend", ran_f.as_str()),
                );
                report.rows.push(
                    Row::new(row_name("fwd+bwd", dtype, d, causal, t, cfg.dropout), fb, "TFLOP/s", true)
                        .with("median_s", tb.median_s())
                        .with("reps", tb.reps())
                        .with("backward_rel_err_t256", bwd_err)
                        .with("backend", ran_b.as_str()),
                );
                let name = row_name("peak fwd+bwd", dtype, d, causal, t, cfg.dropout);
                report.rows.push(Row::new(name, peak, "MiB", false));
                fwd_pts.push((t as f64, ff));
                fb_pts.push((t as f64, fb));
            }
            let tag = format!("d={d} {}", if causal { "causal" } else { "full" });
            series.push(Series { label: format!("fwd {tag}"), points: fwd_pts });
            series.push(Series { label: format!("fwd+bwd {tag}"), points: fb_pts });
        }
    }
    report.notes.push(format!(
        "B={b} H={h}; inputs N(0,1) from Philox (seed {}); q, k, v are views of one [B, T, 3, H, D] buffer; \
         dO N(0,1) [B, H, T, D]; fwd+bwd = recorded forward + the op's backward with dO",
        cfg.seed
    ));
    report.notes.push(format!(
        "backend asked: {} ({cudnn}); each row's `backend` says which ran: cudnn = cuDNN's fused SDPA \
         (backend graph API), flash = our kernels (tensor cores, mma.sync m16n8k16, for bf16/f16 with f32 \
         accumulation; SIMT for f32)",
        cfg.backend.as_str()
    ));
    if let Some(p) = &cfg.plot {
        line_chart(p, &plot_title(&report), "T (log scale)", "TFLOP/s (log scale)", &series)?;
        writeln!(out, "\nwrote {}", p.display())?;
    }
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
            heads: 16,
            seqs: vec![512, 1024, 2048, 4096, 8192],
            head_dims: vec![64, 128],
            causal: vec![false, true],
            dropout: 0.0,
            backend: Backend::Auto,
            json: None,
            plot: None,
            seed: 1,
        }
    }

    #[test]
    fn names_and_validation() {
        assert_eq!(row_name("fwd", DType::BF16, 64, true, 1024, 0.0), "fwd bf16 d=64 causal T=1024");
        assert_eq!(row_name("fwd+bwd", DType::F16, 128, false, 64, 0.1), "fwd+bwd f16 d=128 full T=64 p=0.1");
        assert!(check(&Config { dropout: 1.0, ..cfg() }).is_err());
        assert!(check(&Config { dropout: -0.1, ..cfg() }).is_err());
        assert!(check(&Config { dropout: f64::NAN, ..cfg() }).is_err());
        assert!(check(&cfg()).is_ok());
        assert!(check(&Config { dtype: DType::I32, ..cfg() }).is_err());
        assert!(check(&Config { seqs: vec![0], ..cfg() }).is_err());
        assert!(check(&Config { causal: vec![], ..cfg() }).is_err());
        let e = check(&Config { batch: usize::MAX, ..cfg() }).unwrap_err().to_string();
        assert!(e.contains("overflows"), "{e}");
        let e = run(&cfg(), &mut Vec::new()).unwrap_err().to_string();
        assert!(e.contains("measures a CUDA device"), "{e}");
    }
}
