//! Writing your own op through the fused-op extension point, `ferrograd_core::fused::FusedOp`:
//! softplus, `log(1 + e^x)` (PyTorch's `F.softplus`), with a CPU forward, a CUDA forward, its own
//! backward, a finite-difference gradient check, and a CPU/GPU comparison when a GPU is there.
//!
//! ```sh
//! cargo run --example custom_op                 # gradcheck on the CPU, parity on a GPU if any
//! cargo run --example custom_op -- --device cpu
//! ```
//!
//! A `FusedOp` gives a forward per backend and a backward; `fused::apply` runs the forward on
//! the inputs' device and records the op so that `backward()` calls yours. Here the CUDA forward
//! is composed from the backend's own kernels (`BackendStorage` methods, which `CudaStorage`
//! implements), so it works from any crate. The ops inside ferrograd-core go one step further and
//! launch their own `.cu` kernel (`src/fused/<op>/`, walked through in `docs/adding-an-op.md`).

use ferrograd_core::backend::BackendStorage;
use ferrograd_core::cpu::{strided, CpuStorage};
use ferrograd_core::cuda::CudaStorage;
use ferrograd_core::fused::{self, FusedCtx, FusedOp, FusedOutputs};
use ferrograd_core::op::{BinaryOp, UnaryOp};
use ferrograd_core::{DType, Device, Error, Layout, Result, Rng, Tensor};
use std::sync::Arc;

/// The op. It holds no state; an op with parameters (a scale, an axis) keeps them here.
struct Softplus;

impl FusedOp for Softplus {
    fn name(&self) -> &'static str {
        "softplus"
    }

    /// The CPU reference: one pass over the elements, read through the layout (strided views,
    /// broadcasts and offsets work in place). The stable form `max(x, 0) + ln(1 + e^-|x|)` never
    /// overflows.
    fn cpu_fwd(&self, inputs: &[(&CpuStorage, &Layout)]) -> Result<FusedOutputs<CpuStorage>> {
        let [(x, l)] = inputs else { return Err(Error::InvalidArgument("softplus takes one input".into())) };
        let out = match x {
            CpuStorage::F32(v) => CpuStorage::F32(strided::map(v, l, |x| x.max(0.0) + (-x.abs()).exp().ln_1p())?),
            CpuStorage::F64(v) => CpuStorage::F64(strided::map(v, l, |x| x.max(0.0) + (-x.abs()).exp().ln_1p())?),
            other => return Err(Error::UnsupportedDType { op: "softplus", dtype: other.dtype() }),
        };
        // The op's value first, with its shape; a forward may return more tensors after it (saved
        // statistics), which the backward then finds in `ctx.saved`.
        Ok(vec![(out, l.shape().clone())])
    }

    /// The CUDA forward, queued on the device's current stream without waiting for it (a CUDA
    /// graph can capture it). The same formula from elementwise kernels.
    fn cuda_fwd(&self, inputs: &[(&CudaStorage, &Layout)]) -> Result<FusedOutputs<CudaStorage>> {
        let [(x, l)] = inputs else { return Err(Error::InvalidArgument("softplus takes one input".into())) };
        x.dtype().check_float("softplus")?;
        Ok(vec![(composed(*x, l)?, l.shape().clone())])
    }

    /// `d softplus(x) / dx = sigmoid(x)`: the gradient of the input given the output's. Backward
    /// code is ordinary tensor code (it may call other ops, fused or not).
    fn backward(&self, ctx: &FusedCtx<'_>, grad: &Tensor) -> Result<Vec<Option<Tensor>>> {
        let [x] = ctx.inputs else { return Err(Error::Backward("softplus: expected one recorded input".into())) };
        Ok(vec![Some(grad.mul(&x.sigmoid()?)?)])
    }
}

/// `relu(x) + ln(1 + exp(-|x|))` from a backend's elementwise ops: works on any `BackendStorage`.
fn composed<S: BackendStorage>(x: &S, l: &Layout) -> Result<S> {
    let c = Layout::contiguous(l.shape().clone()); // every op returns a contiguous result
    let neg_abs = x.unary(l, UnaryOp::Abs)?.unary(&c, UnaryOp::Affine { mul: -1.0, add: 0.0 })?;
    let log1p =
        neg_abs.unary(&c, UnaryOp::Exp)?.unary(&c, UnaryOp::Affine { mul: 1.0, add: 1.0 })?.unary(&c, UnaryOp::Log)?;
    x.unary(l, UnaryOp::Relu)?.binary(&c, &log1p, &c, BinaryOp::Add)
}

/// The public function, as an op on `Tensor` would be: any shape, f32 or f64, CPU or CUDA.
fn softplus(x: &Tensor) -> Result<Tensor> {
    fused::apply(Arc::new(Softplus), &[x])
}

fn main() -> Result<()> {
    let dev = ferrograd_examples::device()?;
    let mut rng = Rng::new(0);

    // 1. The value against the textbook formula (moderate inputs, where the naive form is exact).
    let x = Tensor::randn_with(&mut rng, 0.0, 2.0, (4, 5), DType::F64, Device::Cpu)?;
    let naive = x.exp()?.add_scalar(1.0)?.log()?;
    println!("forward vs log(1 + exp(x)): max |diff| {:.2e}", max_abs_diff(&softplus(&x)?, &naive)?);
    // The stable form survives inputs where the naive one overflows to inf.
    let big = Tensor::from_vec(vec![800f64, -800.0], 2, Device::Cpu)?;
    println!("softplus([800, -800]) = {:?}", softplus(&big)?.to_vec::<f64>()?);

    // 2. Gradient check in f64 on the CPU: the backward against central differences of the forward
    // for loss = sum(softplus(x) * w), on a transposed (strided) input to exercise the layout.
    let x = Tensor::randn_with(&mut rng, 0.0, 2.0, (5, 4), DType::F64, Device::Cpu)?.t()?;
    let w = Tensor::randn_with(&mut rng, 0.0, 1.0, (4, 5), DType::F64, Device::Cpu)?;
    let worst = gradcheck(&x, &w)?;
    println!("gradcheck (f64, CPU): worst |analytic - numeric| {worst:.2e}");
    if worst > 1e-7 {
        return Err(Error::Backward(format!("softplus gradcheck failed: {worst:e}")));
    }

    // 3. The same op on the chosen device: value and gradient against the CPU in f32.
    if dev.is_cuda() {
        let x32 = Tensor::randn_with(&mut rng, 0.0, 3.0, (64, 33), DType::F32, Device::Cpu)?;
        let (y_cpu, g_cpu) = value_and_grad(&x32)?;
        let (y_dev, g_dev) = value_and_grad(&x32.to_device(dev)?)?;
        let (dy, dg) = (max_abs_diff(&y_dev, &y_cpu)?, max_abs_diff(&g_dev, &g_cpu)?);
        println!("{dev} vs cpu (f32): value {dy:.2e}, gradient {dg:.2e}");
        if dy > 1e-5 || dg > 1e-5 {
            return Err(Error::Backward(format!("softplus on {dev} differs from the CPU: {dy:e}, {dg:e}")));
        }
    } else {
        println!("no GPU chosen: the CUDA forward was compiled but not run (pass --device cuda on a GPU)");
    }
    Ok(())
}

/// Worst difference between the backward's gradient and `(L(x + h) - L(x - h)) / 2h`.
fn gradcheck(x: &Tensor, w: &Tensor) -> Result<f64> {
    let loss = |x: &Tensor| -> Result<f64> { softplus(x)?.mul(w)?.sum_all()?.item_f64() };
    let leaf = x.requires_grad();
    let grads = softplus(&leaf)?.mul(w)?.sum_all()?.backward()?;
    let analytic = grads.get(&leaf).ok_or(Error::Backward("no gradient reached x".into()))?.to_f64_vec()?;
    let (base, dims, h) = (x.to_f64_vec()?, x.dims().to_vec(), 1e-6);
    let mut worst = 0f64;
    for (i, a) in analytic.iter().enumerate() {
        let mut plus = base.clone();
        plus[i] += h;
        let mut minus = base.clone();
        minus[i] -= h;
        let numeric = (loss(&Tensor::from_vec(plus, dims.clone(), Device::Cpu)?)?
            - loss(&Tensor::from_vec(minus, dims.clone(), Device::Cpu)?)?)
            / (2.0 * h);
        worst = worst.max((a - numeric).abs());
    }
    Ok(worst)
}

/// `softplus(x)` and the gradient of its sum, both back on the CPU.
fn value_and_grad(x: &Tensor) -> Result<(Tensor, Tensor)> {
    let leaf = x.requires_grad();
    let y = softplus(&leaf)?;
    let grads = y.sum_all()?.backward()?;
    let g = grads.get(&leaf).ok_or(Error::Backward("no gradient reached x".into()))?;
    Ok((y.to_device(Device::Cpu)?, g.to_device(Device::Cpu)?))
}

fn max_abs_diff(a: &Tensor, b: &Tensor) -> Result<f64> {
    let (a, b) = (a.to_f64_vec()?, b.to_f64_vec()?);
    Ok(a.iter().zip(&b).map(|(u, v)| (u - v).abs()).fold(0.0, f64::max))
}
