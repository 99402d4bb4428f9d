//! `ferrograd bench elementwise`: memory-bound ops in f32, GB/s and the percentage of the
//! device's measured copy bandwidth. Twin: `bench/torch_elementwise.py`.
//!
//! Bytes counted are the fewest the op must move: every input read once, the output written
//! once (copy, transpose, mul_scalar, relu, sigmoid, tanh, softmax, layer_norm: 2 x 4 B per element; add, mul:
//! 3 x 4 B; cross_entropy, forward and backward: 3 x 4 B; add_bf16, mul_bf16, the same add and mul
//! on bf16 copies of x and y, the 16-byte vectorized path: 3 x 2 B). The reference, **copy**, is a plain
//! device-to-device copy into an existing tensor (`dst.set(&x)`: `cuMemcpyDtoDAsync`; PyTorch:
//! `dst.copy_(x)`); **mul_scalar** (`x * 2`) is the copy-like elementwise kernel; **transpose** is
//! `x.t().contiguous()` (the strided copy of a permuted view: `copy_transpose_*`). The fused ops'
//! workloads (what is timed, their bytes and their float64 reference) live beside each op, in
//! `ferrograd-core/src/fused/<op>/bench.rs`: softmax over the last dim; layer_norm of the last
//! dim with a weight and a bias (eps 1e-5); cross_entropy's loss and the logits' gradient. Every
//! op is first checked against a float64 CPU computation on sampled rows, with poisoned outputs on
//! CUDA; timing is CUDA events (host clock on the CPU), median over batches after warm-up. Inputs
//! are N(0, 1), never zeros.

use super::check::{self, rel_err, require};
use super::{check_bytes, f32_bytes, finish_json, finish_plot, print_rows, Environment, Report, Row};
use crate::timing::{measure_device, Clock, DevicePlan};
use crate::CliResult;
use ferrograd_core::fused::bench::Workload;
use ferrograd_core::fused::cross_entropy::bench::CrossEntropyBench;
use ferrograd_core::fused::layer_norm::bench::LayerNormBench;
use ferrograd_core::fused::softmax::bench::SoftmaxBench;
use ferrograd_core::{DType, Device, Rng, Tensor};
use std::io::Write;
use std::path::PathBuf;

const EPS: f64 = 1e-5;
/// f32 kernels against a float64 reference: rounding only.
const TOL: f64 = 1e-5;

#[derive(Debug, Clone)]
pub struct Config {
    pub device: Device,
    pub shapes: Vec<(usize, usize)>,
    pub json: Option<PathBuf>,
    /// Also draw the rows as a bar chart (PNG) here.
    pub plot: Option<PathBuf>,
    pub seed: u64,
}

#[derive(Debug, Clone, Copy, PartialEq)]
enum Op {
    Copy,
    MulScalar,
    Add,
    Mul,
    Relu,
    Sigmoid,
    /// A transcendental op of the second vector kernel (`unary_vec_math_*`; relu, sigmoid and
    /// x * 2 run `unary_vec_*`).
    Tanh,
    /// `x.t().contiguous()`: a permuted view made contiguous (`copy_transpose_*`).
    Transpose,
    Softmax,
    LayerNorm,
    CrossEntropy,
    AddBf16,
    MulBf16,
}

impl Op {
    fn name(self) -> &'static str {
        match self {
            Op::Copy => "copy",
            Op::MulScalar => "mul_scalar",
            Op::Add => "add",
            Op::Mul => "mul",
            Op::Relu => "relu",
            Op::Sigmoid => "sigmoid",
            Op::Tanh => "tanh",
            Op::Transpose => "transpose",
            Op::Softmax => "softmax",
            Op::LayerNorm => "layer_norm",
            Op::CrossEntropy => "cross_entropy",
            Op::AddBf16 => "add_bf16",
            Op::MulBf16 => "mul_bf16",
        }
    }

    /// Elements moved per element of the output (reads plus the write), for the ops without a
    /// fused workload (those count their own bytes).
    fn passes(self) -> usize {
        match self {
            Op::Add | Op::Mul | Op::AddBf16 | Op::MulBf16 => 3,
            _ => 2,
        }
    }

    /// Bytes per element of the tensors it moves.
    fn elem_bytes(self) -> usize {
        match self {
            Op::AddBf16 | Op::MulBf16 => 2,
            _ => 4,
        }
    }

    /// Allowed error against the float64 reference (of the op's own inputs): f32 rounding, or
    /// one bf16 rounding of the result.
    fn tol(self) -> f64 {
        match self {
            Op::AddBf16 | Op::MulBf16 => 4e-3,
            _ => TOL,
        }
    }
}

/// The inputs of one shape.
struct Inputs {
    x: Tensor,
    y: Tensor,
    /// bf16 copies of x and y.
    xb: Tensor,
    yb: Tensor,
    dst: Tensor,
    softmax: SoftmaxBench,
    layer_norm: LayerNormBench,
    cross_entropy: CrossEntropyBench,
}

impl Inputs {
    fn new(rng: &mut Rng, r: usize, c: usize, device: Device) -> ferrograd_core::Result<Inputs> {
        let x = Tensor::randn_with(rng, 0.0, 1.0, (r, c), DType::F32, device)?;
        let y = Tensor::randn_with(rng, 0.0, 1.0, (r, c), DType::F32, device)?;
        let w = Tensor::rand_with(rng, 0.5, 1.5, c, DType::F32, device)?;
        let b = Tensor::randn_with(rng, 0.0, 1.0, c, DType::F32, device)?;
        let dst = Tensor::randn_with(rng, 0.0, 1.0, (r, c), DType::F32, device)?;
        Ok(Inputs {
            softmax: SoftmaxBench::new(x.clone()),
            layer_norm: LayerNormBench::new(x.clone(), w, b, EPS),
            cross_entropy: CrossEntropyBench::new(x.clone(), rng)?,
            xb: x.to_dtype(DType::BF16)?,
            yb: y.to_dtype(DType::BF16)?,
            x,
            y,
            dst,
        })
    }

    /// The fused op's workload (`ferrograd-core/src/fused/<op>/bench.rs`), for the ops that have one.
    fn workload(&self, op: Op) -> Option<&dyn Workload> {
        match op {
            Op::Softmax => Some(&self.softmax),
            Op::LayerNorm => Some(&self.layer_norm),
            Op::CrossEntropy => Some(&self.cross_entropy),
            _ => None,
        }
    }

    /// Bytes one call of `op` must move at the least.
    fn bytes(&self, op: Op) -> usize {
        self.workload(op).map_or(op.passes() * self.x.elem_count() * op.elem_bytes(), |w| w.bytes())
    }

    fn apply(&self, op: Op) -> ferrograd_core::Result<Option<Tensor>> {
        if let Some(w) = self.workload(op) {
            return w.run().map(Some);
        }
        let Inputs { x, y, xb, yb, dst, .. } = self;
        Ok(Some(match op {
            Op::Copy => {
                dst.set(x)?;
                return Ok(None);
            }
            Op::MulScalar => x.mul_scalar(2.0)?,
            Op::Add => x.add(y)?,
            Op::Mul => x.mul(y)?,
            Op::Relu => x.relu()?,
            Op::Sigmoid => x.sigmoid()?,
            Op::Tanh => x.tanh()?,
            // Viewed back as x's shape, so that the check reads x's rows.
            Op::Transpose => x.t()?.contiguous()?.t()?,
            Op::AddBf16 => xb.add(yb)?,
            Op::MulBf16 => xb.mul(yb)?,
            Op::Softmax | Op::LayerNorm | Op::CrossEntropy => unreachable!("fused ops run their workload"),
        }))
    }
}

/// Which ops run at a shape: all of them at the first, the row-wise ones (and copy, their
/// reference) at the others, where only the row length changes.
fn ops_for(first: bool) -> Vec<Op> {
    if first {
        vec![
            Op::Copy,
            Op::MulScalar,
            Op::Add,
            Op::Mul,
            Op::Relu,
            Op::Sigmoid,
            Op::Tanh,
            Op::Transpose,
            Op::Softmax,
            Op::LayerNorm,
            Op::CrossEntropy,
            Op::AddBf16,
            Op::MulBf16,
        ]
    } else {
        vec![Op::Copy, Op::Softmax, Op::LayerNorm, Op::CrossEntropy]
    }
}

/// The flags, and each shape's tensors (x, y, dst, two outputs live at once, and their float64
/// check rows) against the host's memory on the CPU. Issue 11: `--shapes 3x6148914691236517206`
/// made tensors over 2 elements of storage; `--shapes 100000x100000` aborted with SIGABRT.
pub fn check(cfg: &Config) -> CliResult<()> {
    if cfg.shapes.is_empty() {
        return Err("--shapes needs at least one ROWSxCOLS".into());
    }
    for &(r, c) in &cfg.shapes {
        let bytes = r.checked_mul(c).and_then(|n| f32_bytes(n, 7));
        check_bytes(
            cfg.device,
            || format!("bench elementwise --shapes {r}x{c} (six f32 tensors of that shape and two bf16 ones)"),
            bytes,
        )?;
    }
    Ok(())
}

pub fn run(cfg: &Config, out: &mut dyn Write) -> CliResult<()> {
    check(cfg)?;
    super::open_device("elementwise", cfg.device)?;
    for &(r, c) in &cfg.shapes {
        let bytes = r.checked_mul(c).and_then(|n| f32_bytes(n, 7));
        super::fit_device(cfg.device, || format!("bench elementwise --shapes {r}x{c}"), bytes)?;
    }
    let env = Environment::for_device(cfg.device);
    let clock = Clock::new(cfg.device)?;
    let what = env.gpu.clone().unwrap_or_else(|| env.cpu.clone());
    writeln!(out, "memory-bound f32 ops on {} ({what})", cfg.device)?;
    writeln!(out, "GB/s = (elements read + written) x 4 B / median; % of copy = GB/s over this shape's device copy")?;
    writeln!(out)?;
    out.flush()?;

    let mut rng = Rng::new(cfg.seed);
    let mut rows = Vec::new();
    for (i, &(r, c)) in cfg.shapes.iter().enumerate() {
        let inputs = Inputs::new(&mut rng, r, c, cfg.device)?;
        let check_rows = check::sample_rows(r, 4, 4, &mut rng);
        let mut copy_gbps = None;
        for op in ops_for(i == 0) {
            verify(&inputs, op, &check_rows, cfg.device)?;
            let t = measure_device(&clock, DevicePlan::GPU, || inputs.apply(op))?;
            let m = t.median_s();
            let gbps = inputs.bytes(op) as f64 / m / 1e9;
            if op == Op::Copy {
                copy_gbps = Some(gbps);
            }
            let pct = copy_gbps.map_or(f64::NAN, |cg| 100.0 * gbps / cg);
            rows.push(
                Row::new(format!("{} {r}x{c}", op.name()), gbps, "GB/s", true)
                    .with("median_s", m)
                    .with("reps", t.reps())
                    .with("inner", t.inner)
                    .with("pct_of_copy", pct),
            );
        }
    }
    print_rows(out, &rows, Some(("% of copy", "pct_of_copy")))?;

    let mut report = Report::new(
        "elementwise",
        cfg.device,
        env,
        if cfg.device.is_cuda() {
            "CUDA events on the compute stream; warm-up, batches of calls, median per call"
        } else {
            "host clock; warm-up, batches of calls, median per call"
        },
    );
    report.rows = rows;
    report.notes.push(
        "copy = dst.set(&x) (cuMemcpyDtoDAsync into an existing tensor); mul_scalar = x * 2.0 \
         (one read, one write: the copy-like elementwise kernel)"
            .into(),
    );
    report
        .notes
        .push(format!("seed {}; x, y ~ N(0,1); layer_norm weight ~ U[0.5,1.5), bias ~ N(0,1), eps 1e-5", cfg.seed));
    finish_plot(&cfg.plot, &report, Some("pct_of_copy"), out)?;
    finish_json(&cfg.json, &report, out)
}

/// Run `op` once (poisoned outputs on CUDA) and compare the sampled rows with a float64 reference.
fn verify(inp: &Inputs, op: Op, rows: &[usize], device: Device) -> CliResult<()> {
    let run = || -> CliResult<Tensor> {
        Ok(match inp.apply(op)? {
            Some(t) => t,
            None => inp.dst.clone(),
        })
    };
    let outt = if device.is_cuda() { check::poisoned(run)? } else { run()? };
    let what = format!("{} {:?}", op.name(), inp.x.dims());
    if !check::all_finite(&outt)? {
        return Err(format!("{what}: output has non-finite elements (unwritten output?)").into());
    }
    let got = check::rows_f64(&outt, rows)?;
    let bf16 = op.elem_bytes() == 2;
    let xs = check::rows_f64(if bf16 { &inp.xb } else { &inp.x }, rows)?;
    let ys = check::rows_f64(if bf16 { &inp.yb } else { &inp.y }, rows)?;
    let (mut g, mut want) = (Vec::new(), Vec::new());
    for (((gr, xr), yr), &r) in got.iter().zip(&xs).zip(&ys).zip(rows) {
        g.extend_from_slice(gr);
        match inp.workload(op) {
            Some(w) => want.extend(w.reference(r)?),
            None => want.extend(reference(op, xr, yr)),
        }
    }
    require(&what, rel_err(&g, &want), op.tol())
}

/// The op on one row, in f64 (the fused ops' references are their workloads').
fn reference(op: Op, x: &[f64], y: &[f64]) -> Vec<f64> {
    match op {
        Op::Copy | Op::Transpose => x.to_vec(),
        Op::MulScalar => x.iter().map(|v| v * 2.0).collect(),
        Op::Add | Op::AddBf16 => x.iter().zip(y).map(|(a, b)| a + b).collect(),
        Op::Mul | Op::MulBf16 => x.iter().zip(y).map(|(a, b)| a * b).collect(),
        Op::Relu => x.iter().map(|v| v.max(0.0)).collect(),
        Op::Sigmoid => x.iter().map(|v| 1.0 / (1.0 + (-v).exp())).collect(),
        Op::Tanh => x.iter().map(|v| v.tanh()).collect(),
        Op::Softmax | Op::LayerNorm | Op::CrossEntropy => unreachable!("fused ops have their own reference"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn references_are_right_on_a_small_row() {
        let x = [1.0, -2.0, 3.0];
        let y = [0.5, 0.5, 0.5];
        assert_eq!(reference(Op::Relu, &x, &y), vec![1.0, 0.0, 3.0]);
        assert_eq!(reference(Op::Add, &x, &y), vec![1.5, -1.5, 3.5]);
        assert_eq!(Op::Add.passes(), 3);
        assert_eq!(Op::Relu.passes(), 2);
        // The fused ops' references are checked beside them (ferrograd-core src/fused/bench.rs).
    }

    #[test]
    fn every_op_passes_its_check_on_the_cpu() {
        let mut rng = Rng::new(7);
        let (r, c) = (9, 33);
        let inp = Inputs::new(&mut rng, r, c, Device::Cpu).unwrap();
        let rows = check::sample_rows(r, 4, 3, &mut rng);
        for op in ops_for(true) {
            verify(&inp, op, &rows, Device::Cpu).unwrap_or_else(|e| panic!("{}: {e}", op.name()));
        }
    }
}
