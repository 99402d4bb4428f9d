//! Residual add + layer norm (`src/fused/add_layer_norm/`): the CPU op against its definition
//! (`x + r`, then `layer_norm`), gradcheck in f64 through both outputs, typed errors, and CPU <-> CUDA
//! parity of both outputs and every gradient in f32, f16 and bf16 on odd widths and strided inputs.
//! CUDA outputs are poisoned (NaN) before the kernels; without a GPU the CUDA tests print one line
//! and pass.

mod common;

use common::{gpu, gradcheck, max_err as err, randn};
use ferrograd_core::{DType, Device, Error, Result, Rng, Tensor};

const CPU: Device = Device::Cpu;

/// A scalar that depends on both outputs with weights that vary per element.
fn loss(h: &Tensor, y: &Tensor, gh: &Tensor, gy: &Tensor) -> Result<Tensor> {
    h.mul(gh)?.sum_all()?.add(&y.mul(gy)?.sum_all()?)
}

#[test]
fn cpu_matches_add_then_layer_norm() -> Result<()> {
    let mut rng = Rng::new(1);
    for dtype in [DType::F64, DType::F32, DType::BF16, DType::F16] {
        for &(rows, c) in &[(3, 1), (4, 17), (2, 64), (0, 5)] {
            let (x, r) = (randn(&mut rng, &[rows, c], dtype), randn(&mut rng, &[rows, c], dtype));
            let (w, b) = (randn(&mut rng, &[c], dtype), randn(&mut rng, &[c], dtype));
            let (h, y) = x.add_layer_norm(&r, Some(&w), Some(&b), 1e-5)?;
            let h_ref = x.add(&r)?;
            let y_ref = h_ref.layer_norm(Some(&w), Some(&b), 1e-5)?;
            assert_eq!(h.to_f64_vec()?, h_ref.to_f64_vec()?, "{dtype} {rows}x{c}: h");
            assert_eq!(y.to_f64_vec()?, y_ref.to_f64_vec()?, "{dtype} {rows}x{c}: y");
            assert_eq!((h.dtype(), y.dtype()), (dtype, dtype));
        }
    }
    // Without weight / bias, and a 3-d strided x.
    let x = randn(&mut rng, &[5, 2, 3], DType::F64).permute(&[1, 2, 0])?;
    let r = randn(&mut rng, &[2, 3, 5], DType::F64);
    let (h, y) = x.add_layer_norm(&r, None, None, 1e-5)?;
    assert_eq!(y.to_f64_vec()?, x.add(&r)?.layer_norm(None, None, 1e-5)?.to_f64_vec()?);
    assert_eq!(h.dims(), [2, 3, 5]);
    Ok(())
}

/// Central differences on the f64 CPU op: d loss / d input for every input, loss over both outputs.
#[test]
fn gradcheck_f64() -> Result<()> {
    let mut rng = Rng::new(2);
    let (rows, c) = (3, 6);
    let xs: Vec<Tensor> =
        [vec![rows, c], vec![rows, c], vec![c], vec![c]].iter().map(|d| randn(&mut rng, d, DType::F64)).collect();
    let (gh, gy) = (randn(&mut rng, &[rows, c], DType::F64), randn(&mut rng, &[rows, c], DType::F64));
    let f = |v: &[Tensor]| -> Result<Tensor> {
        let (h, y) = v[0].add_layer_norm(&v[1], Some(&v[2]), Some(&v[3]), 1e-5)?;
        loss(&h, &y, &gh, &gy)
    };
    gradcheck("add_layer_norm", f, &xs);
    let vars: Vec<Tensor> = xs.iter().map(|t| t.requires_grad()).collect();
    let grads = f(&vars)?.backward()?;
    // dx == dr: the residual's gradient is the input's.
    assert_eq!(grads.get(&vars[0]).unwrap().to_f64_vec()?, grads.get(&vars[1]).unwrap().to_f64_vec()?);
    Ok(())
}

#[test]
fn bad_inputs_are_typed_errors() -> Result<()> {
    let mut rng = Rng::new(3);
    let x = randn(&mut rng, &[2, 4], DType::F32);
    let e = x.add_layer_norm(&randn(&mut rng, &[2, 5], DType::F32), None, None, 1e-5).unwrap_err();
    assert!(matches!(e, Error::ShapeMismatch { .. }), "{e}");
    let e = x.add_layer_norm(&randn(&mut rng, &[4], DType::F32), None, None, 1e-5).unwrap_err();
    assert!(matches!(e, Error::ShapeMismatch { .. }), "broadcast residual: {e}");
    let e = x.add_layer_norm(&randn(&mut rng, &[2, 4], DType::F64), None, None, 1e-5).unwrap_err();
    assert!(matches!(e, Error::DTypeMismatch { .. }), "{e}");
    let e = x.add_layer_norm(&x, Some(&randn(&mut rng, &[3], DType::F32)), None, 1e-5).unwrap_err();
    assert!(matches!(e, Error::Shape { .. }) && e.to_string().contains("weight"), "{e}");
    let e = x.add_layer_norm(&x, None, Some(&randn(&mut rng, &[4], DType::BF16)), 1e-5).unwrap_err();
    assert!(matches!(e, Error::DTypeMismatch { .. }), "{e}");
    let ids = Tensor::from_vec(vec![1u32, 2], 2, CPU)?;
    assert!(ids.add_layer_norm(&ids, None, None, 1e-5).is_err());
    let s = Tensor::from_vec(vec![1f32], (), CPU)?;
    assert!(matches!(s.add_layer_norm(&s, None, None, 1e-5).unwrap_err(), Error::Shape { .. }));
    if let Some(g) = gpu() {
        let e = x.to_device(g)?.add_layer_norm(&x, None, None, 1e-5).unwrap_err();
        assert!(matches!(e, Error::DeviceMismatch { .. }), "{e}");
    }
    Ok(())
}

// ---- CUDA parity -----------------------------------------------------------------------------------

/// Allowed `err` against the f64 CPU op on the same (rounded) inputs: (outputs, gradients).
fn tol(dtype: DType) -> (f64, f64) {
    match dtype {
        DType::F32 => (2e-5, 5e-5),
        DType::F16 => (4e-3, 8e-3),
        _ => (3e-2, 5e-2),
    }
}

/// Forward and every gradient on `dev` against the f64 CPU op on the same values. `strided`: x is
/// a transposed view and r a narrowed one (the kernel gets contiguous copies).
fn parity(dev: Device, dtype: DType, rows: usize, c: usize, strided: bool) -> Result<()> {
    let mut rng = Rng::new(rows as u64 * 1000 + c as u64);
    let x = if strided { randn(&mut rng, &[c, rows], dtype).t()? } else { randn(&mut rng, &[rows, c], dtype) };
    let r = if strided {
        randn(&mut rng, &[rows, c + 3], dtype).narrow(1, 1, c)?
    } else {
        randn(&mut rng, &[rows, c], dtype)
    };
    let (w, b) = (randn(&mut rng, &[c], dtype), randn(&mut rng, &[c], dtype));
    let (gh, gy) = (randn(&mut rng, &[rows, c], dtype), randn(&mut rng, &[rows, c], dtype));
    let run = |d: Device, dt: DType| -> Result<(Vec<Tensor>, Vec<Tensor>)> {
        let cv = |t: &Tensor| t.to_dtype(dt).and_then(|t| t.to_device(d));
        let ins = [cv(&x)?, cv(&r)?, cv(&w)?, cv(&b)?];
        let vars: Vec<Tensor> = ins.iter().map(|t| t.requires_grad()).collect();
        let (h, y) = vars[0].add_layer_norm(&vars[1], Some(&vars[2]), Some(&vars[3]), 1e-5)?;
        let grads = loss(&h, &y, &cv(&gh)?, &cv(&gy)?)?.backward()?;
        let g = vars.iter().map(|v| grads.get(v).cloned().expect("gradient")).collect();
        Ok((vec![h, y], g))
    };
    let (outs, grads) = run(dev, dtype)?;
    let (ro, rg) = run(CPU, DType::F64)?;
    let (to, tg) = tol(dtype);
    let what = format!("{dtype} {rows}x{c} strided={strided}");
    for (i, (a, e)) in outs.iter().zip(&ro).enumerate() {
        assert_eq!(a.dtype(), dtype);
        let d = err(a, e);
        assert!(d <= to, "{what}: output {i} err {d:e}");
    }
    for (i, (a, e)) in grads.iter().zip(&rg).enumerate() {
        // dweight / dbias sum over rows: scale the tolerance by sqrt(rows).
        let t = if i >= 2 { tg * (rows as f64).sqrt().max(1.0) } else { tg };
        let d = err(a, e);
        assert!(d <= t, "{what}: gradient {i} err {d:e}");
    }
    Ok(())
}

#[test]
fn cuda_parity_odd_widths() -> Result<()> {
    let Some(dev) = gpu() else { return Ok(()) };
    for dtype in [DType::F32, DType::BF16, DType::F16, DType::F64] {
        for &(rows, c) in &[(5, 1), (7, 17), (33, 768), (6, 1000), (3, 8), (2, 16384)] {
            parity(dev, dtype, rows, c, false)?;
        }
        parity(dev, dtype, 9, 24, true)?;
        parity(dev, dtype, 4, 768, true)?;
    }
    Ok(())
}

/// A row of h cached in shared memory and one that is not (cols * 4 bytes > 48 KiB): same values.
#[test]
fn cuda_long_rows_and_empty() -> Result<()> {
    let Some(dev) = gpu() else { return Ok(()) };
    parity(dev, DType::BF16, 3, 20000, false)?;
    parity(dev, DType::F32, 2, 13000, false)?;
    let x = Tensor::zeros((0, 8), DType::BF16, dev)?;
    let (h, y) = x.add_layer_norm(&x, None, None, 1e-5)?;
    assert_eq!((h.dims(), y.dims()), ([0, 8].as_slice(), [0, 8].as_slice()));
    Ok(())
}
