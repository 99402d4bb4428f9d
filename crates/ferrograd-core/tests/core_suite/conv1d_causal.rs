//! Causal depthwise conv1d (`src/fused/conv1d_causal/`): the op against the same convolution built
//! from primitives (left zero padding, `k` shifted views times the taps), a hand-computed case,
//! gradcheck of x, w and b in f64 on every device (with and without bias, strided inputs, k = 1,
//! k > len), typed errors, and CPU <-> CUDA parity of the forward and every gradient in f32, f64,
//! f16 and bf16 (lengths 1, odd, long; one channel, many channels; empty). CUDA outputs are
//! poisoned (NaN) before the kernels; without a GPU the CUDA tests print one line and pass.

use crate::common;

use common::{assert_close, dev, gpu, gradcheck, max_err, on, randn};
use ferrograd_core::{DType, Device, Error, Result, Rng, Tensor};

const CPU: Device = Device::Cpu;

backend_tests!(gradcheck_f64, matches_padded_shifted_sum);

/// `y = b + sum_j w[:, j] * pad(x)[.., j .. j + len]`, from primitives.
fn reference(x: &Tensor, w: &Tensor, b: Option<&Tensor>) -> Result<Tensor> {
    let (n, c, l) = (x.dims()[0], x.dims()[1], x.dims()[2]);
    let k = w.dims()[1];
    let pad = Tensor::zeros((n, c, k - 1), x.dtype(), x.device())?;
    let xp = Tensor::cat(&[pad, x.clone()], 2)?;
    let mut y: Option<Tensor> = None;
    for j in 0..k {
        let term = xp.narrow(2, j, l)?.mul(&w.narrow(1, j, 1)?.reshape((1, c, 1))?)?;
        y = Some(match y {
            Some(s) => s.add(&term)?,
            None => term,
        });
    }
    let y = y.ok_or_else(|| Error::InvalidArgument("k = 0".into()))?;
    match b {
        Some(b) => y.add(&b.reshape((1, c, 1))?),
        None => Ok(y),
    }
}

/// `(y, dx, dw, db)` for the upstream gradient `dy`, by the op or by [`reference`].
fn value_and_grads(
    x: &Tensor,
    w: &Tensor,
    b: Option<&Tensor>,
    dy: &Tensor,
    fused: bool,
) -> Result<(Tensor, Tensor, Tensor, Option<Tensor>)> {
    let (xv, wv, bv) = (x.requires_grad(), w.requires_grad(), b.map(|b| b.requires_grad()));
    let y = if fused { xv.conv1d_causal(&wv, bv.as_ref())? } else { reference(&xv, &wv, bv.as_ref())? };
    let g = y.backward_with(dy)?;
    let grad = |t: &Tensor| g.get(t).cloned().ok_or_else(|| Error::Backward("a missing gradient".into()));
    Ok((y.detach(), grad(&xv)?, grad(&wv)?, bv.as_ref().map(grad).transpose()?))
}

/// A case small enough to do by hand: one channel, taps (1, 2, 3), x = (1, 10, 100, 1000), bias 5.
#[test]
fn hand_computed() -> Result<()> {
    let x = Tensor::from_vec(vec![1.0f64, 10.0, 100.0, 1000.0], (1, 1, 4), CPU)?;
    let w = Tensor::from_vec(vec![1.0f64, 2.0, 3.0], (1, 3), CPU)?;
    let b = Tensor::from_vec(vec![5.0f64], 1, CPU)?;
    let y = x.conv1d_causal(&w, Some(&b))?.to_f64_vec()?;
    // y[l] = 5 + 3 x[l] + 2 x[l-1] + 1 x[l-2]
    assert_eq!(y, vec![8.0, 37.0, 326.0, 3215.0]);
    Ok(())
}

fn matches_padded_shifted_sum() -> Result<()> {
    let mut rng = Rng::new(1);
    for dtype in [DType::F64, DType::F32, DType::BF16] {
        for &(n, c, l, k, bias) in &[(2, 3, 7, 4, true), (1, 5, 1, 4, false), (3, 2, 9, 1, true), (2, 4, 3, 5, true)] {
            let x = on(&randn(&mut rng, &[n, c, l], dtype), dev());
            let w = on(&randn(&mut rng, &[c, k], dtype), dev());
            let b = bias.then(|| on(&randn(&mut rng, &[c], dtype), dev()));
            let dy = on(&randn(&mut rng, &[n, c, l], dtype), dev());
            let got = value_and_grads(&x, &w, b.as_ref(), &dy, true)?;
            let want = value_and_grads(&x, &w, b.as_ref(), &dy, false)?;
            let what = format!("{dtype} [{n}, {c}, {l}] k {k} bias {bias} on {}", dev());
            let t = match dtype {
                DType::F64 => 1e-12,
                DType::F32 => 1e-5,
                _ => 4e-2,
            };
            let sums = ((n * l) as f64).sqrt();
            for (name, a, e, s) in
                [("y", &got.0, &want.0, 1.0), ("dx", &got.1, &want.1, 1.0), ("dw", &got.2, &want.2, sums)]
            {
                let d = max_err(a, e);
                assert!(d <= t * s, "{what}: {name} err {d:e}");
            }
            if let (Some(a), Some(e)) = (&got.3, &want.3) {
                let d = max_err(a, e);
                assert!(d <= t * sums, "{what}: db err {d:e}");
            }
            assert_eq!(got.3.is_some(), bias);
        }
    }
    Ok(())
}

/// Central differences in f64 on the test's device.
fn gradcheck_f64() -> Result<()> {
    let mut rng = Rng::new(2);
    for &(n, c, l, k) in &[(2, 3, 6, 4), (1, 2, 1, 4), (2, 1, 5, 1), (1, 2, 3, 6)] {
        let x = on(&randn(&mut rng, &[n, c, l], DType::F64), dev());
        let w = on(&randn(&mut rng, &[c, k], DType::F64), dev());
        let b = on(&randn(&mut rng, &[c], DType::F64), dev());
        gradcheck(
            &format!("conv1d_causal [{n},{c},{l}] k {k}"),
            |v| v[0].conv1d_causal(&v[1], Some(&v[2])),
            &[x.clone(), w.clone(), b],
        );
        gradcheck(&format!("conv1d_causal no bias [{n},{c},{l}] k {k}"), |v| v[0].conv1d_causal(&v[1], None), &[x, w]);
    }
    // x stored [batch, len, channels] and viewed [batch, channels, len] (as Mamba's in-projection
    // leaves it); w a column slice of a wider tensor.
    let xt = on(&randn(&mut rng, &[2, 5, 3], DType::F64), dev()).permute(&[0, 2, 1])?;
    let wn = on(&randn(&mut rng, &[3, 6], DType::F64), dev()).narrow(1, 1, 4)?;
    assert!(!xt.is_contiguous() && !wn.is_contiguous());
    let b = on(&randn(&mut rng, &[3], DType::F64), dev());
    gradcheck("conv1d_causal strided", |v| v[0].conv1d_causal(&v[1], Some(&v[2])), &[xt, wn, b]);
    Ok(())
}

#[test]
fn bad_inputs_are_typed_errors() -> Result<()> {
    let mut rng = Rng::new(3);
    let x = randn(&mut rng, &[2, 4, 5], DType::F32);
    let w = randn(&mut rng, &[4, 3], DType::F32);
    let e = x.conv1d_causal(&randn(&mut rng, &[3, 3], DType::F32), None).unwrap_err();
    assert!(matches!(e, Error::Shape { .. }), "channels: {e}");
    let e = x.conv1d_causal(&randn(&mut rng, &[4, 0], DType::F32), None).unwrap_err();
    assert!(matches!(e, Error::Shape { .. }), "k = 0: {e}");
    let e = x.conv1d_causal(&randn(&mut rng, &[4], DType::F32), None).unwrap_err();
    assert!(matches!(e, Error::Shape { .. }), "rank-1 weight: {e}");
    let e = randn(&mut rng, &[4, 5], DType::F32).conv1d_causal(&w, None).unwrap_err();
    assert!(matches!(e, Error::Shape { .. }), "rank-2 x: {e}");
    let e = x.conv1d_causal(&w, Some(&randn(&mut rng, &[3], DType::F32))).unwrap_err();
    assert!(matches!(e, Error::ShapeMismatch { .. }), "bias: {e}");
    let e = x.conv1d_causal(&randn(&mut rng, &[4, 3], DType::BF16), None).unwrap_err();
    assert!(matches!(e, Error::DTypeMismatch { .. }), "{e}");
    let ids = Tensor::from_vec(vec![1u32; 8], (1, 2, 4), CPU)?;
    assert!(matches!(ids.conv1d_causal(&ids, None).unwrap_err(), Error::UnsupportedDType { .. }));
    if let Some(g) = gpu() {
        let e = x.to_device(g)?.conv1d_causal(&w, None).unwrap_err();
        assert!(matches!(e, Error::DeviceMismatch { .. }), "{e}");
        let wide = randn(&mut rng, &[4, 17], DType::F32).to_device(g)?;
        let e = x.to_device(g)?.conv1d_causal(&wide, None).unwrap_err();
        assert!(matches!(e, Error::Shape { .. }), "k > MAX_CUDA_K: {e}");
    }
    Ok(())
}

// ---- CUDA parity -----------------------------------------------------------------------------------

/// The op on the GPU against the CPU op on the same values in the same dtype (outputs poisoned).
fn parity(
    dev: Device,
    dtype: DType,
    (n, c, l, k): (usize, usize, usize, usize),
    bias: bool,
    strided: bool,
) -> Result<()> {
    let mut rng = Rng::new((n * 1000 + c * 31 + l * 7 + k) as u64);
    let x = if strided {
        randn(&mut rng, &[n, l, c], dtype).permute(&[0, 2, 1])?
    } else {
        randn(&mut rng, &[n, c, l], dtype)
    };
    let w = randn(&mut rng, &[c, k], dtype);
    let b = bias.then(|| randn(&mut rng, &[c], dtype));
    let dy = randn(&mut rng, &[n, c, l], dtype);
    let cpu = value_and_grads(&x, &w, b.as_ref(), &dy, true)?;
    let xd = if strided { on(&x.permute(&[0, 2, 1])?, dev).permute(&[0, 2, 1])? } else { on(&x, dev) };
    let gpu = value_and_grads(&xd, &on(&w, dev), b.as_ref().map(|b| on(b, dev)).as_ref(), &on(&dy, dev), true)?;
    let what = format!("conv1d_causal {dtype} [{n}, {c}, {l}] k {k} bias {bias} strided {strided}");
    assert_close(&format!("{what} y"), &cpu.0, &gpu.0, 1.0);
    assert_close(&format!("{what} dx"), &cpu.1, &gpu.1, 1.0);
    // dw and db sum batch x len products: f32 (f64) partial sums on the device, f64 on the host.
    let sums = ((n * l) as f64).sqrt().max(1.0);
    let t = match dtype {
        DType::F64 => 1e-12,
        DType::F32 => 4e-6,
        DType::F16 => 4e-3,
        _ => 3e-2,
    } * sums;
    let d = max_err(&gpu.2, &cpu.2);
    assert!(d <= t, "{what} dw: err {d:e} > {t:e}");
    if let (Some(a), Some(e)) = (&gpu.3, &cpu.3) {
        let d = max_err(a, e);
        assert!(d <= t, "{what} db: err {d:e} > {t:e}");
    }
    Ok(())
}

#[test]
fn cuda_parity_every_dtype() -> Result<()> {
    let Some(dev) = gpu() else { return Ok(()) };
    for dtype in [DType::F32, DType::BF16, DType::F16, DType::F64] {
        for &shape in &[
            (1, 1, 1, 4),
            (2, 3, 7, 4),
            (2, 64, 1, 4),
            (3, 5, 333, 3),
            (2, 48, 1031, 4),
            (1, 7, 4099, 16),
            (2, 3, 9, 1),
        ] {
            parity(dev, dtype, shape, true, false)?;
        }
        parity(dev, dtype, (2, 6, 13, 4), false, false)?;
        parity(dev, dtype, (2, 6, 13, 4), true, true)?;
    }
    Ok(())
}

#[test]
fn cuda_empty_and_deterministic() -> Result<()> {
    let Some(dev) = gpu() else { return Ok(()) };
    for dims in [[0usize, 3, 5], [2, 3, 0]] {
        let x = Tensor::zeros(dims.to_vec(), DType::F32, dev)?;
        let w = Tensor::ones((3, 4), DType::F32, dev)?;
        let b = Tensor::ones(3, DType::F32, dev)?;
        let (y, dx, dw, db) = value_and_grads(&x, &w, Some(&b), &x, true)?;
        assert_eq!((y.dims(), dx.dims(), dw.dims()), (&dims[..], &dims[..], &[3usize, 4][..]));
        assert!(dw.to_f64_vec()?.iter().chain(&db.expect("db").to_f64_vec()?).all(|&v| v == 0.0), "empty sums are 0");
    }
    // The weight gradient has no atomics: two runs give the same bits.
    let mut rng = Rng::new(9);
    let x = on(&randn(&mut rng, &[4, 8, 2000], DType::F32), dev);
    let w = on(&randn(&mut rng, &[8, 4], DType::F32), dev);
    let dy = on(&randn(&mut rng, &[4, 8, 2000], DType::F32), dev);
    let a = value_and_grads(&x, &w, None, &dy, true)?.2.to_f64_vec()?;
    let b = value_and_grads(&x, &w, None, &dy, true)?.2.to_f64_vec()?;
    assert_eq!(a, b);
    Ok(())
}
