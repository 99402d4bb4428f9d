//! The autocast forms of layer norm (`src/fused/layer_norm/`, `src/fused/add_layer_norm/`): an f32
//! input normalized into a bf16 output (`layer_norm_to`) and an f32 residual stream plus a bf16
//! branch (`add_layer_norm_mixed`). On the CPU they give what the cast path gives (cast the branch
//! up, run the f32 op, cast the output down; the gradients likewise), so the f64 gradchecks of the
//! f32 ops cover their math; on CUDA every output and gradient matches the CPU op on odd widths,
//! the row-in-registers widths and strided inputs, with the outputs poisoned (NaN) before the
//! kernels. Other dtype pairs are typed errors. Without a GPU the CUDA tests print one line and pass.

use crate::common;

use common::{gpu, max_err as err, randn};
use ferrograd_core::{DType, Device, Error, Result, Rng, Tensor};

const CPU: Device = Device::Cpu;
const EPS: f64 = 1e-5;

/// A scalar over both outputs with weights that vary per element (each output's own dtype).
fn loss(outs: &[Tensor], gs: &[Tensor]) -> Result<Tensor> {
    let mut l: Option<Tensor> = None;
    for (o, g) in outs.iter().zip(gs) {
        let t = o.mul(&g.to_dtype(o.dtype())?)?.to_dtype(DType::F32)?.sum_all()?;
        l = Some(match l {
            None => t,
            Some(a) => a.add(&t)?,
        });
    }
    l.ok_or_else(|| Error::InvalidArgument("no outputs".into()))
}

/// One case's inputs: x f32 `[rows, c]` (a transposed view when `strided`), the bf16 branch (a
/// narrowed view when `strided`), weight, bias, and the loss weights of h and y.
struct Case {
    x: Tensor,
    r: Tensor,
    w: Tensor,
    b: Tensor,
    gh: Tensor,
    gy: Tensor,
}

fn case(rows: usize, c: usize, strided: bool) -> Result<Case> {
    let mut rng = Rng::new(rows as u64 * 7919 + c as u64);
    let x =
        if strided { randn(&mut rng, &[c, rows], DType::F32).t()? } else { randn(&mut rng, &[rows, c], DType::F32) };
    let r = if strided {
        randn(&mut rng, &[rows, c + 3], DType::BF16).narrow(1, 1, c)?
    } else {
        randn(&mut rng, &[rows, c], DType::BF16)
    };
    let (w, b) = (randn(&mut rng, &[c], DType::F32), randn(&mut rng, &[c], DType::F32));
    let (gh, gy) = (randn(&mut rng, &[rows, c], DType::F32), randn(&mut rng, &[rows, c], DType::F32));
    Ok(Case { x, r, w, b, gh, gy })
}

/// Outputs and gradients (of x, r, w, b; `r` unused by the plain layer norm) on `d`; `mixed`
/// runs the fused autocast op, else the cast path.
fn run(k: &Case, d: Device, residual: bool, mixed: bool) -> Result<(Vec<Tensor>, Vec<Tensor>)> {
    let on = |t: &Tensor| t.to_device(d);
    let vars: Vec<Tensor> = [on(&k.x)?, on(&k.r)?, on(&k.w)?, on(&k.b)?].iter().map(|t| t.requires_grad()).collect();
    let (x, r, w, b) = (&vars[0], &vars[1], Some(&vars[2]), Some(&vars[3]));
    let outs = match (residual, mixed) {
        (true, true) => {
            let (h, y) = x.add_layer_norm_mixed(r, w, b, EPS)?;
            vec![h, y]
        }
        (true, false) => {
            let (h, y) = x.add_layer_norm(&r.to_dtype(DType::F32)?, w, b, EPS)?;
            vec![h, y.to_dtype(DType::BF16)?]
        }
        (false, true) => vec![x.layer_norm_to(w, b, EPS, DType::BF16)?],
        (false, false) => vec![x.layer_norm(w, b, EPS)?.to_dtype(DType::BF16)?],
    };
    let gs = [on(&k.gh)?, on(&k.gy)?];
    let gs = if residual { &gs[..] } else { &gs[1..] };
    let grads = loss(&outs, gs)?.backward()?;
    let n = if residual { 4 } else { 3 };
    let idx: Vec<usize> = if residual { (0..n).collect() } else { vec![0, 2, 3] };
    let g = idx.iter().map(|&i| grads.get(&vars[i]).cloned().expect("gradient")).collect();
    Ok((outs, g))
}

/// The mixed ops on the CPU against the cast path: h, every gradient and the dtypes exactly; y
/// within one bf16 rounding (f64 rounded to bf16 directly against through f32).
#[test]
fn cpu_matches_the_cast_path() -> Result<()> {
    for residual in [true, false] {
        for &(rows, c, strided) in &[(3, 1, false), (4, 17, false), (5, 64, true), (0, 8, false)] {
            let k = case(rows, c, strided)?;
            let what = format!("residual={residual} {rows}x{c} strided={strided}");
            let (mo, mg) = run(&k, CPU, residual, true)?;
            let (ro, rg) = run(&k, CPU, residual, false)?;
            for (i, (a, e)) in mo.iter().zip(&ro).enumerate() {
                assert_eq!(a.dtype(), e.dtype(), "{what}: output {i}");
                let y = i + 1 == mo.len();
                let d = err(a, e);
                assert!(if y { d <= 8e-3 } else { d == 0.0 }, "{what}: output {i} err {d:e}");
            }
            for (i, (a, e)) in mg.iter().zip(&rg).enumerate() {
                assert_eq!(a.dtype(), e.dtype(), "{what}: gradient {i}");
                assert_eq!(a.to_f64_vec()?, e.to_f64_vec()?, "{what}: gradient {i}");
            }
            if residual {
                assert_eq!((mg[0].dtype(), mg[1].dtype(), mg[2].dtype()), (DType::F32, DType::BF16, DType::F32));
            }
        }
    }
    Ok(())
}

#[test]
fn other_dtype_pairs_are_typed_errors() -> Result<()> {
    let mut rng = Rng::new(5);
    let x = randn(&mut rng, &[2, 8], DType::F32);
    let mismatch = |e: Error| assert!(matches!(e, Error::DTypeMismatch { .. }), "{e}");
    mismatch(x.add_layer_norm_mixed(&x.to_dtype(DType::F16)?, None, None, EPS).unwrap_err());
    mismatch(x.add_layer_norm_mixed(&x, None, None, EPS).unwrap_err());
    let xb = x.to_dtype(DType::BF16)?;
    mismatch(xb.add_layer_norm_mixed(&xb, None, None, EPS).unwrap_err());
    // The plain op keeps its rule: one dtype.
    mismatch(x.add_layer_norm(&xb, None, None, EPS).unwrap_err());
    mismatch(x.layer_norm_to(None, None, EPS, DType::F16).unwrap_err());
    mismatch(x.to_dtype(DType::F64)?.layer_norm_to(None, None, EPS, DType::BF16).unwrap_err());
    mismatch(xb.layer_norm_to(None, None, EPS, DType::F32).unwrap_err());
    let w = randn(&mut rng, &[8], DType::BF16);
    mismatch(x.add_layer_norm_mixed(&xb, Some(&w), None, EPS).unwrap_err());
    if let Some(g) = gpu() {
        let e = x.to_device(g)?.add_layer_norm_mixed(&xb, None, None, EPS).unwrap_err();
        assert!(matches!(e, Error::DeviceMismatch { .. }), "{e}");
        let xg = x.to_device(g)?;
        mismatch(xg.layer_norm_to(None, None, EPS, DType::F16).unwrap_err());
    }
    Ok(())
}

// ---- CUDA parity -----------------------------------------------------------------------------------

/// The mixed op on `dev` against the same op on the CPU (f64 math inside, same rounded inputs).
fn parity(dev: Device, residual: bool, rows: usize, c: usize, strided: bool) -> Result<()> {
    let k = case(rows, c, strided)?;
    let (go, gg) = run(&k, dev, residual, true)?;
    let (co, cg) = run(&k, CPU, residual, true)?;
    let what = format!("residual={residual} {rows}x{c} strided={strided}");
    for (i, (a, e)) in go.iter().zip(&co).enumerate() {
        assert_eq!(a.dtype(), e.dtype(), "{what}: output {i}");
        // h is f32 (exact up to the add's rounding); y is bf16 (one rounding apart at most).
        let t = if a.dtype() == DType::F32 { 1e-6 } else { 8e-3 };
        let d = err(a, e);
        assert!(d <= t, "{what}: output {i} err {d:e}");
    }
    for (i, (a, e)) in gg.iter().zip(&cg).enumerate() {
        assert_eq!(a.dtype(), e.dtype(), "{what}: gradient {i}");
        // dweight / dbias sum over rows: scale by sqrt(rows); the branch's gradient is bf16.
        let base = if a.dtype() == DType::BF16 { 8e-3 } else { 5e-5 };
        let t = if a.dims().len() == 1 { base * (rows as f64).sqrt().max(1.0) } else { base };
        let d = err(a, e);
        assert!(d <= t, "{what}: gradient {i} err {d:e}");
    }
    Ok(())
}

#[test]
fn cuda_parity() -> Result<()> {
    let Some(dev) = gpu() else { return Ok(()) };
    for residual in [true, false] {
        for &(rows, c) in &[(5, 1), (7, 17), (33, 768), (6, 1000), (3, 8), (2, 16384), (3, 20000)] {
            parity(dev, residual, rows, c, false)?;
        }
        parity(dev, residual, 9, 24, true)?;
        parity(dev, residual, 4, 768, true)?;
        // GPT-2 124M's rows: many rows per block in the backward (the register accumulation of
        // dweight and dbias across rows).
        parity(dev, residual, 2048, 768, false)?;
    }
    Ok(())
}
