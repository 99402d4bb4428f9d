//! `ferrograd bench int8`: the int8 x int8 -> int32 matmul (`ferrograd_core::quant::matmul_i8_nt`,
//! cuBLASLt's IMMA kernels) against the bf16 matmul at the same square size, and the two int8
//! linear layers (W8A8: per-token quantization + int8 matmul + rescale; W8A16: dequantize +
//! bf16 linear) against the bf16 linear. TFLOP/s = 2 n^3 / median (TOPS for int8). Twin:
//! `bench/torch_int8.py` (`torch._int_mm`, `torch.matmul`, and the same linears in eager PyTorch;
//! same shapes and row names).
//!
//! Checks before timing: the int8 product of sampled rows must equal the CPU's integer product
//! exactly (outputs poisoned first); the bf16 product and both linears must match an f64 product
//! of the same (quantized) values within their dtypes' tolerance. Timing: CUDA events, warm-up,
//! batches, median per call (`timing::measure_device`).

use super::check::{poisoned, require, sample_rows};
use super::{cuda_device, finish_json, write_head, Environment, Report, Row, EVENT_TIMING};
use crate::timing::{measure_device, Clock, DevicePlan};
use crate::CliResult;
use ferrograd_core::fused::linear::{linear, Activation};
use ferrograd_core::quant::{linear_w8a16, linear_w8a8, matmul_i8_nt, Int8Weight};
use ferrograd_core::{DType, Device, Rng, Tensor};
use std::io::Write;
use std::path::PathBuf;

#[derive(Debug, Clone)]
pub struct Config {
    pub device: Device,
    pub sizes: Vec<usize>,
    pub json: Option<PathBuf>,
    pub seed: u64,
}

pub fn check(cfg: &Config) -> CliResult<()> {
    if cfg.sizes.is_empty() {
        return Err("--sizes needs at least one size".into());
    }
    if let Some(n) = cfg.sizes.iter().find(|&&n| !(16..=32768).contains(&n) || n % 16 != 0) {
        return Err(format!("size {n}: int8 sizes must be multiples of 16 between 16 and 32768").into());
    }
    Ok(())
}

/// Uniform int8 in [-127, 127] on the device: a normal draw scaled, rounded by quantization.
fn int8_matrix(rng: &mut Rng, n: usize, device: Device) -> CliResult<(Tensor, Int8Weight)> {
    let f = Tensor::randn_with(rng, 0.0, 1.0, (n, n), DType::F32, device)?;
    let w = Int8Weight::quantize(&f)?;
    Ok((f, w))
}

fn row(name: String, n: usize, t: &crate::timing::DeviceTiming, unit: &'static str) -> Row {
    let flops = 2.0 * (n as f64).powi(3);
    Row::new(name, flops / t.median_s() / 1e12, unit, true)
        .with("median_s", t.median_s())
        .with("min_s", t.min_s())
        .with("reps", t.reps())
        .with("inner", t.inner)
}

pub fn run(cfg: &Config, out: &mut dyn Write) -> CliResult<()> {
    check(cfg)?;
    let dev = cuda_device("int8", cfg.device)?;
    let env = Environment::for_device(cfg.device);
    let clock = Clock::new(cfg.device)?;
    writeln!(
        out,
        "int8 matmul (cuBLASLt IMMA, int32 out) vs bf16, and int8 linears, on {} ({})",
        cfg.device,
        env.device_name()
    )?;
    writeln!(out, "{EVENT_TIMING}\n")?;
    let mut report = Report::new("int8", cfg.device, env, EVENT_TIMING);
    let mut rng = Rng::new(cfg.seed);
    write_head(out, &format!("{:<22} | {:>10} | {:>12} | {:>9}", "what", "value", "median ms", "check"))?;
    for &n in &cfg.sizes {
        let (af, a) = int8_matrix(&mut rng, n, cfg.device)?;
        let (_, b) = int8_matrix(&mut rng, n, cfg.device)?;
        let rows = sample_rows(n, 64, 6, &mut rng);
        // int8: exact against the CPU on sampled rows of A.
        let c = poisoned(|| Ok(matmul_i8_nt(&a.q, &b.q)?))?;
        let bq = b.q.to_device(Device::Cpu)?;
        let mut mismatches = 0usize;
        for &r in &rows {
            let ar = a.q.narrow(0, r, 1)?.to_device(Device::Cpu)?;
            let want = matmul_i8_nt(&ar, &bq)?.to_f64_vec()?;
            let got = c.narrow(0, r, 1)?.to_f64_vec()?;
            mismatches += want.iter().zip(&got).filter(|(x, y)| x != y).count();
        }
        if mismatches > 0 {
            return Err(format!(
                "int8 n={n}: {mismatches} elements of the sampled rows differ from the CPU's integer product"
            )
            .into());
        }
        let t = measure_device(&clock, DevicePlan::GPU, || matmul_i8_nt(&a.q, &b.q))?;
        let r = row(format!("int8 n={n}"), n, &t, "TOPS").with("check", "exact");
        writeln!(out, "{:<22} | {:>10.1} | {:>12.4} | {:>9}", r.name, r.value, t.median_s() * 1e3, "exact")?;
        report.rows.push(r);

        // bf16 square matmul of the same values (dequantized), checked against f64.
        let ab = a.dequantize(DType::BF16)?;
        let bb = b.dequantize(DType::BF16)?.t()?.contiguous()?;
        let cb = poisoned(|| Ok(ab.matmul(&bb)?))?;
        let err = rows_err(&cb, &ab, &bb, &rows)?;
        require(&format!("bf16 n={n}"), err, 1e-2)?;
        let t = measure_device(&clock, DevicePlan::GPU, || ab.matmul(&bb))?;
        let r = row(format!("bf16 n={n}"), n, &t, "TFLOP/s").with("rel_err", err);
        writeln!(out, "{:<22} | {:>10.1} | {:>12.4} | {:>9.2e}", r.name, r.value, t.median_s() * 1e3, err)?;
        report.rows.push(r);

        // Linears: x [n, n] bf16 (tokens x features), weight [n, n] as int8 per output row.
        let x = af.to_dtype(DType::BF16)?;
        let wb = a.dequantize(DType::BF16)?;
        let bias = Tensor::randn_with(&mut rng, 0.0, 1.0, n, DType::BF16, cfg.device)?;
        let float = linear(&x, &wb, Some(&bias), Activation::None)?;
        for (name, y) in [("w8a8", linear_w8a8(&x, &a, Some(&bias))?), ("w8a16", linear_w8a16(&x, &a, Some(&bias))?)] {
            let e = rel(&y, &float)?;
            // W8A16 rounds like the bf16 linear; W8A8 adds the activations' int8 rounding (~1%).
            require(&format!("{name} n={n} vs bf16 linear"), e, if name == "w8a8" { 3e-2 } else { 1e-2 })?;
            let t = match name {
                "w8a8" => measure_device(&clock, DevicePlan::GPU, || linear_w8a8(&x, &a, Some(&bias)))?,
                _ => measure_device(&clock, DevicePlan::GPU, || linear_w8a16(&x, &a, Some(&bias)))?,
            };
            let r = row(format!("{name} linear n={n}"), n, &t, "TFLOP/s").with("rel_err_vs_bf16", e);
            writeln!(out, "{:<22} | {:>10.1} | {:>12.4} | {:>9.2e}", r.name, r.value, t.median_s() * 1e3, e)?;
            report.rows.push(r);
        }
        let t = measure_device(&clock, DevicePlan::GPU, || linear(&x, &wb, Some(&bias), Activation::None))?;
        let r = row(format!("bf16 linear n={n}"), n, &t, "TFLOP/s");
        writeln!(out, "{:<22} | {:>10.1} | {:>12.4} | {:>9}", r.name, r.value, t.median_s() * 1e3, "-")?;
        report.rows.push(r);
        dev.synchronize()?;
    }
    report.notes.push(format!("seed {}; int8 values = per-row symmetric quantization of N(0,1) draws", cfg.seed));
    finish_json(&cfg.json, &report, out)
}

/// ‖x − y‖ / ‖y‖ over whole tensors (f64 on the host).
fn rel(x: &Tensor, y: &Tensor) -> CliResult<f64> {
    Ok(ferrograd_core::fused::bench::rel_err(&x.to_f64_vec()?, &y.to_f64_vec()?))
}

/// Relative error of sampled rows of `c = a b` against the f64 product.
fn rows_err(c: &Tensor, a: &Tensor, b: &Tensor, rows: &[usize]) -> CliResult<f64> {
    let b64 = b.to_dtype(DType::F64)?;
    let (mut got, mut want) = (vec![], vec![]);
    for &r in rows {
        got.extend(c.narrow(0, r, 1)?.to_f64_vec()?);
        want.extend(a.narrow(0, r, 1)?.to_dtype(DType::F64)?.matmul(&b64)?.to_f64_vec()?);
    }
    Ok(ferrograd_core::fused::bench::rel_err(&got, &want))
}
