//! `ferrograd bench linear`: one linear layer with bias and an activation (GELU, tanh form, by
//! default), forward and forward + backward, at GPT-2's MLP shapes (the workload:
//! `ferrograd_core::fused::linear::bench`). Twin: `bench/torch_linear.py` (`F.linear` +
//! `F.gelu(approximate="tanh")` eager, gradients by `torch.autograd.grad`).
//!
//! Rows, per shape: `fwd` (no gradients recorded: the epilogue skips the pre-activation) and
//! `fwd+bwd` (forward keeping the pre-activation, then dx, dW, db from a given output gradient),
//! TFLOP/s = matmul FLOPs (2, resp. 6, x rows x in x out) / median time. A third row, `fwd+bwd
//! unfused`, runs the same layer from primitive ops (cuBLAS matmul, add, gelu, each with its own
//! backward): what the fusion buys within ferrograd; it has no twin.
//!
//! With the default shapes and GELU it also times GPT-2's whole MLP block (`mlp` rows: 768 -> 3072
//! -> 768 and 1024 -> 4096 -> 1024) through `fused::linear::mlp`, whose backward takes the GELU
//! gradient and db1 from the second layer's dx matmul (DGELU_BGRAD), against the same block as two
//! fused linears (`fwd+bwd two linears`, no twin) and the twin's F.linear, F.gelu, F.linear.
//!
//! `--breakdown` adds, per shape, each piece of the fused step timed alone (forward with and
//! without the saved pre-activation, the activation gradient with and without db, the dx and dW
//! matmuls, dW with db from the BGRADB epilogue), in µs.
//!
//! Checked before timing, with every new buffer poisoned (NaN): y and dx on the first, the last and
//! six random rows against float64 computed on the host from the same inputs; dW and db (which need
//! every row) against the unfused path on the GPU. Inputs from a seeded Philox stream, never zeros.

use super::check::{self, rel_err, require};
use super::{check_bytes, cuda_device, finish_json, finish_plot, print_rows, Environment, Report, Row};
use crate::timing::{measure_device, Clock, DevicePlan};
use crate::CliResult;
use ferrograd_core::cuda::{set_matmul_precision, MatmulPrecision};
use ferrograd_core::fused::linear::bench::{Case, Inputs, MlpCase, MlpInputs, GPT2, GPT2_MLP};
use ferrograd_core::fused::linear::Activation;
use ferrograd_core::op::UnaryOp;
use ferrograd_core::{with_no_grad, DType, Device, Rng, Tensor};
use std::io::Write;
use std::path::PathBuf;

#[derive(Debug, Clone)]
pub struct Config {
    pub device: Device,
    pub dtypes: Vec<DType>,
    pub act: Activation,
    /// Tokens per problem (None: GPT-2's 16 x 1024).
    pub rows: Option<usize>,
    /// (in, out) pairs (None: the GPT-2 shapes).
    pub features: Option<Vec<(usize, usize)>>,
    /// Also time each piece of the fused step alone (rows `... part NAME`, µs).
    pub breakdown: bool,
    pub json: Option<PathBuf>,
    pub plot: Option<PathBuf>,
    pub seed: u64,
}

impl Config {
    pub fn cases(&self) -> CliResult<Vec<Case>> {
        let mut cases: Vec<Case> = match &self.features {
            Some(f) => f.iter().map(|&(i, o)| Case { rows: 0, in_features: i, out_features: o }).collect(),
            None => GPT2.to_vec(),
        };
        for c in &mut cases {
            match self.rows {
                Some(r) => c.rows = r,
                None if c.rows == 0 => c.rows = 16 * 1024,
                None => {}
            }
        }
        if let Some(c) = cases.iter().find(|c| c.rows == 0 || c.in_features == 0 || c.out_features == 0) {
            return Err(format!("bench linear: every size must be at least 1, got {c:?}").into());
        }
        if self.dtypes.is_empty() {
            return Err("--dtype needs at least one dtype".into());
        }
        Ok(cases)
    }
}

/// `gelu`, `none`, `relu`: what the row names and the twin's `--act` call them.
pub fn act_name(a: Activation) -> &'static str {
    match a {
        Activation::None => "none",
        Activation::GeluTanh => "gelu",
        Activation::Relu => "relu",
    }
}

pub fn parse_act(s: &str) -> Result<Activation, String> {
    match s.trim() {
        "none" => Ok(Activation::None),
        "gelu" | "gelu_tanh" => Ok(Activation::GeluTanh),
        "relu" => Ok(Activation::Relu),
        other => Err(format!("`{other}`: expected gelu (tanh form), relu or none")),
    }
}

/// `bf16 gelu 768->3072 rows=16384 fwd+bwd`: the row name here and in the twin.
pub fn row_name(dtype: DType, act: Activation, case: &Case, what: &str) -> String {
    format!("{dtype} {} {} {what}", act_name(act), case.name())
}

/// Norm-relative error allowed against the references: one rounding of each output, and the
/// epilogue's GELU in f32.
fn tolerance(dtype: DType) -> f64 {
    match dtype {
        DType::F32 => 1e-3,
        DType::F16 => 5e-3,
        _ => 2e-2,
    }
}

/// Bytes one problem holds at once, or None on overflow: x, dx (rows x in), y, dy, the saved
/// pre-activation, dz and the unfused path's intermediates (5 x rows x out, the aux buffer's
/// padded width), w, dW and the unfused path's dW (3 x in x out), and the bias vectors.
fn case_bytes(c: &Case, dtype: DType) -> Option<usize> {
    let x = c.rows.checked_mul(c.in_features)?.checked_mul(3)?;
    let y = c.rows.checked_mul(c.out_features.checked_next_multiple_of(8)?)?.checked_mul(5)?;
    let w = c.in_features.checked_mul(c.out_features)?.checked_mul(3)?;
    x.checked_add(y)?.checked_add(w)?.checked_add(c.out_features.checked_mul(3)?)?.checked_mul(dtype.size_in_bytes())
}

/// Bytes of the MLP block's problem (both layers at once, with the two-linears path's copies).
fn mlp_bytes(c: &MlpCase, dtype: DType) -> Option<usize> {
    let first = Case { rows: c.rows, in_features: c.dim, out_features: c.hidden };
    let second = Case { rows: c.rows, in_features: c.hidden, out_features: c.dim };
    case_bytes(&first, dtype)?.checked_add(case_bytes(&second, dtype)?)
}

/// The flags (sizes at least 1, dtypes bf16/f16/f32, one at least) and every problem's byte count
/// checked for overflow (issue 11), before any device is opened.
pub fn check(cfg: &Config) -> CliResult<()> {
    let cases = cfg.cases()?;
    if let Some(d) = cfg.dtypes.iter().find(|d| !matches!(d, DType::BF16 | DType::F16 | DType::F32)) {
        return Err(format!("--dtype {d}: the linear bench runs bf16, f16 or f32").into());
    }
    for &dtype in &cfg.dtypes {
        for c in &cases {
            let what = || format!("bench linear {dtype} {}", c.name());
            check_bytes(cfg.device, what, case_bytes(c, dtype))?;
        }
        if cfg.features.is_none() && cfg.act == Activation::GeluTanh {
            for c in GPT2_MLP {
                let c = MlpCase { rows: cfg.rows.unwrap_or(c.rows), ..*c };
                check_bytes(cfg.device, || format!("bench linear {dtype} mlp {}", c.name()), mlp_bytes(&c, dtype))?;
            }
        }
    }
    Ok(())
}

pub fn run(cfg: &Config, out: &mut dyn Write) -> CliResult<()> {
    check(cfg)?;
    let cases = cfg.cases()?;
    cuda_device("linear", cfg.device)?;
    for &dtype in &cfg.dtypes {
        for c in &cases {
            super::fit_device(cfg.device, || format!("bench linear {dtype} {}", c.name()), case_bytes(c, dtype))?;
        }
    }
    // Exact f32, as PyTorch's default (allow_tf32 = False).
    set_matmul_precision(MatmulPrecision::Highest);
    let env = Environment::for_device(cfg.device);
    let clock = Clock::new(cfg.device)?;
    writeln!(
        out,
        "linear + bias + {} on {} ({}): fused op (cuBLASLt epilogues); CUDA events, median over batches; \
         TFLOP/s = matmul FLOPs / median",
        act_name(cfg.act),
        cfg.device,
        env.gpu.as_deref().unwrap_or("?")
    )?;
    let mut rng = Rng::new(cfg.seed);
    let mut rows = vec![];
    for &dtype in &cfg.dtypes {
        for case in &cases {
            let inp = Inputs::new(*case, dtype, cfg.device, &mut rng)?;
            let err = verify(&inp, cfg.act, dtype, &mut rng)?;
            let act = cfg.act;
            let fwd = measure_device(&clock, DevicePlan::GPU, || {
                with_no_grad(|| ferrograd_core::fused::linear::linear(&inp.x, &inp.w, Some(&inp.b), act))
            })?;
            let step = measure_device(&clock, DevicePlan::GPU, || inp.fused_step(act))?;
            let unfused = measure_device(&clock, DevicePlan::GPU, || inp.unfused_step(act))?;
            for (what, t, flops) in [
                ("fwd", &fwd, case.forward_flops()),
                ("fwd+bwd", &step, case.step_flops()),
                ("fwd+bwd unfused", &unfused, case.step_flops()),
            ] {
                rows.push(
                    Row::new(row_name(dtype, act, case, what), flops / t.median_s() / 1e12, "TFLOP/s", true)
                        .with("median_s", t.median_s())
                        .with("min_s", t.min_s())
                        .with("reps", t.reps())
                        .with("inner", t.inner)
                        .with("rel_err", err),
                );
            }
            if cfg.breakdown {
                for mut piece in inp.pieces(act)? {
                    let t = measure_device(&clock, DevicePlan::GPU, &mut piece.run)?;
                    let what = format!("part {}", piece.name);
                    rows.push(
                        Row::new(row_name(dtype, act, case, &what), t.median_s() * 1e6, "µs", false)
                            .with("median_s", t.median_s())
                            .with("reps", t.reps()),
                    );
                }
            }
        }
    }
    if cfg.features.is_none() && cfg.act == Activation::GeluTanh {
        for &dtype in &cfg.dtypes {
            for case in GPT2_MLP {
                let case = MlpCase { rows: cfg.rows.unwrap_or(case.rows), ..*case };
                rows.extend(bench_mlp(&clock, case, dtype, cfg.device, &mut rng)?);
            }
        }
    }
    print_rows(out, &rows, None)?;
    let mut report = Report::new(
        "linear",
        cfg.device,
        env,
        "CUDA events on the compute stream; warm-up, batches of calls, median per call",
    );
    report.rows = rows;
    report.notes.push(format!(
        "seed {}; x ~ N(0,1), w and b ~ U(+-1/sqrt(in)), dy ~ N(0,1); fwd+bwd = forward + dx, dW, db (6 x rows x in x out \
         FLOPs)",
        cfg.seed
    ));
    finish_plot(&cfg.plot, &report, None, out)?;
    finish_json(&cfg.json, &report, out)
}

/// The MLP block rows: the fused block, and the same block as two fused linears.
fn bench_mlp(clock: &Clock, case: MlpCase, dtype: DType, device: Device, rng: &mut Rng) -> CliResult<Vec<Row>> {
    let inp = MlpInputs::new(case, dtype, device, rng)?;
    let err = verify_mlp(&inp, dtype, rng)?;
    let fwd = measure_device(clock, DevicePlan::GPU, || {
        with_no_grad(|| ferrograd_core::fused::linear::mlp(&inp.x, &inp.w1, Some(&inp.b1), &inp.w2, Some(&inp.b2)))
    })?;
    let step = measure_device(clock, DevicePlan::GPU, || inp.fused_step())?;
    let two = measure_device(clock, DevicePlan::GPU, || inp.two_linears_step())?;
    let name = |what: &str| format!("{dtype} mlp {} {what}", case.name());
    Ok([
        ("fwd", &fwd, case.forward_flops()),
        ("fwd+bwd", &step, case.step_flops()),
        ("fwd+bwd two linears", &two, case.step_flops()),
    ]
    .into_iter()
    .map(|(what, t, flops)| {
        Row::new(name(what), flops / t.median_s() / 1e12, "TFLOP/s", true)
            .with("median_s", t.median_s())
            .with("min_s", t.min_s())
            .with("reps", t.reps())
            .with("inner", t.inner)
            .with("rel_err", err)
    })
    .collect())
}

/// y on sampled rows against float64; every gradient against the two-linears path (whose
/// layers the linear rows check against float64).
fn verify_mlp(inp: &MlpInputs, dtype: DType, rng: &mut Rng) -> CliResult<f64> {
    let (y, g) = check::poisoned(|| Ok(inp.fused_step()?))?;
    let (y2, g2) = inp.two_linears_step()?;
    let (m, d, h) = (inp.x.dims()[0], inp.x.dims()[1], inp.w1.dims()[0]);
    let rows = check::sample_rows(m, 0, 6, rng);
    let (xr, yr) = (check::rows_f64(&inp.x.detach(), &rows)?, check::rows_f64(&y, &rows)?);
    let (w1, b1) = (inp.w1.detach().to_f64_vec()?, inp.b1.detach().to_f64_vec()?);
    let (w2, b2) = (inp.w2.detach().to_f64_vec()?, inp.b2.detach().to_f64_vec()?);
    let (mut got, mut want) = (vec![], vec![]);
    for (x, yg) in xr.iter().zip(&yr) {
        let hid: Vec<f64> = (0..h)
            .map(|j| {
                UnaryOp::GeluTanh
                    .eval_f64(b1[j] + w1[j * d..(j + 1) * d].iter().zip(x).map(|(a, c)| a * c).sum::<f64>())
            })
            .collect();
        want.extend((0..d).map(|o| b2[o] + w2[o * h..(o + 1) * h].iter().zip(&hid).map(|(a, c)| a * c).sum::<f64>()));
        got.extend(yg);
    }
    let tol = tolerance(dtype);
    let what = format!("mlp {dtype} {m}x{d}->{h}->{d}");
    let mut worst = rel_err(&got, &want);
    require(&format!("{what} y ({} rows)", rows.len()), worst, tol)?;
    let e = rel_err(&y.to_f64_vec()?, &y2.to_f64_vec()?);
    require(&format!("{what} y (against two linears)"), e, tol)?;
    worst = worst.max(e);
    for (name, p) in ["dx", "dW1", "db1", "dW2", "db2"].iter().zip(inp.params()) {
        let (a, b) = (g.get(p), g2.get(p));
        let (Some(a), Some(b)) = (a, b) else { return Err(format!("{what}: no gradient for {name}").into()) };
        if !check::all_finite(a)? {
            return Err(format!("{what}: {name} has non-finite elements (unwritten output?)").into());
        }
        let e = rel_err(&a.to_f64_vec()?, &b.to_f64_vec()?);
        require(&format!("{what} {name} (against two linears)"), e, tol)?;
        worst = worst.max(e);
    }
    Ok(worst)
}

type F64Fn = fn(f64) -> f64;

/// The activation and its derivative in f64.
fn act_f64(act: Activation) -> (F64Fn, F64Fn) {
    match act {
        Activation::None => (|v| v, |_| 1.0),
        Activation::GeluTanh => (|v| UnaryOp::GeluTanh.eval_f64(v), |v| UnaryOp::GeluTanhGrad.eval_f64(v)),
        Activation::Relu => (|v| v.max(0.0), |v| if v > 0.0 { 1.0 } else { 0.0 }),
    }
}

/// Check the fused step before timing it; returns the largest relative error seen.
fn verify(inp: &Inputs, act: Activation, dtype: DType, rng: &mut Rng) -> CliResult<f64> {
    let (y, g) = check::poisoned(|| Ok(inp.fused_step(act)?))?;
    let grad = |t: &Tensor| g.get(t).cloned().ok_or_else(|| "bench linear: a gradient is missing".to_string());
    let (dx, dw, db) = (grad(&inp.x)?, grad(&inp.w)?, grad(&inp.b)?);
    for (what, t) in [("y", &y), ("dx", &dx), ("dW", &dw), ("db", &db)] {
        if !check::all_finite(t)? {
            return Err(format!("bench linear: {what} has non-finite elements (unwritten output?)").into());
        }
    }
    let (m, k, n) = (inp.x.dims()[0], inp.x.dims()[1], inp.w.dims()[0]);
    let rows = check::sample_rows(m, 0, 6, rng);
    let (xr, dyr) = (check::rows_f64(&inp.x.detach(), &rows)?, check::rows_f64(&inp.dy, &rows)?);
    let (yr, dxr) = (check::rows_f64(&y, &rows)?, check::rows_f64(&dx, &rows)?);
    let (w, b) = (inp.w.detach().to_f64_vec()?, inp.b.detach().to_f64_vec()?);
    let (mut got_y, mut want_y, mut got_dx, mut want_dx) = (vec![], vec![], vec![], vec![]);
    for i in 0..rows.len() {
        let z: Vec<f64> =
            (0..n).map(|o| b[o] + w[o * k..(o + 1) * k].iter().zip(&xr[i]).map(|(a, c)| a * c).sum::<f64>()).collect();
        let (f, df) = act_f64(act);
        let dz: Vec<f64> = z.iter().zip(&dyr[i]).map(|(&zv, &g)| g * df(zv)).collect();
        want_y.extend(z.iter().map(|&v| f(v)));
        got_y.extend(&yr[i]);
        want_dx.extend((0..k).map(|c| (0..n).map(|o| dz[o] * w[o * k + c]).sum::<f64>()));
        got_dx.extend(&dxr[i]);
    }
    let tol = tolerance(dtype);
    let what = format!("linear {dtype} {} {m}x{k}->{n}", act_name(act));
    let mut worst = 0f64;
    for (name, got, want) in [("y", &got_y, &want_y), ("dx", &got_dx, &want_dx)] {
        let e = rel_err(got, want);
        require(&format!("{what} {name} ({} rows)", rows.len()), e, tol)?;
        worst = worst.max(e);
    }
    let (_, gu) = inp.unfused_step(act)?;
    for (name, t, p) in [("dW", &dw, &inp.w), ("db", &db, &inp.b)] {
        let u = gu.get(p).ok_or("bench linear: the unfused path has no gradient")?;
        let e = rel_err(&t.to_f64_vec()?, &u.to_f64_vec()?);
        require(&format!("{what} {name} (against the unfused path)"), e, tol)?;
        worst = worst.max(e);
    }
    Ok(worst)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg(features: Option<Vec<(usize, usize)>>, rows: Option<usize>) -> Config {
        Config {
            device: Device::Cuda(0),
            dtypes: vec![DType::BF16],
            act: Activation::GeluTanh,
            rows,
            features,
            breakdown: false,
            json: None,
            plot: None,
            seed: 1,
        }
    }

    #[test]
    fn cases_default_to_gpt2_and_take_overrides() {
        assert_eq!(cfg(None, None).cases().unwrap(), GPT2.to_vec());
        let c = cfg(Some(vec![(64, 96)]), Some(128)).cases().unwrap();
        assert_eq!(c, vec![Case { rows: 128, in_features: 64, out_features: 96 }]);
        assert_eq!(cfg(Some(vec![(64, 96)]), None).cases().unwrap()[0].rows, 16 * 1024);
        assert!(cfg(None, Some(0)).cases().is_err());
        assert!(Config { dtypes: vec![], ..cfg(None, None) }.cases().is_err());
    }

    #[test]
    fn check_refuses_bad_dtypes_and_overflowing_sizes() {
        assert!(check(&cfg(None, None)).is_ok());
        assert!(check(&Config { dtypes: vec![DType::F64], ..cfg(None, None) }).is_err());
        let e = check(&cfg(Some(vec![(1 << 20, 1 << 20)]), Some(usize::MAX / 4))).unwrap_err().to_string();
        assert!(e.contains("overflows"), "{e}");
        let e = check(&cfg(None, Some(usize::MAX / 8))).unwrap_err().to_string();
        assert!(e.contains("overflows"), "{e}");
    }

    #[test]
    fn names_and_activations() {
        let c = GPT2[0];
        assert_eq!(
            row_name(DType::BF16, Activation::GeluTanh, &c, "fwd+bwd"),
            "bf16 gelu 768->3072 rows=16384 fwd+bwd"
        );
        for a in [Activation::None, Activation::GeluTanh, Activation::Relu] {
            assert_eq!(parse_act(act_name(a)).unwrap(), a);
        }
        assert!(parse_act("erf").is_err());
    }

    #[test]
    fn verify_accepts_the_cpu_mlp() -> ferrograd_core::Result<()> {
        let mut rng = Rng::new(4);
        let inp = MlpInputs::new(MlpCase { rows: 6, dim: 8, hidden: 12 }, DType::F32, Device::Cpu, &mut rng)?;
        let e = verify_mlp(&inp, DType::F32, &mut rng).unwrap();
        assert!(e < 1e-5, "{e}");
        Ok(())
    }

    #[test]
    fn verify_accepts_the_cpu_layer() -> ferrograd_core::Result<()> {
        // The checker itself on the CPU (f32): a correct layer passes.
        let mut rng = Rng::new(3);
        let inp = Inputs::new(Case { rows: 9, in_features: 12, out_features: 7 }, DType::F32, Device::Cpu, &mut rng)?;
        for act in [Activation::None, Activation::GeluTanh, Activation::Relu] {
            let e = verify(&inp, act, DType::F32, &mut rng).unwrap();
            assert!(e < 1e-5, "{act:?}: {e}");
        }
        Ok(())
    }
}
