//! Mean squared error (`src/fused/mse_loss/`): the fused op against `sub`, `sqr`, `mean_all` built
//! from primitives, gradcheck in f64 on every device (both inputs, contiguous and strided), typed
//! errors, and CPU <-> CUDA parity of the loss and both gradients in f32, f64, f16 and bf16 over
//! sizes from one element to more than one block per SM. CUDA outputs are poisoned (NaN) before the
//! kernels; without a GPU the CUDA tests print one line and pass.

use crate::common;

use common::{dev, gpu, gradcheck, max_err, on, randn, rounding_tol};
use ferrograd_core::{DType, Device, Error, Result, Rng, Tensor};

const CPU: Device = Device::Cpu;

backend_tests!(gradcheck_f64, matches_sub_sqr_mean);

/// `(loss, dpred, dtarget)` for the upstream gradient `g` (a scalar; the tests pass `n` times a
/// constant, so that the gradients are of order one and a wrong scale cannot hide in rounding).
fn value_and_grads(p: &Tensor, t: &Tensor, g: f64, fused: bool) -> Result<(Tensor, Tensor, Tensor)> {
    let (pv, tv) = (p.requires_grad(), t.requires_grad());
    let loss = if fused { pv.mse_loss(&tv)? } else { pv.sub(&tv)?.sqr()?.mean_all()? };
    let seed = Tensor::full(g, (), p.dtype(), p.device())?;
    let gs = loss.backward_with(&seed)?;
    let grad = |x: &Tensor| gs.get(x).cloned().ok_or_else(|| Error::Backward("a missing gradient".into()));
    Ok((loss.detach(), grad(&pv)?, grad(&tv)?))
}

/// The same loss and gradients as the composite, to within rounding (the sum's order differs).
fn matches_sub_sqr_mean() -> Result<()> {
    let mut rng = Rng::new(1);
    for dtype in [DType::F64, DType::F32, DType::BF16, DType::F16] {
        for dims in [vec![1], vec![5, 7], vec![3, 4, 33], vec![100, 71]] {
            let p = on(&randn(&mut rng, &dims, dtype), dev());
            let t = on(&randn(&mut rng, &dims, dtype), dev());
            let g = 1.5 * p.elem_count() as f64;
            let (l, dp, dt) = value_and_grads(&p, &t, g, true)?;
            let (le, dpe, dte) = value_and_grads(&p, &t, g, false)?;
            assert_eq!((l.dtype(), l.device(), l.dims()), (dtype, dev(), &[][..]));
            let what = format!("{dtype} {dims:?} on {}", dev());
            // The loss sums n squares: f32 partial sums against the composite's reduction.
            let n = (p.elem_count() as f64).sqrt();
            for (name, a, e, scale) in [("loss", &l, &le, n), ("dpred", &dp, &dpe, 2.0), ("dtarget", &dt, &dte, 2.0)] {
                let d = max_err(a, e);
                let want = rounding_tol(dtype) * scale;
                assert!(d <= want, "{what}: {name} err {d:e} > {want:e}");
            }
        }
    }
    Ok(())
}

/// Central differences in f64 on the test's device: both inputs, contiguous and transposed.
fn gradcheck_f64() -> Result<()> {
    let mut rng = Rng::new(2);
    let f = |v: &[Tensor]| v[0].mse_loss(&v[1]);
    for dims in [vec![1], vec![3, 5], vec![2, 3, 4]] {
        let (p, t) = (randn(&mut rng, &dims, DType::F64), randn(&mut rng, &dims, DType::F64));
        gradcheck(&format!("mse_loss {dims:?}"), f, &[on(&p, dev()), on(&t, dev())]);
    }
    let pt = on(&randn(&mut rng, &[6, 4], DType::F64), dev()).t()?;
    let tn = on(&randn(&mut rng, &[4, 9], DType::F64), dev()).narrow(1, 2, 6)?;
    assert!(!pt.is_contiguous() && !tn.is_contiguous());
    gradcheck("mse_loss strided", f, &[pt, tn]);
    Ok(())
}

#[test]
fn bad_inputs_are_typed_errors() -> Result<()> {
    let mut rng = Rng::new(3);
    let x = randn(&mut rng, &[2, 4], DType::F32);
    let e = x.mse_loss(&randn(&mut rng, &[8], DType::F32)).unwrap_err();
    assert!(matches!(e, Error::ShapeMismatch { op: "mse_loss", .. }), "{e}");
    let e = x.mse_loss(&randn(&mut rng, &[2, 4], DType::BF16)).unwrap_err();
    assert!(matches!(e, Error::DTypeMismatch { op: "mse_loss", .. }), "{e}");
    let ids = Tensor::from_vec(vec![1u32, 2], 2, CPU)?;
    assert!(matches!(ids.mse_loss(&ids).unwrap_err(), Error::UnsupportedDType { .. }));
    // No elements: NaN, as PyTorch's mean of nothing.
    let empty = Tensor::zeros((0, 3), DType::F32, CPU)?;
    assert!(empty.mse_loss(&empty)?.item_f64()?.is_nan());
    if let Some(g) = gpu() {
        let e = x.to_device(g)?.mse_loss(&x).unwrap_err();
        assert!(matches!(e, Error::DeviceMismatch { .. }), "{e}");
        let empty = Tensor::zeros((0, 3), DType::F32, g)?;
        assert!(empty.mse_loss(&empty)?.item_f64()?.is_nan());
    }
    Ok(())
}

#[test]
fn cuda_parity_every_dtype_and_size() -> Result<()> {
    let Some(g) = gpu() else { return Ok(()) };
    let mut rng = Rng::new(4);
    for dtype in [DType::F32, DType::BF16, DType::F16, DType::F64] {
        for n in [1usize, 7, 255, 1025, 5041 * 71, 1 << 21] {
            if dtype == DType::F16 && n > 40_000 {
                continue; // the seed g = 0.75 n would overflow f16
            }
            let (p, t) = (randn(&mut rng, &[n], dtype), randn(&mut rng, &[n], dtype));
            let (l, dp, dt) = value_and_grads(&p, &t, 0.75 * n as f64, true)?;
            let (ld, dpd, dtd) = value_and_grads(&on(&p, g), &on(&t, g), 0.75 * n as f64, true)?;
            let what = format!("mse_loss {dtype} n={n}");
            let scale = (n as f64).sqrt();
            for (name, a, e, s) in [("loss", &ld, &l, scale), ("dpred", &dpd, &dp, 2.0), ("dtarget", &dtd, &dt, 2.0)] {
                let d = max_err(a, e);
                assert!(d <= rounding_tol(dtype) * s, "{what} {name}: err {d:e}");
            }
        }
    }
    Ok(())
}
