//! The fused classifier (`fused::classifier`): gradcheck of the CPU op in f64, agreement with
//! `cross_entropy_acc` (loss and gradient, with and without an ignore index), the padded-columns
//! entry `classifier_loss_grad` (classes < columns, a grad scale), input errors, and CPU<->CUDA
//! parity in f32 and bf16 on row lengths that are not multiples of the kernel's vector or block,
//! strided logits, ignored rows, and in place. Device outputs are poisoned (NaN bytes) before every
//! kernel. Without a usable GPU the CUDA tests print one line and pass.

use crate::common::gpu;
use ferrograd_core::fused::classifier::ClassifierOpts;
use ferrograd_core::{with_no_grad, DType, Device, Error, Result, Rng, Tensor};

const CPU: Device = Device::Cpu;

fn randn(rng: &mut Rng, rows: usize, cols: usize, std: f64, dtype: DType) -> Tensor {
    Tensor::randn_with(rng, 0.0, std, (rows, cols), DType::F64, CPU).and_then(|t| t.to_dtype(dtype)).expect("randn")
}

/// Targets in `[0, classes)`, `ignore` at every third row when given.
fn targets(rows: usize, classes: usize, ignore: Option<i64>) -> Tensor {
    let v: Vec<i32> = (0..rows)
        .map(|r| match ignore {
            Some(ix) if r % 3 == 1 => ix as i32,
            _ => ((r * 7919 + 13) % classes) as i32,
        })
        .collect();
    Tensor::from_vec(v, rows, CPU).expect("targets")
}

fn max_abs_diff(a: &Tensor, b: &Tensor) -> f64 {
    let (a, b) = (a.to_f64_vec().unwrap(), b.to_f64_vec().unwrap());
    assert_eq!(a.len(), b.len());
    // NaN on one side only is an infinite difference (f64::max would drop it).
    let diff = |x: f64, y: f64| match (x.is_nan(), y.is_nan()) {
        (true, true) => 0.0,
        (false, false) => (x - y).abs(),
        _ => f64::INFINITY,
    };
    a.iter().zip(&b).map(|(&x, &y)| diff(x, y)).fold(0.0, f64::max)
}

#[test]
fn gradcheck_f64() -> Result<()> {
    let mut rng = Rng::new(5);
    for ignore in [None, Some(-100)] {
        let x = randn(&mut rng, 5, 7, 1.5, DType::F64);
        let t = targets(5, 7, ignore);
        let v = x.requires_grad();
        // A non-unit upstream gradient: the backward scales the saved gradient by it.
        let loss = v.fused_classifier(&t, ignore)?.mul_scalar(1.7)?;
        let g = loss.backward()?.get(&v).cloned().expect("gradient");
        let analytic = g.to_f64_vec()?;
        let base = x.to_f64_vec()?;
        let h = 1e-6;
        for j in 0..base.len() {
            let eval = |d: f64| -> Result<f64> {
                let mut vals = base.clone();
                vals[j] += d;
                let xi = Tensor::from_vec(vals, (5, 7), CPU)?;
                with_no_grad(|| xi.fused_classifier(&t, ignore)?.mul_scalar(1.7)?.item_f64())
            };
            let numeric = (eval(h)? - eval(-h)?) / (2.0 * h);
            let a = analytic[j];
            assert!((a - numeric).abs() <= 1e-8 + 1e-6 * a.abs().max(numeric.abs()), "element {j}: {a} vs {numeric}");
        }
    }
    Ok(())
}

#[test]
fn matches_cross_entropy_on_the_cpu() -> Result<()> {
    let mut rng = Rng::new(6);
    for ignore in [None, Some(3)] {
        let x = randn(&mut rng, 9, 33, 2.0, DType::F32);
        let t = targets(9, 33, ignore);
        let (a, b) = (x.requires_grad(), x.requires_grad());
        let la = a.fused_classifier(&t, ignore)?;
        let lb = b.cross_entropy_acc(&t, ignore)?;
        assert_eq!(la.dtype(), DType::F32);
        assert!((la.item_f64()? - lb.item_f64()?).abs() < 1e-6);
        let (ga, gb) = (la.backward()?, lb.backward()?);
        assert!(max_abs_diff(ga.get(&a).unwrap(), gb.get(&b).unwrap()) < 1e-7);
    }
    Ok(())
}

#[test]
fn padded_columns_get_no_probability_and_a_zero_gradient() -> Result<()> {
    let mut rng = Rng::new(7);
    let x = randn(&mut rng, 6, 20, 1.0, DType::F64);
    let t = targets(6, 13, Some(-1));
    let opts = ClassifierOpts { classes: Some(13), ignore_index: Some(-1), grad_scale: 0.25, in_place: false };
    let (loss, d) = x.classifier_loss_grad(&t, opts)?;
    let real = x.narrow(1, 0, 13)?.requires_grad();
    let want = real.cross_entropy(&t, Some(-1))?;
    assert!((loss.item_f64()? - want.item_f64()?).abs() < 1e-12);
    let g = want.mul_scalar(0.25)?.backward()?.get(&real).cloned().unwrap();
    assert!(max_abs_diff(&d.narrow(1, 0, 13)?, &g) < 1e-14);
    assert!(d.narrow(1, 13, 7)?.to_f64_vec()?.iter().all(|&v| v == 0.0));
    assert!(!loss.tracks_grad() && !d.tracks_grad());
    Ok(())
}

#[test]
fn bad_inputs_are_typed_errors() {
    let x = Tensor::zeros((4, 5), DType::F32, CPU).unwrap();
    let e = x.fused_classifier(&targets(3, 5, None), None).unwrap_err();
    assert!(matches!(e, Error::Shape { .. }), "{e}");
    let e = x.fused_classifier(&Tensor::zeros(4, DType::F32, CPU).unwrap(), None).unwrap_err();
    assert!(matches!(e, Error::UnsupportedDType { .. }), "{e}");
    let bad = Tensor::from_vec(vec![0i32, 1, 5, 2], 4, CPU).unwrap();
    let e = x.fused_classifier(&bad, None).unwrap_err();
    assert!(matches!(e, Error::IndexOutOfRange { .. }), "{e}");
    let opts = ClassifierOpts { classes: Some(6), ..Default::default() };
    assert!(x.classifier_loss_grad(&targets(4, 5, None), opts).is_err());
    let opts = ClassifierOpts { classes: Some(3), ..Default::default() };
    let e = x.classifier_loss_grad(&targets(4, 5, None), opts).unwrap_err();
    assert!(matches!(e, Error::IndexOutOfRange { .. }), "a target past the classes: {e}");
}

// ---- CUDA parity -----------------------------------------------------------------------------------

/// Allowed max |difference| of the loss (relative) and of the gradient (times rows: its entries are
/// O(1 / rows)) against the f64 CPU op on the same rounded logits.
fn tol(dtype: DType) -> (f64, f64) {
    match dtype {
        DType::F32 => (1e-5, 1e-5),
        _ => (1e-3, 1e-2),
    }
}

#[test]
fn cuda_matches_the_cpu() -> Result<()> {
    let Some(dev) = gpu() else { return Ok(()) };
    let mut rng = Rng::new(8);
    // (rows, columns, classes): short rows, a row shorter than one vector per thread, columns not a
    // multiple of 8 (each row then starts at another 16-byte alignment: a head before the first
    // vector), GPT-2's padded vocabulary and its unpadded 50257, more rows than the grid (a block
    // reuses its shared-memory row cache).
    let shapes = [
        (7, 5, 5),
        (33, 77, 77),
        (5, 1000, 999),
        (9, 8200, 8193),
        (4, 50304, 50257),
        (6, 50257, 50257),
        (9000, 301, 300),
    ];
    for dtype in [DType::F32, DType::BF16] {
        let (tl, tg) = tol(dtype);
        for &(rows, cols, classes) in &shapes {
            for ignore in [None, Some(-100)] {
                for (strided, in_place) in [(false, false), (true, false), (false, true)] {
                    let what = format!(
                        "{dtype} {rows}x{cols} ({classes}) ignore {ignore:?} strided {strided} in_place {in_place}"
                    );
                    let wide = randn(&mut rng, rows, cols + 3, 3.0, dtype);
                    // Strided: a narrow of wider rows (row stride cols + 3, offset 1).
                    let x = if strided { wide.narrow(1, 1, cols)? } else { wide.narrow(1, 0, cols)?.contiguous()? };
                    let t = targets(rows, classes, ignore);
                    let opts =
                        ClassifierOpts { classes: Some(classes), ignore_index: ignore, grad_scale: 0.5, in_place };
                    let (want_l, want_d) = x.to_dtype(DType::F64)?.classifier_loss_grad(&t, opts)?;
                    let xd = x.to_device(dev)?;
                    let (l, d) = xd.classifier_loss_grad(&t.to_device(dev)?, opts)?;
                    assert_eq!((l.dtype(), d.dtype(), d.dims()), (DType::F32, dtype, x.dims()), "{what}");
                    let (a, b) = (l.item_f64()?, want_l.item_f64()?);
                    assert!((a - b).abs() <= tl * b.abs().max(1.0), "{what}: loss {a} vs {b}");
                    let err = max_abs_diff(&d.to_dtype(DType::F64)?, &want_d) * rows as f64;
                    assert!(err <= tg, "{what}: gradient error {err}");
                    if in_place {
                        assert!(max_abs_diff(&xd, &d) == 0.0, "{what}: the gradient is not over the logits");
                    }
                }
            }
        }
        // The differentiable entry: loss and gradient through the tape.
        let x = randn(&mut rng, 11, 300, 2.0, dtype);
        let t = targets(11, 300, Some(-1));
        let xc = x.to_dtype(DType::F64)?.requires_grad();
        let want = xc.fused_classifier(&t, Some(-1))?;
        let gw = want.mul_scalar(3.0)?.backward()?.get(&xc).cloned().unwrap();
        let xg = x.to_device(dev)?.requires_grad();
        let got = xg.fused_classifier(&t.to_device(dev)?, Some(-1))?;
        let gg = got.mul_scalar(3.0)?.backward()?.get(&xg).cloned().unwrap();
        assert!((got.item_f64()? - want.item_f64()?).abs() <= tl * want.item_f64()?.abs());
        assert!(max_abs_diff(&gg.to_dtype(DType::F64)?, &gw) * 11.0 <= 3.0 * tg, "{dtype} tape gradient");
    }
    // Masked logits: -inf entries (not the target) take no probability; a row of -inf whose target
    // is ignored gets gradient 0 (its log-sum-exp is -inf: the kernel's non-finite path).
    for dtype in [DType::F32, DType::BF16] {
        let (tl, tg) = tol(dtype);
        let (rows, cols) = (5, 4099);
        let mut v = randn(&mut rng, rows, cols, 2.0, DType::F64).to_f64_vec()?;
        for (i, e) in v.iter_mut().enumerate() {
            if (i % cols) % 3 == 1 || i / cols == 3 {
                *e = f64::NEG_INFINITY;
            }
        }
        let x = Tensor::from_vec(v, (rows, cols), CPU)?.to_dtype(dtype)?;
        let t = Tensor::from_vec(vec![0i32, 3, 6, -1, 4098], rows, CPU)?;
        let opts = ClassifierOpts { ignore_index: Some(-1), ..Default::default() };
        let (want_l, want_d) = x.to_dtype(DType::F64)?.classifier_loss_grad(&t, opts)?;
        let (l, d) = x.to_device(dev)?.classifier_loss_grad(&t.to_device(dev)?, opts)?;
        let (a, b) = (l.item_f64()?, want_l.item_f64()?);
        assert!((a - b).abs() <= tl * b.abs().max(1.0), "{dtype} masked: loss {a} vs {b}");
        let err = max_abs_diff(&d.to_dtype(DType::F64)?, &want_d) * rows as f64;
        assert!(err <= tg, "{dtype} masked: gradient error {err}");
    }
    // Every row ignored: NaN loss (0 / 0, as PyTorch) and a zero gradient.
    let x = randn(&mut rng, 3, 40, 1.0, DType::F32).to_device(dev)?;
    let t = Tensor::from_vec(vec![-1i32; 3], 3, dev)?;
    let (l, d) = x.classifier_loss_grad(&t, ClassifierOpts { ignore_index: Some(-1), ..Default::default() })?;
    assert!(l.item_f64()?.is_nan());
    assert!(d.to_f64_vec()?.iter().all(|&v| v == 0.0));
    Ok(())
}
