//! The fused global-norm clipping kernels (`optim::global_norm_fused`,
//! `optim::clip_global_norm_fused`) against an f64 reference on the host: more tensors than one
//! launch table holds, empty and odd sizes, a factor below and at 1, NaN, determinism, and the
//! inputs they decline (CPU, other dtypes, views) or refuse (a negative max norm).

use crate::common;

use common::{gpu, randn};
use ferrograd_core::optim::{clip_global_norm_fused, global_norm_fused};
use ferrograd_core::{DType, Device, Error, Result, Rng, Tensor};

fn host(t: &Tensor) -> Vec<f64> {
    t.to_f64_vec().expect("values")
}

/// 45 tensors (two launch tables), sizes 0 to 70k, on `dev`.
fn grads(rng: &mut Rng, dev: Device) -> Vec<Tensor> {
    (0..45)
        .map(|i| {
            let n = [0, 1, 7, 1000, 70_001][i % 5];
            randn(rng, &[n], DType::F32).to_device(dev).expect("transfer")
        })
        .collect()
}

#[test]
fn cuda_fused_norm_and_clip_match_f64() -> Result<()> {
    let Some(dev) = gpu() else { return Ok(()) };
    let mut rng = Rng::new(8);
    let gs = grads(&mut rng, dev);
    let want: f64 = gs.iter().flat_map(host).map(|x| x * x).sum::<f64>().sqrt();
    let norm = global_norm_fused(&gs)?.expect("fused path");
    assert_eq!((norm.dims(), norm.device()), (&[][..], dev));
    let got = norm.item_f64()?;
    assert!((got - want).abs() <= 1e-5 * want, "norm {got} vs {want}");
    for max_norm in [0.25 * want, 10.0 * want] {
        let (n, scaled) = clip_global_norm_fused(&gs, max_norm)?.expect("fused path");
        assert_eq!(n.item_f64()?, got, "the same norm from both entry points");
        let factor = (max_norm as f32 * (1.0 / (got as f32 + 1e-6))).min(1.0);
        for (g, s) in gs.iter().zip(&scaled) {
            assert_eq!(s.dims(), g.dims());
            let expect: Vec<f64> = host(g).iter().map(|&x| (x as f32 * factor) as f64).collect();
            assert_eq!(host(s), expect, "each element times the factor {factor}");
        }
        // Summation order fixed: a second call is bit-identical.
        let (n2, _) = clip_global_norm_fused(&gs, max_norm)?.expect("fused path");
        assert_eq!(n2.item_f64()?.to_bits(), got.to_bits());
    }
    // Nothing to sum: norm 0, factor 1.
    let empty = vec![Tensor::zeros(0, DType::F32, dev)?];
    assert_eq!(global_norm_fused(&empty)?.expect("fused path").item_f64()?, 0.0);
    Ok(())
}

#[test]
fn cuda_nan_gradient_gives_nan_everywhere() -> Result<()> {
    let Some(dev) = gpu() else { return Ok(()) };
    let gs = vec![Tensor::from_vec(vec![1f32, f32::NAN, 2.0], 3, dev)?, Tensor::from_vec(vec![3f32], 1, dev)?];
    let (norm, scaled) = clip_global_norm_fused(&gs, 1.0)?.expect("fused path");
    assert!(norm.item_f64()?.is_nan());
    assert!(scaled.iter().flat_map(host).all(f64::is_nan), "a NaN norm poisons every gradient, as in PyTorch");
    Ok(())
}

#[test]
fn declines_what_it_does_not_fuse_and_refuses_bad_norms() -> Result<()> {
    let mut rng = Rng::new(9);
    let cpu = vec![randn(&mut rng, &[4], DType::F32)];
    assert!(global_norm_fused(&cpu)?.is_none() && clip_global_norm_fused(&cpu, 1.0)?.is_none());
    assert!(global_norm_fused(&[])?.is_none());
    assert!(matches!(clip_global_norm_fused(&cpu, -1.0), Err(Error::InvalidArgument(_))));
    assert!(matches!(clip_global_norm_fused(&cpu, f64::NAN), Err(Error::InvalidArgument(_))));
    if let Some(dev) = gpu() {
        let half = vec![randn(&mut rng, &[4], DType::BF16).to_device(dev)?];
        let view = vec![randn(&mut rng, &[4, 3], DType::F32).to_device(dev)?.t()?];
        assert!(global_norm_fused(&half)?.is_none() && global_norm_fused(&view)?.is_none());
    }
    Ok(())
}
