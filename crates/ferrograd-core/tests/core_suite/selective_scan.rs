//! Selective scan (`src/fused/selective_scan/`): the CPU op against a naive sequential reference
//! written here from mamba_ssm's `selective_scan_ref`, a hand-computed case, gradcheck of every
//! input in f64, a directional-derivative check across the chunk boundary, typed errors, and
//! CPU <-> CUDA parity of the forward and every gradient in f32 and bf16 (lengths 1, 7, one chunk
//! and several, with and without D / z / delta_bias, one and two groups). CUDA outputs are
//! poisoned (NaN) before the kernels; without a GPU the CUDA tests print one line and pass.

use crate::common;

use common::{gpu, gradcheck, rel_err_of as rel_err};
use ferrograd_core::fused::selective_scan::{selective_scan, ScanArgs, CHUNK};
use ferrograd_core::{with_no_grad, DType, Device, Error, Result, Rng, Tensor};

const CPU: Device = Device::Cpu;

/// One problem's shape and options.
#[derive(Debug, Clone, Copy)]
struct Case {
    batch: usize,
    dim: usize,
    len: usize,
    state: usize,
    groups: usize,
    d: bool,
    z: bool,
    bias: bool,
    softplus: bool,
}

impl Case {
    fn new(batch: usize, dim: usize, len: usize, state: usize, groups: usize) -> Case {
        Case { batch, dim, len, state, groups, d: true, z: true, bias: true, softplus: true }
    }

    fn bare(self) -> Case {
        Case { d: false, z: false, bias: false, softplus: false, ..self }
    }
}

/// Inputs in the order the op takes them: u, delta, A, B, C, then D, z, delta_bias if present.
fn inputs(rng: &mut Rng, cs: Case, dtype: DType) -> Vec<Tensor> {
    let Case { batch, dim, len, state, groups, .. } = cs;
    let n = |rng: &mut Rng, dims: Vec<usize>, std: f64| {
        Tensor::randn_with(rng, 0.0, std, dims, DType::F64, CPU).and_then(|t| t.to_dtype(dtype)).expect("randn")
    };
    let u = n(rng, vec![batch, dim, len], 1.0);
    // Without softplus delta must be positive: |N(0, 1)| / 2 + 0.05.
    let delta = n(rng, vec![batch, dim, len], 0.5);
    let delta = if cs.softplus { delta } else { delta.abs().unwrap().add_scalar(0.05).unwrap() };
    // A < 0 (decaying states): -(0.2 + |N(0, 1)|).
    let a = n(rng, vec![dim, state], 1.0).abs().unwrap().add_scalar(0.2).unwrap().neg().unwrap();
    let mut v =
        vec![u, delta, a, n(rng, vec![batch, groups, state, len], 1.0), n(rng, vec![batch, groups, state, len], 1.0)];
    if cs.d {
        v.push(n(rng, vec![dim], 1.0));
    }
    if cs.z {
        v.push(n(rng, vec![batch, dim, len], 1.0));
    }
    if cs.bias {
        // Without softplus the bias must keep delta + bias positive too (a negative dt makes the
        // recurrence grow as exp(-dt A) and reach inf over a few hundred steps, which the H200 run
        // hit at length 301): |N(0, 0.5)| there.
        let bias = n(rng, vec![dim], 0.5);
        v.push(if cs.softplus { bias } else { bias.abs().unwrap() });
    }
    v
}

fn scan(cs: Case, x: &[Tensor]) -> Result<Tensor> {
    let mut i = 5;
    let mut next = |present: bool| {
        present.then(|| {
            i += 1;
            &x[i - 1]
        })
    };
    let (d, z, delta_bias) = (next(cs.d), next(cs.z), next(cs.bias));
    selective_scan(&x[0], &x[1], &x[2], &x[3], &x[4], ScanArgs { d, z, delta_bias, delta_softplus: cs.softplus })
}

/// mamba_ssm's `selective_scan_ref`, step by step in f64 on plain vectors.
fn naive(cs: Case, x: &[Tensor]) -> Vec<f64> {
    let v: Vec<Vec<f64>> = x.iter().map(|t| t.to_f64_vec().unwrap()).collect();
    let (u, delta, a, b, c) = (&v[0], &v[1], &v[2], &v[3], &v[4]);
    let mut i = 5;
    let mut next = |present: bool| {
        present.then(|| {
            i += 1;
            v[i - 1].clone()
        })
    };
    let (dv, zv, bv) = (next(cs.d), next(cs.z), next(cs.bias));
    let Case { batch, dim, len, state, groups, .. } = cs;
    let mut out = vec![0.0; batch * dim * len];
    for bb in 0..batch {
        for d in 0..dim {
            let g = d / (dim / groups);
            let mut h = vec![0.0; state];
            for l in 0..len {
                let at = (bb * dim + d) * len + l;
                let mut dt = delta[at] + bv.as_ref().map_or(0.0, |b| b[d]);
                if cs.softplus && dt <= 20.0 {
                    dt = (1.0 + dt.exp()).ln();
                }
                let mut y = 0.0;
                for (n, hn) in h.iter_mut().enumerate() {
                    let bc = ((bb * groups + g) * state + n) * len + l;
                    *hn = (dt * a[d * state + n]).exp() * *hn + dt * b[bc] * u[at];
                    y += c[bc] * *hn;
                }
                y += dv.as_ref().map_or(0.0, |dd| dd[d]) * u[at];
                if let Some(z) = &zv {
                    y *= z[at] / (1.0 + (-z[at]).exp());
                }
                out[at] = y;
            }
        }
    }
    out
}

// ---- the CPU op against its definition -----------------------------------------------------------

#[test]
fn cpu_f64_matches_the_naive_recurrence() -> Result<()> {
    let mut rng = Rng::new(1);
    let cases = [
        Case::new(1, 1, 1, 1, 1),
        Case::new(2, 3, 7, 4, 1),
        Case::new(2, 4, 7, 16, 2).bare(),
        Case { z: false, ..Case::new(1, 4, 33, 5, 4) },
        Case { d: false, bias: false, ..Case::new(1, 2, 9, 3, 1) },
        Case { softplus: false, ..Case::new(1, 2, 9, 3, 2) },
        Case::new(1, 2, CHUNK + 5, 3, 1),
    ];
    for cs in cases {
        let x = inputs(&mut rng, cs, DType::F64);
        let got = scan(cs, &x)?;
        assert_eq!(got.dims(), [cs.batch, cs.dim, cs.len], "{cs:?}");
        let e = rel_err(&got.to_f64_vec()?, &naive(cs, &x));
        assert!(e < 1e-13, "{cs:?}: rel err {e:.3e}");
    }
    Ok(())
}

#[test]
fn cpu_reduced_precision_is_close_to_f64() -> Result<()> {
    let mut rng = Rng::new(2);
    let cs = Case::new(2, 4, 50, 8, 2);
    for (dtype, tol) in [(DType::F32, 1e-5), (DType::BF16, 1e-2), (DType::F16, 2e-3)] {
        let x = inputs(&mut rng, cs, dtype);
        let got = scan(cs, &x)?;
        assert_eq!(got.dtype(), dtype);
        let e = rel_err(&got.to_f64_vec()?, &naive(cs, &x));
        assert!(e < tol, "{dtype}: rel err {e:.3e}");
    }
    Ok(())
}

/// A case small enough to do by hand. One channel, one state, no softplus-free shortcut:
/// delta = 0 with delta_bias = ln(e - 1), so dt = softplus(ln(e - 1)) = ln(e) = 1; A = ln(1/2), so
/// each step keeps half the state; B = 1, u = (1, 2, 3), C = (1, 2, 1), D = 1/2:
///   x = 1, 2.5, 4.25;  y = C x + D u = 1.5, 6, 5.75;
/// with z = (0, 1, -1): out = y * silu(z) = 0, 6 * 0.7310585786, 5.75 * -0.2689414214.
/// A second group with B = 2 doubles x and so the C x part (3 - 0.5 = 2.5 -> y1 = 2.5, ...).
#[test]
fn mamba_semantics_on_a_hand_computed_case() -> Result<()> {
    let t = |v: Vec<f64>, dims: Vec<usize>| Tensor::from_vec(v, dims, CPU).unwrap();
    let u = t(vec![1.0, 2.0, 3.0, 1.0, 2.0, 3.0], vec![1, 2, 3]);
    let delta = t(vec![0.0; 6], vec![1, 2, 3]);
    let a = t(vec![0.5f64.ln(); 2], vec![2, 1]);
    let b = t(vec![1.0, 1.0, 1.0, 2.0, 2.0, 2.0], vec![1, 2, 1, 3]);
    let c = t(vec![1.0, 2.0, 1.0, 1.0, 2.0, 1.0], vec![1, 2, 1, 3]);
    let d = t(vec![0.5, 0.5], vec![2]);
    let bias = t(vec![(std::f64::consts::E - 1.0).ln(); 2], vec![2]);
    let z = t(vec![0.0, 1.0, -1.0, 0.0, 1.0, -1.0], vec![1, 2, 3]);
    let args = ScanArgs { d: Some(&d), z: None, delta_bias: Some(&bias), delta_softplus: true };
    let y = selective_scan(&u, &delta, &a, &b, &c, args)?.to_f64_vec()?;
    let want = [1.5, 6.0, 5.75, 2.5, 11.0, 10.0];
    for (g, w) in y.iter().zip(want) {
        assert!((g - w).abs() < 1e-12, "y {y:?}, want {want:?}");
    }
    let gated = selective_scan(&u, &delta, &a, &b, &c, ScanArgs { z: Some(&z), ..args })?.to_f64_vec()?;
    let silu = |x: f64| x / (1.0 + (-x).exp());
    for (i, (g, w)) in gated.iter().zip(want).enumerate() {
        let w = w * silu([0.0, 1.0, -1.0][i % 3]);
        assert!((g - w).abs() < 1e-12, "gated {gated:?} at {i}: want {w}");
    }
    // dD = sum_l dout * u = 6 per channel; dC[l] = dout * x_l = (1, 2.5, 4.25) for group 0; with
    // dout = 1 and no later steps, dL/dx_3 = C_3 = 1, so dB[3] = dt * u_3 * 1 = 3.
    let (dv, cv, bv) = (d.requires_grad(), c.requires_grad(), b.requires_grad());
    let args = ScanArgs { d: Some(&dv), z: None, delta_bias: Some(&bias), delta_softplus: true };
    let g = selective_scan(&u, &delta, &a, &bv, &cv, args)?.sum_all()?.backward()?;
    assert_eq!(g.get(&dv).expect("dD").to_f64_vec()?, vec![6.0, 6.0]);
    let dc = g.get(&cv).expect("dC").to_f64_vec()?;
    for (got, want) in dc.iter().zip([1.0, 2.5, 4.25, 2.0, 5.0, 8.5]) {
        assert!((got - want).abs() < 1e-12, "dC {dc:?}");
    }
    let db = g.get(&bv).expect("dB").to_f64_vec()?;
    assert!((db[2] - 3.0).abs() < 1e-12, "dB {db:?}");
    Ok(())
}

#[test]
fn no_grad_records_nothing_and_empty_sequences_work() -> Result<()> {
    let mut rng = Rng::new(3);
    let cs = Case::new(2, 2, 0, 3, 1);
    let x: Vec<Tensor> = inputs(&mut rng, cs, DType::F32).iter().map(|t| t.requires_grad()).collect();
    let y = scan(cs, &x)?;
    assert_eq!(y.dims(), [2, 2, 0]);
    let g = y.sum_all()?.backward()?;
    assert_eq!(g.get(&x[2]).expect("dA").to_f64_vec()?, vec![0.0; 6]);
    let cs = Case::new(1, 2, 4, 3, 1);
    let x: Vec<Tensor> = inputs(&mut rng, cs, DType::F32).iter().map(|t| t.requires_grad()).collect();
    let y = with_no_grad(|| scan(cs, &x))?;
    assert!(y.op().is_none());
    Ok(())
}

// ---- gradients ------------------------------------------------------------------------------------

#[test]
fn gradcheck_every_input_f64() {
    let mut rng = Rng::new(4);
    let cases = [
        Case::new(2, 4, 5, 3, 2),
        Case::new(1, 2, 1, 2, 1),
        Case::new(1, 3, 6, 2, 3).bare(),
        Case { z: false, ..Case::new(2, 2, 4, 2, 1) },
        Case { softplus: false, d: false, ..Case::new(1, 2, 5, 3, 1) },
    ];
    for cs in cases {
        let x = inputs(&mut rng, cs, DType::F64);
        gradcheck(&format!("{cs:?}"), |x: &[Tensor]| scan(cs, x), &x);
    }
    // Strided inputs: u and z as transposed views, B and C as narrowed views.
    let cs = Case::new(1, 3, 4, 2, 1);
    let x = inputs(&mut rng, cs, DType::F64);
    let ut = x[0].transpose(1, 2).unwrap().contiguous().unwrap();
    let wide = Tensor::randn_with(&mut rng, 0.0, 1.0, vec![1, 1, 2, 7], DType::F64, CPU).unwrap();
    let mut xs = x.clone();
    xs[0] = ut;
    xs[3] = wide;
    gradcheck(
        "strided views",
        |v: &[Tensor]| {
            let mut w = v.to_vec();
            w[0] = v[0].transpose(1, 2)?;
            w[3] = v[3].narrow(3, 2, 4)?;
            scan(cs, &w)
        },
        &xs,
    );
}

/// Past one chunk the backward resumes from saved states; gradcheck there would cost millions of
/// evaluations, so each input's gradient is checked along one random direction instead.
#[test]
fn gradients_across_the_chunk_boundary_match_a_directional_derivative() -> Result<()> {
    let mut rng = Rng::new(5);
    let cs = Case::new(1, 2, CHUNK + 37, 2, 1);
    let x = inputs(&mut rng, cs, DType::F64);
    let w = Tensor::randn_with(&mut rng, 0.0, 1.0, vec![1, 2, cs.len], DType::F64, CPU)?;
    let contract = |x: &[Tensor]| -> Result<f64> { scan(cs, x)?.mul(&w)?.sum_all()?.item_f64() };
    let vars: Vec<Tensor> = x.iter().map(|t| t.requires_grad()).collect();
    let g = scan(cs, &vars)?.mul(&w)?.sum_all()?.backward()?;
    for i in 0..x.len() {
        let dir = Tensor::randn_with(&mut rng, 0.0, 1.0, x[i].dims().to_vec(), DType::F64, CPU)?;
        let analytic: f64 =
            g.get(&vars[i]).expect("grad").to_f64_vec()?.iter().zip(dir.to_f64_vec()?).map(|(a, b)| a * b).sum();
        let h = 1e-6;
        let at = |s: f64| -> Result<f64> {
            let mut xs = x.clone();
            xs[i] = x[i].add(&dir.mul_scalar(s)?)?;
            with_no_grad(|| contract(&xs))
        };
        let numeric = (at(h)? - at(-h)?) / (2.0 * h);
        assert!(
            (analytic - numeric).abs() <= 1e-6 * analytic.abs().max(numeric.abs()) + 1e-8,
            "input {i}: analytic {analytic:.9e} numeric {numeric:.9e}"
        );
    }
    Ok(())
}

// ---- errors ----------------------------------------------------------------------------------------

#[test]
fn sscan_bad_inputs_are_typed_errors() -> Result<()> {
    let t = |dims: &[usize], dt: DType| Tensor::zeros(dims.to_vec(), dt, CPU).unwrap();
    let f = DType::F32;
    let (u, a, b) = (t(&[2, 4, 5], f), t(&[4, 3], f), t(&[2, 2, 3, 5], f));
    let none = ScanArgs::default();
    let ok = selective_scan(&u, &u, &a, &b, &b, none)?;
    assert_eq!(ok.dims(), [2, 4, 5]);
    let shape = |r: Result<Tensor>, what: &str| {
        let e = r.unwrap_err();
        assert!(matches!(e, Error::Shape { .. }) && e.to_string().contains(what), "{what}: {e}");
    };
    shape(selective_scan(&t(&[4, 5], f), &u, &a, &b, &b, none), "u must be");
    shape(selective_scan(&u, &t(&[2, 4, 6], f), &a, &b, &b, none), "delta");
    shape(selective_scan(&u, &u, &t(&[3, 3], f), &b, &b, none), "A must be");
    shape(selective_scan(&u, &u, &t(&[4, 0], f), &t(&[2, 2, 0, 5], f), &t(&[2, 2, 0, 5], f), none), "no state");
    shape(selective_scan(&u, &u, &a, &t(&[2, 3, 3, 5], f), &t(&[2, 3, 3, 5], f), none), "does not divide");
    shape(selective_scan(&u, &u, &a, &t(&[2, 3, 5], f), &b, none), "B must be");
    shape(selective_scan(&u, &u, &a, &b, &t(&[2, 2, 3, 4], f), none), "C must");
    let d5 = t(&[5], f);
    shape(selective_scan(&u, &u, &a, &b, &b, ScanArgs { d: Some(&d5), ..none }), "D must");
    shape(selective_scan(&u, &u, &a, &b, &b, ScanArgs { delta_bias: Some(&d5), ..none }), "delta_bias must");
    shape(selective_scan(&u, &u, &a, &b, &b, ScanArgs { z: Some(&t(&[2, 4, 4], f)), ..none }), "z must");
    let e = selective_scan(&u, &t(&[2, 4, 5], DType::BF16), &a, &b, &b, none).unwrap_err();
    assert!(matches!(e, Error::DTypeMismatch { .. }), "{e}");
    let e = selective_scan(&u, &u, &t(&[4, 3], DType::F64), &b, &b, none).unwrap_err();
    assert!(matches!(e, Error::DTypeMismatch { .. }), "A f64 with f32 u: {e}");
    let ub = t(&[2, 4, 5], DType::BF16);
    let bb = t(&[2, 2, 3, 5], DType::BF16);
    assert!(selective_scan(&ub, &ub, &a, &bb, &bb, none).is_ok(), "bf16 activations with f32 A");
    let ui = t(&[2, 4, 5], DType::I32);
    let e = selective_scan(&ui, &ui, &a, &b, &b, none).unwrap_err();
    assert!(matches!(e, Error::UnsupportedDType { .. }), "{e}");
    if let Some(dev) = gpu() {
        let g = |x: &Tensor| x.to_device(dev).unwrap();
        let e = selective_scan(&g(&u), &u, &a, &b, &b, none).unwrap_err();
        assert!(matches!(e, Error::DeviceMismatch { .. }), "{e}");
        let e = selective_scan(&g(&u), &g(&u), &a, &g(&b), &g(&b), none).unwrap_err();
        assert!(matches!(e, Error::DeviceMismatch { .. }), "A on the host: {e}");
        let (u16, b16) = (g(&t(&[2, 4, 5], DType::F16)), g(&t(&[2, 2, 3, 5], DType::F16)));
        let e = selective_scan(&u16, &u16, &g(&a), &b16, &b16, none).unwrap_err();
        assert!(matches!(e, Error::UnsupportedDType { .. }), "f16 on CUDA: {e}");
        let big = g(&t(&[4, 300], f));
        let bbig = g(&t(&[2, 2, 300, 5], f));
        shape(selective_scan(&g(&u), &g(&u), &big, &bbig, &bbig, none), "state size 300");
    }
    Ok(())
}

// ---- CUDA parity -----------------------------------------------------------------------------------

/// Norm-wise relative error allowed against the float64 reference: (forward, gradients). bf16
/// outputs and gradients are rounded to 8 bits of mantissa (2^-9 relative each).
fn parity_tol(dtype: DType) -> (f64, f64) {
    match dtype {
        DType::F32 => (2e-5, 1e-4),
        _ => (1e-2, 2e-2),
    }
}

/// The names of a case's inputs, in the op's order.
fn names(cs: Case) -> Vec<&'static str> {
    let mut v = vec!["u", "delta", "A", "B", "C"];
    v.extend([(cs.d, "D"), (cs.z, "z"), (cs.bias, "delta_bias")].iter().filter(|p| p.0).map(|p| p.1));
    v
}

/// Forward and every gradient on `dev` against the f64 CPU op on the same (rounded) inputs. A, D
/// and delta_bias stay f32 for bf16 activations (mamba's mixed precision).
fn parity_case(dev: Device, rng: &mut Rng, dtype: DType, cs: Case) -> Result<()> {
    let what = format!("{dtype} {cs:?}");
    let names = names(cs);
    let x: Vec<Tensor> = inputs(rng, cs, dtype)
        .into_iter()
        .zip(&names)
        .map(|(t, n)| if ["A", "D", "delta_bias"].contains(n) { t.to_dtype(DType::F32).unwrap() } else { t })
        .collect();
    let w = Tensor::randn_with(rng, 0.0, 1.0, vec![cs.batch, cs.dim, cs.len], DType::F64, CPU)?.to_dtype(dtype)?;
    let value_and_grads = |x: &[Tensor], w: &Tensor| -> Result<(Tensor, Vec<Tensor>)> {
        let vars: Vec<Tensor> = x.iter().map(|t| t.requires_grad()).collect();
        let o = scan(cs, &vars)?;
        let g = o.mul(w)?.sum_all()?.backward()?;
        Ok((o, vars.iter().map(|v| g.get(v).expect("gradient").clone()).collect()))
    };
    let r: Vec<Tensor> = x.iter().map(|t| t.to_dtype(DType::F64).unwrap()).collect();
    let (ro, rg) = value_and_grads(&r, &w.to_dtype(DType::F64)?)?;
    let on = |t: &Tensor| t.to_device(dev).unwrap();
    let gx: Vec<Tensor> = x.iter().map(on).collect();
    let (o, g) = value_and_grads(&gx, &on(&w))?;
    assert_eq!((o.device(), o.dtype()), (dev, dtype), "{what}");
    let (tf, tb) = parity_tol(dtype);
    let fe = rel_err(&o.to_f64_vec()?, &ro.to_f64_vec()?);
    let mut line = format!("{what}: out {fe:.2e}");
    let mut ok = fe < tf;
    for ((a, r), (name, xi)) in g.iter().zip(&rg).zip(names.iter().zip(&x)) {
        assert_eq!((a.device(), a.dtype()), (dev, xi.dtype()), "{what}: d{name}");
        let e = rel_err(&a.to_f64_vec()?, &r.to_f64_vec()?);
        line += &format!(" d{name} {e:.2e}");
        ok &= e < tb;
    }
    println!("{line}");
    if ok {
        Ok(())
    } else {
        Err(Error::InvalidArgument(format!("{line} (tolerances {tf:.0e} / {tb:.0e})")))
    }
}

#[test]
fn cuda_sscan_parity_forward_and_backward() -> Result<()> {
    let Some(dev) = gpu() else { return Ok(()) };
    let mut rng = Rng::new(7);
    let lens = [1, 7, 128, 200, 300, 777, 1500, CHUNK, CHUNK + 1, 2 * CHUNK + 901];
    let (mut n, mut failures) = (0usize, Vec::new());
    for dtype in [DType::F32, DType::BF16] {
        for (i, &len) in lens.iter().enumerate() {
            let (groups, state) = [(1, 16), (2, 4), (1, 1), (4, 17)][i % 4];
            let full = Case::new(2, 4, len, state, groups);
            let cases =
                [full, full.bare(), Case { z: false, bias: false, ..full }, Case { d: false, softplus: false, ..full }];
            let cs = cases[(i + n) % cases.len()];
            n += 1;
            if let Err(e) = parity_case(dev, &mut rng, dtype, cs) {
                failures.push(e.to_string());
            }
        }
    }
    assert!(failures.is_empty(), "{} of {n} cases failed:\n{}", failures.len(), failures.join("\n"));
    Ok(())
}

#[test]
fn cuda_sscan_parity_every_option_and_mamba_sizes() -> Result<()> {
    let Some(dev) = gpu() else { return Ok(()) };
    let mut rng = Rng::new(8);
    for dtype in [DType::F32, DType::BF16] {
        for mask in 0..16u32 {
            let bit = |k: u32| mask & (1 << k) != 0;
            let cs = Case { d: bit(0), z: bit(1), bias: bit(2), softplus: bit(3), ..Case::new(1, 3, 301, 8, 1) };
            parity_case(dev, &mut rng, dtype, cs)?;
        }
        // A Mamba layer's shape (d_inner 64 of a toy model, state 16) at a length of several chunks,
        // and state 64.
        parity_case(dev, &mut rng, dtype, Case::new(2, 64, 3000, 16, 1))?;
        parity_case(dev, &mut rng, dtype, Case::new(1, 8, 1024, 64, 2))?;
    }
    Ok(())
}

/// Strided device views (u and z transposed, B narrowed) are copied by the launch, and A, D and
/// delta_bias in the activations' dtype (bf16 in the bf16 run) converted to f32: the result
/// matches the f64 CPU op on the same values.
#[test]
fn cuda_sscan_reads_strided_views() -> Result<()> {
    let Some(dev) = gpu() else { return Ok(()) };
    let mut rng = Rng::new(9);
    for dtype in [DType::F32, DType::BF16] {
        let cs = Case::new(2, 3, 37, 4, 1);
        let x = inputs(&mut rng, cs, dtype);
        let wide = Tensor::randn_with(&mut rng, 0.0, 1.0, vec![2, 1, 4, 40], DType::F64, CPU)?.to_dtype(dtype)?;
        let mut host = x.clone();
        host[3] = wide.narrow(3, 1, 37)?;
        let want = scan(cs, &host.iter().map(|t| t.to_dtype(DType::F64).unwrap()).collect::<Vec<_>>())?;
        let on = |t: &Tensor| t.to_device(dev).unwrap();
        let mut gx: Vec<Tensor> = x.iter().map(on).collect();
        gx[0] = on(&x[0].transpose(1, 2)?.contiguous()?).transpose(1, 2)?;
        gx[6] = on(&x[6].transpose(1, 2)?.contiguous()?).transpose(1, 2)?;
        gx[3] = on(&wide).narrow(3, 1, 37)?;
        let got = scan(cs, &gx)?;
        let e = rel_err(&got.to_f64_vec()?, &want.to_f64_vec()?);
        assert!(e < parity_tol(dtype).0, "{dtype} strided views: rel err {e:.3e}");
    }
    Ok(())
}

/// A few small cases, forward and backward, for compute-sanitizer (memcheck, racecheck): every
/// kernel configuration once, a partial last chunk, several chunks.
#[test]
fn cuda_sscan_sanitizer_smoke() -> Result<()> {
    let Some(dev) = gpu() else { return Ok(()) };
    let mut rng = Rng::new(10);
    for (len, dtype) in
        [(5, DType::F32), (250, DType::BF16), (500, DType::F32), (1000, DType::BF16), (CHUNK + 3, DType::F32)]
    {
        parity_case(dev, &mut rng, dtype, Case::new(1, 2, len, 5, 2))?;
    }
    Ok(())
}

#[test]
fn bench_workload_checks_on_the_cpu() -> Result<()> {
    use ferrograd_core::fused::selective_scan::bench::{tolerance, Workload};
    let w = Workload::new(&mut Rng::new(11), (2, 3, 45, 4), DType::F32, CPU)?;
    let o = w.forward()?;
    assert_eq!(o.dims(), [2, 3, 45]);
    assert!(w.check_forward(&o)? < 1e-5);
    assert!(w.check_backward()? < tolerance(DType::F32));
    // The check can fail: a wrong output is caught.
    assert!(w.check_forward(&o.mul_scalar(1.01)?)? > 1e-3);
    Ok(())
}

/// The module compiles under NVRTC for Ampere and Hopper wherever libnvrtc is found (also part of
/// the core's every-kernel compile test; here alone, for quick iteration).
/// FERROGRAD_DUMP_CUBIN=DIR writes the cubins there, for cuobjdump.
#[test]
fn kernels_compile_for_sm80_and_sm90() {
    use ferrograd_core::cuda::nvrtc::{compile_cubin, find_cuda_include, nvrtc_info, Arch};
    use ferrograd_core::fused::selective_scan::MODULES;
    if let Err(e) = nvrtc_info() {
        assert!(std::env::var_os("FERROGRAD_REQUIRE_NVRTC").is_none_or(|v| v != "1"), "NVRTC required: {e}");
        println!("skipping: {e}");
        return;
    }
    let include = find_cuda_include().unwrap_or_else(|e| panic!("{e}"));
    for m in MODULES {
        for arch in [Arch::SM80, Arch::SM90] {
            let cubin =
                compile_cubin(&m.source(), arch, &include).unwrap_or_else(|e| panic!("{} for {arch}: {e}", m.name));
            assert!(cubin.len() > 1000, "{} {arch}: {} bytes", m.name, cubin.len());
            if let Some(dir) = std::env::var_os("FERROGRAD_DUMP_CUBIN") {
                let path = std::path::Path::new(&dir).join(format!("{}_{arch}.cubin", m.name));
                std::fs::write(&path, &cubin).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
            }
        }
    }
}
