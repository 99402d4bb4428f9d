//! The fused Adam kernel's two paths (16-byte vectors where every stream is aligned, one element
//! at a time otherwise, `kernels/optim.cu`) round alike: the same steps on fresh tensors and on
//! views one element into a buffer give the same bits, and both follow the CPU twin.

use crate::common;

use common::{gpu, randn};
use ferrograd_core::optim::{adam_step, AdamConfig};
use ferrograd_core::{DType, Result, Rng, Tensor};

fn bits(t: &Tensor) -> Result<Vec<u32>> {
    Ok(t.to_vec::<f32>()?.iter().map(|x| x.to_bits()).collect())
}

fn deep_copy(t: &Tensor) -> Result<Tensor> {
    let c = t.zeros_like()?;
    c.set(t)?;
    Ok(c)
}

#[test]
fn cuda_adam_vector_and_scalar_paths_agree() -> Result<()> {
    let Some(dev) = gpu() else { return Ok(()) };
    let mut rng = Rng::new(19);
    let c = AdamConfig { lr: 1e-2, weight_decay: 0.1, decoupled: true, ..AdamConfig::default() };
    // Less than one vector, whole vectors, and 1 to 3 elements after the last one.
    for n in [1usize, 3, 4, 1029, 4098, 70_003] {
        // p, g, m, v (v >= 0) on the host.
        let host = (0..4)
            .map(|i| {
                let t = randn(&mut rng, &[n], DType::F32);
                if i == 3 {
                    t.abs()
                } else {
                    Ok(t)
                }
            })
            .collect::<Result<Vec<_>>>()?;
        let fresh = host.iter().map(|t| t.to_device(dev)).collect::<Result<Vec<_>>>()?;
        // The same values one element into a buffer: 4-byte aligned, so the kernel goes one at a time.
        let shifted = host
            .iter()
            .map(|t| Tensor::cat(&[t.narrow(0, 0, 1)?, t.clone()], 0)?.to_device(dev)?.narrow(0, 1, n))
            .collect::<Result<Vec<_>>>()?;
        let cpu = host.iter().map(deep_copy).collect::<Result<Vec<_>>>()?;
        for set in [&fresh, &shifted, &cpu] {
            for k in 1..=3u64 {
                let one = |i: usize| std::slice::from_ref(&set[i]);
                adam_step(one(0), one(1), one(2), one(3), &c, k)?;
            }
        }
        // To the CPU twin: within rounding at the operands' scale (the device may contract
        // `b1 * m + (1 - b1) * g` into one FMA, and m is a difference of such terms).
        for (i, name) in [(0, "p"), (2, "m"), (3, "v")] {
            assert_eq!(bits(&fresh[i])?, bits(&shifted[i])?, "n = {n}, {name}: both paths, the same bits");
            let (got, want) = (fresh[i].to_vec::<f32>()?, cpu[i].to_vec::<f32>()?);
            for (j, (g, w)) in got.iter().zip(&want).enumerate() {
                assert!((g - w).abs() <= 2e-6 * w.abs().max(1.0), "n = {n}, {name}[{j}]: {g} vs the CPU's {w}");
            }
        }
    }
    Ok(())
}
