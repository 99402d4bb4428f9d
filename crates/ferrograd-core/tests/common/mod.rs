//! What the core's integration tests share: `tests/core_suite/main.rs` (one binary, a module per
//! file) and each `tests/*.rs` (a binary of its own) include it with `mod common;` (a folder, so
//! cargo does not run it as a test of its own).
//!
//! - The backend suite: [`backend_tests!`] turns test bodies into one `#[test]` per device, in
//!   modules `on_cpu` and `on_cuda` (burn's backend tests: one suite every backend must pass). The
//!   body reads the device it runs on from [`dev()`]. Without a usable GPU the `on_cuda` tests print
//!   one line and pass; on a GPU machine `bash .gpu/run tests on_cuda::` runs them all.
//! - [`gpu()`] / [`cuda_device()`]: CUDA device 0 with every allocation poisoned (NaN bytes), so a test fails on any
//!   output element a kernel did not write.
//! - [`gradcheck`]: analytic against central-difference gradients, on the inputs' device.
//! - Random inputs ([`randn`]) and error measures ([`rel_err`], [`max_err`]) with per-dtype
//!   tolerances ([`tol`]).
#![allow(dead_code)] // each test crate uses a different part

use ferrograd_core::cuda::{set_poison_allocations, CudaDevice};
use ferrograd_core::{with_no_grad, DType, Device, Result, Rng, Tensor};
use std::cell::Cell;
use std::sync::Arc;

// ---- devices ------------------------------------------------------------------------------------

/// CUDA device 0 with poisoned allocations, or `None` (and one printed line) without a usable GPU.
pub fn cuda_device() -> Option<Arc<CudaDevice>> {
    match CudaDevice::get(0) {
        Ok(d) => {
            set_poison_allocations(true);
            Some(d)
        }
        Err(e) => {
            println!("skipping CUDA test: {e}");
            None
        }
    }
}

/// [`cuda_device`] as a `Device`.
pub fn gpu() -> Option<Device> {
    cuda_device().map(|_| Device::Cuda(0))
}

/// CUDA device 0 without poisoning (tests of transfers and of the allocator's own figures, where
/// a NaN fill of every allocation would be in the measurement), or `None` after one printed line.
pub fn gpu_unpoisoned() -> Option<Device> {
    match CudaDevice::get(0) {
        Ok(_) => Some(Device::Cuda(0)),
        Err(e) => {
            println!("skipping CUDA test: {e}");
            None
        }
    }
}

thread_local! {
    static DEVICE: Cell<Device> = const { Cell::new(Device::Cpu) };
}

/// The device the running backend test is instantiated for (the CPU outside [`run_on`]).
pub fn dev() -> Device {
    DEVICE.with(|d| d.get())
}

/// What a test body may return: nothing (it asserts) or a `Result`.
pub trait Outcome {
    fn into_result(self) -> Result<()>;
}

impl Outcome for () {
    fn into_result(self) -> Result<()> {
        Ok(())
    }
}

impl Outcome for Result<()> {
    fn into_result(self) -> Result<()> {
        self
    }
}

/// Run `body` with [`dev()`] answering `device` (restored afterwards, also on a panic).
pub fn run_on<R: Outcome>(device: Device, body: impl FnOnce() -> R) -> Result<()> {
    struct Restore(Device);
    impl Drop for Restore {
        fn drop(&mut self) {
            DEVICE.with(|d| d.set(self.0));
        }
    }
    let _restore = Restore(DEVICE.with(|d| d.replace(device)));
    body().into_result()
}

/// Run `body` on the GPU when there is one; pass (after one printed line) when there is not.
pub fn run_on_gpu<R: Outcome>(body: impl FnOnce() -> R) -> Result<()> {
    match gpu() {
        Some(d) => run_on(d, body),
        None => Ok(()),
    }
}

/// One `#[test]` per listed body and device: `on_cpu::NAME` always, `on_cuda::NAME` on the GPU
/// (skipping cleanly without one). Each body is a plain `fn NAME()` (returning `()` or `Result<()>`)
/// of the test crate that places its tensors on [`dev()`].
#[macro_export]
macro_rules! backend_tests {
    ($($name:ident),* $(,)?) => {
        mod on_cpu {
            $(
                #[test]
                fn $name() -> ferrograd_core::Result<()> {
                    $crate::common::run_on(ferrograd_core::Device::Cpu, super::$name)
                }
            )*
        }
        mod on_cuda {
            $(
                #[test]
                fn $name() -> ferrograd_core::Result<()> {
                    $crate::common::run_on_gpu(super::$name)
                }
            )*
        }
    };
}

// ---- inputs and error measures ----------------------------------------------------------------------

/// Standard normal values drawn in f64 on the host, then rounded to `dtype`, on the CPU.
pub fn randn(rng: &mut Rng, dims: &[usize], dtype: DType) -> Tensor {
    Tensor::randn_with(rng, 0.0, 1.0, dims.to_vec(), DType::F64, Device::Cpu)
        .and_then(|t| t.to_dtype(dtype))
        .expect("randn")
}

/// `t` on device `d`.
pub fn on(t: &Tensor, d: Device) -> Tensor {
    t.to_device(d).expect("transfer")
}

/// Every element's bits as f64 (exact for every dtype): for tests that two paths agree bit for bit.
pub fn bits(t: &Tensor) -> Vec<u64> {
    t.to_f64_vec().expect("values").into_iter().map(f64::to_bits).collect()
}

/// ‖x − y‖ / ‖y‖ of two value lists; infinite when anything is not finite.
pub use ferrograd_core::fused::bench::rel_err as rel_err_of;

/// ‖x − y‖ / ‖y‖ of two tensors of one shape (any devices); infinite when anything is not finite.
pub fn rel_err(x: &Tensor, y: &Tensor) -> f64 {
    assert_eq!(x.dims(), y.dims(), "shapes");
    rel_err_of(&x.to_f64_vec().expect("values"), &y.to_f64_vec().expect("values"))
}

/// max |x − y| / (1 + max |y|); infinite when anything is not finite.
pub fn max_err(x: &Tensor, y: &Tensor) -> f64 {
    assert_eq!(x.dims(), y.dims(), "shapes");
    let (a, b) = (x.to_f64_vec().expect("values"), y.to_f64_vec().expect("values"));
    if a.iter().chain(&b).any(|v| !v.is_finite()) {
        return f64::INFINITY;
    }
    let scale = 1.0 + b.iter().fold(0.0f64, |m, v| m.max(v.abs()));
    a.iter().zip(&b).fold(0.0f64, |m, (p, q)| m.max((p - q).abs())) / scale
}

/// Elementwise (rtol, atol) of one op in `dtype` against the same op in f64 or on the CPU: about
/// a few units in the last place of each dtype (bf16 has 8 bits of mantissa, f16 11, f32 24).
pub fn tol(d: DType) -> (f64, f64) {
    match d {
        DType::F64 => (1e-10, 1e-12),
        DType::F32 => (2e-5, 2e-6),
        DType::F16 => (4e-3, 4e-3),
        DType::BF16 => (3e-2, 3e-2),
        _ => (0.0, 0.0),
    }
}

/// max |a - e| / (1 + max |e|) allowed between two results in `dtype` that differ by a few
/// roundings (a fused op against its composition, a kernel against its CPU twin).
pub fn rounding_tol(dtype: DType) -> f64 {
    match dtype {
        DType::F64 => 1e-12,
        DType::F32 => 4e-6,
        DType::F16 => 4e-3,
        _ => 3e-2,
    }
}

/// Compare a CUDA result with the CPU reference elementwise to [`tol`] times `scale` (NaN must
/// match NaN).
pub fn assert_close(what: &str, cpu: &Tensor, gpu: &Tensor, scale: f64) {
    assert_eq!(cpu.dims(), gpu.dims(), "{what}: shapes");
    assert_eq!(cpu.dtype(), gpu.dtype(), "{what}: dtypes");
    let (rtol, atol) = tol(cpu.dtype());
    let (rtol, atol) = (rtol * scale, atol * scale);
    let a = cpu.to_f64_vec().expect("cpu values");
    let b = gpu.to_f64_vec().expect("gpu values");
    for (i, (x, y)) in a.iter().zip(&b).enumerate() {
        let ok = (x.is_nan() && y.is_nan()) || x == y || (x - y).abs() <= atol + rtol * x.abs().max(y.abs());
        assert!(ok, "{what} [{}] element {i}: cpu {x} vs cuda {y}", cpu.dtype());
    }
}

// ---- gradcheck --------------------------------------------------------------------------------------

/// Step and tolerances of [`gradcheck_tol`]: analytic `a` and numeric `n` agree when
/// `|a - n| <= atol + rtol * max(|a|, |n|)`.
#[derive(Clone, Copy)]
pub struct Tol {
    pub h: f64,
    pub rtol: f64,
    pub atol: f64,
}

/// For f64 inputs of order one.
pub const TOL: Tol = Tol { h: 1e-6, rtol: 1e-5, atol: 1e-7 };

/// `out` as a scalar: itself when it has one element, else `sum(out * w)` with weights that depend
/// only on the output's shape, so every evaluation uses the same ones (a plain sum would give every
/// element the same upstream gradient and hide permutation bugs).
pub fn contract(out: &Tensor) -> Result<Tensor> {
    if out.elem_count() == 1 {
        return out.reshape(());
    }
    let seed = 0xC0FFEE ^ out.dims().iter().fold(17u64, |a, &d| a * 31 + d as u64);
    let w = Tensor::randn_with(&mut Rng::new(seed), 0.0, 1.0, out.shape().clone(), out.dtype(), out.device())?;
    out.mul(&w)?.sum_all()
}

/// [`gradcheck_tol`] with [`TOL`].
pub fn gradcheck<F: Fn(&[Tensor]) -> Result<Tensor>>(name: &str, f: F, inputs: &[Tensor]) {
    gradcheck_tol(name, f, inputs, TOL)
}

/// Panics naming every element whose analytic gradient disagrees with central differences.
pub fn gradcheck_tol<F: Fn(&[Tensor]) -> Result<Tensor>>(name: &str, f: F, inputs: &[Tensor], tol: Tol) {
    if let Err(e) = try_gradcheck(name, &f, inputs, tol) {
        panic!("{name}: {e}");
    }
}

/// Turns each input into a leaf variable (keeping its layout and device, so a transposed input
/// stays a strided leaf), runs `f`, contracts the output and compares every input element's
/// gradient with `(f(x + h) - f(x - h)) / 2h`, evaluated under `no_grad` on the inputs' device.
pub fn try_gradcheck(name: &str, f: &dyn Fn(&[Tensor]) -> Result<Tensor>, inputs: &[Tensor], tol: Tol) -> Result<()> {
    let vars: Vec<Tensor> = inputs.iter().map(|t| t.requires_grad()).collect();
    let loss = contract(&f(&vars)?)?;
    let grads = loss.backward()?;
    // Recording must not change values: the tracked forward equals the untracked one.
    let plain = with_no_grad(|| contract(&f(inputs)?)?.item_f64())?;
    let tracked = loss.item_f64()?;
    assert!(
        (plain - tracked).abs() <= 1e-12 * (1.0 + plain.abs()),
        "{name}: forward with grad {tracked} != without {plain}"
    );
    let mut bad = vec![];
    for (i, (x, v)) in inputs.iter().zip(&vars).enumerate() {
        let g = grads.get(v).unwrap_or_else(|| panic!("{name}: no gradient for input {i} {:?}", x.dims()));
        assert_eq!(g.dims(), x.dims(), "{name}: gradient shape of input {i}");
        assert_eq!(g.dtype(), x.dtype(), "{name}: gradient dtype of input {i}");
        assert_eq!(g.device(), x.device(), "{name}: gradient device of input {i}");
        let analytic = g.to_f64_vec()?;
        let base = x.to_f64_vec()?;
        for j in 0..base.len() {
            let eval = |delta: f64| -> Result<f64> {
                let mut vals = base.clone();
                vals[j] += delta;
                let xi = Tensor::from_vec(vals, x.shape().clone(), Device::Cpu)?
                    .to_dtype(x.dtype())?
                    .to_device(x.device())?;
                let xs: Vec<Tensor> =
                    inputs.iter().enumerate().map(|(k, t)| if k == i { xi.clone() } else { t.clone() }).collect();
                with_no_grad(|| contract(&f(&xs)?)?.item_f64())
            };
            let numeric = (eval(tol.h)? - eval(-tol.h)?) / (2.0 * tol.h);
            let a = analytic[j];
            // Written so that a NaN on either side counts as a mismatch.
            let ok = (a - numeric).abs() <= tol.atol + tol.rtol * a.abs().max(numeric.abs());
            if !ok {
                bad.push(format!("input {i} {:?} elem {j}: analytic {a:.9e} numeric {numeric:.9e}", x.dims()));
            }
        }
    }
    if bad.is_empty() {
        Ok(())
    } else {
        Err(ferrograd_core::Error::Backward(format!(
            "{} mismatches:\n  {}",
            bad.len(),
            bad[..bad.len().min(8)].join("\n  ")
        )))
    }
}
