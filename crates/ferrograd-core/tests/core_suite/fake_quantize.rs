//! Fake quantization (`src/fused/fake_quantize/`): hand-computed forward values and gradients (ties
//! at .5 rounding to even, zero points, clamping, per tensor and per channel), the learnable
//! (LSQ) scale and zero-point gradients, an independent f32 reference on random inputs, gradcheck
//! where the straight-through / LSQ gradient is the true derivative (saturated elements), typed
//! errors, and CUDA against the CPU op in f32, f64, f16 and bf16 (outputs poisoned).

use crate::common;

use common::{dev, gpu, gradcheck_tol, on, randn, Tol};
use ferrograd_core::{DType, Device, Error, FakeQuant, Result, Rng, Tensor};

backend_tests!(
    hand_computed_per_tensor,
    hand_computed_per_channel,
    hand_computed_lsq,
    random_matches_f32_reference,
    gradcheck_saturated_f64
);

const CPU: Device = Device::Cpu;

fn t(v: &[f64], dims: &[usize], dtype: DType) -> Tensor {
    on(&Tensor::from_vec(v.to_vec(), dims.to_vec(), CPU).and_then(|t| t.to_dtype(dtype)).expect("tensor"), dev())
}

fn f32s(v: &[f64]) -> Tensor {
    t(v, &[v.len()], DType::F32)
}

/// `(y, dx, dscale, dzero_point)` for upstream `dy` (the last two `None` without learning).
fn run(
    x: &Tensor,
    s: &Tensor,
    z: &Tensor,
    q: FakeQuant,
    dy: &Tensor,
) -> Result<(Tensor, Tensor, Option<Tensor>, Option<Tensor>)> {
    let (xv, sv, zv) = (x.requires_grad(), s.requires_grad(), z.requires_grad());
    let y = xv.fake_quantize(&sv, &zv, q)?;
    let g = y.backward_with(dy)?;
    let dx = g.get(&xv).cloned().ok_or_else(|| Error::Backward("no dx".into()))?;
    Ok((y.detach(), dx, g.get(&sv).cloned(), g.get(&zv).cloned()))
}

fn vals(t: &Tensor) -> Vec<f64> {
    t.to_f64_vec().expect("values")
}

fn hand_computed_per_tensor() -> Result<()> {
    for dtype in [DType::F32, DType::F64, DType::BF16, DType::F16] {
        // Ties at .5 go to the even neighbour (scale 1, then scale 0.5: x * 2 lands on .5).
        let x = t(&[0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 0.25, 0.75], &[8], dtype);
        let y = x.fake_quantize_per_tensor(1.0, 0, -128, 127)?;
        assert_eq!(vals(&y)[..6], [0.0, 2.0, 2.0, 0.0, -2.0, -2.0], "{dtype} ties, scale 1");
        let y = x.fake_quantize_per_tensor(0.5, 0, -128, 127)?;
        assert_eq!(vals(&y)[6..], [0.0, 1.0], "{dtype} ties, scale 0.5");
        // Zero point 3 on [0, 15], scale 0.5: x * 2 + 3, clamped, then (q - 3) * 0.5.
        let x = t(&[1.0, -2.0, 6.25, 6.75, -1.5, -1.75], &[2, 3], dtype);
        let dy = t(&[1.0, 2.0, 3.0, 4.0, 5.0, 6.0], &[2, 3], dtype);
        let q = FakeQuant { qmin: 0, qmax: 15, axis: None, grad_factor: None };
        let (y, dx, ds, dz) = run(&x, &f32s(&[0.5]), &f32s(&[3.0]), q, &dy)?;
        assert_eq!(vals(&y), [1.0, -1.5, 6.0, 6.0, -1.5, -1.5], "{dtype} zero point, clamp");
        // The straight-through estimator: dy where raw = round(x / s) + zp is in [0, 15].
        assert_eq!(vals(&dx), [1.0, 0.0, 3.0, 0.0, 5.0, 0.0], "{dtype} STE mask");
        assert!(ds.is_none() && dz.is_none(), "fixed scale and zero point get no gradient");
        // A fractional zero point is rounded half to even (2.5 -> 2) and clamped (20 -> 15).
        let y = x.fake_quantize(&f32s(&[0.5]), &f32s(&[2.5]), q)?;
        assert_eq!(vals(&y)[0], 1.0);
        let y = x.fake_quantize(&f32s(&[0.5]), &f32s(&[20.0]), q)?;
        assert_eq!(vals(&y)[..2], [0.0, -2.0], "{dtype} zero point clamped to 15 (20 gives -2.5, -2.5)");
    }
    Ok(())
}

fn hand_computed_per_channel() -> Result<()> {
    for dtype in [DType::F32, DType::BF16] {
        // Rows: scale 1 zp 0, and scale 0.25 zp -2, on [-4, 3].
        let x = t(&[2.5, 3.5, -5.0, 0.125, 1.0, -0.5], &[2, 3], dtype);
        let (s, z) = (f32s(&[1.0, 0.25]), f32s(&[0.0, -2.0]));
        let y = x.fake_quantize_per_channel(&s, &z, 0, -4, 3)?;
        assert_eq!(vals(&y), [2.0, 3.0, -4.0, 0.0, 1.0, -0.5], "{dtype} per row");
        let q = FakeQuant { qmin: -4, qmax: 3, axis: Some(0), grad_factor: None };
        let (_, dx, _, _) = run(&x, &s, &z, q, &t(&[1.0; 6], &[2, 3], dtype))?;
        assert_eq!(vals(&dx), [1.0, 0.0, 0.0, 1.0, 1.0, 1.0], "{dtype} per-row mask");
        // The same per row of a strided view, and along axis 1 of the transposed view.
        let xv = x.t()?.contiguous()?.t()?;
        assert!(!xv.is_contiguous());
        assert_eq!(vals(&xv.fake_quantize_per_channel(&s, &z, 0, -4, 3)?), [2.0, 3.0, -4.0, 0.0, 1.0, -0.5]);
        let xt = x.t()?;
        assert!(!xt.is_contiguous());
        let y = xt.fake_quantize_per_channel(&s, &z, 1, -4, 3)?;
        assert_eq!(vals(&y), [2.0, 0.0, 3.0, 1.0, -4.0, -0.5], "{dtype} per column of a view");
        // A middle axis: [2, 2, 2] with channels on dim 1.
        let x3 = t(&[0.5, 1.5, 0.5, 1.5, 0.5, 1.5, 0.5, 1.5], &[2, 2, 2], dtype);
        let y = x3.fake_quantize_per_channel(&f32s(&[1.0, 0.5]), &f32s(&[0.0, 0.0]), 1, -128, 127)?;
        assert_eq!(vals(&y), [0.0, 2.0, 0.5, 1.5, 0.0, 2.0, 0.5, 1.5], "{dtype} axis 1 of 3");
    }
    Ok(())
}

/// LSQ: inside the range dscale = dy (y - x) / s; below dy (qmin - zp), above dy (qmax - zp);
/// dzp = -dy s outside, 0 inside; all times grad_factor, summed.
fn hand_computed_lsq() -> Result<()> {
    let x = t(&[0.3, 1.2, 5.0, -3.0], &[4], DType::F64);
    let dy = t(&[1.0, 2.0, 1.0, 1.0], &[4], DType::F64);
    for (gf, ds_want, dz_want) in [(1.0f32, -1.4, -1.0), (0.5, -0.7, -0.5)] {
        let q = FakeQuant { qmin: -4, qmax: 3, axis: None, grad_factor: Some(gf) };
        let (y, dx, ds, dz) = run(&x, &f32s(&[0.5]), &f32s(&[0.0]), q, &dy)?;
        assert_eq!(vals(&y), [0.5, 1.0, 1.5, -2.0]);
        assert_eq!(vals(&dx), [1.0, 2.0, 0.0, 0.0]);
        let (ds, dz) = (vals(&ds.expect("dscale")), vals(&dz.expect("dzero_point")));
        assert!((ds[0] - ds_want).abs() < 1e-6 && (dz[0] - dz_want).abs() < 1e-6, "gf {gf}: {ds:?} {dz:?}");
    }
    // Per channel: each channel sums its own elements (rows of [2, 2], channel 1 all clipped).
    let x = t(&[0.3, 1.2, 5.0, -3.0], &[2, 2], DType::F32);
    let q = FakeQuant { qmin: -4, qmax: 3, axis: Some(0), grad_factor: Some(1.0) };
    let (_, _, ds, dz) = run(&x, &f32s(&[0.5, 0.5]), &f32s(&[0.0, 1.0]), q, &t(&[1.0; 4], &[2, 2], DType::F32))?;
    let (ds, dz) = (vals(&ds.expect("dscale")), vals(&dz.expect("dzero_point")));
    // Row 0: (0.5 - 0.3) * 2 + (1 - 1.2) * 2 = 0; row 1 (zp 1): (3 - 1) + (-4 - 1) = -3, dz = -1.
    assert!(ds[0].abs() < 1e-6 && (ds[1] + 3.0).abs() < 1e-6, "{ds:?}");
    assert_eq!(dz, [0.0, -1.0]);
    Ok(())
}

/// The forward and dx in f32, written out independently of the library (PyTorch's CUDA functor).
fn reference_f32(x: &[f32], s: f32, z: f32, qmin: i32, qmax: i32) -> (Vec<f32>, Vec<bool>) {
    let inv = 1.0f32 / s;
    let z = z.round_ties_even().clamp(qmin as f32, qmax as f32);
    x.iter()
        .map(|&v| {
            let raw = (v * inv).round_ties_even() + z;
            ((raw.clamp(qmin as f32, qmax as f32) - z) * s, raw >= qmin as f32 && raw <= qmax as f32)
        })
        .unzip()
}

fn random_matches_f32_reference() -> Result<()> {
    let mut rng = Rng::new(7);
    let (rows, cols) = (6, 300);
    let x = randn(&mut rng, &[rows, cols], DType::F32).mul_scalar(3.0)?;
    let xs: Vec<f32> = x.to_f64_vec()?.iter().map(|&v| v as f32).collect();
    let scales: Vec<f64> = (0..rows).map(|r| 0.01 + 0.02 * r as f64).collect();
    let zps: Vec<f64> = (0..rows).map(|r| r as f64 - 3.0).collect();
    let y = on(&x, dev()).fake_quantize_per_channel(&f32s(&scales), &f32s(&zps), 0, -128, 127)?;
    let got = vals(&y);
    let mut clipped = 0;
    for r in 0..rows {
        let (want, mask) = reference_f32(&xs[r * cols..(r + 1) * cols], scales[r] as f32, zps[r] as f32, -128, 127);
        clipped += mask.iter().filter(|m| !**m).count();
        for (c, w) in want.iter().enumerate() {
            assert_eq!(got[r * cols + c], *w as f64, "row {r} col {c}");
        }
    }
    assert!(clipped > 10 && clipped < rows * cols / 2, "{clipped} clipped: the test must see both cases");
    Ok(())
}

/// Where an element is clipped the op is `(qmin|qmax - zp) * scale`: constant in x, linear in the
/// scale, so the STE (0) and LSQ (`qmin|qmax - zp`) gradients are the true derivatives there and
/// central differences must agree. Inside the range the op is a staircase: no derivative to check
/// (STE and LSQ are estimators by design), which the hand-computed tests cover.
fn gradcheck_saturated_f64() -> Result<()> {
    let mut rng = Rng::new(8);
    for (dims, axis) in [(vec![5], None), (vec![3, 4], Some(0)), (vec![2, 3, 2], Some(1))] {
        let v: Vec<f64> =
            randn(&mut rng, &dims, DType::F64).to_f64_vec()?.iter().map(|v| v + 40.0 * v.signum()).collect();
        let x = on(&Tensor::from_vec(v, dims.clone(), CPU)?, dev());
        let c = axis.map_or(1, |a| dims[a]);
        let s = on(&Tensor::from_vec((0..c).map(|i| 0.5 + 0.1 * i as f32).collect::<Vec<_>>(), c, CPU)?, dev());
        let z = f32s(&vec![2.0; c]);
        // grad_factor 1: the unscaled LSQ gradient is the derivative.
        let q = FakeQuant { qmin: -8, qmax: 7, axis, grad_factor: Some(1.0) };
        // The scale is f32 (as PyTorch's): checked through an f64 leaf cast to f32 inside, with a
        // step of 2^-10 that f32 holds exactly at these scales (the op is linear in it here).
        let f = |v: &[Tensor]| v[0].fake_quantize(&v[1].to_dtype(DType::F32)?, &z, q);
        let s64 = s.to_dtype(DType::F64)?;
        let tol = Tol { h: 1.0 / 1024.0, rtol: 1e-6, atol: 1e-9 };
        gradcheck_tol(&format!("fake_quantize saturated {dims:?} axis {axis:?}"), f, &[x, s64], tol);
    }
    Ok(())
}

#[test]
fn bad_inputs_are_typed_errors() -> Result<()> {
    let x = Tensor::from_vec(vec![1f32, 2.0, 3.0, 4.0], (2, 2), CPU)?;
    let (s, z) = (Tensor::from_vec(vec![0.1f32], 1, CPU)?, Tensor::from_vec(vec![0f32], 1, CPU)?);
    let q = FakeQuant::int8();
    let ids = Tensor::from_vec(vec![1i32, 2], 2, CPU)?;
    assert!(matches!(ids.fake_quantize(&s, &z, q).unwrap_err(), Error::UnsupportedDType { .. }));
    let s64 = s.to_dtype(DType::F64)?;
    assert!(matches!(x.fake_quantize(&s64, &z, q).unwrap_err(), Error::UnsupportedDType { .. }));
    let e = x.fake_quantize(&s, &z, FakeQuant { qmin: 5, qmax: 5, ..q }).unwrap_err();
    assert!(matches!(e, Error::InvalidArgument(_)), "{e}");
    assert!(matches!(x.fake_quantize(&s, &z, q.per_channel(2)).unwrap_err(), Error::Shape { .. }));
    assert!(matches!(x.fake_quantize(&s, &z, q.per_channel(0)).unwrap_err(), Error::Shape { .. }), "1 scale, 2 rows");
    let s2 = Tensor::from_vec(vec![0.1f32, 0.2], (1, 2), CPU)?;
    assert!(matches!(x.fake_quantize(&s2, &z, q).unwrap_err(), Error::Shape { .. }));
    let e = x.fake_quantize(&s, &z, q.learnable(f32::NAN)).unwrap_err();
    assert!(matches!(e, Error::InvalidArgument(_)), "{e}");
    if let Some(g) = gpu() {
        let e = x.to_device(g)?.fake_quantize(&s, &z, q).unwrap_err();
        assert!(matches!(e, Error::DeviceMismatch { .. }), "{e}");
    }
    Ok(())
}

// ---- CUDA parity -----------------------------------------------------------------------------------

/// y and dx bit for bit (one formula, each step rounded alike), dscale / dzp to summation order.
fn parity(g: Device, dtype: DType, dims: &[usize], axis: Option<usize>, learn: bool, transposed: bool) -> Result<()> {
    let mut rng = Rng::new(dims.iter().product::<usize>() as u64 + 11);
    let x = if transposed {
        let mut rev = dims.to_vec();
        rev.reverse();
        randn(&mut rng, &rev, dtype).mul_scalar(2.0)?.t()?
    } else {
        randn(&mut rng, dims, dtype).mul_scalar(2.0)?
    };
    let c = axis.map_or(1, |a| dims[a]);
    let s = Tensor::from_vec((0..c).map(|i| 0.01 + 0.003 * (i % 7) as f32).collect::<Vec<_>>(), c, CPU)?;
    let z = Tensor::from_vec((0..c).map(|i| (i % 5) as f32 - 2.0).collect::<Vec<_>>(), c, CPU)?;
    let dy = randn(&mut rng, dims, dtype);
    let q = FakeQuant { qmin: -128, qmax: 127, axis, grad_factor: learn.then_some(0.01) };
    let (y, dx, ds, dz) = run(&x, &s, &z, q, &dy)?;
    let xg = if transposed { on(&x.t()?, g).t()? } else { on(&x, g) };
    let (yg, dxg, dsg, dzg) = run(&xg, &on(&s, g), &on(&z, g), q, &on(&dy, g))?;
    let what = format!("fake_quantize {dtype} {dims:?} axis {axis:?} learn {learn} transposed {transposed}");
    assert_eq!(vals(&y), vals(&yg), "{what}: y");
    assert_eq!(vals(&dx), vals(&dxg), "{what}: dx");
    if learn {
        let per = (x.elem_count() / c.max(1)) as f64;
        for (name, a, b) in [("dscale", ds, dsg), ("dzp", dz, dzg)] {
            let (a, b) = (vals(&a.expect("cpu grad")), vals(&b.expect("cuda grad")));
            let scale = 1.0 + a.iter().fold(0.0f64, |m, v| m.max(v.abs()));
            for (i, (p, q)) in a.iter().zip(&b).enumerate() {
                assert!((p - q).abs() <= 1e-6 * per.sqrt() * scale, "{what}: {name}[{i}] cpu {p} cuda {q}");
            }
        }
    }
    Ok(())
}

#[test]
fn cuda_parity_every_dtype() -> Result<()> {
    let Some(g) = gpu() else { return Ok(()) };
    for dtype in [DType::F32, DType::BF16, DType::F16, DType::F64] {
        for learn in [false, true] {
            parity(g, dtype, &[1, 1], None, learn, false)?;
            parity(g, dtype, &[7, 17], None, learn, false)?;
            parity(g, dtype, &[7, 17], Some(0), learn, false)?;
            parity(g, dtype, &[7, 17], Some(1), learn, false)?;
            parity(g, dtype, &[4097, 3], Some(1), learn, false)?;
            parity(g, dtype, &[256, 3000], Some(0), learn, false)?;
            parity(g, dtype, &[300, 1000], None, learn, false)?;
            parity(g, dtype, &[3, 5, 7], Some(1), learn, false)?;
            parity(g, dtype, &[9, 24], Some(0), learn, true)?;
        }
    }
    Ok(())
}

#[test]
fn cuda_empty() -> Result<()> {
    let Some(g) = gpu() else { return Ok(()) };
    let x = Tensor::zeros(vec![0, 4], DType::F32, g)?;
    let (s, z) = (Tensor::ones(4, DType::F32, g)?, Tensor::zeros(4, DType::F32, g)?);
    let q = FakeQuant::int8().per_channel(1).learnable(1.0);
    let (y, dx, ds, _) = run(&x, &s, &z, q, &x)?;
    assert_eq!((y.dims(), dx.dims()), ([0, 4].as_slice(), [0, 4].as_slice()));
    assert_eq!(vals(&ds.expect("dscale")), [0.0; 4]);
    Ok(())
}

#[test]
fn bench_workload_reference_matches_the_op() -> Result<()> {
    use ferrograd_core::fused::bench::Workload;
    use ferrograd_core::fused::fake_quantize::bench::FakeQuantizeBench;
    let mut rng = Rng::new(9);
    for dtype in [DType::F64, DType::BF16, DType::F32] {
        let s = Tensor::from_vec(vec![0.01f32, 0.02, 0.015, 0.03], 4, CPU)?;
        let z = Tensor::from_vec(vec![0f32, 1.0, -3.0, 0.0], 4, CPU)?;
        let w = FakeQuantizeBench::new(randn(&mut rng, &[4, 90], dtype), s, z);
        let y = w.run()?;
        for r in 0..4 {
            assert_eq!(y.narrow(0, r, 1)?.to_f64_vec()?, w.reference(r)?, "{dtype} row {r}");
        }
    }
    Ok(())
}
