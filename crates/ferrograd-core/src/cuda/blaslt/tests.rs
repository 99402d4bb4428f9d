//! Every epilogue of the layer against an f64 reference on the CPU, on shapes that are and are
//! not multiples of 8, in f32, f16 and bf16, and f16/bf16 products written in f32 (the epilogues a
//! master-weight gradient uses). Outputs start as NaN, so an unwritten element fails.
//! Without a GPU each test prints one line and passes.
//!
//! Column-major operands are built as row-major tensors of the transposed shape: A (m x k) is a
//! `[k, m]` tensor, B (k x n) is `[n, k]`, D (m x n) is `[n, m]`, so `D^T = B^T A^T` is
//! `Bt.matmul(At)` on the CPU. The linear op's parity tests cover the transposed operands.

use super::{counters_on_this_thread, gemm, gemm_tuned, Aux, Epilogue, Gemm, Operand};
use crate::cuda::CudaDevice;
use crate::{DType, Device, Result, Rng, Tensor};

const ALL: [Epilogue; 12] = [
    Epilogue::Default,
    Epilogue::Bias,
    Epilogue::Relu,
    Epilogue::ReluBias,
    Epilogue::Gelu,
    Epilogue::GeluBias,
    Epilogue::GeluAux,
    Epilogue::GeluAuxBias,
    Epilogue::DGelu,
    Epilogue::DGeluBGrad,
    Epilogue::BGradB,
    Epilogue::BGradA,
];

/// The epilogues that may write an f16/bf16 product in f32 (no aux).
const WIDE: [Epilogue; 3] = [Epilogue::Default, Epilogue::BGradB, Epilogue::BGradA];

fn randn(rng: &mut Rng, dims: &[usize], d: DType) -> Tensor {
    Tensor::randn_with(rng, 0.0, 1.0, dims.to_vec(), DType::F64, Device::Cpu)
        .and_then(|t| t.to_dtype(d))
        .expect("randn")
}

fn max_rel(a: &[f64], b: &[f64]) -> f64 {
    let diff = a
        .iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .map(|v| if v.is_nan() { f64::INFINITY } else { v })
        .fold(0.0, f64::max);
    let scale = b.iter().map(|y| y.abs()).fold(0.0, f64::max);
    if a.len() != b.len() {
        f64::INFINITY
    } else if diff == 0.0 {
        0.0
    } else {
        diff / scale.max(1e-30)
    }
}

fn tol(d: DType, e: Epilogue) -> f64 {
    let gelu = matches!(
        e,
        Epilogue::Gelu
            | Epilogue::GeluBias
            | Epilogue::GeluAux
            | Epilogue::GeluAuxBias
            | Epilogue::DGelu
            | Epilogue::DGeluBGrad
    );
    match d {
        DType::F32 if gelu => 1e-3,
        DType::F32 => 2e-5,
        DType::F16 => 3e-3,
        _ => 1.6e-2,
    }
}

/// The values `e` must produce: (D^T as [n, m], the bias output if the epilogue writes one, the
/// aux output if it writes one), in f64.
fn reference(
    e: Epilogue,
    at: &Tensor,
    bt: &Tensor,
    bias: &Tensor,
    aux_in: &Tensor,
    d: DType,
) -> Result<(Tensor, Option<Tensor>, Option<Tensor>)> {
    let f = |t: &Tensor| t.to_dtype(DType::F64);
    let p = f(bt)?.matmul(&f(at)?)?; // [n, m]
    let round = |t: Tensor| t.to_dtype(d)?.to_dtype(DType::F64);
    let biased = p.add(&f(bias)?)?;
    Ok(match e {
        Epilogue::Default => (p, None, None),
        Epilogue::Bias => (biased, None, None),
        Epilogue::Relu => (p.relu()?, None, None),
        Epilogue::ReluBias => (biased.relu()?, None, None),
        Epilogue::Gelu => (p.gelu_tanh()?, None, None),
        Epilogue::GeluBias => (biased.gelu_tanh()?, None, None),
        Epilogue::GeluAux => (p.gelu_tanh()?, None, Some(round(p)?)),
        Epilogue::GeluAuxBias => (biased.gelu_tanh()?, None, Some(round(biased)?)),
        Epilogue::DGelu | Epilogue::DGeluBGrad => {
            let z = f(aux_in)?;
            let grad = z.unary_op(crate::op::UnaryOp::GeluTanhGrad)?;
            let dz = p.mul(&grad)?;
            let db = (e == Epilogue::DGeluBGrad).then(|| dz.sum(0, false)).transpose()?;
            (dz, db, None)
        }
        // One bias entry per column of D (per row of D^T): op(B) summed over k.
        Epilogue::BGradB => (p, Some(f(bt)?.sum(1, false)?), None),
        // One bias entry per row of D (per column of D^T): op(A) summed over k.
        Epilogue::BGradA => (p, Some(f(at)?.sum(0, false)?), None),
    })
}

/// Every epilogue on each dtype and shape; `tune` times the candidates of each new plan.
fn check_epilogues(shapes: &[(usize, usize, usize)], tune: bool) -> Result<()> {
    let dev = match CudaDevice::get(0) {
        Ok(d) => d,
        Err(e) => {
            println!("skipping CUDA test: {e}");
            return Ok(());
        }
    };
    let gd = Device::Cuda(0);
    let mut rng = Rng::new(21);
    let kinds = [
        (DType::F32, DType::F32),
        (DType::F16, DType::F16),
        (DType::BF16, DType::BF16),
        (DType::F16, DType::F32),
        (DType::BF16, DType::F32),
    ];
    for (d, od) in kinds {
        for &(m, n, k) in shapes {
            let ld_aux = m.next_multiple_of(8);
            let (at, bt) = (randn(&mut rng, &[k, m], d), randn(&mut rng, &[n, k], d));
            // The bias input has one entry per row of D; BGRADB's output one per column.
            let bias_in = randn(&mut rng, &[m], d);
            let aux_in = randn(&mut rng, &[n, m], d);
            for e in ALL.into_iter().filter(|e| od == d || WIDE.contains(e)) {
                let what = format!("{e:?} {d}->{od} m={m} n={n} k={k}");
                let (want_d, want_bias, want_aux) = reference(e, &at, &bt, &bias_in, &aux_in, d)?;
                let (ga, gb) = (at.to_device(gd)?, bt.to_device(gd)?);
                let out = Tensor::full(f64::NAN, (n, m), od, gd)?;
                let bias = match e {
                    Epilogue::Bias | Epilogue::ReluBias | Epilogue::GeluBias | Epilogue::GeluAuxBias => {
                        Some(bias_in.to_device(gd)?)
                    }
                    Epilogue::DGeluBGrad | Epilogue::BGradA => Some(Tensor::full(f64::NAN, m, od, gd)?),
                    Epilogue::BGradB => Some(Tensor::full(f64::NAN, n, od, gd)?),
                    _ => None,
                };
                let aux = match e {
                    Epilogue::GeluAux | Epilogue::GeluAuxBias => Some(Tensor::full(f64::NAN, (n, ld_aux), d, gd)?),
                    // Read by the gradients: the given pre-activation in padded rows.
                    Epilogue::DGelu | Epilogue::DGeluBGrad => {
                        let pad = Tensor::zeros((n, ld_aux - m), d, Device::Cpu)?;
                        Some(Tensor::cat(&[aux_in.clone(), pad], 1)?.to_device(gd)?)
                    }
                    _ => None,
                };
                let g = Gemm {
                    dtype: d,
                    d_dtype: od,
                    m,
                    n,
                    k,
                    a: Operand { ptr: ga.cuda_ptr()?, ld: m, trans: false },
                    b: Operand { ptr: gb.cuda_ptr()?, ld: k, trans: false },
                    d: Operand { ptr: out.cuda_ptr()?, ld: m, trans: false },
                    epilogue: e,
                    bias: bias.as_ref().map(|b| b.cuda_ptr()).transpose()?,
                    aux: aux.as_ref().map(|a| a.cuda_ptr().map(|ptr| Aux { ptr, ld: ld_aux })).transpose()?,
                };
                if !gemm_tuned(&dev, &g, tune)? {
                    println!("{what}: cuBLASLt has no kernel (the callers fall back)");
                    continue;
                }
                // Written in f32, only the inputs' rounding remains (the reference starts from the
                // rounded inputs): the f32 tolerance.
                let tl = tol(od, e);
                let err = max_rel(&out.to_f64_vec()?, &want_d.to_f64_vec()?);
                assert!(err <= tl, "{what}: D max rel err {err:e}");
                if let (Some(want), Some(got)) = (&want_bias, &bias) {
                    let err = max_rel(&got.to_f64_vec()?, &want.to_f64_vec()?);
                    assert!(err <= tl, "{what}: bias gradient max rel err {err:e}");
                }
                if let (Some(want), Some(got)) = (&want_aux, &aux) {
                    let got = got.narrow(1, 0, m)?;
                    let err = max_rel(&got.to_f64_vec()?, &want.to_f64_vec()?);
                    assert!(err <= tol(d, e), "{what}: aux max rel err {err:e}");
                }
            }
        }
    }
    Ok(())
}

#[test]
fn every_epilogue_matches_the_cpu() -> Result<()> {
    check_epilogues(&[(24, 40, 16), (13, 7, 9), (64, 3, 32)], false)
}

/// Autotuning (opt-in, FERROGRAD_CUBLASLT_AUTOTUNE=1) times several algorithms on the call's own
/// buffers before the real launch: the results must be the same.
#[test]
fn autotuned_plans_match_the_cpu() -> Result<()> {
    let before = counters_on_this_thread();
    // Shapes no other test uses, so every plan is new and gets tuned.
    check_epilogues(&[(136, 72, 48), (21, 11, 5)], true)?;
    let tuned = counters_on_this_thread().tuning_launches - before.tuning_launches;
    if CudaDevice::get(0).is_ok() {
        assert!(tuned > 0, "no candidate was timed");
    }
    Ok(())
}

#[test]
fn bad_problems_are_typed_errors() {
    let Ok(dev) = CudaDevice::get(0) else {
        println!("skipping CUDA test: no device");
        return;
    };
    let op = Operand { ptr: 1 << 20, ld: 8, trans: false };
    let base = Gemm {
        dtype: DType::BF16,
        d_dtype: DType::BF16,
        m: 8,
        n: 8,
        k: 8,
        a: op,
        b: op,
        d: op,
        epilogue: Epilogue::Default,
        bias: None,
        aux: None,
    };
    for (why, g) in [
        ("empty", Gemm { k: 0, ..base }),
        ("leading dim", Gemm { m: 16, ..base }),
        ("bias missing", Gemm { epilogue: Epilogue::Bias, ..base }),
        ("aux missing", Gemm { epilogue: Epilogue::GeluAux, ..base }),
        ("aux ld", Gemm { epilogue: Epilogue::GeluAux, aux: Some(Aux { ptr: 1 << 20, ld: 12 }), m: 4, ..base }),
        ("dtype", Gemm { dtype: DType::F64, d_dtype: DType::F64, ..base }),
        ("f32 product in bf16", Gemm { dtype: DType::F32, ..base }),
        (
            "wide aux",
            Gemm { d_dtype: DType::F32, epilogue: Epilogue::GeluAux, aux: Some(Aux { ptr: 1 << 20, ld: 8 }), ..base },
        ),
    ] {
        let e = gemm(&dev, &g).unwrap_err();
        assert!(matches!(e, crate::Error::InvalidArgument(_) | crate::Error::UnsupportedDType { .. }), "{why}: {e}");
    }
}

/// `tune_new_plans` turns tuning on for this thread until its guard drops; scopes nest.
#[test]
fn tune_scopes_nest_and_end() {
    let outside = super::autotune();
    {
        let _a = super::tune_new_plans();
        assert!(super::autotune());
        {
            let _b = super::tune_new_plans();
            assert!(super::autotune());
        }
        assert!(super::autotune(), "the outer scope is still open");
    }
    assert_eq!(super::autotune(), outside);
}

/// `without_tuning` wins over `tune_new_plans` (and the variable) on its thread until it drops.
#[test]
fn untuned_scope_overrides_tuning_scopes() {
    let outside = super::autotune();
    let _t = super::tune_new_plans();
    {
        let _u = super::without_tuning();
        assert!(!super::autotune());
        let _inner = super::tune_new_plans();
        assert!(!super::autotune(), "a tuning scope inside does not turn it back on");
    }
    assert!(super::autotune(), "the tuning scope is in force again");
    drop(_t);
    assert_eq!(super::autotune(), outside);
}

/// Tuning keeps the heuristic's first choice unless another candidate is clearly faster, and
/// takes the fastest when the first did not run.
#[test]
fn tuning_keeps_the_first_choice_unless_another_is_clearly_faster() {
    assert_eq!(super::pick(&[Some(1.0), Some(0.99), Some(0.98)]), 0, "within the margin");
    assert_eq!(super::pick(&[Some(1.0), Some(0.9), Some(0.95)]), 1);
    assert_eq!(super::pick(&[None, Some(0.9), Some(0.8)]), 2);
    assert_eq!(super::pick(&[Some(1.0), None]), 0);
    assert_eq!(super::pick(&[None, None]), 0);
}
