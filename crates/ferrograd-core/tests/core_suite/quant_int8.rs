//! int8 inference (`src/quant/`): per-row quantization by hand (ties to even, clamping, zero
//! rows), agreement with `fake_quantize` at the same range, the int8 matmul exact against an
//! integer reference (odd shapes; on CUDA both cuBLASLt's IMMA path and the fallback kernel), the
//! rescale, W8A8 and W8A16 linears against the float linear, CUDA bit for bit against the CPU
//! where the math is exact, and typed errors.

use crate::common;

use common::{dev, gpu, on, randn};
use ferrograd_core::quant::{
    dequantize_rows, linear_w8a16, linear_w8a8, matmul_i8_nt, quantize_rows_i8, rescale_i32, Int8Weight,
};
use ferrograd_core::{DType, Device, Error, FakeQuant, Result, Rng, Tensor};

backend_tests!(
    quantize_rows_by_hand,
    quantize_rows_matches_fake_quantize,
    int8_matmul_is_exact,
    w8a8_and_w8a16_track_the_float_linear
);

const CPU: Device = Device::Cpu;

/// Uniform integers in [-127, 127] (a xorshift: only the values matter).
fn i8s(state: &mut u64, m: usize, k: usize) -> Tensor {
    let mut next = || {
        *state ^= *state << 13;
        *state ^= *state >> 7;
        *state ^= *state << 17;
        (*state % 255) as i64 - 127
    };
    let v: Vec<i8> = (0..m * k).map(|_| next() as i8).collect();
    Tensor::from_vec(v, (m, k), CPU).expect("i8 tensor")
}

/// The integer reference, written out here.
fn reference(a: &Tensor, b: &Tensor) -> Vec<f64> {
    let (m, k, n) = (a.dims()[0], a.dims()[1], b.dims()[0]);
    let (a, b) = (a.to_f64_vec().expect("a"), b.to_f64_vec().expect("b"));
    let mut c = vec![0.0; m * n];
    for i in 0..m {
        for j in 0..n {
            c[i * n + j] = (0..k).map(|p| (a[i * k + p] as i64 * b[j * k + p] as i64) as f64).sum::<f64>();
        }
    }
    c
}

fn quantize_rows_by_hand() -> Result<()> {
    for dtype in [DType::F32, DType::F64, DType::BF16] {
        let v = vec![127.0, -63.5, 0.5, 0.0, 254.0, 1.0, 3.0, -381.0, 0.0, 0.0, 0.0, 0.0];
        let x = on(&Tensor::from_vec(v, (3, 4), CPU)?.to_dtype(dtype)?, dev());
        // bf16 holds row 0 exactly (381 needs 9 bits).
        let x = if dtype == DType::BF16 { x.narrow(0, 0, 1)? } else { x };
        let (q, s) = quantize_rows_i8(&x)?;
        assert_eq!((q.dtype(), s.dtype()), (DType::I8, DType::F32));
        let (qv, sv) = (q.to_f64_vec()?, s.to_f64_vec()?);
        // s = 127 / 127 = 1: -63.5 and 0.5 are ties, to the even -64 and 0.
        assert_eq!(qv[..4], [127.0, -64.0, 0.0, 0.0], "{dtype}");
        assert_eq!(sv[0], 1.0);
        let y = dequantize_rows(&q, &s, DType::F32)?.to_f64_vec()?;
        assert_eq!(y[..4], [127.0, -64.0, 0.0, 0.0]);
        if dtype == DType::BF16 {
            continue;
        }
        // s = 381 / 127 = 3: 254 / 3 = 84.67 -> 85, 1 / 3 -> 0, -381 / 3 = -127.
        assert_eq!(qv[4..8], [85.0, 0.0, 1.0, -127.0], "{dtype}");
        assert_eq!(sv[1], 3.0);
        assert_eq!(y[4..8], [255.0, 0.0, 3.0, -381.0]);
        assert_eq!(qv[8..], [0.0; 4], "a row of zeros");
        assert_eq!(sv[2], 1.0, "a row of zeros gets scale 1");
    }
    Ok(())
}

/// What int8 inference stores is what QAT simulated: fake_quantize at the same scale and range
/// equals dequantize(quantize(x)), bit for bit.
fn quantize_rows_matches_fake_quantize() -> Result<()> {
    let mut rng = Rng::new(3);
    for dtype in [DType::F32, DType::BF16, DType::F16] {
        let x = on(&randn(&mut rng, &[9, 300], dtype).mul_scalar(3.0)?, dev());
        let (q, s) = quantize_rows_i8(&x)?;
        let fq = x.fake_quantize(
            &s,
            &Tensor::zeros(9, DType::F32, dev())?,
            FakeQuant { qmin: -127, qmax: 127, axis: Some(0), grad_factor: None },
        )?;
        assert_eq!(dequantize_rows(&q, &s, dtype)?.to_f64_vec()?, fq.to_f64_vec()?, "{dtype}");
    }
    Ok(())
}

fn int8_matmul_is_exact() -> Result<()> {
    let mut rng = 0x9E37_79B9_7F4A_7C15u64;
    for (m, n, k) in [(1, 1, 1), (17, 33, 5), (64, 128, 256), (3, 5, 4097), (40, 24, 64), (130, 7, 96)] {
        let (a, b) = (i8s(&mut rng, m, k), i8s(&mut rng, n, k));
        let c = matmul_i8_nt(&on(&a, dev()), &on(&b, dev()))?;
        assert_eq!((c.dtype(), c.dims()), (DType::I32, [m, n].as_slice()));
        assert_eq!(c.to_f64_vec()?, reference(&a, &b), "{m}x{n}x{k} on {}", dev());
    }
    // Extremes: -127 * -127 summed k times.
    let a = Tensor::from_vec(vec![-127i8; 32 * 4096], (32, 4096), CPU)?;
    let c = matmul_i8_nt(&on(&a, dev()), &on(&a, dev()))?;
    assert!(c.to_f64_vec()?.iter().all(|&v| v == 127.0 * 127.0 * 4096.0));
    Ok(())
}

fn w8a8_and_w8a16_track_the_float_linear() -> Result<()> {
    let mut rng = Rng::new(5);
    for dtype in [DType::F32, DType::BF16] {
        let x = on(&randn(&mut rng, &[2, 24, 64], dtype), dev());
        let w = on(&randn(&mut rng, &[48, 64], DType::F32).mul_scalar(0.1)?, dev());
        let b = on(&randn(&mut rng, &[48], dtype), dev());
        let wq = Int8Weight::quantize(&w)?;
        let float = x.to_dtype(DType::F32)?.matmul(&w.t()?)?.add(&b.to_dtype(DType::F32)?)?;
        for (name, y) in [("w8a8", linear_w8a8(&x, &wq, Some(&b))?), ("w8a16", linear_w8a16(&x, &wq, Some(&b))?)] {
            assert_eq!((y.dims(), y.dtype()), ([2, 24, 48].as_slice(), dtype));
            let e = common::rel_err(&y.to_dtype(DType::F32)?, &float);
            // int8 keeps about 1% of a dot product's norm (two roundings of 1/254 of the max).
            assert!(e < 2e-2, "{name} {dtype}: rel err {e}");
        }
        // W8A8 is exactly rescale(int8 matmul) of the quantized parts.
        let (xq, xs) = quantize_rows_i8(&x.reshape((48, 64))?)?;
        let want = rescale_i32(&matmul_i8_nt(&xq, &wq.q)?, &xs, &wq.scale, Some(&b), dtype)?;
        assert_eq!(linear_w8a8(&x, &wq, Some(&b))?.reshape((48, 48))?.to_f64_vec()?, want.to_f64_vec()?);
    }
    Ok(())
}

#[test]
fn rescale_by_hand() -> Result<()> {
    let acc = Tensor::from_vec(vec![10i32, -20, 30, 40], (2, 2), CPU)?;
    let (sa, sb) = (Tensor::from_vec(vec![0.5f32, 2.0], 2, CPU)?, Tensor::from_vec(vec![1.0f32, 0.25], 2, CPU)?);
    let b = Tensor::from_vec(vec![1.0f32, -1.0], 2, CPU)?;
    let y = rescale_i32(&acc, &sa, &sb, Some(&b), DType::F32)?;
    assert_eq!(y.to_f64_vec()?, [6.0, -3.5, 61.0, 19.0]);
    Ok(())
}

/// Rounding to bf16 is from the f32 result, correctly (as `__float2bfloat16_rn`): 1 + 2^-8 + 2^-23
/// is just past the tie between 1 and 1 + 2^-7 (a conversion that reads only the top 32 bits of
/// an f64, as `half`'s `bf16::from_f64`, sees a tie and rounds to 1; the GPU run caught that).
#[test]
fn bf16_rounds_from_f32_correctly() -> Result<()> {
    let acc = Tensor::from_vec(vec![1i32], (1, 1), CPU)?;
    let sa = Tensor::from_vec(vec![1.0f32 + 2f32.powi(-8) + 2f32.powi(-23)], 1, CPU)?;
    let y = rescale_i32(&acc, &sa, &Tensor::ones(1, DType::F32, CPU)?, None, DType::BF16)?;
    assert_eq!(y.to_f64_vec()?, [1.0 + 2f64.powi(-7)]);
    if let Some(g) = gpu() {
        let yg = rescale_i32(&on(&acc, g), &on(&sa, g), &Tensor::ones(1, DType::F32, g)?, None, DType::BF16)?;
        assert_eq!(yg.to_f64_vec()?, [1.0 + 2f64.powi(-7)]);
    }
    Ok(())
}

#[test]
fn bad_inputs_are_typed_errors() -> Result<()> {
    let a = Tensor::from_vec(vec![1i8; 6], (2, 3), CPU)?;
    let b = Tensor::from_vec(vec![1i8; 8], (2, 4), CPU)?;
    assert!(matches!(matmul_i8_nt(&a, &b).unwrap_err(), Error::ShapeMismatch { .. }));
    let f = Tensor::ones((2, 3), DType::F32, CPU)?;
    assert!(matches!(matmul_i8_nt(&f, &a).unwrap_err(), Error::UnsupportedDType { .. }));
    assert!(matches!(quantize_rows_i8(&a).unwrap_err(), Error::UnsupportedDType { .. }));
    assert!(matches!(Int8Weight::quantize(&Tensor::ones(3, DType::F32, CPU)?).unwrap_err(), Error::Shape { .. }));
    let w = Int8Weight::quantize(&Tensor::ones((4, 3), DType::F32, CPU)?)?;
    assert!(matches!(
        linear_w8a8(&Tensor::ones((2, 5), DType::F32, CPU)?, &w, None).unwrap_err(),
        Error::ShapeMismatch { .. }
    ));
    let bad_bias = Tensor::ones(3, DType::F32, CPU)?;
    assert!(matches!(linear_w8a16(&f, &w, Some(&bad_bias)).unwrap_err(), Error::Shape { .. }));
    assert!(Int8Weight::from_parts(a.clone(), Tensor::ones(3, DType::F32, CPU)?).is_err());
    if let Some(g) = gpu() {
        assert!(matches!(
            matmul_i8_nt(&a, &a.to_device(g)?.t()?.contiguous()?.t()?).unwrap_err(),
            Error::DeviceMismatch { .. }
        ));
    }
    Ok(())
}

// ---- CUDA against the CPU ----------------------------------------------------------------------

#[test]
fn cuda_matches_cpu_bit_for_bit() -> Result<()> {
    let Some(g) = gpu() else { return Ok(()) };
    let mut rng = Rng::new(6);
    for dtype in [DType::F32, DType::F64, DType::F16, DType::BF16] {
        for (rows, cols) in [(1, 1), (7, 300), (64, 4096), (300, 17)] {
            let x = randn(&mut rng, &[rows, cols], dtype).mul_scalar(2.0)?;
            let (q, s) = quantize_rows_i8(&x)?;
            let (qg, sg) = quantize_rows_i8(&on(&x, g))?;
            let what = format!("{dtype} {rows}x{cols}");
            assert_eq!(q.to_f64_vec()?, qg.to_f64_vec()?, "{what} q");
            assert_eq!(s.to_f64_vec()?, sg.to_f64_vec()?, "{what} scale");
            assert_eq!(
                dequantize_rows(&q, &s, dtype)?.to_f64_vec()?,
                dequantize_rows(&qg, &sg, dtype)?.to_f64_vec()?,
                "{what} dequant"
            );
            let w = Int8Weight::quantize(&randn(&mut rng, &[24, cols], DType::F32))?;
            let wg = Int8Weight { q: on(&w.q, g), scale: on(&w.scale, g) };
            let b = randn(&mut rng, &[24], dtype);
            let y = linear_w8a8(&x, &w, Some(&b))?;
            let yg = linear_w8a8(&on(&x, g), &wg, Some(&on(&b, g)))?;
            assert_eq!(y.to_f64_vec()?, yg.to_f64_vec()?, "{what} w8a8");
        }
    }
    Ok(())
}
