//! The fused linear op (`fused::linear`): gradcheck of the CPU reference in f64, agreement with
//! the same layer built from primitive ops, input errors, and CPU<->CUDA parity of the forward and
//! every gradient in f32, f16, bf16 (and f64, the cuBLAS fallback) on odd and 3-D shapes, strided
//! operands, with and without bias, for each activation; the cuBLASLt plan cache. The same for the
//! fused MLP block (`mlp`, and `mlp_recompute`, whose backward recomputes the hidden activation),
//! against two linears. Device outputs
//! are poisoned (NaN bytes) before every kernel. Without a usable GPU the CUDA tests print one line
//! and pass.

use crate::common;

use common::{gpu, gradcheck, randn};
use ferrograd_core::cuda::blaslt::counters_on_this_thread;
use ferrograd_core::cuda::CudaDevice;
use ferrograd_core::fused::linear::{linear, mlp, mlp_recompute, Activation};
use ferrograd_core::{DType, Device, Error, Result, Rng, Tensor};

const CPU: Device = Device::Cpu;
const ACTS: [Activation; 3] = [Activation::None, Activation::GeluTanh, Activation::Relu];

/// The same layer from primitive ops.
fn composed(x: &Tensor, w: &Tensor, b: Option<&Tensor>, act: Activation) -> Result<Tensor> {
    let mut z = x.matmul(&w.t()?)?;
    if let Some(b) = b {
        z = z.add(b)?;
    }
    match act {
        Activation::None => Ok(z),
        Activation::GeluTanh => z.gelu_tanh(),
        Activation::Relu => z.relu(),
    }
}

#[test]
fn gradcheck_each_activation_with_and_without_bias() {
    let mut rng = Rng::new(11);
    for act in ACTS {
        for (xs, n) in [(vec![4usize, 5], 3usize), (vec![2, 3, 5], 4), (vec![5], 2)] {
            let k = *xs.last().unwrap();
            let (x, w, b) = (
                randn(&mut rng, &xs, DType::F64),
                randn(&mut rng, &[n, k], DType::F64),
                randn(&mut rng, &[n], DType::F64),
            );
            let name = format!("linear {act:?} x{xs:?} -> {n}");
            gradcheck(&format!("{name} bias"), |t| linear(&t[0], &t[1], Some(&t[2]), act), &[x.clone(), w.clone(), b]);
            gradcheck(&format!("{name} no bias"), |t| linear(&t[0], &t[1], None, act), &[x, w]);
        }
        // Strided operands: x a transposed buffer, w a transposed view ([in, out] stored).
        let (xt, wt, b) = (
            randn(&mut rng, &[5, 4], DType::F64),
            randn(&mut rng, &[5, 3], DType::F64),
            randn(&mut rng, &[3], DType::F64),
        );
        gradcheck(
            &format!("linear {act:?} strided"),
            |t| linear(&t[0].t()?, &t[1].t()?, Some(&t[2]), act),
            &[xt, wt, b],
        );
    }
}

#[test]
fn cpu_matches_the_composed_layer() -> Result<()> {
    let mut rng = Rng::new(12);
    for act in ACTS {
        for d in [DType::F64, DType::F32] {
            let (x, w, b) = (randn(&mut rng, &[3, 7, 13], d), randn(&mut rng, &[11, 13], d), randn(&mut rng, &[11], d));
            let got = linear(&x, &w, Some(&b), act)?.to_f64_vec()?;
            let want = composed(&x, &w, Some(&b), act)?.to_f64_vec()?;
            let tol = if d == DType::F64 { 1e-12 } else { 1e-5 };
            let err = max_rel(&got, &want);
            assert!(err <= tol, "{act:?} {d}: {err:e}");
        }
    }
    Ok(())
}

#[test]
fn partial_gradients_match_the_composed_layer() -> Result<()> {
    // Every subset of {x, w, b} tracking (at least one): only those gradients, equal to the
    // primitive-op layer's; also for the MLP block with its second layer frozen.
    let mut rng = Rng::new(18);
    let (x, w, b) = (
        randn(&mut rng, &[3, 2, 5], DType::F64),
        randn(&mut rng, &[4, 5], DType::F64),
        randn(&mut rng, &[4], DType::F64),
    );
    let dy = randn(&mut rng, &[3, 2, 4], DType::F64);
    for act in ACTS {
        for mask in 1..8u32 {
            let pick = |t: &Tensor, bit: u32| if mask & bit != 0 { t.requires_grad() } else { t.clone() };
            let (xv, wv, bv) = (pick(&x, 1), pick(&w, 2), pick(&b, 4));
            let got = linear(&xv, &wv, Some(&bv), act)?.backward_with(&dy)?;
            let want = composed(&xv, &wv, Some(&bv), act)?.backward_with(&dy)?;
            for (t, bit) in [(&xv, 1), (&wv, 2), (&bv, 4)] {
                match (got.get(t), want.get(t)) {
                    (Some(g), Some(c)) => {
                        assert!(max_rel(&g.to_f64_vec()?, &c.to_f64_vec()?) < 1e-12, "{act:?} mask {mask}")
                    }
                    (None, None) => assert_eq!(mask & bit, 0),
                    _ => panic!("{act:?} mask {mask}: gradient presence differs for input bit {bit}"),
                }
            }
        }
    }
    let (w2, b2) = (randn(&mut rng, &[3, 4], DType::F64), randn(&mut rng, &[3], DType::F64));
    let (xv, bv) = (x.requires_grad(), b.requires_grad());
    let dy = randn(&mut rng, &[3, 2, 3], DType::F64);
    let got = mlp(&xv, &w, Some(&bv), &w2, Some(&b2))?.backward_with(&dy)?;
    let want = linear(&linear(&xv, &w, Some(&bv), Activation::GeluTanh)?, &w2, Some(&b2), Activation::None)?
        .backward_with(&dy)?;
    for t in [&xv, &bv] {
        let (g, c) = (got.get(t).expect("mlp grad"), want.get(t).expect("reference grad"));
        assert!(max_rel(&g.to_f64_vec()?, &c.to_f64_vec()?) < 1e-12, "mlp partial");
    }
    assert_eq!(got.len(), 2);
    Ok(())
}

#[test]
fn bad_inputs_are_typed_errors() -> Result<()> {
    let x = Tensor::zeros((2, 3), DType::F32, CPU)?;
    let w = Tensor::zeros((4, 3), DType::F32, CPU)?;
    let e = linear(&x, &Tensor::zeros((4, 5), DType::F32, CPU)?, None, Activation::None).unwrap_err();
    assert!(matches!(e, Error::ShapeMismatch { op: "linear", .. }), "{e}");
    let e = linear(&x, &Tensor::zeros(3, DType::F32, CPU)?, None, Activation::None).unwrap_err();
    assert!(matches!(e, Error::ShapeMismatch { .. }), "{e}");
    let e = linear(&x, &w, Some(&Tensor::zeros(3, DType::F32, CPU)?), Activation::None).unwrap_err();
    assert!(e.to_string().contains("bias"), "{e}");
    let e = linear(&x, &w.to_dtype(DType::F64)?, None, Activation::None).unwrap_err();
    assert!(matches!(e, Error::DTypeMismatch { .. }), "{e}");
    let xi = Tensor::zeros((2, 3), DType::I32, CPU)?;
    let e = linear(&xi, &w.to_dtype(DType::I32)?, None, Activation::None).unwrap_err();
    assert!(matches!(e, Error::UnsupportedDType { .. }), "{e}");
    let e = linear(&Tensor::scalar(1f32, CPU)?, &w, None, Activation::None).unwrap_err();
    assert!(matches!(e, Error::ShapeMismatch { .. }), "{e}");
    // Empty leading dims and zero input features are values, not errors.
    let y = linear(&Tensor::zeros((0, 3), DType::F32, CPU)?, &w, None, Activation::GeluTanh)?;
    assert_eq!(y.dims(), [0, 4]);
    let b = Tensor::from_vec(vec![1f32, -1.0, 2.0, 0.0], 4, CPU)?;
    let y = linear(
        &Tensor::zeros((2, 0), DType::F32, CPU)?,
        &Tensor::zeros((4, 0), DType::F32, CPU)?,
        Some(&b),
        Activation::Relu,
    )?;
    assert_eq!(y.to_vec::<f32>()?, vec![1.0, 0.0, 2.0, 0.0, 1.0, 0.0, 2.0, 0.0]);
    // Inputs that exist (broadcast views) whose output could not: a typed error, before any work.
    let one = Tensor::zeros((1, 1), DType::F32, CPU)?;
    let (xb, wb) = (one.broadcast_as((1 << 30, 1))?, one.broadcast_as((1 << 32, 1))?);
    let e = linear(&xb, &wb, None, Activation::None).unwrap_err();
    assert!(matches!(e, Error::SizeOverflow { op: "linear", .. }), "{e}");
    let e = mlp(&xb, &one, None, &wb, None).unwrap_err();
    assert!(matches!(e, Error::SizeOverflow { op: "mlp", .. }), "{e}");
    if let Some(dev) = gpu() {
        let e = linear(&x, &w.to_device(dev)?, None, Activation::None).unwrap_err();
        assert!(matches!(e, Error::DeviceMismatch { .. }), "{e}");
    }
    Ok(())
}

/// max |a - b| / max |b| (infinite on a NaN or a length mismatch).
fn max_rel(a: &[f64], b: &[f64]) -> f64 {
    if a.len() != b.len() {
        return f64::INFINITY;
    }
    let diff = a
        .iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .map(|d| if d.is_nan() { f64::INFINITY } else { d })
        .fold(0.0, f64::max);
    let scale = b.iter().map(|y| y.abs()).fold(0.0, f64::max);
    if diff == 0.0 {
        0.0
    } else {
        diff / scale.max(1e-30)
    }
}

/// Relative-to-largest tolerance per dtype: one rounding of the output (f16 2^-11, bf16 2^-8)
/// plus f32 accumulation in a different order; GELU in f32 is computed by cuBLASLt's epilogue,
/// whose tanh may be an approximation.
fn tol(d: DType, act: Activation) -> f64 {
    match d {
        DType::F64 => 1e-10,
        DType::F32 if act == Activation::GeluTanh => 1e-3,
        DType::F32 => 2e-5,
        DType::F16 => 3e-3,
        _ => 1.6e-2,
    }
}

/// Forward value and the gradients of x, w (and b) for an upstream gradient `dy`.
fn run(
    x: &Tensor,
    w: &Tensor,
    b: Option<&Tensor>,
    act: Activation,
    dy: &Tensor,
    view: &dyn Fn(&Tensor) -> Result<Tensor>,
) -> Result<Vec<Tensor>> {
    let (x, w, b) = (x.requires_grad(), w.requires_grad(), b.map(|b| b.requires_grad()));
    let y = linear(&view(&x)?, &w, b.as_ref(), act)?;
    let g = y.backward_with(dy)?;
    let mut out = vec![y.detach(), g.get(&x).expect("dx").clone(), g.get(&w).expect("dw").clone()];
    if let Some(b) = &b {
        out.push(g.get(b).expect("db").clone());
    }
    Ok(out)
}

#[test]
fn cuda_matches_cpu_forward_and_backward() -> Result<()> {
    let Some(dev) = gpu() else { return Ok(()) };
    let mut rng = Rng::new(13);
    // (x dims, out, whether x is passed transposed): odd sizes, 3-D, multiples of 8, one row;
    // 300 rows (the bias gradient's partial sums then span more splits than a column-sum block
    // has lanes); 2,200 rows, more than the 8 blocks an SM of `cfg_col_sums` give one each, so a
    // block's rows (3 on a 132-SM GPU, 2 on a 144-SM one) go through the dz + db kernel's two-row
    // step (and its odd remainder), which fewer rows never reach.
    let cases: [(&[usize], usize, bool); 8] = [
        (&[7, 13], 11, false),
        (&[300, 24], 70, false),
        (&[2200, 16], 24, false),
        (&[2, 5, 24], 40, false),
        (&[3, 1, 17], 9, false),
        (&[1, 64], 48, false),
        (&[33, 16], 8, true),
        (&[4, 9, 32], 72, false),
    ];
    let names = ["y", "dx", "dw", "db"];
    for d in [DType::F32, DType::F16, DType::BF16, DType::F64] {
        for &(xs, n, transposed) in &cases {
            let k = *xs.last().unwrap();
            let lead: Vec<usize> = xs[..xs.len() - 1].to_vec();
            let x = if transposed {
                let mut rev: Vec<usize> = xs.to_vec();
                rev.reverse();
                randn(&mut rng, &rev, d)
            } else {
                randn(&mut rng, xs, d)
            };
            let view = move |t: &Tensor| if transposed { t.t() } else { Ok(t.clone()) };
            let (w, b) = (randn(&mut rng, &[n, k], d), randn(&mut rng, &[n], d));
            let dy = randn(&mut rng, &lead.iter().copied().chain([n]).collect::<Vec<_>>(), d);
            for act in ACTS {
                for bias in [true, false] {
                    let what = format!("{d} x{xs:?}{} -> {n} {act:?} bias={bias}", if transposed { "^T" } else { "" });
                    let bb = bias.then_some(&b);
                    let want = run(&x, &w, bb, act, &dy, &view)?;
                    let before = counters_on_this_thread();
                    let gb = bias.then(|| b.to_device(dev)).transpose()?;
                    let got =
                        run(&x.to_device(dev)?, &w.to_device(dev)?, gb.as_ref(), act, &dy.to_device(dev)?, &view)?;
                    let launched = counters_on_this_thread().launches - before.launches;
                    for (i, (c, g)) in want.iter().zip(&got).enumerate() {
                        assert_eq!(g.device(), dev, "{what} {}", names[i]);
                        assert_eq!(c.dims(), g.dims(), "{what} {}", names[i]);
                        let err = max_rel(&g.to_f64_vec()?, &c.to_f64_vec()?);
                        assert!(err <= tol(d, act), "{what} {}: max rel err {err:e} > {:e}", names[i], tol(d, act));
                    }
                    // Sizes cuBLASLt takes in every dtype must really go through it (forward,
                    // dx, dw+db): a silent fallback would hide a broken epilogue path.
                    let rows: usize = lead.iter().product();
                    let aligned = k % 8 == 0 && n % 8 == 0 && rows > 1 && !transposed;
                    if matches!(d, DType::F16 | DType::BF16) && aligned {
                        assert_eq!(launched, 3, "{what}: cuBLASLt launches");
                    }
                    if d == DType::F64 {
                        assert_eq!(launched, 0, "{what}: f64 takes the cuBLAS path");
                    }
                }
            }
        }
    }
    Ok(())
}

/// Every operand a view: x a column window of a wider 3-D buffer (row stride above its width,
/// unaligned start), w a transposed buffer, the bias every other element of a buffer (offset 1),
/// and the upstream gradient a permuted (column-major) view. Gradients reach the base buffers
/// through the views; all against the CPU.
#[test]
fn cuda_strided_operands_match_cpu() -> Result<()> {
    let Some(dev) = gpu() else { return Ok(()) };
    let mut rng = Rng::new(19);
    let (k, n) = (24usize, 40usize);
    // x and w integer-valued and the bias a half-integer: the pre-activation is exact in every
    // dtype and never 0, so ReLU's mask cannot flip between the devices on a rounding difference
    // (a random pre-activation within rounding of 0 flips one dz element: a 4e-2 error in bf16
    // that is the test's, not the kernel's). dy stays random.
    let ints = |rng: &mut Rng, dims: &[usize], shift: f64| -> Result<Tensor> {
        let v: Vec<f64> =
            randn(rng, dims, DType::F64).to_f64_vec()?.iter().map(|x| (1.5 * x).round() + shift).collect();
        Tensor::from_vec(v, dims.to_vec(), CPU)
    };
    for d in [DType::F32, DType::F16, DType::BF16] {
        let (xb, wb, bb, dyb) = (
            ints(&mut rng, &[2, 9, k + 3], 0.0)?.to_dtype(d)?,
            ints(&mut rng, &[k, n], 0.0)?.to_dtype(d)?,
            ints(&mut rng, &[n, 2], 0.5)?.to_dtype(d)?,
            randn(&mut rng, &[n, 2, 9], d),
        );
        for act in ACTS {
            let run = |dv: Device| -> Result<Vec<Tensor>> {
                let vars: Vec<Tensor> = [&xb, &wb, &bb]
                    .iter()
                    .map(|t| t.to_device(dv).map(|t| t.requires_grad()))
                    .collect::<Result<_>>()?;
                let (x, w, b) = (vars[0].narrow(2, 1, k)?, vars[1].t()?, vars[2].narrow(1, 1, 1)?.squeeze(1)?);
                assert!(!x.is_contiguous() && !w.is_contiguous() && !b.is_contiguous());
                let dy = dyb.to_device(dv)?.permute(&[1, 2, 0])?;
                let y = linear(&x, &w, Some(&b), act)?;
                let g = y.backward_with(&dy)?;
                let mut out = vec![y.detach()];
                out.extend(vars.iter().map(|v| g.get(v).expect("gradient").clone()));
                Ok(out)
            };
            let (want, got) = (run(CPU)?, run(dev)?);
            for (name, (c, g)) in ["y", "dx", "dw", "db"].iter().zip(want.iter().zip(&got)) {
                assert_eq!(c.dims(), g.dims(), "{d} {act:?} {name}");
                let err = max_rel(&g.to_f64_vec()?, &c.to_f64_vec()?);
                assert!(err <= tol(d, act), "{d} {act:?} strided {name}: max rel err {err:e}");
            }
        }
    }
    Ok(())
}

#[test]
fn cuda_inference_and_partial_gradients() -> Result<()> {
    let Some(dev) = gpu() else { return Ok(()) };
    let mut rng = Rng::new(14);
    for d in [DType::F32, DType::BF16] {
        let (x, w, b) = (randn(&mut rng, &[6, 24], d), randn(&mut rng, &[16, 24], d), randn(&mut rng, &[16], d));
        let (gx, gw, gb) = (x.to_device(dev)?, w.to_device(dev)?, b.to_device(dev)?);
        for act in ACTS {
            // No tracked input: GELU runs without its aux buffer.
            let want = linear(&x, &w, Some(&b), act)?.to_f64_vec()?;
            let got = linear(&gx, &gw, Some(&gb), act)?.to_f64_vec()?;
            assert!(max_rel(&got, &want) <= tol(d, act), "{d} {act:?} inference");
            // Only the bias trains (frozen weight, data input): db without any matmul gradient.
            let (bv, gbv) = (b.requires_grad(), gb.requires_grad());
            let dy = randn(&mut rng, &[6, 16], d);
            let want = linear(&x, &w, Some(&bv), act)?.backward_with(&dy)?;
            let got = linear(&gx, &gw, Some(&gbv), act)?.backward_with(&dy.to_device(dev)?)?;
            let (c, g) = (want.get(&bv).expect("db cpu"), got.get(&gbv).expect("db cuda"));
            assert!(max_rel(&g.to_f64_vec()?, &c.to_f64_vec()?) <= tol(d, act), "{d} {act:?} db only");
            assert!(got.get(&gx).is_none() && got.get(&gw).is_none());
        }
    }
    Ok(())
}

#[test]
fn cuda_plans_are_cached() -> Result<()> {
    let Some(dev) = gpu() else { return Ok(()) };
    let mut rng = Rng::new(15);
    // A shape no other test uses, so the first step must build its plans here.
    let (x, w, b) = (
        randn(&mut rng, &[3, 40, 56], DType::BF16),
        randn(&mut rng, &[88, 56], DType::BF16),
        randn(&mut rng, &[88], DType::BF16),
    );
    let dy = randn(&mut rng, &[3, 40, 88], DType::BF16).to_device(dev)?;
    let (x, w, b) =
        (x.to_device(dev)?.requires_grad(), w.to_device(dev)?.requires_grad(), b.to_device(dev)?.requires_grad());
    let step = || -> Result<()> {
        linear(&x, &w, Some(&b), Activation::GeluTanh)?.backward_with(&dy)?;
        Ok(())
    };
    let c0 = counters_on_this_thread();
    step()?;
    let c1 = counters_on_this_thread();
    assert_eq!(c1.heuristic_calls - c0.heuristic_calls, 3, "first step: one plan each for forward, dx, dw");
    assert_eq!(c1.launches - c0.launches, 3);
    for _ in 0..3 {
        step()?;
    }
    let c2 = counters_on_this_thread();
    assert_eq!(c2.heuristic_calls, c1.heuristic_calls, "later steps must not run the heuristic");
    assert_eq!(c2.launches - c1.launches, 9);
    CudaDevice::get(0)?.synchronize()?;
    Ok(())
}

/// `mlp` or `mlp_recompute`.
type MlpFn = fn(&Tensor, &Tensor, Option<&Tensor>, &Tensor, Option<&Tensor>) -> Result<Tensor>;

/// Both layers of the MLP block as two linears (the reference for `mlp`).
fn two_linears(x: &Tensor, w1: &Tensor, b1: Option<&Tensor>, w2: &Tensor, b2: Option<&Tensor>) -> Result<Tensor> {
    linear(&linear(x, w1, b1, Activation::GeluTanh)?, w2, b2, Activation::None)
}

#[test]
fn mlp_gradcheck_and_two_linears() -> Result<()> {
    let mut rng = Rng::new(16);
    for (xs, h, n) in [(vec![3usize, 4], 5usize, 2usize), (vec![2, 3, 4], 6, 3)] {
        let k = *xs.last().unwrap();
        let t = |rng: &mut Rng, d: &[usize]| randn(rng, d, DType::F64);
        let (x, w1, b1, w2, b2) =
            (t(&mut rng, &xs), t(&mut rng, &[h, k]), t(&mut rng, &[h]), t(&mut rng, &[n, h]), t(&mut rng, &[n]));
        let what = format!("mlp x{xs:?} {k}->{h}->{n}");
        gradcheck(
            &what,
            |t| mlp(&t[0], &t[1], Some(&t[2]), &t[3], Some(&t[4])),
            &[x.clone(), w1.clone(), b1.clone(), w2.clone(), b2.clone()],
        );
        gradcheck(
            &format!("{what} no biases"),
            |t| mlp(&t[0], &t[1], None, &t[2], None),
            &[x.clone(), w1.clone(), w2.clone()],
        );
        let got = mlp(&x, &w1, Some(&b1), &w2, Some(&b2))?.to_f64_vec()?;
        let want = two_linears(&x, &w1, Some(&b1), &w2, Some(&b2))?.to_f64_vec()?;
        assert!(max_rel(&got, &want) < 1e-12, "{what}: value");
        gradcheck(
            &format!("{what} recompute"),
            |t| mlp_recompute(&t[0], &t[1], Some(&t[2]), &t[3], Some(&t[4])),
            &[x.clone(), w1.clone(), b1.clone(), w2.clone(), b2.clone()],
        );
        // The same gradients as keeping the hidden activation.
        let grads = |f: MlpFn| -> Result<Vec<Vec<f64>>> {
            let v: Vec<Tensor> = [&x, &w1, &b1, &w2, &b2].iter().map(|t| t.requires_grad()).collect();
            let g = f(&v[0], &v[1], Some(&v[2]), &v[3], Some(&v[4]))?.sum_all()?.backward()?;
            v.iter().map(|t| g.get(t).expect("gradient").to_f64_vec()).collect()
        };
        for (a, b) in grads(mlp)?.iter().zip(&grads(mlp_recompute)?) {
            assert!(max_rel(a, b) < 1e-12, "{what}: recompute gradient");
        }
    }
    let (x, w1, w2) = (
        randn(&mut rng, &[2, 4], DType::F32),
        randn(&mut rng, &[5, 4], DType::F32),
        randn(&mut rng, &[3, 6], DType::F32),
    );
    let e = mlp(&x, &w1, None, &w2, None).unwrap_err();
    assert!(e.to_string().contains("second layer"), "{e}");
    let w2 = randn(&mut rng, &[3, 5], DType::F32);
    let e = mlp(&x, &w1, None, &w2, Some(&randn(&mut rng, &[5], DType::F32))).unwrap_err();
    assert!(e.to_string().contains("second bias"), "{e}");
    Ok(())
}

#[test]
fn cuda_mlp_matches_cpu() -> Result<()> {
    let Some(dev) = gpu() else { return Ok(()) };
    let mut rng = Rng::new(17);
    let names = ["y", "dx", "dw1", "db1", "dw2", "db2"];
    for (d, recompute) in
        [DType::F32, DType::F16, DType::BF16, DType::F64].into_iter().flat_map(|d| [(d, false), (d, true)])
    {
        let f: MlpFn = if recompute { mlp_recompute } else { mlp };
        // (x dims, hidden, out): aligned, odd, 3-D.
        for (xs, h, n) in [(vec![24usize, 32], 64usize, 16usize), (vec![7, 13], 11, 5), (vec![2, 9, 16], 40, 24)] {
            let k = *xs.last().unwrap();
            let x = randn(&mut rng, &xs, d);
            let (w1, b1, w2, b2) = (
                randn(&mut rng, &[h, k], d),
                randn(&mut rng, &[h], d),
                randn(&mut rng, &[n, h], d),
                randn(&mut rng, &[n], d),
            );
            let dy = randn(&mut rng, &xs[..xs.len() - 1].iter().copied().chain([n]).collect::<Vec<_>>(), d);
            let run = |dev: Device, f: MlpFn| -> Result<Vec<Tensor>> {
                let vars: Vec<Tensor> = [&x, &w1, &b1, &w2, &b2]
                    .iter()
                    .map(|t| t.to_device(dev).map(|t| t.requires_grad()))
                    .collect::<Result<_>>()?;
                let y = f(&vars[0], &vars[1], Some(&vars[2]), &vars[3], Some(&vars[4]))?;
                let g = y.backward_with(&dy.to_device(dev)?)?;
                let mut out = vec![y.detach()];
                out.extend(vars.iter().map(|v| g.get(v).expect("gradient").clone()));
                Ok(out)
            };
            let want = run(CPU, mlp)?;
            let before = counters_on_this_thread();
            let got = run(dev, f)?;
            let launched = counters_on_this_thread().launches - before.launches;
            let what = format!("mlp{} {d} x{xs:?} {k}->{h}->{n}", if recompute { " recompute" } else { "" });
            for (i, (c, g)) in want.iter().zip(&got).enumerate() {
                assert_eq!(c.dims(), g.dims(), "{what} {}", names[i]);
                let err = max_rel(&g.to_f64_vec()?, &c.to_f64_vec()?);
                assert!(err <= tol(d, Activation::GeluTanh), "{what} {}: max rel err {err:e}", names[i]);
            }
            // Two forward matmuls and three backward ones (dW2+db2, dW1, dx) through cuBLASLt: no
            // fallback. dz's GEMM is the backend's plain one followed by our dz + db1 kernel (mlp.rs
            // `HiddenGrad`), unless FERROGRAD_MLP_BACKWARD=epilogue puts it in cuBLASLt too.
            let epilogue = std::env::var("FERROGRAD_MLP_BACKWARD").is_ok_and(|v| v.trim() == "epilogue");
            if matches!(d, DType::F16 | DType::BF16) && [k, h, n].iter().all(|v| v % 8 == 0) {
                assert_eq!(launched, if epilogue { 6 } else { 5 }, "{what}: cuBLASLt launches");
            }
        }
    }
    Ok(())
}

/// `mlp_recompute`'s backward takes h = gelu(z) from the kernel that forms dz (one more store)
/// when the first layer needs a gradient, and from the unary op otherwise: the same bits, so
/// dW2 and db2 agree exactly between a block whose first layer trains and one whose does not.
#[test]
fn cuda_mlp_recompute_hidden_is_the_unary_gelu() -> Result<()> {
    let Some(dev) = gpu() else { return Ok(()) };
    let mut rng = Rng::new(18);
    for d in [DType::BF16, DType::F16, DType::F32] {
        for (xs, h, n) in [(vec![24usize, 32], 64usize, 16usize), (vec![7, 13], 11, 5)] {
            let k = *xs.last().unwrap();
            let t = |rng: &mut Rng, dims: &[usize]| randn(rng, dims, d).to_device(dev);
            let (x, w1, b1, w2, b2) = (
                t(&mut rng, &xs)?,
                t(&mut rng, &[h, k])?,
                t(&mut rng, &[h])?,
                t(&mut rng, &[n, h])?,
                t(&mut rng, &[n])?,
            );
            let dy = t(&mut rng, &[xs[0], n])?;
            let second = |first_trains: bool| -> Result<Vec<Vec<u64>>> {
                let track = |t: &Tensor, on: bool| if on { t.requires_grad() } else { t.clone() };
                let (xv, w1v, b1v) = (track(&x, first_trains), track(&w1, first_trains), track(&b1, first_trains));
                let (w2v, b2v) = (w2.requires_grad(), b2.requires_grad());
                let g = mlp_recompute(&xv, &w1v, Some(&b1v), &w2v, Some(&b2v))?.backward_with(&dy)?;
                [&w2v, &b2v]
                    .iter()
                    .map(|v| {
                        let g = g.get(v).expect("gradient").to_f64_vec()?;
                        Ok(g.into_iter().map(f64::to_bits).collect())
                    })
                    .collect()
            };
            assert_eq!(second(true)?, second(false)?, "mlp_recompute {d} x{xs:?} {k}->{h}->{n}: dW2, db2");
        }
    }
    Ok(())
}
