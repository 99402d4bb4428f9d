//! The Mamba block: the recurrent decode (`Mamba::step`, state carried) equals the full-sequence
//! forward token by token (f64 and f32 on the CPU, f32 on CUDA); every parameter gets a gradient
//! with mamba_ssm's names; mamba_ssm's initialisation (A_log, D, dt bias range); typed errors; the
//! block on CUDA (poisoned allocations) against the CPU, forward and every gradient.

use crate::common::*;
use ferrograd_core::{DType, Error, Result, Rng, Tensor};
use ferrograd_nn::{Mamba, MambaConfig, Module};

fn small() -> MambaConfig {
    MambaConfig { d_state: 4, ..MambaConfig::new(12) }
}

/// max |a - b| / (1 + max |b|)
fn err(a: &Tensor, b: &Tensor) -> f64 {
    let (x, y) = (a.to_f64_vec().expect("a"), b.to_f64_vec().expect("b"));
    assert_eq!(x.len(), y.len());
    let scale = 1.0 + y.iter().fold(0.0f64, |m, v| m.max(v.abs()));
    x.iter().zip(&y).fold(0.0f64, |m, (p, q)| m.max((p - q).abs())) / scale
}

/// Step through `x` `[batch, len, d_model]` one token at a time from a zero state, and compare
/// each output with the full forward's.
fn decode_matches_forward(block: &Mamba, x: &Tensor, tol: f64) -> Result<()> {
    let full = block.forward_seq(x)?;
    let (b, l) = (x.dims()[0], x.dims()[1]);
    let mut state = block.zero_state(b, x.dtype())?;
    for t in 0..l {
        let y = block.step(&x.narrow(1, t, 1)?.squeeze(1)?, &mut state)?;
        let want = full.narrow(1, t, 1)?.squeeze(1)?;
        let e = err(&y, &want);
        assert!(e <= tol, "{} step {t}: err {e:e} > {tol:e}", x.dtype());
    }
    Ok(())
}

#[test]
fn decode_equals_full_forward_f64_and_f32() -> Result<()> {
    let mut rng = Rng::new(1);
    let block = Mamba::new(small(), &mut rng, CPU)?;
    let x = Tensor::randn_with(&mut rng, 0.0, 1.0, (2, 11, 12), DType::F32, CPU)?;
    decode_matches_forward(&block.to_dtype(DType::F64)?, &x.to_dtype(DType::F64)?, 1e-12)?;
    decode_matches_forward(&block, &x, 2e-5)?;
    // d_conv 1 and a kernel wider than the sequence.
    for d_conv in [1, 6] {
        let block = Mamba::new(MambaConfig { d_conv, ..small() }, &mut rng, CPU)?.to_dtype(DType::F64)?;
        decode_matches_forward(&block, &x.narrow(1, 0, 4)?.to_dtype(DType::F64)?, 1e-12)?;
    }
    Ok(())
}

#[test]
fn init_and_names_follow_mamba_ssm() -> Result<()> {
    let cfg = small();
    let block = Mamba::new(cfg, &mut Rng::new(2), CPU)?;
    let names: Vec<String> = block.named_parameters().into_iter().map(|(n, _)| n).collect();
    let want = [
        "in_proj.weight",
        "conv1d.weight",
        "conv1d.bias",
        "x_proj.weight",
        "dt_proj.weight",
        "dt_proj.bias",
        "A_log",
        "D",
        "out_proj.weight",
    ];
    assert_eq!(names, want);
    let (di, n, r) = (cfg.d_inner(), cfg.d_state, cfg.dt_rank());
    assert_eq!((di, r), (24, 1));
    assert_eq!(block.in_proj.weight.dims(), [2 * di, 12]);
    assert_eq!(block.x_proj.weight.dims(), [r + 2 * n, di]);
    let a = block.a_log.to_f64_vec()?;
    assert!((a[n - 1] - (n as f64).ln()).abs() < 1e-6 && a[0] == 0.0, "A_log = log(1..=n)");
    assert!(block.d.to_f64_vec()?.iter().all(|&v| v == 1.0));
    // softplus(dt bias) lies in [dt_min, dt_max].
    for b in block.dt_proj.bias.as_ref().expect("dt bias").to_f64_vec()? {
        let dt = b.exp().ln_1p();
        assert!((cfg.dt_min * 0.999..=cfg.dt_max * 1.001).contains(&dt), "dt {dt}");
    }
    Ok(())
}

#[test]
fn every_parameter_gets_a_gradient() -> Result<()> {
    let mut rng = Rng::new(3);
    let block = Mamba::new(small(), &mut rng, CPU)?;
    let x = Tensor::randn_with(&mut rng, 0.0, 1.0, (2, 5, 12), DType::F32, CPU)?;
    let g = block.forward(&x)?.sqr()?.mean_all()?.backward()?;
    for (name, p) in block.named_parameters() {
        let gp = g.get(&p).unwrap_or_else(|| panic!("no gradient for {name}"));
        assert_eq!(gp.dims(), p.dims(), "{name}");
        assert!(gp.to_f64_vec()?.iter().any(|v| *v != 0.0), "{name}: zero gradient");
    }
    Ok(())
}

#[test]
fn bad_inputs_are_typed_errors() -> Result<()> {
    let block = Mamba::new(small(), &mut Rng::new(4), CPU)?;
    let e = block.forward(&Tensor::zeros((2, 5, 7), DType::F32, CPU)?).unwrap_err();
    assert!(matches!(e, Error::Shape { .. }), "{e}");
    let mut st = block.zero_state(2, DType::F32)?;
    let e = block.step(&Tensor::zeros((3, 12), DType::F32, CPU)?, &mut st).unwrap_err();
    assert!(matches!(e, Error::Shape { .. }), "batch mismatch with the state: {e}");
    assert!(Mamba::new(MambaConfig { d_state: 0, ..small() }, &mut Rng::new(0), CPU).is_err());
    Ok(())
}

#[test]
fn cuda_block_matches_cpu_and_decodes() -> Result<()> {
    let Some(gpu) = cuda("cuda_block_matches_cpu_and_decodes") else { return Ok(()) };
    ferrograd_core::cuda::set_poison_allocations(true);
    let mut rng = Rng::new(5);
    let cfg = MambaConfig { d_state: 16, ..MambaConfig::new(32) };
    let cpu = Mamba::new(cfg, &mut Rng::new(6), CPU)?;
    let dev = Mamba::new(cfg, &mut Rng::new(6), gpu)?;
    let x = Tensor::randn_with(&mut rng, 0.0, 1.0, (3, 37, 32), DType::F32, CPU)?;
    let xg = x.to_device(gpu)?;
    let (yc, yg) = (cpu.forward(&x)?, dev.forward(&xg)?);
    assert!(err(&yg, &yc) < 1e-4, "forward err {:e}", err(&yg, &yc));
    let (gc, gg) = (yc.sqr()?.mean_all()?.backward()?, yg.sqr()?.mean_all()?.backward()?);
    for ((name, pc), (_, pg)) in cpu.named_parameters().into_iter().zip(dev.named_parameters()) {
        let (a, b) = (gg.get(&pg).expect("cuda grad"), gc.get(&pc).expect("cpu grad"));
        let e = err(a, b);
        assert!(e < 1e-3, "{name}: grad err {e:e}");
    }
    decode_matches_forward(&dev, &xg.narrow(1, 0, 9)?, 1e-4)?;
    Ok(())
}
