//! Residual add + layer norm (`src/fused/add_layer_norm/`): the CPU op against its definition
//! (`x + r`, then `layer_norm`), gradcheck in f64 through both outputs, typed errors, and CPU <-> CUDA
//! parity of both outputs and every gradient in f32, f16 and bf16 on odd widths and strided inputs.
//! Then the fold: two pre-LN blocks, where layer norm's backward adds h's pending gradient (from the
//! next residual add, or from the loss) into dh, against the unfused walk, finite differences and,
//! on CUDA, the CPU op, through both backward kernels, with and without a pending gradient, and with
//! a strided and a misaligned one. CUDA outputs are poisoned (NaN) before the kernels; without a GPU
//! the CUDA tests print one line and pass.

use crate::common;

use common::{gpu, gradcheck, max_err as err, randn};
use ferrograd_core::{DType, Device, Error, Result, Rng, Tensor};

const CPU: Device = Device::Cpu;
const EPS: f64 = 1e-5;

/// A scalar that depends on both outputs with weights that vary per element.
fn loss(h: &Tensor, y: &Tensor, gh: &Tensor, gy: &Tensor) -> Result<Tensor> {
    h.mul(gh)?.sum_all()?.add(&y.mul(gy)?.sum_all()?)
}

#[test]
fn cpu_matches_add_then_layer_norm() -> Result<()> {
    let mut rng = Rng::new(1);
    for dtype in [DType::F64, DType::F32, DType::BF16, DType::F16] {
        for &(rows, c) in &[(3, 1), (4, 17), (2, 64), (0, 5)] {
            let (x, r) = (randn(&mut rng, &[rows, c], dtype), randn(&mut rng, &[rows, c], dtype));
            let (w, b) = (randn(&mut rng, &[c], dtype), randn(&mut rng, &[c], dtype));
            let (h, y) = x.add_layer_norm(&r, Some(&w), Some(&b), 1e-5)?;
            let h_ref = x.add(&r)?;
            let y_ref = h_ref.layer_norm(Some(&w), Some(&b), 1e-5)?;
            assert_eq!(h.to_f64_vec()?, h_ref.to_f64_vec()?, "{dtype} {rows}x{c}: h");
            assert_eq!(y.to_f64_vec()?, y_ref.to_f64_vec()?, "{dtype} {rows}x{c}: y");
            assert_eq!((h.dtype(), y.dtype()), (dtype, dtype));
        }
    }
    // Without weight / bias, and a 3-d strided x.
    let x = randn(&mut rng, &[5, 2, 3], DType::F64).permute(&[1, 2, 0])?;
    let r = randn(&mut rng, &[2, 3, 5], DType::F64);
    let (h, y) = x.add_layer_norm(&r, None, None, 1e-5)?;
    assert_eq!(y.to_f64_vec()?, x.add(&r)?.layer_norm(None, None, 1e-5)?.to_f64_vec()?);
    assert_eq!(h.dims(), [2, 3, 5]);
    Ok(())
}

/// Central differences on the f64 CPU op: d loss / d input for every input, loss over both outputs.
#[test]
fn gradcheck_f64() -> Result<()> {
    let mut rng = Rng::new(2);
    let (rows, c) = (3, 6);
    let xs: Vec<Tensor> =
        [vec![rows, c], vec![rows, c], vec![c], vec![c]].iter().map(|d| randn(&mut rng, d, DType::F64)).collect();
    let (gh, gy) = (randn(&mut rng, &[rows, c], DType::F64), randn(&mut rng, &[rows, c], DType::F64));
    let f = |v: &[Tensor]| -> Result<Tensor> {
        let (h, y) = v[0].add_layer_norm(&v[1], Some(&v[2]), Some(&v[3]), 1e-5)?;
        loss(&h, &y, &gh, &gy)
    };
    gradcheck("add_layer_norm", f, &xs);
    let vars: Vec<Tensor> = xs.iter().map(|t| t.requires_grad()).collect();
    let grads = f(&vars)?.backward()?;
    // dx == dr: the residual's gradient is the input's.
    assert_eq!(grads.get(&vars[0]).unwrap().to_f64_vec()?, grads.get(&vars[1]).unwrap().to_f64_vec()?);
    Ok(())
}

#[test]
fn bad_inputs_are_typed_errors() -> Result<()> {
    let mut rng = Rng::new(3);
    let x = randn(&mut rng, &[2, 4], DType::F32);
    let e = x.add_layer_norm(&randn(&mut rng, &[2, 5], DType::F32), None, None, 1e-5).unwrap_err();
    assert!(matches!(e, Error::ShapeMismatch { .. }), "{e}");
    let e = x.add_layer_norm(&randn(&mut rng, &[4], DType::F32), None, None, 1e-5).unwrap_err();
    assert!(matches!(e, Error::ShapeMismatch { .. }), "broadcast residual: {e}");
    let e = x.add_layer_norm(&randn(&mut rng, &[2, 4], DType::F64), None, None, 1e-5).unwrap_err();
    assert!(matches!(e, Error::DTypeMismatch { .. }), "{e}");
    let e = x.add_layer_norm(&x, Some(&randn(&mut rng, &[3], DType::F32)), None, 1e-5).unwrap_err();
    assert!(matches!(e, Error::Shape { .. }) && e.to_string().contains("weight"), "{e}");
    let e = x.add_layer_norm(&x, None, Some(&randn(&mut rng, &[4], DType::BF16)), 1e-5).unwrap_err();
    assert!(matches!(e, Error::DTypeMismatch { .. }), "{e}");
    let ids = Tensor::from_vec(vec![1u32, 2], 2, CPU)?;
    assert!(ids.add_layer_norm(&ids, None, None, 1e-5).is_err());
    let s = Tensor::from_vec(vec![1f32], (), CPU)?;
    assert!(matches!(s.add_layer_norm(&s, None, None, 1e-5).unwrap_err(), Error::Shape { .. }));
    if let Some(g) = gpu() {
        let e = x.to_device(g)?.add_layer_norm(&x, None, None, 1e-5).unwrap_err();
        assert!(matches!(e, Error::DeviceMismatch { .. }), "{e}");
    }
    Ok(())
}

// ---- CUDA parity -----------------------------------------------------------------------------------

/// Allowed `err` against the f64 CPU op on the same (rounded) inputs: (outputs, gradients).
fn tol(dtype: DType) -> (f64, f64) {
    match dtype {
        DType::F32 => (2e-5, 5e-5),
        DType::F16 => (4e-3, 8e-3),
        _ => (3e-2, 5e-2),
    }
}

/// Forward and every gradient on `dev` against the f64 CPU op on the same values. `strided`: x is
/// a transposed view and r a narrowed one (the kernel gets contiguous copies).
fn parity(dev: Device, dtype: DType, rows: usize, c: usize, strided: bool) -> Result<()> {
    let mut rng = Rng::new(rows as u64 * 1000 + c as u64);
    let x = if strided { randn(&mut rng, &[c, rows], dtype).t()? } else { randn(&mut rng, &[rows, c], dtype) };
    let r = if strided {
        randn(&mut rng, &[rows, c + 3], dtype).narrow(1, 1, c)?
    } else {
        randn(&mut rng, &[rows, c], dtype)
    };
    let (w, b) = (randn(&mut rng, &[c], dtype), randn(&mut rng, &[c], dtype));
    let (gh, gy) = (randn(&mut rng, &[rows, c], dtype), randn(&mut rng, &[rows, c], dtype));
    let run = |d: Device, dt: DType| -> Result<(Vec<Tensor>, Vec<Tensor>)> {
        let cv = |t: &Tensor| t.to_dtype(dt).and_then(|t| t.to_device(d));
        let ins = [cv(&x)?, cv(&r)?, cv(&w)?, cv(&b)?];
        let vars: Vec<Tensor> = ins.iter().map(|t| t.requires_grad()).collect();
        let (h, y) = vars[0].add_layer_norm(&vars[1], Some(&vars[2]), Some(&vars[3]), 1e-5)?;
        let grads = loss(&h, &y, &cv(&gh)?, &cv(&gy)?)?.backward()?;
        let g = vars.iter().map(|v| grads.get(v).cloned().expect("gradient")).collect();
        Ok((vec![h, y], g))
    };
    let (outs, grads) = run(dev, dtype)?;
    let (ro, rg) = run(CPU, DType::F64)?;
    let (to, tg) = tol(dtype);
    let what = format!("{dtype} {rows}x{c} strided={strided}");
    for (i, (a, e)) in outs.iter().zip(&ro).enumerate() {
        assert_eq!(a.dtype(), dtype);
        let d = err(a, e);
        assert!(d <= to, "{what}: output {i} err {d:e}");
    }
    for (i, (a, e)) in grads.iter().zip(&rg).enumerate() {
        // dweight / dbias sum over rows: scale the tolerance by sqrt(rows).
        let t = if i >= 2 { tg * (rows as f64).sqrt().max(1.0) } else { tg };
        let d = err(a, e);
        assert!(d <= t, "{what}: gradient {i} err {d:e}");
    }
    Ok(())
}

#[test]
fn cuda_parity_odd_widths() -> Result<()> {
    let Some(dev) = gpu() else { return Ok(()) };
    for dtype in [DType::F32, DType::BF16, DType::F16, DType::F64] {
        for &(rows, c) in &[(5, 1), (7, 17), (33, 768), (6, 1000), (3, 8), (2, 16384)] {
            parity(dev, dtype, rows, c, false)?;
        }
        parity(dev, dtype, 9, 24, true)?;
        parity(dev, dtype, 4, 768, true)?;
    }
    Ok(())
}

/// A row of h cached in shared memory and one that is not (cols * 4 bytes > 48 KiB): same values.
#[test]
fn cuda_long_rows_and_empty() -> Result<()> {
    let Some(dev) = gpu() else { return Ok(()) };
    parity(dev, DType::BF16, 3, 20000, false)?;
    parity(dev, DType::F32, 2, 13000, false)?;
    let x = Tensor::zeros((0, 8), DType::BF16, dev)?;
    let (h, y) = x.add_layer_norm(&x, None, None, 1e-5)?;
    assert_eq!((h.dims(), y.dims()), ([0, 8].as_slice(), [0, 8].as_slice()));
    Ok(())
}

// ---- the fold: layer norm's backward adds h's pending gradient into dh -----------------------------

/// How the loss reads `h2` besides its norm: not at all (nothing pending at the second norm),
/// elementwise (a contiguous pending gradient), through a transpose (a strided one), or behind one
/// leading element (a contiguous one, one element off: not 16-byte aligned).
#[derive(Clone, Copy, Debug)]
enum Tail {
    None,
    Plain,
    Transposed,
    Offset,
}

const TAILS: [Tail; 4] = [Tail::None, Tail::Plain, Tail::Transposed, Tail::Offset];

/// Two pre-LN blocks: `h1 = x + r, y1 = ln1(h1); h2 = h1 + tanh(y1), y2 = ln2(h2)`; the loss is
/// `sum(y2 * gy)` plus h2's `tail`. h2 is made after y1, so h1's gradient from h2's add is pending
/// when ln1's backward runs, which folds it (ln2 folds the tail's). `split` puts a copy (`h * 1`)
/// between each h and its norm, which then has an input of its own: the walk adds h's two
/// gradients itself, the unfused path. `mixed`: x f32 and r bf16, the norms' outputs bf16
/// (`add_layer_norm_mixed`, autocast's GPT-2). `v`: x, r, w1, b1, w2, b2; `k`: gy, gh.
fn blocks(v: &[Tensor], k: &[Tensor], tail: Tail, split: bool, mixed: bool) -> Result<Tensor> {
    let block = |x: &Tensor, r: &Tensor, w: &Tensor, b: &Tensor| -> Result<(Tensor, Tensor)> {
        match (split, mixed) {
            (false, false) => x.add_layer_norm(r, Some(w), Some(b), EPS),
            (false, true) => x.add_layer_norm_mixed(r, Some(w), Some(b), EPS),
            (true, _) => {
                let h = x.add(&r.to_dtype(x.dtype())?)?;
                Ok((h.clone(), h.mul_scalar(1.0)?.layer_norm_to(Some(w), Some(b), EPS, r.dtype())?))
            }
        }
    };
    let (h1, y1) = block(&v[0], &v[1], &v[2], &v[3])?;
    let (h2, y2) = block(&h1, &y1.tanh()?, &v[4], &v[5])?;
    let sum = |t: Tensor| t.to_dtype(v[0].dtype())?.sum_all();
    let loss = sum(y2.mul(&k[0].to_dtype(y2.dtype())?)?)?;
    let gh = k[1].to_dtype(h2.dtype())?;
    let t = match tail {
        Tail::None => return Ok(loss),
        Tail::Plain => h2.mul(&gh)?,
        Tail::Transposed => h2.t()?.mul(&gh.t()?)?,
        Tail::Offset => {
            let one = Tensor::ones(1, h2.dtype(), h2.device())?;
            let flat = |t: &Tensor| Tensor::cat(&[one.clone(), t.flatten_all()?], 0);
            flat(&h2)?.mul(&flat(&gh)?)?
        }
    };
    loss.add(&sum(t)?)
}

/// `blocks`' inputs and loss weights, `[rows, c]` (x, r, gy, gh) and `[c]` (weights around 1,
/// biases), f64 on the CPU.
fn block_inputs(rows: usize, c: usize) -> (Vec<Tensor>, Vec<Tensor>) {
    let mut rng = Rng::new(rows as u64 * 31 + c as u64);
    let mut n = |d: &[usize]| randn(&mut rng, d, DType::F64);
    let (x, r) = (n(&[rows, c]), n(&[rows, c]));
    let w = |t: Tensor| t.affine(0.25, 1.0).expect("weight");
    let (w1, b1, w2, b2) = (w(n(&[c])), n(&[c]), w(n(&[c])), n(&[c]));
    (vec![x, r, w1, b1, w2, b2], vec![n(&[rows, c]), n(&[rows, c])])
}

/// Each input's gradient from `blocks` on `dev`, the inputs in `dtypes` (one per input, or one for
/// all).
fn block_grads(
    (v, k): &(Vec<Tensor>, Vec<Tensor>),
    dev: Device,
    dtypes: &[DType],
    tail: Tail,
    split: bool,
    mixed: bool,
) -> Result<Vec<Tensor>> {
    let dt = |i: usize| dtypes[i.min(dtypes.len() - 1)];
    let vars: Vec<Tensor> = v
        .iter()
        .enumerate()
        .map(|(i, t)| Ok(t.to_dtype(dt(i))?.to_device(dev)?.requires_grad()))
        .collect::<Result<_>>()?;
    let k: Vec<Tensor> = k.iter().map(|t| t.to_dtype(dt(0))?.to_device(dev)).collect::<Result<_>>()?;
    let grads = blocks(&vars, &k, tail, split, mixed)?.backward()?;
    vars.iter().map(|t| grads.get(t).cloned().ok_or_else(|| Error::Backward("no gradient".into()))).collect()
}

/// On the CPU in f64 the folded gradients are the unfused walk's exactly (the kernel's sum is the
/// walk's add, in the same dtype), and finite differences agree; in f32, f16 and bf16 they are one
/// rounding of the sum apart at most (the fold rounds once).
#[test]
fn cpu_fold_matches_the_unfused_walk() -> Result<()> {
    for tail in TAILS {
        let ins = block_inputs(4, 6);
        let f64s = [DType::F64];
        let fold = block_grads(&ins, CPU, &f64s, tail, false, false)?;
        let split = block_grads(&ins, CPU, &f64s, tail, true, false)?;
        for (i, (a, e)) in fold.iter().zip(&split).enumerate() {
            assert_eq!(a.to_f64_vec()?, e.to_f64_vec()?, "{tail:?}: gradient {i}");
        }
        gradcheck(&format!("blocks {tail:?}"), |v| blocks(v, &ins.1, tail, false, false), &ins.0);
        for dtype in [DType::F32, DType::F16, DType::BF16] {
            let fold = block_grads(&ins, CPU, &[dtype], tail, false, false)?;
            let split = block_grads(&ins, CPU, &[dtype], tail, true, false)?;
            for (i, (a, e)) in fold.iter().zip(&split).enumerate() {
                let d = err(a, e);
                assert!(d <= tol(dtype).1, "{dtype} {tail:?}: gradient {i} err {d:e}");
            }
        }
        // The autocast form: f32 x, bf16 branch.
        let mixed = [DType::F32, DType::BF16, DType::F32];
        let fold = block_grads(&ins, CPU, &mixed, tail, false, true)?;
        let split = block_grads(&ins, CPU, &mixed, tail, true, true)?;
        for (i, (a, e)) in fold.iter().zip(&split).enumerate() {
            assert_eq!(a.dtype(), e.dtype(), "mixed {tail:?}: gradient {i}");
            let d = err(a, e);
            assert!(d <= if a.dtype() == DType::BF16 { 8e-3 } else { 2e-6 }, "mixed {tail:?}: gradient {i} err {d:e}");
        }
    }
    Ok(())
}

/// h used by its norm only (nothing pending), through both the fused op and a plain layer norm of a
/// leaf: the gradients are the unfused walk's and finite differences'.
#[test]
fn cpu_nothing_pending() -> Result<()> {
    let mut rng = Rng::new(9);
    let xs: Vec<Tensor> =
        [vec![3, 5], vec![3, 5], vec![5], vec![5], vec![3, 5]].iter().map(|d| randn(&mut rng, d, DType::F64)).collect();
    let f = |v: &[Tensor], split: bool| -> Result<Tensor> {
        let y = if split {
            v[0].add(&v[1])?.mul_scalar(1.0)?.layer_norm(Some(&v[2]), Some(&v[3]), EPS)?
        } else {
            v[0].add_layer_norm(&v[1], Some(&v[2]), Some(&v[3]), EPS)?.1
        };
        y.mul(&xs[4])?.sum_all()
    };
    gradcheck("add_layer_norm, y only", |v| f(v, false), &xs[..4]);
    let grads = |split: bool| -> Result<Vec<Vec<f64>>> {
        let vars: Vec<Tensor> = xs[..4].iter().map(|t| t.requires_grad()).collect();
        let g = f(&vars, split)?.backward()?;
        vars.iter().map(|t| g.get(t).map(|g| g.to_f64_vec()).unwrap_or(Ok(vec![]))).collect()
    };
    assert_eq!(grads(false)?, grads(true)?);
    gradcheck(
        "layer_norm of a leaf",
        |v| v[0].layer_norm(Some(&v[1]), Some(&v[2]), EPS),
        &[xs[0].clone(), xs[2].clone(), xs[3].clone()],
    );
    Ok(())
}

/// The folded gradients on `dev` against the CPU: the plain op in `dtype` against f64, or the
/// autocast form (`mixed`, f32 x and bf16 branch) against itself on the CPU.
fn fold_parity(dev: Device, dtype: DType, mixed: bool, rows: usize, c: usize, tail: Tail) -> Result<()> {
    let ins = block_inputs(rows, c);
    let (dts, ref_dts) = if mixed {
        (vec![DType::F32, DType::BF16, DType::F32], vec![DType::F32, DType::BF16, DType::F32])
    } else {
        (vec![dtype], vec![DType::F64])
    };
    let got = block_grads(&ins, dev, &dts, tail, false, mixed)?;
    let want = block_grads(&ins, CPU, &ref_dts, tail, false, mixed)?;
    let what = format!("{dtype} mixed={mixed} {rows}x{c} {tail:?}");
    for (i, (a, e)) in got.iter().zip(&want).enumerate() {
        let base = match (mixed, a.dtype()) {
            (true, DType::BF16) => 8e-3,
            // x's f32 gradient is the norm's backward of a bf16 dy (through the bf16 branch and its
            // tanh), which the two devices round differently here and there (one bf16 ulp is 3.9e-3
            // of a value), so it gets bf16's tolerance: measured on an H200, 1.97e-4 (33 x 768)
            // and 1.30e-3 (512 x 768). A fold that lost the pending gradient would be off by O(1).
            (true, _) => 8e-3,
            // Two norms and a tanh between them: twice the single op's tolerance.
            (false, _) => 2.0 * tol(dtype).1,
        };
        // dweight / dbias sum over rows: scale the tolerance by sqrt(rows).
        let t = if a.rank() == 1 { base * (rows as f64).sqrt().max(1.0) } else { base };
        let d = err(a, e);
        assert!(d <= t, "{what}: gradient {i} err {d:e}");
    }
    Ok(())
}

/// Both backward kernels with and without a pending gradient: f32 rows of 768 and 1000 take the
/// warp-per-row kernel (cols a multiple of 4, at most 1024, 16-byte aligned), 17 and 2048 the
/// block-per-row one, as every bf16, f16 and f64 row does; the offset tail's pending gradient is
/// misaligned, which sends ln2 to the block kernel whatever the width.
#[test]
fn cuda_fold_parity() -> Result<()> {
    let Some(dev) = gpu() else { return Ok(()) };
    for dtype in [DType::F32, DType::BF16, DType::F16, DType::F64] {
        for &(rows, c) in &[(7, 17), (33, 768), (6, 1000), (5, 2048)] {
            for tail in TAILS {
                fold_parity(dev, dtype, false, rows, c, tail)?;
            }
        }
    }
    for &(rows, c) in &[(7, 17), (33, 768), (5, 2048), (9, 24)] {
        for tail in TAILS {
            fold_parity(dev, DType::F32, true, rows, c, tail)?;
        }
    }
    // GPT-2 124M's width with many rows per block (dweight / dbias accumulated across rows).
    fold_parity(dev, DType::F32, false, 512, 768, Tail::Plain)?;
    fold_parity(dev, DType::F32, true, 512, 768, Tail::Plain)?;
    Ok(())
}
