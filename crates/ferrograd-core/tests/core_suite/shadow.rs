//! Kept low-precision copies of master weights (`cuda::ShadowSet`) and the optimizer's gradient
//! factor (`adam_step_scheduled`'s `grad_scale`, `optim::clip_factor_fused`): the copies equal
//! the casts of their masters after every Adam step, bit for bit; the fused linear reads the copy
//! (shown by a stale one); the factor gives the same bits as scaling the gradients first; and the
//! refusals (a second set over a master, SGD over a kept master, a copy dtype that is not half).

use crate::common;

use common::{bits, gpu, randn};
use ferrograd_core::cuda::ShadowSet;
use ferrograd_core::fused::linear::{linear, Activation};
use ferrograd_core::optim::{
    adam_step_scheduled, clip_factor_fused, clip_global_norm_fused, sgd_step, AdamConfig, SgdConfig,
};
use ferrograd_core::{DType, Device, Error, Result, Rng, Tensor};

fn cfg() -> AdamConfig {
    AdamConfig { lr: 1e-3, beta1: 0.9, beta2: 0.95, eps: 1e-8, weight_decay: 0.1, decoupled: true }
}

/// Parameters of 45 tensors (two launch tables; sizes 1 to 70k, odd ones included), their
/// gradients and zero moments, on `dev`.
#[allow(clippy::type_complexity)]
fn problem(rng: &mut Rng, dev: Device) -> Result<(Vec<Tensor>, Vec<Tensor>, Vec<Tensor>, Vec<Tensor>)> {
    let mut ps = vec![];
    let mut gs = vec![];
    for i in 0..45 {
        let n = [1, 7, 1000, 70_001, 96][i % 5];
        ps.push(randn(rng, &[n], DType::F32).to_device(dev)?);
        gs.push(randn(rng, &[n], DType::F32).to_device(dev)?);
    }
    let zeros = |ps: &[Tensor]| ps.iter().map(|p| p.zeros_like()).collect::<Result<Vec<_>>>();
    Ok((ps.clone(), gs, zeros(&ps)?, zeros(&ps)?))
}

fn scalar(v: f64, dtype: DType, dev: Device) -> Result<Tensor> {
    Tensor::full(v, 1, dtype, dev)
}

#[test]
fn gradient_factor_equals_scaling_first() -> Result<()> {
    let devs: Vec<Device> = std::iter::once(Device::Cpu).chain(gpu()).collect();
    for dev in devs {
        let mut rng = Rng::new(31);
        let (ps, gs, m, v) = problem(&mut rng, dev)?;
        let (ps2, m2, v2) = (
            ps.iter().map(|p| p.mul_scalar(1.0)).collect::<Result<Vec<_>>>()?,
            m.iter().map(|t| t.mul_scalar(1.0)).collect::<Result<Vec<_>>>()?,
            v.iter().map(|t| t.mul_scalar(1.0)).collect::<Result<Vec<_>>>()?,
        );
        let factor = 0.37f32 as f64;
        let f = scalar(factor, DType::F32, dev)?;
        let (lr, s1, s2) =
            (scalar(1e-3, DType::F32, dev)?, scalar(0.0, DType::F64, dev)?, scalar(0.0, DType::F64, dev)?);
        for _ in 0..3 {
            adam_step_scheduled(&ps, &gs, &m, &v, &cfg(), &s1, &lr, Some(&f))?;
            let scaled = gs.iter().map(|g| g.mul_scalar(factor)).collect::<Result<Vec<_>>>()?;
            adam_step_scheduled(&ps2, &scaled, &m2, &v2, &cfg(), &s2, &lr, None)?;
        }
        for (a, b) in ps.iter().zip(&ps2).chain(m.iter().zip(&m2)).chain(v.iter().zip(&v2)) {
            assert_eq!(bits(a), bits(b), "{dev}: factor in the kernel vs scaled gradients");
        }
        // A factor that is not one f32 element is refused.
        let bad = scalar(1.0, DType::F64, dev)?;
        assert!(matches!(
            adam_step_scheduled(&ps, &gs, &m, &v, &cfg(), &s1, &lr, Some(&bad)),
            Err(Error::InvalidArgument(_))
        ));
    }
    Ok(())
}

#[test]
fn cuda_clip_factor_is_the_clip_kernels_factor() -> Result<()> {
    let Some(dev) = gpu() else { return Ok(()) };
    let mut rng = Rng::new(32);
    let (_, gs, _, _) = problem(&mut rng, dev)?;
    for max_norm in [0.5, 1e9] {
        let (norm, factor) = clip_factor_fused(&gs, max_norm)?.expect("fused path");
        let (norm2, scaled) = clip_global_norm_fused(&gs, max_norm)?.expect("fused path");
        assert_eq!(norm.item_f64()?.to_bits(), norm2.item_f64()?.to_bits());
        assert_eq!(factor.dims(), &[1]);
        let f = factor.to_f64_vec()?[0];
        assert!(f <= 1.0 && (max_norm > 1e8) == (f == 1.0), "factor {f} for max norm {max_norm}");
        for (g, s) in gs.iter().zip(&scaled) {
            assert_eq!(bits(&g.mul_scalar(f)?), bits(s), "the factor the scale kernel applied");
        }
    }
    assert!(clip_factor_fused(&[randn(&mut rng, &[3], DType::F32)], 1.0)?.is_none(), "CPU: not fused");
    Ok(())
}

#[test]
fn sets_refuse_what_they_cannot_keep() -> Result<()> {
    let mut rng = Rng::new(33);
    let cpu = vec![randn(&mut rng, &[5], DType::F32)];
    assert!(ShadowSet::new(&cpu, DType::BF16)?.is_empty(), "CPU masters get no copy");
    assert!(matches!(ShadowSet::new(&cpu, DType::F32), Err(Error::InvalidArgument(_))));
    let Some(dev) = gpu() else { return Ok(()) };
    let p = randn(&mut rng, &[4, 6], DType::F32).to_device(dev)?;
    let half = randn(&mut rng, &[4], DType::BF16).to_device(dev)?;
    let set = ShadowSet::new(&[p.clone(), p.t()?, half, p.clone()], DType::BF16)?;
    assert_eq!(set.len(), 1, "one copy: a view and a bf16 tensor are skipped, a repeat counted once");
    assert!(
        matches!(ShadowSet::new(std::slice::from_ref(&p), DType::F16), Err(Error::InvalidArgument(_))),
        "one set a master"
    );
    // SGD would leave the copy stale.
    let g = p.ones_like()?;
    let sgd = SgdConfig { lr: 0.1, ..Default::default() };
    assert!(matches!(sgd_step(std::slice::from_ref(&p), &[g], &[], &sgd, true), Err(Error::InvalidArgument(_))));
    drop(set);
    assert_eq!(ShadowSet::new(&[p], DType::F16)?.len(), 1, "free again once the set is gone");
    Ok(())
}

#[test]
fn cuda_copies_follow_every_adam_step() -> Result<()> {
    let Some(dev) = gpu() else { return Ok(()) };
    for dtype in [DType::BF16, DType::F16] {
        let mut rng = Rng::new(34);
        let (ps, gs, m, v) = problem(&mut rng, dev)?;
        // A set over all but the first parameter: the others keep casting.
        let set = ShadowSet::new(&ps[1..], dtype)?;
        assert_eq!(set.len(), ps.len() - 1);
        let check = |what: &str| -> Result<()> {
            assert!(set.copy_of(&ps[0]).is_none());
            for p in &ps[1..] {
                let copy = set.copy_of(p).expect("a copy");
                assert_eq!((copy.dims(), copy.dtype()), (p.dims(), dtype));
                assert_eq!(bits(&copy), bits(&p.to_dtype(dtype)?), "{dtype} {what}: the copy is the cast");
            }
            Ok(())
        };
        check("at creation")?;
        let (lr, step, f) =
            (scalar(1e-2, DType::F32, dev)?, scalar(0.0, DType::F64, dev)?, scalar(0.5, DType::F32, dev)?);
        for i in 0..3 {
            adam_step_scheduled(&ps, &gs, &m, &v, &cfg(), &step, &lr, (i == 1).then_some(&f))?;
            check(&format!("after step {}", i + 1))?;
        }
    }
    Ok(())
}

#[test]
fn cuda_linear_reads_the_kept_copy() -> Result<()> {
    let Some(dev) = gpu() else { return Ok(()) };
    let mut rng = Rng::new(35);
    let x = randn(&mut rng, &[24, 32], DType::BF16).to_device(dev)?;
    // GPT-2's layout: `[in, out]` read transposed, and a bias.
    let w = randn(&mut rng, &[32, 16], DType::F32).to_device(dev)?;
    let b = randn(&mut rng, &[16], DType::F32).to_device(dev)?;
    let y = |w: &Tensor, b: &Tensor| -> Result<Vec<u64>> { Ok(bits(&linear(&x, &w.t()?, Some(b), Activation::None)?)) };
    let cast = y(&w, &b)?;
    let set = ShadowSet::new(&[w.clone(), b.clone()], DType::BF16)?;
    assert_eq!(y(&w, &b)?, cast, "the copy is the cast");
    // Written behind the optimizer's back, the masters differ from their (stale) copies until a
    // refresh: the linear reads the copies.
    let (w2, b2) = (w.mul_scalar(3.0)?, b.mul_scalar(-2.0)?);
    w.set(&w2)?;
    b.set(&b2)?;
    assert_eq!(y(&w, &b)?, cast, "stale copies are what the linear reads");
    set.refresh()?;
    let fresh = y(&w, &b)?;
    assert_ne!(fresh, cast);
    drop(set);
    assert_eq!(y(&w, &b)?, fresh, "without the set the linear casts the same values");
    // The gradients still reach the f32 masters.
    let (wv, bv) = (w.requires_grad(), b.requires_grad());
    let _set = ShadowSet::new(&[wv.clone(), bv.clone()], DType::BF16)?;
    let g = linear(&x, &wv.t()?, Some(&bv), Activation::None)?.to_dtype(DType::F32)?.sum_all()?.backward()?;
    assert_eq!(g.get(&wv).expect("dW").dtype(), DType::F32);
    assert_eq!(g.get(&bv).expect("db").dims(), &[16]);
    Ok(())
}
