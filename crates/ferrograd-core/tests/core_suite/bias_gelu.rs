//! Bias + GELU (`src/fused/bias_gelu/`): the op against `x.add(b).gelu_tanh()` built from
//! primitives, gradcheck in f64 on every device (contiguous, 3-D and strided inputs), typed
//! errors, and CPU <-> CUDA parity of the forward and both gradients in f32, f64, f16 and bf16 on
//! odd shapes, strided x and empty tensors. CUDA outputs are poisoned (NaN) before the kernels;
//! without a GPU the CUDA tests print one line and pass.

use crate::common;

use common::{assert_close, dev, gpu, gradcheck, max_err, on, randn, rounding_tol};
use ferrograd_core::{DType, Device, Error, Result, Rng, Tensor};

const CPU: Device = Device::Cpu;

backend_tests!(gradcheck_f64, matches_add_then_gelu_tanh);

/// `(y, dx, db)` of the op for the upstream gradient `dy`.
fn value_and_grads(x: &Tensor, b: &Tensor, dy: &Tensor, fused: bool) -> Result<(Tensor, Tensor, Tensor)> {
    let (xv, bv) = (x.requires_grad(), b.requires_grad());
    let y = if fused { xv.bias_gelu(&bv)? } else { xv.add(&bv)?.gelu_tanh()? };
    let g = y.backward_with(dy)?;
    let grad = |t: &Tensor| g.get(t).cloned().ok_or_else(|| Error::Backward("a missing gradient".into()));
    Ok((y.detach(), grad(&xv)?, grad(&bv)?))
}

/// The same values and gradients as the unfused graph: bit for bit in f64 (one formula, one
/// order of operations), to within rounding in the other dtypes.
fn matches_add_then_gelu_tanh() -> Result<()> {
    let mut rng = Rng::new(1);
    for dtype in [DType::F64, DType::F32, DType::BF16, DType::F16] {
        for dims in [vec![5, 7], vec![2, 3, 16], vec![1, 1]] {
            let c = dims[dims.len() - 1];
            let x = on(&randn(&mut rng, &dims, dtype).mul_scalar(2.0)?, dev());
            let b = on(&randn(&mut rng, &[c], dtype), dev());
            let dy = on(&randn(&mut rng, &dims, dtype), dev());
            let (y, dx, db) = value_and_grads(&x, &b, &dy, true)?;
            let (ye, dxe, dbe) = value_and_grads(&x, &b, &dy, false)?;
            assert_eq!((y.dtype(), y.device(), y.dims()), (dtype, dev(), x.dims()));
            let what = format!("{dtype} {dims:?} on {}", dev());
            let rows = (x.elem_count() / c) as f64;
            for (name, a, e, scale) in [("y", &y, &ye, 1.0), ("dx", &dx, &dxe, 1.0), ("db", &db, &dbe, rows.sqrt())] {
                let d = max_err(a, e);
                let t = if dtype == DType::F64 && dev() == CPU { 0.0 } else { rounding_tol(dtype) * scale };
                assert!(d <= t, "{what}: {name} err {d:e} > {t:e}");
            }
        }
    }
    Ok(())
}

/// Central differences in f64 on the test's device: contiguous, 3-D, x transposed and b a view at
/// an offset.
fn gradcheck_f64() -> Result<()> {
    let mut rng = Rng::new(2);
    let f = |v: &[Tensor]| v[0].bias_gelu(&v[1]);
    for dims in [vec![3, 5], vec![2, 3, 4], vec![1, 1], vec![4, 1]] {
        let c = dims[dims.len() - 1];
        let (x, b) = (randn(&mut rng, &dims, DType::F64), randn(&mut rng, &[c], DType::F64));
        gradcheck(&format!("bias_gelu {dims:?}"), f, &[on(&x, dev()), on(&b, dev())]);
    }
    let xt = on(&randn(&mut rng, &[6, 4], DType::F64), dev()).t()?;
    let bn = on(&randn(&mut rng, &[9], DType::F64), dev()).narrow(0, 2, 6)?;
    assert!(!xt.is_contiguous());
    gradcheck("bias_gelu strided", f, &[xt, bn]);
    Ok(())
}

#[test]
fn bad_inputs_are_typed_errors() -> Result<()> {
    let mut rng = Rng::new(3);
    let x = randn(&mut rng, &[2, 4], DType::F32);
    let e = x.bias_gelu(&randn(&mut rng, &[3], DType::F32)).unwrap_err();
    assert!(matches!(e, Error::ShapeMismatch { op: "bias_gelu", .. }), "{e}");
    let e = x.bias_gelu(&randn(&mut rng, &[2, 4], DType::F32)).unwrap_err();
    assert!(matches!(e, Error::ShapeMismatch { .. }), "a full-shape bias: {e}");
    let e = x.bias_gelu(&randn(&mut rng, &[4], DType::BF16)).unwrap_err();
    assert!(matches!(e, Error::DTypeMismatch { .. }), "{e}");
    let ids = Tensor::from_vec(vec![1u32, 2], 2, CPU)?;
    assert!(matches!(ids.bias_gelu(&ids).unwrap_err(), Error::UnsupportedDType { .. }));
    let s = Tensor::from_vec(vec![1f32], (), CPU)?;
    assert!(matches!(s.bias_gelu(&s).unwrap_err(), Error::Shape { .. }));
    if let Some(g) = gpu() {
        let e = x.to_device(g)?.bias_gelu(&randn(&mut rng, &[4], DType::F32)).unwrap_err();
        assert!(matches!(e, Error::DeviceMismatch { .. }), "{e}");
    }
    Ok(())
}

// ---- CUDA parity -----------------------------------------------------------------------------------

/// Forward, dx and db on the GPU against the CPU op on the same values in the same dtype. `x` is
/// `[rows, c]` made contiguous, transposed (`[c, rows]` stored) or narrowed (columns of a wider row).
fn parity(dev: Device, dtype: DType, rows: usize, c: usize, layout: &str) -> Result<()> {
    let mut rng = Rng::new((rows * 131 + c) as u64);
    // The stored buffer (scaled first: an op on a view returns a contiguous tensor), then the view
    // taken on each device, so the kernel reads the layout under test.
    let base = match layout {
        "transposed" => randn(&mut rng, &[c, rows], dtype),
        "narrowed" => randn(&mut rng, &[rows, c + 3], dtype),
        _ => randn(&mut rng, &[rows, c], dtype),
    }
    .mul_scalar(2.0)?;
    let view = |t: &Tensor| match layout {
        "transposed" => t.t(),
        "narrowed" => t.narrow(1, 2, c),
        _ => Ok(t.clone()),
    };
    let x = view(&base)?;
    let (b, dy) = (randn(&mut rng, &[c], dtype), randn(&mut rng, &[rows, c], dtype));
    let (y, dx, db) = value_and_grads(&x, &b, &dy, true)?;
    let xd = view(&on(&base, dev))?;
    assert_eq!(xd.is_contiguous(), layout == "contiguous");
    let (yd, dxd, dbd) = value_and_grads(&xd, &on(&b, dev), &on(&dy, dev), true)?;
    let what = format!("bias_gelu {dtype} {rows}x{c} {layout}");
    assert_close(&format!("{what} y"), &y, &yd, 1.0);
    assert_close(&format!("{what} dx"), &dx, &dxd, 1.0);
    // db sums `rows` values: f32 partial sums on the device, f64 on the host.
    let d = max_err(&dbd, &db);
    let t = rounding_tol(dtype) * (rows as f64).sqrt().max(1.0);
    assert!(d <= t, "{what} db: err {d:e} > {t:e}");
    Ok(())
}

#[test]
fn cuda_parity_odd_shapes_every_dtype() -> Result<()> {
    let Some(dev) = gpu() else { return Ok(()) };
    for dtype in [DType::F32, DType::BF16, DType::F16, DType::F64] {
        for &(rows, c) in &[(1, 1), (7, 17), (33, 768), (5, 1000), (3, 3072), (1000, 7), (4097, 3)] {
            parity(dev, dtype, rows, c, "contiguous")?;
        }
        parity(dev, dtype, 9, 24, "transposed")?;
        parity(dev, dtype, 13, 100, "narrowed")?;
    }
    Ok(())
}

#[test]
fn cuda_three_dims_and_empty() -> Result<()> {
    let Some(dev) = gpu() else { return Ok(()) };
    let mut rng = Rng::new(5);
    let (x, b) = (randn(&mut rng, &[2, 5, 12], DType::BF16), randn(&mut rng, &[12], DType::BF16));
    let dy = randn(&mut rng, &[2, 5, 12], DType::BF16);
    let (y, dx, db) = value_and_grads(&x, &b, &dy, true)?;
    let (yd, dxd, dbd) = value_and_grads(&on(&x, dev), &on(&b, dev), &on(&dy, dev), true)?;
    assert_close("3-d y", &y, &yd, 1.0);
    assert_close("3-d dx", &dx, &dxd, 1.0);
    assert_close("3-d db", &db, &dbd, 4.0);
    for dims in [[0usize, 8], [4, 0]] {
        let x = Tensor::zeros(dims.to_vec(), DType::F32, dev)?;
        let b = Tensor::zeros(dims[1], DType::F32, dev)?;
        let (y, dx, db) = value_and_grads(&x, &b, &x, true)?;
        assert_eq!((y.dims(), dx.dims(), db.dims()), (&dims[..], &dims[..], &dims[1..]));
        assert!(db.to_f64_vec()?.iter().all(|&v| v == 0.0), "db of no rows is 0");
    }
    Ok(())
}

#[test]
fn bench_workload_reference_matches_the_op() -> Result<()> {
    use ferrograd_core::fused::bench::Workload;
    use ferrograd_core::fused::bias_gelu::bench::BiasGeluBench;
    let mut rng = Rng::new(6);
    for dtype in [DType::F64, DType::BF16] {
        let w = BiasGeluBench::new(randn(&mut rng, &[4, 9], dtype), randn(&mut rng, &[9], dtype));
        let y = w.run()?;
        for r in 0..4 {
            let got = y.narrow(0, r, 1)?.to_f64_vec()?;
            let want = w.reference(r)?;
            let t = if dtype == DType::F64 { 1e-15 } else { 4e-3 };
            for (g, e) in got.iter().zip(&want) {
                assert!((g - e).abs() <= t * (1.0 + e.abs()), "{dtype} row {r}: {g} vs {e}");
            }
        }
        let (_, grads) = w.forward_backward(&randn(&mut rng, &[4, 9], dtype))?;
        assert_eq!((grads[0].dims(), grads[1].dims()), ([4, 9].as_slice(), [9].as_slice()));
    }
    Ok(())
}
