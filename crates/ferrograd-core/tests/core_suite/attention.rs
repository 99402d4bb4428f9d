//! Scaled dot-product attention (`src/fused/attention/`): the CPU op against its definition
//! composed from primitives (matmul, softmax, an explicit dropout mask built from the documented
//! Philox mapping), gradcheck in f64, typed errors, and CPU <-> CUDA parity of the forward and all
//! three gradients in f32, f16 and bf16 on odd shapes, strided QKV views, causal or not, with and
//! without dropout. CUDA outputs are poisoned (NaN) before the kernels; without a GPU the CUDA
//! tests print one line and pass.

use crate::common;

use common::{gpu, gradcheck, randn, rel_err};
use ferrograd_core::fused::attention::{AttentionOpts, CUDA_HEAD_DIMS};
use ferrograd_core::rng::philox4x32_10;
use ferrograd_core::{with_no_grad, DType, Device, Error, Result, Rng, Tensor};

const CPU: Device = Device::Cpu;

fn sdpa(q: &Tensor, k: &Tensor, v: &Tensor, opts: AttentionOpts, seed: u64) -> Result<Tensor> {
    Tensor::scaled_dot_product_attention_with(&mut Rng::new(seed), q, k, v, opts)
}

fn norm(x: &Tensor) -> f64 {
    x.to_f64_vec().expect("values").iter().map(|v| v * v).sum::<f64>().sqrt()
}

/// ‖x − y‖ / max(‖y‖, floor); infinite when anything is not finite.
fn rel_err_floor(x: &Tensor, y: &Tensor, floor: f64) -> f64 {
    let (e, n) = (rel_err(x, y), norm(y));
    if !e.is_finite() && n > 0.0 {
        return e;
    }
    let diff = norm(&x.to_device(CPU).and_then(|x| x.sub(y)).expect("difference"));
    if !diff.is_finite() {
        return f64::INFINITY;
    }
    if diff == 0.0 {
        0.0
    } else {
        diff / n.max(floor)
    }
}

/// The `[B, H, T, D]` views of a `[B, T, 3, H, D]` buffer, as a fused QKV projection gives them.
fn qkv_views(qkv: &Tensor) -> Vec<Tensor> {
    (0..3).map(|i| qkv.narrow(2, i, 1).unwrap().squeeze(2).unwrap().permute(&[0, 2, 1, 3]).unwrap()).collect()
}

/// The dropout multiplier of the documented mapping (mod.rs `Dropout`), computed independently:
/// keep/(1 - p) for element (b, h, i, j) of seed `seed` at stream offset 0.
fn dropout_mask(dims: (usize, usize, usize, usize), p: f64, seed: u64) -> Tensor {
    let (b, h, tq, tk) = dims;
    let thr = (p * 65_536.0).ceil() as u32;
    let mut m = Vec::with_capacity(b * h * tq * tk);
    for bh in 0..b * h {
        for i in 0..tq {
            for j in 0..tk {
                let index = ((bh * tq + i) * tk.div_ceil(8) + j / 8) as u64;
                let w = philox4x32_10([index as u32, (index >> 32) as u32, 0, 0], [seed as u32, (seed >> 32) as u32]);
                let half = (w[(j % 8) / 2] >> (16 * (j % 2))) & 0xffff;
                m.push(if half >= thr { 1.0 / (1.0 - p) } else { 0.0 });
            }
        }
    }
    Tensor::from_vec(m, (b, h, tq, tk), CPU).unwrap()
}

/// Attention composed from primitives: softmax(scale q k^T + causal bias) [* mask] v.
fn composed(q: &Tensor, k: &Tensor, v: &Tensor, opts: AttentionOpts, seed: u64) -> Result<Tensor> {
    let (b, h, tq, d) = (q.dims()[0], q.dims()[1], q.dims()[2], q.dims()[3]);
    let tk = k.dims()[2];
    let scale = opts.scale.unwrap_or(1.0 / (d as f64).sqrt());
    let mut s = q.matmul(&k.transpose(2, 3)?)?.mul_scalar(scale)?;
    if opts.causal {
        let bias: Vec<f64> = (0..tq * tk).map(|e| if e % tk > e / tk { f64::NEG_INFINITY } else { 0.0 }).collect();
        s = s.add(&Tensor::from_vec(bias, (tq, tk), CPU)?.to_dtype(q.dtype())?)?;
    }
    let mut p = s.softmax(-1)?;
    if opts.dropout_p > 0.0 {
        p = p.mul(&dropout_mask((b, h, tq, tk), opts.dropout_p, seed).to_dtype(q.dtype())?)?;
    }
    p.matmul(v)
}

/// Forward and gradients of `sum(out * w)` for q, k, v (w fixed by `wseed`).
fn value_and_grads(
    f: &dyn Fn(&Tensor, &Tensor, &Tensor) -> Result<Tensor>,
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    w: &Tensor,
) -> Result<(Tensor, Vec<Tensor>)> {
    let (qv, kv, vv) = (q.requires_grad(), k.requires_grad(), v.requires_grad());
    let o = f(&qv, &kv, &vv)?;
    let g = o.mul(w)?.sum_all()?.backward()?;
    let grads = [&qv, &kv, &vv].iter().map(|t| g.get(t).expect("gradient").clone()).collect();
    Ok((o, grads))
}

// ---- the CPU op against its definition -----------------------------------------------------------

#[test]
fn cpu_f64_matches_the_composed_definition() -> Result<()> {
    let mut rng = Rng::new(1);
    let cases = [
        // (b, h, tq, tk, d, causal, dropout, scale)
        (1, 1, 1, 1, 4, false, 0.0, None),
        (2, 3, 7, 7, 5, false, 0.0, None),
        (2, 3, 7, 7, 5, true, 0.0, None),
        (1, 2, 70, 70, 8, true, 0.0, Some(0.3)),
        (1, 2, 5, 9, 6, true, 0.0, None),
        (1, 2, 9, 5, 6, true, 0.0, None),
        (2, 2, 33, 65, 16, false, 0.25, None),
        (2, 1, 67, 67, 8, true, 0.5, Some(-0.2)),
    ];
    for (b, h, tq, tk, d, causal, p, scale) in cases {
        let (q, k, v) = (randn(&mut rng, &[b, h, tq, d], DType::F64), randn(&mut rng, &[b, h, tk, d], DType::F64), {
            randn(&mut rng, &[b, h, tk, d], DType::F64)
        });
        let w = randn(&mut rng, &[b, h, tq, d], DType::F64);
        let opts = AttentionOpts { causal, scale, dropout_p: p };
        let what = format!("b{b} h{h} tq{tq} tk{tk} d{d} causal={causal} p={p} scale={scale:?}");
        let (o, g) = value_and_grads(&|q, k, v| sdpa(q, k, v, opts, 11), &q, &k, &v, &w)?;
        let (ro, rg) = value_and_grads(&|q, k, v| composed(q, k, v, opts, 11), &q, &k, &v, &w)?;
        assert_eq!(o.dims(), [b, h, tq, d], "{what}");
        assert!(rel_err(&o, &ro) < 1e-12, "{what}: forward {}", rel_err(&o, &ro));
        for (name, (a, r)) in ["dq", "dk", "dv"].iter().zip(g.iter().zip(&rg)) {
            assert!(rel_err(a, r) < 1e-11, "{what}: {name} {}", rel_err(a, r));
        }
    }
    Ok(())
}

#[test]
fn cpu_reads_fused_qkv_views_in_place() -> Result<()> {
    let mut rng = Rng::new(2);
    let qkv = randn(&mut rng, &[2, 11, 3, 4, 8], DType::F64);
    let views = qkv_views(&qkv);
    let o = sdpa(&views[0], &views[1], &views[2], AttentionOpts::causal(), 0)?;
    let c: Vec<Tensor> = views.iter().map(|t| t.contiguous().unwrap()).collect();
    let r = composed(&c[0], &c[1], &c[2], AttentionOpts::causal(), 0)?;
    assert!(rel_err(&o, &r) < 1e-12);
    // The result is a [B, H, T, D] view of a [B, T, H, D] buffer: its transpose is contiguous.
    assert!(o.transpose(1, 2)?.is_contiguous());
    Ok(())
}

#[test]
fn cpu_reduced_precision_is_close_to_f64() -> Result<()> {
    let mut rng = Rng::new(3);
    for (dtype, tol) in [(DType::F32, 1e-5), (DType::F16, 5e-3), (DType::BF16, 3e-2)] {
        let (q, k, v) = (
            randn(&mut rng, &[2, 2, 37, 16], dtype),
            randn(&mut rng, &[2, 2, 37, 16], dtype),
            randn(&mut rng, &[2, 2, 37, 16], dtype),
        );
        let w = randn(&mut rng, &[2, 2, 37, 16], dtype);
        let opts = AttentionOpts { causal: true, scale: None, dropout_p: 0.1 };
        let f = |q: &Tensor, k: &Tensor, v: &Tensor| sdpa(q, k, v, opts, 5);
        let (o, g) = value_and_grads(&f, &q, &k, &v, &w)?;
        let f64s: Vec<Tensor> = [&q, &k, &v, &w].iter().map(|t| t.to_dtype(DType::F64).unwrap()).collect();
        let (ro, rg) = value_and_grads(&f, &f64s[0], &f64s[1], &f64s[2], &f64s[3])?;
        assert_eq!(o.dtype(), dtype);
        assert!(rel_err(&o, &ro) < tol, "{dtype} forward {}", rel_err(&o, &ro));
        for (a, r) in g.iter().zip(&rg) {
            assert_eq!(a.dtype(), dtype);
            assert!(rel_err(a, r) < 2.0 * tol, "{dtype} gradient {}", rel_err(a, r));
        }
    }
    Ok(())
}

#[test]
fn dropout_keeps_one_minus_p_and_scales_the_kept() -> Result<()> {
    // With v = ones every output element is sum_j p_ij keep_ij / (1 - p): 1 on average.
    let (b, h, t, d) = (1, 2, 256, 4);
    let mut rng = Rng::new(4);
    let q = randn(&mut rng, &[b, h, t, d], DType::F64).mul_scalar(0.1)?;
    let k = randn(&mut rng, &[b, h, t, d], DType::F64);
    let v = Tensor::ones((b, h, t, d), DType::F64, CPU)?;
    let opts = AttentionOpts { dropout_p: 0.3, ..Default::default() };
    let o = sdpa(&q, &k, &v, opts, 9)?.to_f64_vec()?;
    let mean = o.iter().sum::<f64>() / o.len() as f64;
    assert!((mean - 1.0).abs() < 0.02, "mean {mean}");
    let kept = dropout_mask((b, h, t, t), 0.3, 9).to_f64_vec()?.iter().filter(|&&x| x > 0.0).count();
    assert!((kept as f64 / (b * h * t * t) as f64 - 0.7).abs() < 0.01, "kept {kept}");
    // Same seed, same result; another seed, another mask; the default generator advances.
    assert_eq!(o, sdpa(&q, &k, &v, opts, 9)?.to_f64_vec()?);
    assert_ne!(o, sdpa(&q, &k, &v, opts, 10)?.to_f64_vec()?);
    let a = Tensor::scaled_dot_product_attention(&q, &k, &v, opts)?.to_f64_vec()?;
    let b2 = Tensor::scaled_dot_product_attention(&q, &k, &v, opts)?.to_f64_vec()?;
    assert_ne!(a, b2);
    Ok(())
}

#[test]
fn no_grad_records_nothing_and_empty_queries_work() -> Result<()> {
    let mut rng = Rng::new(5);
    let q = randn(&mut rng, &[1, 2, 3, 4], DType::F64).requires_grad();
    let k = randn(&mut rng, &[1, 2, 5, 4], DType::F64);
    let o = with_no_grad(|| sdpa(&q, &k, &k, AttentionOpts::default(), 0))?;
    assert!(!o.tracks_grad());
    let q0 = Tensor::zeros((1, 2, 0, 4), DType::F32, CPU)?.requires_grad();
    let k32 = k.to_dtype(DType::F32)?.requires_grad();
    let o = sdpa(&q0, &k32, &k32, AttentionOpts::default(), 0)?;
    assert_eq!(o.dims(), [1, 2, 0, 4]);
    Ok(())
}

// ---- gradcheck (f64, central differences) --------------------------------------------------------

#[test]
fn gradcheck_attention_f64() {
    let mut rng = Rng::new(6);
    for (tq, tk, d) in [(1, 1, 3), (4, 4, 8), (7, 7, 3), (3, 6, 4), (6, 3, 4)] {
        for causal in [false, true] {
            for p in [0.0, 0.4] {
                let inputs =
                    [randn(&mut rng, &[1, 2, tq, d], DType::F64), randn(&mut rng, &[1, 2, tk, d], DType::F64), {
                        randn(&mut rng, &[1, 2, tk, d], DType::F64)
                    }];
                let opts = AttentionOpts { causal, scale: None, dropout_p: p };
                gradcheck(
                    &format!("attention tq={tq} tk={tk} d={d} causal={causal} p={p}"),
                    |x: &[Tensor]| sdpa(&x[0], &x[1], &x[2], opts, 21),
                    &inputs,
                );
            }
        }
    }
    // Strided inputs: one fused QKV buffer, and a custom scale.
    let qkv = randn(&mut rng, &[1, 5, 3, 2, 4], DType::F64);
    let opts = AttentionOpts { causal: true, scale: Some(0.7), dropout_p: 0.0 };
    gradcheck(
        "attention of qkv views",
        |x: &[Tensor]| {
            let v = qkv_views(&x[0]);
            sdpa(&v[0], &v[1], &v[2], opts, 0)
        },
        &[qkv],
    );
}

// ---- errors ----------------------------------------------------------------------------------------

#[test]
fn bad_inputs_are_typed_errors() -> Result<()> {
    let t = |dims: &[usize], dt: DType| Tensor::zeros(dims.to_vec(), dt, CPU).unwrap();
    let f = DType::F32;
    let (q, kv) = (t(&[2, 3, 4, 8], f), t(&[2, 3, 5, 8], f));
    let o = AttentionOpts::default();
    let e = sdpa(&t(&[3, 4, 8], f), &kv, &kv, o, 0).unwrap_err();
    assert!(matches!(e, Error::Shape { .. }) && e.to_string().contains("[B, H, T, D]"), "{e}");
    for bad in [t(&[1, 3, 5, 8], f), t(&[2, 2, 5, 8], f), t(&[2, 3, 5, 4], f)] {
        let e = sdpa(&q, &bad, &bad, o, 0).unwrap_err();
        assert!(matches!(e, Error::ShapeMismatch { .. }), "{e}");
    }
    let e = sdpa(&q, &kv, &t(&[2, 3, 6, 8], f), o, 0).unwrap_err();
    assert!(matches!(e, Error::ShapeMismatch { .. }), "k and v lengths: {e}");
    let e = sdpa(&q, &kv, &t(&[2, 3, 5, 8], DType::F16), o, 0).unwrap_err();
    assert!(matches!(e, Error::DTypeMismatch { .. }), "{e}");
    let e = sdpa(&t(&[2, 3, 4, 8], DType::I32), &kv, &kv, o, 0).unwrap_err();
    assert!(matches!(e, Error::UnsupportedDType { .. }), "{e}");
    for p in [-0.1, 1.0, f64::NAN] {
        let e = sdpa(&q, &kv, &kv, AttentionOpts { dropout_p: p, ..o }, 0).unwrap_err();
        assert!(matches!(e, Error::InvalidArgument(_)), "p={p}: {e}");
    }
    let e = sdpa(&q, &kv, &kv, AttentionOpts { scale: Some(f64::INFINITY), ..o }, 0).unwrap_err();
    assert!(matches!(e, Error::InvalidArgument(_)), "{e}");
    let e = sdpa(&q, &t(&[2, 3, 0, 8], f), &t(&[2, 3, 0, 8], f), o, 0).unwrap_err();
    assert!(matches!(e, Error::Shape { .. }), "no keys: {e}");
    if let Some(dev) = gpu() {
        let g = |x: &Tensor| x.to_device(dev).unwrap();
        let e = sdpa(&g(&q), &kv, &kv, o, 0).unwrap_err();
        assert!(matches!(e, Error::DeviceMismatch { .. }), "{e}");
        let (q48, kv48) = (g(&t(&[1, 1, 4, 48], f)), g(&t(&[1, 1, 4, 48], f)));
        let e = sdpa(&q48, &kv48, &kv48, o, 0).unwrap_err();
        assert!(matches!(e, Error::Shape { .. }) && e.to_string().contains("head dim 48"), "{e}");
        let q64 = g(&t(&[1, 1, 4, 64], DType::F64));
        let e = sdpa(&q64, &q64, &q64, o, 0).unwrap_err();
        assert!(matches!(e, Error::UnsupportedDType { .. }), "{e}");
    }
    Ok(())
}

// ---- CUDA parity -----------------------------------------------------------------------------------

/// Norm-wise relative error allowed against the float64 reference: (forward, gradients). Measured
/// on an H200 at T = 300 (every head dim): bf16 <= 2.7e-3, f16 <= 3.3e-4, f32 <= 5.6e-7.
fn parity_tol(dtype: DType) -> (f64, f64) {
    match dtype {
        DType::F32 => (4e-6, 8e-6),
        DType::F16 => (1.5e-3, 2.5e-3),
        _ => (1e-2, 1.5e-2),
    }
}

/// How q, k, v are laid out.
#[derive(Debug, Clone, Copy)]
enum Inputs {
    /// Three contiguous `[B, H, T, D]` tensors.
    Separate,
    /// Views of one `[B, T, 3, H, D]` buffer (Tq == Tk only).
    FusedQkv,
    /// Transposed `[B, H, D, T]` buffers viewed as `[B, H, T, D]`: the head dim is not contiguous.
    Transposed,
}

fn make_inputs(rng: &mut Rng, kind: Inputs, dims: (usize, usize, usize, usize, usize), dtype: DType) -> Vec<Tensor> {
    let (b, h, tq, tk, d) = dims;
    match kind {
        Inputs::Separate => {
            vec![
                randn(rng, &[b, h, tq, d], dtype),
                randn(rng, &[b, h, tk, d], dtype),
                randn(rng, &[b, h, tk, d], dtype),
            ]
        }
        Inputs::FusedQkv => qkv_views(&randn(rng, &[b, tq, 3, h, d], dtype)),
        Inputs::Transposed => {
            [tq, tk, tk].iter().map(|&t| randn(rng, &[b, h, d, t], dtype).transpose(2, 3).unwrap()).collect()
        }
    }
}

#[allow(clippy::too_many_arguments)]
fn parity_case(
    dev: Device,
    rng: &mut Rng,
    dtype: DType,
    dims: (usize, usize, usize, usize, usize),
    kind: Inputs,
    causal: bool,
    p: f64,
) -> Result<()> {
    let (b, h, tq, _, d) = dims;
    let what = format!("{dtype} {dims:?} {kind:?} causal={causal} p={p}");
    let x = make_inputs(rng, kind, dims, dtype);
    let w = randn(rng, &[b, h, tq, d], dtype);
    let opts = AttentionOpts { causal, scale: None, dropout_p: p };
    let f = |q: &Tensor, k: &Tensor, v: &Tensor| sdpa(q, k, v, opts, 1234);
    // Reference: the same (rounded) inputs in f64 on the CPU.
    let r: Vec<Tensor> = x.iter().chain([&w]).map(|t| t.to_dtype(DType::F64).unwrap()).collect();
    let (ro, rg) = value_and_grads(&f, &r[0], &r[1], &r[2], &r[3])?;
    // The device copies keep the views' layouts (a view moved as a whole buffer, then viewed).
    let on = |t: &Tensor| t.to_device(dev).unwrap();
    let gx: Vec<Tensor> = match kind {
        Inputs::FusedQkv => {
            // Move the underlying buffer and take the views there, so the kernels read strides.
            let qkv = Tensor::stack(&[x[0].transpose(1, 2)?, x[1].transpose(1, 2)?, x[2].transpose(1, 2)?], 2)?;
            qkv_views(&on(&qkv))
        }
        Inputs::Transposed => x.iter().map(|t| on(&t.transpose(2, 3).unwrap()).transpose(2, 3).unwrap()).collect(),
        Inputs::Separate => x.iter().map(on).collect(),
    };
    let (o, g) = value_and_grads(&f, &gx[0], &gx[1], &gx[2], &on(&w))?;
    let (tf, tb) = parity_tol(dtype);
    assert_eq!(o.device(), dev, "{what}");
    assert_eq!(o.dtype(), dtype, "{what}");
    let mut errs = vec![rel_err(&o.to_dtype(DType::F64)?, &ro)];
    // dq and dk can be exactly zero (one key: the softmax is constant), so their errors are taken
    // relative to at least 1% of dv's norm. With one key the exact dq and dk ARE zero and what the
    // kernels return is rounding: delta = dO . O reads O rounded to the output dtype (as
    // FlashAttention does) while dP = dO . V does not, which leaves about 2e-3 |dv| in bf16 (4e-4
    // in f16) once dropout's 1/(1-p) rounds O. Against an exact zero the error is measured on dv's
    // own scale (dq's size for unit inputs when the softmax is not constant); a wrong kernel is
    // off by order one there.
    let (_, _, _, tk, _) = dims;
    let floor = if tk == 1 { norm(&rg[2]) } else { 0.01 * norm(&rg[2]) };
    for (a, r) in g.iter().zip(&rg) {
        assert_eq!(a.device(), dev, "{what}");
        errs.push(rel_err_floor(&a.to_dtype(DType::F64)?, r, floor));
    }
    let line = format!("{what}: rel err o {:.2e} dq {:.2e} dk {:.2e} dv {:.2e}", errs[0], errs[1], errs[2], errs[3]);
    println!("{line}");
    if errs[0] < tf && errs[1..].iter().all(|e| *e < tb) {
        Ok(())
    } else {
        Err(Error::InvalidArgument(format!("{line} (tolerances {tf:.0e} / {tb:.0e})")))
    }
}

#[test]
fn cuda_parity_forward_and_backward() -> Result<()> {
    let Some(dev) = gpu() else { return Ok(()) };
    let mut rng = Rng::new(7);
    let shapes = [(1, 1), (17, 17), (129, 129), (300, 300), (17, 129), (129, 17)];
    let (mut case, mut failures) = (0usize, Vec::new());
    for dtype in [DType::BF16, DType::F16, DType::F32] {
        for &(tq, tk) in &shapes {
            for causal in [false, true] {
                for p in [0.0, 0.2] {
                    let d = CUDA_HEAD_DIMS[case % CUDA_HEAD_DIMS.len()];
                    let kind = match case % 3 {
                        0 if tq == tk => Inputs::FusedQkv,
                        1 => Inputs::Transposed,
                        _ => Inputs::Separate,
                    };
                    case += 1;
                    if let Err(e) = parity_case(dev, &mut rng, dtype, (2, 3, tq, tk, d), kind, causal, p) {
                        failures.push(e.to_string());
                    }
                }
            }
        }
    }
    assert!(failures.is_empty(), "{} of {case} cases failed:\n{}", failures.len(), failures.join("\n"));
    Ok(())
}

#[test]
fn cuda_parity_every_head_dim_at_length_300() -> Result<()> {
    let Some(dev) = gpu() else { return Ok(()) };
    let mut rng = Rng::new(8);
    for dtype in [DType::BF16, DType::F16, DType::F32] {
        for (i, &d) in CUDA_HEAD_DIMS.iter().enumerate() {
            let causal = i % 2 == 0;
            parity_case(dev, &mut rng, dtype, (1, 2, 300, 300, d), Inputs::FusedQkv, causal, 0.0)?;
        }
    }
    Ok(())
}

#[test]
fn cuda_rows_past_a_tile_and_unaligned_views() -> Result<()> {
    let Some(dev) = gpu() else { return Ok(()) };
    let mut rng = Rng::new(9);
    // A narrowed head dim (row stride 72, not 16-byte aligned for 2-byte types): copied first.
    for dtype in [DType::BF16, DType::F32] {
        let big: Vec<Tensor> = (0..3).map(|_| randn(&mut rng, &[1, 2, 65, 72], dtype)).collect();
        let x: Vec<Tensor> = big.iter().map(|t| t.narrow(3, 3, 64).unwrap()).collect();
        let opts = AttentionOpts { causal: true, ..Default::default() };
        let r: Vec<Tensor> = x.iter().map(|t| t.to_dtype(DType::F64).unwrap()).collect();
        let want = sdpa(&r[0], &r[1], &r[2], opts, 0)?;
        let gx: Vec<Tensor> = big.iter().map(|t| t.to_device(dev).unwrap().narrow(3, 3, 64).unwrap()).collect();
        let got = sdpa(&gx[0], &gx[1], &gx[2], opts, 0)?;
        let e = rel_err(&got.to_dtype(DType::F64)?, &want);
        assert!(e < parity_tol(dtype).0, "{dtype} narrowed: {e:.3e}");
    }
    Ok(())
}

/// A few small cases, forward and backward, for compute-sanitizer (memcheck, racecheck): every
/// kernel of the op, partial tiles, causal, dropout, each dtype.
#[test]
fn cuda_sanitizer_smoke() -> Result<()> {
    let Some(dev) = gpu() else { return Ok(()) };
    let mut rng = Rng::new(10);
    parity_case(dev, &mut rng, DType::BF16, (1, 2, 129, 129, 64), Inputs::FusedQkv, true, 0.2)?;
    parity_case(dev, &mut rng, DType::F16, (1, 1, 77, 45, 128), Inputs::Separate, false, 0.0)?;
    parity_case(dev, &mut rng, DType::BF16, (1, 1, 33, 70, 96), Inputs::Transposed, true, 0.0)?;
    parity_case(dev, &mut rng, DType::F32, (1, 2, 70, 70, 64), Inputs::FusedQkv, true, 0.1)?;
    // On sm_90: the Hopper kernels with dropout at d = 128 (the TMA forward), Tq != Tk.
    parity_case(dev, &mut rng, DType::F16, (1, 2, 77, 130, 128), Inputs::Separate, true, 0.1)?;
    Ok(())
}

#[test]
fn bench_workload_checks_on_the_cpu() -> Result<()> {
    use ferrograd_core::fused::attention::bench::{tolerance, Workload};
    let w = Workload::new(&mut Rng::new(11), 2, 3, 45, 16, DType::F32, CPU, true)?;
    let o = w.forward()?;
    assert_eq!(o.dims(), [2, 3, 45, 16]);
    assert!(w.check_forward(&o, &mut Rng::new(1), 4)? < 1e-5);
    assert!(w.check_backward()? < tolerance(DType::F32));
    // The check can fail: a wrong output is caught.
    assert!(w.check_forward(&o.mul_scalar(1.01)?, &mut Rng::new(1), 4)? > 1e-3);
    assert_eq!(w.flops(false), 4.0 * 6.0 * 45.0 * 45.0 * 16.0 / 2.0);
    // With dropout: both checks apply the op's mask, and the output without dropout fails them.
    let wd = w.clone().with_dropout(0.25);
    let od = wd.forward()?;
    assert!(wd.check_forward(&od, &mut Rng::new(1), 4)? < 1e-5);
    assert!(wd.check_backward()? < tolerance(DType::F32));
    assert!(wd.check_forward(&o, &mut Rng::new(1), 4)? > 1e-2);
    assert!(w.check_forward(&od, &mut Rng::new(1), 4)? > 1e-2);
    Ok(())
}
