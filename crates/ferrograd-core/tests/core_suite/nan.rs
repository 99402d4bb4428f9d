//! NaN and infinity semantics, as PyTorch's: ReLU, clamp, maximum/minimum and max/min reductions
//! propagate NaN (a NaN mapped to 0 hides a diverged model: issue 11 found an `--init` file of NaN
//! weights training to exit 0 because ReLU turned the NaNs into zeros). ReLU's backward passes the
//! gradient where the input was NaN (PyTorch's `threshold_backward` zeroes only where `x <= 0`);
//! clamp's backward is 0 there (`x >= min && x <= max` is false).
//!
//! The CPU semantics are checked against the expected values; the CUDA kernels
//! (`kernels/unary.cu`, `binary.cu`, `reduce.cu`) are checked against the CPU on inputs full of
//! NaN and infinities, every float dtype, contiguous and strided, outputs poisoned first. Without
//! a usable GPU the CUDA tests print one line and pass.

use crate::common;

use common::gpu;
use ferrograd_core::{DType, Device, Result, Tensor};

const NAN: f64 = f64::NAN;
const INF: f64 = f64::INFINITY;
const FLOATS: [DType; 4] = [DType::F32, DType::F64, DType::F16, DType::BF16];

fn t(v: &[f64], d: DType) -> Tensor {
    Tensor::from_vec(v.to_vec(), v.len(), Device::Cpu).and_then(|t| t.to_dtype(d)).expect("tensor")
}

/// Same values, NaN equal to NaN.
fn same(what: &str, got: &[f64], want: &[f64]) {
    assert_eq!(got.len(), want.len(), "{what}: lengths");
    for (i, (a, b)) in got.iter().zip(want).enumerate() {
        assert!((a.is_nan() && b.is_nan()) || a == b, "{what}: element {i} is {a}, expected {b} (all: {got:?})");
    }
}

#[test]
fn relu_propagates_nan_on_every_float_dtype() -> Result<()> {
    let x = [NAN, -1.0, 0.0, 2.5, INF, -INF];
    for d in FLOATS {
        same(&format!("relu {d}"), &t(&x, d).relu()?.to_f64_vec()?, &[NAN, 0.0, 0.0, 2.5, INF, 0.0]);
    }
    Ok(())
}

#[test]
fn clamp_propagates_nan() -> Result<()> {
    for d in FLOATS {
        let y = t(&[NAN, -5.0, 0.5, 5.0, INF, -INF], d).clamp(-1.0, 1.0)?;
        same(&format!("clamp {d}"), &y.to_f64_vec()?, &[NAN, -1.0, 0.5, 1.0, 1.0, -1.0]);
    }
    Ok(())
}

#[test]
fn maximum_minimum_and_reductions_propagate_nan() -> Result<()> {
    for d in FLOATS {
        let (a, b) = (t(&[NAN, 1.0, 2.0, NAN], d), t(&[1.0, NAN, 3.0, NAN], d));
        same(&format!("maximum {d}"), &a.maximum(&b)?.to_f64_vec()?, &[NAN, NAN, 3.0, NAN]);
        same(&format!("minimum {d}"), &a.minimum(&b)?.to_f64_vec()?, &[NAN, NAN, 2.0, NAN]);
        let m = t(&[1.0, NAN, 3.0, 4.0, 5.0, 6.0], d).reshape((2, 3))?;
        same(&format!("max dim {d}"), &m.max(1, false)?.to_f64_vec()?, &[NAN, 6.0]);
        same(&format!("min dim {d}"), &m.min(1, false)?.to_f64_vec()?, &[NAN, 4.0]);
        same(&format!("max all {d}"), &m.max(ferrograd_core::AllDims, false)?.to_f64_vec()?, &[NAN]);
    }
    Ok(())
}

#[test]
fn relu_backward_passes_the_gradient_where_the_input_was_nan() -> Result<()> {
    let x = t(&[NAN, -1.0, 2.0], DType::F64).requires_grad();
    let g = x.relu()?.sum_all()?.backward()?;
    same("d relu", &g.get(&x).expect("grad").to_f64_vec()?, &[1.0, 0.0, 1.0]);
    let g = x.clamp(-0.5, 0.5)?.sum_all()?.backward()?;
    same("d clamp", &g.get(&x).expect("grad").to_f64_vec()?, &[0.0, 0.0, 0.0]);
    Ok(())
}

#[test]
fn a_nan_weight_reaches_the_loss() -> Result<()> {
    // The failure of issue 11 in miniature: one NaN weight, a ReLU layer, an MSE loss.
    let x = t(&[1.0, 2.0], DType::F32).reshape((1, 2))?;
    let w = t(&[NAN, 1.0, 1.0, 1.0], DType::F32).reshape((2, 2))?;
    let loss = x.matmul(&w.t()?)?.relu()?.mse_loss(&x)?;
    assert!(loss.item_f64()?.is_nan(), "loss {}", loss.item_f64()?);
    Ok(())
}

// ---- CUDA against the CPU ------------------------------------------------------------------

/// Values with NaN, both infinities, signed zeros and ordinary numbers, in a fixed pattern.
fn specials(n: usize) -> Vec<f64> {
    let pool = [NAN, 1.5, -2.0, INF, 0.0, -INF, -0.0, 3.25, NAN, -0.75, 7.0];
    (0..n).map(|i| pool[(i * 7 + i / 11) % pool.len()]).collect()
}

fn parity(what: &str, dev: Device, inputs: &[Tensor], f: impl Fn(&[Tensor]) -> Result<Tensor>) {
    let cpu = f(inputs).unwrap_or_else(|e| panic!("{what} on cpu: {e}"));
    let g: Vec<Tensor> = inputs.iter().map(|x| x.to_device(dev).expect("to device")).collect();
    let out = f(&g).unwrap_or_else(|e| panic!("{what} on cuda: {e}"));
    let (a, b) = (cpu.to_f64_vec().expect("cpu"), out.to_f64_vec().expect("cuda"));
    assert_eq!(cpu.dims(), out.dims(), "{what}");
    for (i, (x, y)) in a.iter().zip(&b).enumerate() {
        let ok = (x.is_nan() && y.is_nan()) || x == y || (x - y).abs() <= 1e-6 * x.abs().max(1.0);
        assert!(ok, "{what} [{}] element {i}: cpu {x} vs cuda {y}", cpu.dtype());
    }
}

#[test]
fn cuda_nan_parity_unary_binary_reduce() -> Result<()> {
    let Some(dev) = gpu() else { return Ok(()) };
    for d in FLOATS {
        let a = t(&specials(6 * 37), d).reshape((6, 37))?;
        let b = t(&specials(6 * 37 + 5)[5..], d).reshape((6, 37))?;
        let at = a.t()?; // strided path of the kernels
        let bt = b.t()?;
        for (name, x, y) in [("contiguous", &a, &b), ("transposed", &at, &bt)] {
            let ins = [x.clone(), y.clone()];
            parity(&format!("relu {name}"), dev, &ins, |v| v[0].relu());
            parity(&format!("clamp {name}"), dev, &ins, |v| v[0].clamp(-1.0, 2.0));
            parity(&format!("maximum {name}"), dev, &ins, |v| v[0].maximum(&v[1]));
            parity(&format!("minimum {name}"), dev, &ins, |v| v[0].minimum(&v[1]));
            parity(&format!("max dim {name}"), dev, &ins, |v| v[0].max(1, false));
            parity(&format!("min dim {name}"), dev, &ins, |v| v[0].min(0, false));
            parity(&format!("max all {name}"), dev, &ins, |v| v[0].max(ferrograd_core::AllDims, false));
            parity(&format!("argmax {name}"), dev, &ins, |v| v[0].argmax(1, false));
        }
        // A long row takes the split (two-stage) reduction path; one NaN deep inside it.
        let mut long = vec![1.0; 70_000];
        long[65_537] = NAN;
        let l = t(&long, d).reshape((1, 70_000))?;
        parity("max of a long row with one NaN", dev, std::slice::from_ref(&l), |v| v[0].max(1, false));
        parity("min of a long row with one NaN", dev, &[l], |v| v[0].min(1, false));
    }
    // ReLU's backward (MaskPositive) with NaN inputs, through autograd on both devices.
    let x = t(&specials(64), DType::F32);
    let grad_of = |x: &Tensor| -> Result<Tensor> {
        let v = x.requires_grad();
        let g = v.relu()?.mul_scalar(3.0)?.sum_all()?.backward()?;
        Ok(g.get(&v).expect("grad").clone())
    };
    parity("relu backward", dev, &[x], |v| grad_of(&v[0]));
    Ok(())
}
