//! `cuda::Predictor`: eager and graph modes give the model's forward for batch 1 and 32 (a
//! 3-layer MLP), call after call with new inputs (the graph really reads the refilled buffer);
//! wrong lengths are typed errors; on the CPU both modes run eagerly. CUDA allocations are
//! poisoned; without a GPU the CUDA test prints one line and passes.

use crate::common;

use common::gpu;
use ferrograd_core::cuda::{PredictMode, Predictor};
use ferrograd_core::{DType, Device, Error, Result, Rng, Tensor};

/// `relu(relu(x W1 + b1) W2 + b2) W3 + b3`, width 64, on `device`.
fn mlp(device: Device, seed: u64) -> Result<impl FnMut(&Tensor) -> Result<Tensor>> {
    let mut rng = Rng::new(seed);
    let mut w =
        |i: usize, o: usize| Tensor::randn_with(&mut rng, 0.0, 1.0 / (i as f64).sqrt(), (i, o), DType::F32, device);
    let (w1, w2, w3) = (w(16, 64)?, w(64, 64)?, w(64, 4)?);
    let b = Tensor::randn_with(&mut Rng::new(seed + 1), 0.0, 0.1, 64, DType::F32, device)?;
    Ok(move |x: &Tensor| x.matmul(&w1)?.add(&b)?.relu()?.matmul(&w2)?.relu()?.matmul(&w3))
}

fn check(device: Device) -> Result<()> {
    let mut rng = Rng::new(3);
    for batch in [1usize, 32] {
        let mut reference = mlp(device, 7)?;
        for mode in [PredictMode::Eager, PredictMode::Graph] {
            let mut p = Predictor::new(device, (batch, 16), mode, mlp(device, 7)?)?;
            assert_eq!(p.output_shape().dims(), [batch, 4]);
            let mut out = vec![f32::NAN; batch * 4];
            for call in 0..3 {
                let x = Tensor::randn_with(&mut rng, 0.0, 1.0, (batch, 16), DType::F32, Device::Cpu)?;
                p.predict(&x.to_vec::<f32>()?, &mut out)?;
                let want = reference(&x.to_device(device)?)?.to_vec::<f32>()?;
                for (i, (a, b)) in out.iter().zip(&want).enumerate() {
                    assert!(
                        (a - b).abs() <= 1e-5 * (1.0 + b.abs()),
                        "{mode:?} batch {batch} call {call} [{i}]: {a} vs {b}"
                    );
                }
            }
            let e = p.predict(&[0.0; 3], &mut out).unwrap_err();
            assert!(matches!(e, Error::InvalidArgument(_)), "{e}");
        }
    }
    Ok(())
}

#[test]
fn cpu_predictor_matches_the_forward() -> Result<()> {
    check(Device::Cpu)
}

#[test]
fn cuda_predictor_eager_and_graph_match_the_forward() -> Result<()> {
    let Some(dev) = gpu() else { return Ok(()) };
    check(dev)
}
