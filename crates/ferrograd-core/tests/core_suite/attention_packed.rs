//! `Tensor::attention_packed`: the attention of one `[B, T, 3, H, D]` QKV buffer against
//! `scaled_dot_product_attention` of its three views (forward and the buffer's gradient), on the
//! CPU in f64 and on CUDA in every dtype through both CUDA backends (cuDNN, whose backward writes
//! the packed gradient through its output strides, and our kernels), with poisoned allocations so
//! that an element of the packed gradient no kernel wrote fails the test.

use crate::common;

use common::{gpu, gradcheck, randn, rel_err};
use ferrograd_core::fused::attention::select::{counters_on_this_thread, set_backend, Backend};
use ferrograd_core::fused::attention::{cudnn, AttentionOpts};
use ferrograd_core::{DType, Device, Error, Result, Rng, Tensor};

/// The `[B, H, T, D]` views of a `[B, T, 3, H, D]` buffer.
fn views(qkv: &Tensor) -> Result<Vec<Tensor>> {
    (0..3).map(|i| qkv.narrow(2, i, 1)?.squeeze(2)?.permute(&[0, 2, 1, 3])).collect()
}

/// Output `[B, T, H, D]` and the gradient of `sum(out * w)` for the buffer, packed or through
/// the views.
fn run(qkv: &Tensor, w: &Tensor, causal: bool, packed: bool) -> Result<(Tensor, Tensor)> {
    let x = qkv.requires_grad();
    let opts = AttentionOpts { causal, ..Default::default() };
    let o = if packed {
        Tensor::attention_packed(&x, opts)?
    } else {
        let v = views(&x)?;
        Tensor::scaled_dot_product_attention(&v[0], &v[1], &v[2], opts)?.permute(&[0, 2, 1, 3])?
    };
    let g = o.mul(w)?.sum_all()?.backward()?;
    let dx = g.get(&x).ok_or_else(|| Error::Backward("no gradient for qkv".into()))?.clone();
    Ok((o, dx))
}

#[test]
fn cpu_packed_equals_the_views_f64() -> Result<()> {
    let mut rng = Rng::new(3);
    for (b, t, h, d) in [(1, 1, 1, 4), (2, 7, 3, 8), (1, 33, 2, 16)] {
        for causal in [false, true] {
            let qkv = randn(&mut rng, &[b, t, 3, h, d], DType::F64);
            let w = randn(&mut rng, &[b, t, h, d], DType::F64);
            let (o, g) = run(&qkv, &w, causal, true)?;
            let (ro, rg) = run(&qkv, &w, causal, false)?;
            assert_eq!((o.dims(), g.dims()), (&[b, t, h, d][..], &[b, t, 3, h, d][..]));
            assert!(o.is_contiguous(), "the output is [B, T, H, D] and contiguous");
            assert_eq!(o.to_f64_vec()?, ro.contiguous()?.to_f64_vec()?, "forward {b} {t} {h} {d} causal={causal}");
            assert_eq!(g.to_f64_vec()?, rg.to_f64_vec()?, "gradient {b} {t} {h} {d} causal={causal}");
        }
    }
    Ok(())
}

#[test]
fn gradcheck_packed_f64() {
    let mut rng = Rng::new(4);
    for causal in [false, true] {
        let qkv = randn(&mut rng, &[2, 5, 3, 2, 3], DType::F64);
        gradcheck(
            &format!("attention_packed causal={causal}"),
            |x: &[Tensor]| Tensor::attention_packed(&x[0], AttentionOpts { causal, ..Default::default() }),
            &[qkv],
        );
    }
}

#[test]
fn bad_shapes_are_typed_errors() {
    for dims in [vec![2, 5, 3, 4], vec![2, 5, 2, 2, 4], vec![1, 4, 4, 2, 8]] {
        let x = Tensor::zeros(dims.clone(), DType::F32, Device::Cpu).expect("zeros");
        match Tensor::attention_packed(&x, AttentionOpts::causal()) {
            Err(Error::Shape { .. }) => {}
            other => panic!("{dims:?}: expected a shape error, got {other:?}"),
        }
    }
}

/// Packed against the views on the device (same backend, same kernels): forward and gradient
/// agree to rounding, and both agree with the f64 CPU reference within the dtype's tolerance.
#[test]
fn cuda_packed_matches_the_views_every_dtype_and_backend() -> Result<()> {
    let Some(dev) = gpu() else { return Ok(()) };
    let mut rng = Rng::new(5);
    let mut backends = vec![Backend::Flash];
    if cudnn::available() {
        backends.push(Backend::Cudnn);
    } else {
        println!("cuDNN not found: checking our kernels only");
    }
    for &backend in &backends {
        set_backend(Some(backend));
        for dtype in [DType::BF16, DType::F16, DType::F32] {
            if backend == Backend::Cudnn && dtype == DType::F32 {
                continue; // cuDNN's SDPA takes bf16 / f16; f32 runs our kernels either way
            }
            for (b, t, h, d, causal) in [(2, 64, 3, 64, true), (1, 129, 2, 64, false), (2, 77, 2, 128, true)] {
                let qkv = randn(&mut rng, &[b, t, 3, h, d], dtype);
                let w = randn(&mut rng, &[b, t, h, d], dtype);
                let before = counters_on_this_thread();
                let (o, g) = run(&qkv.to_device(dev)?, &w.to_device(dev)?, causal, true)?;
                let after = counters_on_this_thread();
                if backend == Backend::Cudnn {
                    assert!(after.cudnn_bwd > before.cudnn_bwd, "cuDNN ran the packed backward ({dtype} T={t} D={d})");
                }
                let (vo, vg) = run(&qkv.to_device(dev)?, &w.to_device(dev)?, causal, false)?;
                let f64s = |x: &Tensor| x.to_dtype(DType::F64).and_then(|x| x.to_device(Device::Cpu));
                let (ro, rg) = run(&f64s(&qkv)?, &f64s(&w)?, causal, false)?;
                let what = format!("{backend:?} {dtype} B={b} T={t} H={h} D={d} causal={causal}");
                let (same_o, same_g) = (rel_err(&f64s(&o)?, &f64s(&vo)?), rel_err(&f64s(&g)?, &f64s(&vg)?));
                let (ref_o, ref_g) = (rel_err(&f64s(&o)?, &ro), rel_err(&f64s(&g)?, &rg));
                println!("{what}: vs views o {same_o:.1e} dqkv {same_g:.1e}; vs f64 o {ref_o:.1e} dqkv {ref_g:.1e}");
                let tol = match dtype {
                    DType::F32 => 1e-5,
                    DType::F16 => 3e-3,
                    _ => 2e-2,
                };
                // The forward runs the same kernel on the same views; the backward may get another cuDNN
                // engine for its other output strides, so it agrees to rounding.
                assert!(same_o <= 1e-6 && same_g <= tol / 2.0, "{what}: packed differs from the views");
                assert!(
                    ref_o < tol && ref_g < tol,
                    "{what}: against f64 {ref_o:.2e} / {ref_g:.2e} (tolerance {tol:.0e})"
                );
            }
        }
    }
    set_backend(None);
    Ok(())
}
