//! Tensors and autograd in ten minutes: making tensors, dtypes and devices, broadcasting, views,
//! reductions, matmul, errors instead of panics, and gradients with `backward()`.
//!
//! ```sh
//! cargo run --example tensors                 # the best device (a GPU if there is one)
//! cargo run --example tensors -- --device cpu
//! ```

use ferrograd_core::{no_grad, DType, Device, Error, Result, Rng, Tensor};

fn main() -> Result<()> {
    let dev = ferrograd_examples::device()?;

    // ---- making tensors ----------------------------------------------------------------------
    // Shapes are tuples, vectors or slices; data is row-major. The dtype comes from the Rust type.
    let a = Tensor::from_vec(vec![1f32, 2., 3., 4., 5., 6.], (2, 3), dev)?;
    let zeros = Tensor::zeros((2, 3), DType::F32, dev)?;
    let steps = Tensor::arange(0.0, 3.0, 1.0, DType::F32, dev)?; // [0, 1, 2]
                                                                 // Random tensors come from a Philox generator: the same numbers on the CPU and on a GPU.
    let mut rng = Rng::new(42);
    let noise = Tensor::randn_with(&mut rng, 0.0, 1.0, (2, 3), DType::F32, dev)?;
    println!("a = {a:?}, zeros {:?}, noise {:?}", zeros.dims(), noise.dims());

    // ---- elementwise ops and broadcasting ----------------------------------------------------
    // `steps` [3] broadcasts over the rows of `a` [2, 3], as in NumPy and PyTorch.
    let b = a.add(&steps)?.mul_scalar(2.0)?;
    println!("(a + [0, 1, 2]) * 2 = {:?}", b.to_vec2::<f32>()?);
    // Operands must share dtype and device: nothing is converted behind your back.
    let a64 = a.to_dtype(DType::F64)?;
    match a.add(&a64) {
        Err(Error::DTypeMismatch { op, lhs, rhs }) => println!("{op}: {lhs} vs {rhs} is an error, not a panic"),
        other => println!("unexpected: {other:?}"),
    }

    // ---- views share storage -------------------------------------------------------------------
    let t = a.t()?; // [3, 2], no copy
    let row = a.narrow(0, 1, 1)?; // the second row, [1, 3]
    println!("a^T {:?} shares a's storage: {}; row 1 = {:?}", t.dims(), t.same_storage(&a), row.to_vec::<f32>()?);

    // ---- reductions and matmul -----------------------------------------------------------------
    let col_sums = a.sum(0, false)?; // over dim 0 -> [3]
    let mean = a.mean_all()?.item::<f32>()?;
    let gram = a.matmul(&a.t()?)?; // [2, 3] x [3, 2] -> [2, 2]
    println!("column sums {:?}, mean {mean}, a a^T = {:?}", col_sums.to_vec::<f32>()?, gram.to_vec2::<f32>()?);
    let probs = a.softmax(-1)?; // rows sum to 1
    println!("softmax rows sum to {:?}", probs.sum(-1, false)?.to_vec::<f32>()?);

    // ---- autograd ------------------------------------------------------------------------------
    // `requires_grad()` makes a leaf that collects a gradient; ops on it are recorded, and
    // `backward()` on a scalar returns a GradStore with the gradient of every leaf.
    let x = Tensor::from_vec(vec![0.5f32, -1.0, 2.0], 3, dev)?.requires_grad();
    let w = Tensor::from_vec(vec![1f32, 2., 3.], 3, dev)?.requires_grad();
    let loss = x.mul(&w)?.tanh()?.sum_all()?; // sum(tanh(x * w))
    let grads = loss.backward()?;
    let dx = grads.get(&x).ok_or(Error::Backward("no gradient for x".into()))?;
    // d/dx tanh(x w) = w (1 - tanh^2(x w)): check it by hand.
    let want: Vec<f32> =
        [0.5f32, -1.0, 2.0].iter().zip([1f32, 2., 3.]).map(|(x, w)| w * (1.0 - (x * w).tanh().powi(2))).collect();
    println!("dloss/dx = {:?} (by hand {want:?})", dx.to_vec::<f32>()?);

    // Work that needs no gradient (evaluation, updates) runs under `no_grad`: nothing is recorded.
    {
        let _guard = no_grad();
        let y = x.mul(&w)?;
        println!("under no_grad the result tracks no gradient: {}", !y.tracks_grad());
    }

    // ---- moving data -----------------------------------------------------------------------------
    // `to_device` copies between the CPU and a GPU; reading values (`to_vec`, `item`) copies to
    // the host and waits for the device.
    let on_cpu = gram.to_device(Device::Cpu)?;
    println!("a a^T on the CPU: {:?}", on_cpu.to_vec2::<f32>()?);
    Ok(())
}
