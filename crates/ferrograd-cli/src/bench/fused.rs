//! `ferrograd bench fused`: fused transformer ops against their unfused PyTorch counterparts, GB/s
//! and time, forward and forward + backward, at GPT-2 shapes (16384 x 768, bf16, by default):
//! - residual add + layer norm (`Tensor::add_layer_norm`, the pre-LN block's `h = x + r;
//!   y = layer_norm(h)`): forward reads x and r and writes h and y (4 x N elements); forward +
//!   backward adds dy and dh (the gradients arriving at y and h) and h read, dx written (dr is dx:
//!   8 x N in all);
//! - bias + GELU (`Tensor::bias_gelu`, `gelu_tanh(x + b)`): forward reads x and writes y (2 x N);
//!   forward + backward adds dy and x read, dx written (5 x N).
//! - the fused classifier (`Tensor::classifier_loss_grad`: the mean cross entropy and the logits'
//!   gradient from one kernel) at 8192 x 50257: the logits read once, their gradient written once
//!   (2 x N).
//!
//! Twin: `bench/torch_fused.py` (`x + r` then `F.layer_norm`; `F.gelu(x + b, approximate="tanh")`;
//! `F.log_softmax` + `F.nll_loss` forward and backward; eager and `torch.compile`). Bytes counted are the fewest the op must move; weight and bias rows
//! are not counted. Each workload (inputs, the float64 reference of a row, the backward call) lives
//! beside its op in `ferrograd-core/src/fused/<op>/bench.rs`. Before timing, the forward into
//! poisoned memory is checked on sampled rows against float64, and the forward + backward of a
//! 64-row problem against the float64 CPU op. Timing: CUDA events, warm-up, batches, median per call.

use super::check::{self, poisoned, rel_err, require};
use super::{cuda_device, finish_json, finish_plot, print_rows, Environment, Report, Row, EVENT_TIMING};
use crate::timing::DeviceTiming;
use crate::timing::{measure_device, Clock, DevicePlan};
use crate::CliResult;
use ferrograd_core::fused::add_layer_norm::bench::AddLayerNormBench;
use ferrograd_core::fused::bench::Workload;
use ferrograd_core::fused::bias_gelu::bench::BiasGeluBench;
use ferrograd_core::fused::classifier::bench::ClassifierBench;
use ferrograd_core::{DType, Device, Rng, Tensor};
use std::io::Write;
use std::path::PathBuf;

const EPS: f64 = 1e-5;

#[derive(Debug, Clone)]
pub struct Config {
    pub device: Device,
    pub dtype: DType,
    pub shapes: Vec<(usize, usize)>,
    /// Fused classifier problems (rows x classes).
    pub classifier: Vec<(usize, usize)>,
    pub json: Option<PathBuf>,
    pub plot: Option<PathBuf>,
    pub seed: u64,
}

/// `add_layer_norm fwd bf16 16384x768`: the row name both sides use.
pub fn row_name(op: &str, mode: &str, dtype: DType, r: usize, c: usize) -> String {
    format!("{op} {mode} {} {r}x{c}", dtype.as_str())
}

/// Norm-wise relative error allowed against float64 (one rounding of h and of y in the dtype; of
/// x + b and of y for bias + GELU).
fn tolerance(dtype: DType) -> f64 {
    match dtype {
        DType::F32 => 1e-5,
        DType::F16 => 2e-3,
        _ => 1.5e-2,
    }
}

/// The flags, and each shape's tensors (x, r, h, y, dy, dh, dx and one spare) checked for overflow.
pub fn check(cfg: &Config) -> CliResult<()> {
    if !matches!(cfg.dtype, DType::BF16 | DType::F16 | DType::F32) {
        return Err(format!("--dtype {}: the fused bench runs bf16, f16 or f32", cfg.dtype).into());
    }
    if cfg.shapes.is_empty() {
        return Err("--shapes needs at least one ROWSxCOLS".into());
    }
    for &(r, c) in cfg.shapes.iter().chain(&cfg.classifier) {
        if [r, c, 8, cfg.dtype.size_in_bytes()].iter().try_fold(1usize, |a, &x| a.checked_mul(x)).is_none() {
            return Err(format!("bench fused --shapes {r}x{c}: its byte count overflows").into());
        }
    }
    Ok(())
}

/// The workload of one shape in `dtype` on `device`: x, r ~ N(0, 1), weight ~ U[0.5, 1.5), bias
/// ~ N(0, 1); and the gradients dh, dy ~ N(0, 1).
fn add_ln_workload(
    rng: &mut Rng,
    r: usize,
    c: usize,
    dtype: DType,
    device: Device,
) -> CliResult<(AddLayerNormBench, Tensor, Tensor)> {
    let n = |rng: &mut Rng, dims: Vec<usize>| Tensor::randn_with(rng, 0.0, 1.0, dims, dtype, device);
    let (x, res) = (n(rng, vec![r, c])?, n(rng, vec![r, c])?);
    let w = Tensor::rand_with(rng, 0.5, 1.5, c, dtype, device)?;
    let b = n(rng, vec![c])?;
    let (dh, dy) = (n(rng, vec![r, c])?, n(rng, vec![r, c])?);
    Ok((AddLayerNormBench::new(x, res, w, b, EPS), dh, dy))
}

/// The forward + backward of a 64-row problem against the same op in float64 on the CPU: the
/// largest norm-wise relative error over dx, dweight and dbias.
fn add_ln_check_backward(rng: &mut Rng, c: usize, dtype: DType, device: Device) -> CliResult<f64> {
    let (w, dh, dy) = add_ln_workload(rng, 64, c, dtype, device)?;
    let (_, got) = poisoned(|| Ok(w.forward_backward(&dh, &dy)?))?;
    let f64_cpu = |t: &Tensor| t.to_dtype(DType::F64).and_then(|t| t.to_device(Device::Cpu));
    let (x, r, wt, b) = w.inputs();
    let cpu = AddLayerNormBench::new(f64_cpu(x)?, f64_cpu(r)?, f64_cpu(wt)?, f64_cpu(b)?, EPS);
    let (_, want) = cpu.forward_backward(&f64_cpu(&dh)?, &f64_cpu(&dy)?)?;
    worst_rel_err(&got, &want)
}

/// The workload of one shape: x ~ N(0, 2^2), b ~ N(0, 1) (x + b spans GELU's bend and both
/// tails); and the gradient dy ~ N(0, 1).
fn bias_gelu_workload(
    rng: &mut Rng,
    r: usize,
    c: usize,
    dtype: DType,
    device: Device,
) -> CliResult<(BiasGeluBench, Tensor)> {
    let x = Tensor::randn_with(rng, 0.0, 2.0, vec![r, c], dtype, device)?;
    let b = Tensor::randn_with(rng, 0.0, 1.0, c, dtype, device)?;
    let dy = Tensor::randn_with(rng, 0.0, 1.0, vec![r, c], dtype, device)?;
    Ok((BiasGeluBench::new(x, b), dy))
}

/// As [`add_ln_check_backward`], for bias + GELU (dx and db).
fn bias_gelu_check_backward(rng: &mut Rng, c: usize, dtype: DType, device: Device) -> CliResult<f64> {
    let (w, dy) = bias_gelu_workload(rng, 64, c, dtype, device)?;
    let (_, got) = poisoned(|| Ok(w.forward_backward(&dy)?))?;
    let f64_cpu = |t: &Tensor| t.to_dtype(DType::F64).and_then(|t| t.to_device(Device::Cpu));
    let (x, b) = w.inputs();
    let (_, want) = BiasGeluBench::new(f64_cpu(x)?, f64_cpu(b)?).forward_backward(&f64_cpu(&dy)?)?;
    worst_rel_err(&got, &want)
}

/// The largest norm-wise relative error over pairs of tensors.
fn worst_rel_err(got: &[Tensor], want: &[Tensor]) -> CliResult<f64> {
    let mut worst = 0.0f64;
    for (g, e) in got.iter().zip(want) {
        worst = worst.max(rel_err(&g.to_f64_vec()?, &e.to_f64_vec()?));
    }
    Ok(worst)
}

/// The forward of a workload into poisoned memory against its float64 reference on sampled rows.
fn check_forward(w: &dyn Workload, rows: usize, rng: &mut Rng) -> CliResult<f64> {
    let sample = check::sample_rows(rows, 4, 4, rng);
    let y = poisoned(|| Ok(w.run()?))?;
    let (mut got, mut want) = (vec![], vec![]);
    for (row, &i) in check::rows_f64(&y, &sample)?.into_iter().zip(&sample) {
        got.extend(row);
        want.extend(w.reference(i)?);
    }
    Ok(rel_err(&got, &want))
}

/// One op at one shape: its checks, then the forward and forward + backward timed. `passes`: the
/// elements each moves, in units of N = rows x cols.
struct OpRows<'a> {
    op: &'a str,
    fwd_err: f64,
    bwd_err: f64,
    fwd: (DeviceTiming, f64),
    fwd_bwd: (DeviceTiming, f64),
}

impl OpRows<'_> {
    fn push(self, rows: &mut Vec<Row>, dtype: DType, r: usize, c: usize) {
        let es = (r * c * dtype.size_in_bytes()) as f64;
        for (mode, (t, passes), err, what) in [
            ("fwd", self.fwd, self.fwd_err, "rel_err"),
            ("fwd+bwd", self.fwd_bwd, self.bwd_err, "backward_rel_err_64_rows"),
        ] {
            let m = t.median_s();
            rows.push(
                Row::new(row_name(self.op, mode, dtype, r, c), passes * es / m / 1e9, "GB/s", true)
                    .with("median_s", m)
                    .with("reps", t.reps())
                    .with(what, err),
            );
        }
    }
}

pub fn run(cfg: &Config, out: &mut dyn Write) -> CliResult<()> {
    check(cfg)?;
    let _dev = cuda_device("fused", cfg.device)?;
    let env = Environment::for_device(cfg.device);
    let clock = Clock::new(cfg.device)?;
    let dtype = cfg.dtype;
    writeln!(
        out,
        "fused residual add + layer norm and bias + GELU, {dtype}, on {} ({})",
        cfg.device,
        env.gpu.as_deref().unwrap_or("?")
    )?;
    writeln!(
        out,
        "GB/s = bytes the op must move (add_layer_norm fwd 4 x N elements, fwd+bwd 8 x N; bias_gelu 2 x N, 5 x N) \
         / median; CUDA events"
    )?;
    writeln!(out)?;
    out.flush()?;

    let mut rng = Rng::new(cfg.seed);
    let mut rows = Vec::new();
    for &(r, c) in &cfg.shapes {
        let bwd_err = add_ln_check_backward(&mut rng, c, dtype, cfg.device)?;
        require(&format!("add_layer_norm {dtype} 64x{c} backward"), bwd_err, 2.0 * tolerance(dtype))?;
        let (w, dh, dy) = add_ln_workload(&mut rng, r, c, dtype, cfg.device)?;
        let fwd_err = check_forward(&w, r, &mut rng)?;
        require(&row_name("add_layer_norm", "fwd", dtype, r, c), fwd_err, tolerance(dtype))?;
        let fwd = (measure_device(&clock, DevicePlan::GPU, || w.run())?, 4.0);
        let fwd_bwd = (measure_device(&clock, DevicePlan::GPU, || w.forward_backward(&dh, &dy))?, 8.0);
        OpRows { op: "add_layer_norm", fwd_err, bwd_err, fwd, fwd_bwd }.push(&mut rows, dtype, r, c);
        drop((w, dh, dy));

        let bwd_err = bias_gelu_check_backward(&mut rng, c, dtype, cfg.device)?;
        require(&format!("bias_gelu {dtype} 64x{c} backward"), bwd_err, 2.0 * tolerance(dtype))?;
        let (w, dy) = bias_gelu_workload(&mut rng, r, c, dtype, cfg.device)?;
        let fwd_err = check_forward(&w, r, &mut rng)?;
        require(&row_name("bias_gelu", "fwd", dtype, r, c), fwd_err, tolerance(dtype))?;
        let fwd = (measure_device(&clock, DevicePlan::GPU, || w.run())?, 2.0);
        let fwd_bwd = (measure_device(&clock, DevicePlan::GPU, || w.forward_backward(&dy))?, 5.0);
        OpRows { op: "bias_gelu", fwd_err, bwd_err, fwd, fwd_bwd }.push(&mut rows, dtype, r, c);
    }
    for &(r, c) in &cfg.classifier {
        rows.push(classifier_row(&mut rng, r, c, dtype, cfg.device, &clock)?);
    }
    print_rows(out, &rows, None)?;
    let mut report = Report::new("fused", cfg.device, env, EVENT_TIMING);
    report.rows = rows;
    report.notes.push(format!(
        "seed {}; x, r, dh, dy ~ N(0,1); weight ~ U[0.5,1.5), bias ~ N(0,1), eps 1e-5; fwd+bwd = forward with \
         tracked inputs, layer norm's backward kernel on y, dx = dr = dh_ln + dh",
        cfg.seed
    ));
    report.notes.push(
        "bias_gelu: x ~ N(0, 2^2), b, dy ~ N(0,1); fwd+bwd = forward with tracked inputs and its backward (dx, db)"
            .into(),
    );
    finish_plot(&cfg.plot, &report, None, out)?;
    finish_json(&cfg.json, &report, out)
}

/// `classifier fwd+bwd bf16 8192x50257`.
pub fn classifier_row_name(dtype: DType, r: usize, c: usize) -> String {
    format!("classifier fwd+bwd {} {r}x{c}", dtype.as_str())
}

/// The fused classifier on logits ~ N(0, 2^2): its gradient checked on sampled rows against float64
/// (into poisoned memory), then timed.
fn classifier_row(rng: &mut Rng, r: usize, c: usize, dtype: DType, device: Device, clock: &Clock) -> CliResult<Row> {
    let x = Tensor::randn_with(rng, 0.0, 2.0, (r, c), dtype, device)?;
    let w = ClassifierBench::new(x, rng)?;
    let d = poisoned(|| Ok(w.run()?))?;
    let sample = check::sample_rows(r, 4, 4, rng);
    let (mut got, mut want) = (vec![], vec![]);
    for (row, &i) in check::rows_f64(&d, &sample)?.into_iter().zip(&sample) {
        got.extend(row);
        want.extend(w.reference(i)?);
    }
    drop(d);
    let err = rel_err(&got, &want);
    let name = classifier_row_name(dtype, r, c);
    require(&name, err, 2.0 * tolerance(dtype))?;
    let t = measure_device(clock, DevicePlan::GPU, || w.loss_grad())?;
    let m = t.median_s();
    let bytes = w.bytes() as f64;
    Ok(Row::new(name, bytes / m / 1e9, "GB/s", true).with("median_s", m).with("reps", t.reps()).with("rel_err", err))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg() -> Config {
        Config {
            device: Device::Cpu,
            dtype: DType::BF16,
            shapes: vec![(16384, 768)],
            classifier: vec![(8192, 50257)],
            json: None,
            plot: None,
            seed: 1,
        }
    }

    #[test]
    fn names_and_validation() {
        assert_eq!(row_name("add_layer_norm", "fwd", DType::BF16, 16384, 768), "add_layer_norm fwd bf16 16384x768");
        assert!(check(&cfg()).is_ok());
        assert!(check(&Config { dtype: DType::I32, ..cfg() }).is_err());
        assert!(check(&Config { shapes: vec![], ..cfg() }).is_err());
        let e = check(&Config { shapes: vec![(usize::MAX, 2)], ..cfg() }).unwrap_err().to_string();
        assert!(e.contains("overflows"), "{e}");
        let e = run(&cfg(), &mut Vec::new()).unwrap_err().to_string();
        assert!(e.contains("measures a CUDA device"), "{e}");
    }

    /// The backward checks pass on the CPU in f32 (the same path the GPU run takes), and so does
    /// the forward check of each workload.
    #[test]
    fn checks_run_on_the_cpu() {
        let err = add_ln_check_backward(&mut Rng::new(3), 17, DType::F32, Device::Cpu).unwrap();
        assert!(err < 1e-5, "{err}");
        let err = bias_gelu_check_backward(&mut Rng::new(3), 17, DType::F32, Device::Cpu).unwrap();
        assert!(err < 1e-5, "{err}");
        let (w, _) = bias_gelu_workload(&mut Rng::new(4), 9, 13, DType::F32, Device::Cpu).unwrap();
        let err = check_forward(&w, 9, &mut Rng::new(5)).unwrap();
        assert!(err < 1e-6, "{err}");
    }
}
