//! The CUDA backends of attention against each other and against the float64 CPU op: cuDNN's
//! fused SDPA (`src/fused/attention/cudnn/`), our kernels (on Hopper both their `wgmma` and their
//! mma.sync variants), and the composed `math` path, forward
//! and all three gradients, bf16 and f16, head dims 64 and 128, causal and full, odd lengths, q / k
//! / v as strided views of one `[B, T, 3, H, D]` buffer. Each case asserts which implementation
//! actually ran (the op's counters), so a cuDNN plan that silently fell back fails the test. Outputs
//! are poisoned (NaN) before the kernels. Without a GPU, or (for the cuDNN cases) without libcudnn
//! 9, the tests print why and pass.

use crate::common::gpu;
use ferrograd_core::cuda::nvrtc::Arch;
use ferrograd_core::cuda::{Capture, CudaDevice};
use ferrograd_core::fused::attention::select::{counters_on_this_thread, set_backend, set_wgmma, Backend, Counters};
use ferrograd_core::fused::attention::{cudnn, AttentionOpts};
use ferrograd_core::{DType, Device, Error, Result, Rng, Tensor};

const CPU: Device = Device::Cpu;

fn gpu_with_cudnn() -> Option<Device> {
    let dev = gpu()?;
    match cudnn::library() {
        Ok(l) => {
            println!("using {l:?}");
            Some(dev)
        }
        Err(e) => {
            println!("skipping cuDNN test: {e}");
            None
        }
    }
}

/// Per-dtype tolerances of tests/core_suite/attention.rs (forward, gradients), norm-wise against float64.
fn tol(dtype: DType) -> (f64, f64) {
    match dtype {
        DType::F32 => (4e-6, 8e-6),
        DType::F16 => (1.5e-3, 2.5e-3),
        _ => (1e-2, 1.5e-2),
    }
}

/// Device 0 when it is an sm_90 GPU, the Hopper (wgmma) kernels' only target; else `None` and
/// one printed line.
fn hopper() -> Option<Device> {
    let dev = gpu()?;
    match CudaDevice::get(0) {
        Ok(d) if d.arch == Arch::SM90 => Some(dev),
        Ok(d) => {
            println!("skipping: the wgmma kernels need sm_90, this GPU is {}", d.arch);
            None
        }
        Err(e) => {
            println!("skipping: {e}");
            None
        }
    }
}

/// `f` with our kernels forced and their Hopper variant on, both settings reset whatever `f`
/// returns.
fn with_wgmma(f: impl FnOnce() -> Result<()>) -> Result<()> {
    set_backend(Some(Backend::Flash));
    set_wgmma(Some(true));
    let result = f();
    set_wgmma(None);
    set_backend(None);
    result
}

fn randn(rng: &mut Rng, dims: &[usize], dtype: DType) -> Tensor {
    Tensor::randn_with(rng, 0.0, 1.0, dims.to_vec(), DType::F64, CPU).and_then(|t| t.to_dtype(dtype)).expect("randn")
}

fn rel_err(x: &Tensor, y: &Tensor) -> f64 {
    assert_eq!(x.dims(), y.dims(), "shapes");
    let (a, b) = (x.to_f64_vec().expect("values"), y.to_f64_vec().expect("values"));
    if a.iter().chain(&b).any(|v| !v.is_finite()) {
        return f64::INFINITY;
    }
    let num: f64 = a.iter().zip(&b).map(|(p, q)| (p - q) * (p - q)).sum();
    let den: f64 = b.iter().map(|q| q * q).sum();
    if num == 0.0 {
        0.0
    } else {
        (num / den.max(1e-300)).sqrt()
    }
}

/// The `[B, H, T, D]` views of a `[B, T, 3, H, D]` buffer.
fn qkv_views(qkv: &Tensor) -> Vec<Tensor> {
    (0..3).map(|i| qkv.narrow(2, i, 1).unwrap().squeeze(2).unwrap().permute(&[0, 2, 1, 3]).unwrap()).collect()
}

/// Output and the gradients of `sum(out * w)`, the forward run by `fwd`, the backward by `bwd`.
fn run(fwd: Backend, bwd: Backend, x: &[Tensor], w: &Tensor, causal: bool) -> Result<(Tensor, Vec<Tensor>)> {
    let (q, k, v) = (x[0].requires_grad(), x[1].requires_grad(), x[2].requires_grad());
    set_backend(Some(fwd));
    let o = Tensor::scaled_dot_product_attention(&q, &k, &v, AttentionOpts { causal, ..Default::default() });
    set_backend(Some(bwd));
    let g = o.and_then(|o| {
        let g = o.mul(w)?.sum_all()?.backward()?;
        Ok((o, g))
    });
    set_backend(None);
    let (o, g) = g?;
    let grads = [&q, &k, &v].iter().map(|t| g.get(t).expect("gradient").clone()).collect();
    Ok((o, grads))
}

fn delta(before: Counters) -> Counters {
    let a = counters_on_this_thread();
    Counters {
        flash_fwd: a.flash_fwd - before.flash_fwd,
        flash_bwd: a.flash_bwd - before.flash_bwd,
        cudnn_fwd: a.cudnn_fwd - before.cudnn_fwd,
        cudnn_bwd: a.cudnn_bwd - before.cudnn_bwd,
        math: a.math - before.math,
        cudnn_fallbacks: a.cudnn_fallbacks - before.cudnn_fallbacks,
        wgmma_fwd: a.wgmma_fwd - before.wgmma_fwd,
        wgmma_bwd: a.wgmma_bwd - before.wgmma_bwd,
    }
}

/// One problem's inputs: q, k, v (separate `[B, H, T, D]` tensors, or the strided views of one
/// `[B, T, 3, H, D]` buffer moved to the device whole, so the kernels read strides) and the output
/// weights `w` on `dev`, with the float64 CPU op's output and gradients of `sum(out * w)`.
struct Problem {
    what: String,
    x: Vec<Tensor>,
    w: Tensor,
    reference: (Tensor, Vec<Tensor>),
}

fn problem(
    dev: Device,
    rng: &mut Rng,
    dtype: DType,
    dims: (usize, usize, usize, usize, usize),
    fused_qkv: bool,
    causal: bool,
) -> Result<Problem> {
    let (b, h, tq, tk, d) = dims;
    let what = format!("{dtype} B={b} H={h} Tq={tq} Tk={tk} D={d} causal={causal} fused_qkv={fused_qkv}");
    let x: Vec<Tensor> = if fused_qkv {
        assert_eq!(tq, tk);
        qkv_views(&randn(rng, &[b, tq, 3, h, d], dtype))
    } else {
        vec![randn(rng, &[b, h, tq, d], dtype), randn(rng, &[b, h, tk, d], dtype), randn(rng, &[b, h, tk, d], dtype)]
    };
    let w = randn(rng, &[b, h, tq, d], dtype);
    let r: Vec<Tensor> = x.iter().map(|t| t.to_dtype(DType::F64).unwrap()).collect();
    let reference = run(Backend::Flash, Backend::Flash, &r, &w.to_dtype(DType::F64)?, causal)?;
    let gx: Vec<Tensor> = if fused_qkv {
        let qkv = Tensor::stack(&[x[0].transpose(1, 2)?, x[1].transpose(1, 2)?, x[2].transpose(1, 2)?], 2)?;
        qkv_views(&qkv.to_device(dev)?)
    } else {
        x.iter().map(|t| t.to_device(dev).unwrap()).collect()
    };
    Ok(Problem { what, x: gx, w: w.to_device(dev)?, reference })
}

/// Relative errors of an output and its three gradients against another run's (the same order).
fn errors(a: &(Tensor, Vec<Tensor>), b: &(Tensor, Vec<Tensor>)) -> Result<Vec<f64>> {
    let mut e = vec![rel_err(&a.0.to_dtype(DType::F64)?, &b.0.to_dtype(DType::F64)?)];
    for (x, y) in a.1.iter().zip(&b.1) {
        e.push(rel_err(&x.to_dtype(DType::F64)?, &y.to_dtype(DType::F64)?));
    }
    Ok(e)
}

/// One problem: cuDNN forward + backward, our kernels' forward + backward, and the two crossed
/// (one's forward with the other's backward: the saved statistics are shared), each against the
/// float64 CPU op; cuDNN against our kernels directly. `Err` with every number on failure.
fn case(
    dev: Device,
    rng: &mut Rng,
    dtype: DType,
    dims: (usize, usize, usize, usize, usize),
    fused_qkv: bool,
    causal: bool,
) -> Result<String> {
    let Problem { what, x: gx, w: gw, reference } = problem(dev, rng, dtype, dims, fused_qkv, causal)?;
    let (tf, tb) = tol(dtype);
    let mut lines = vec![];
    let mut ok = true;
    let mut results = vec![];
    for (fwd, bwd) in [
        (Backend::Cudnn, Backend::Cudnn),
        (Backend::Flash, Backend::Flash),
        (Backend::Cudnn, Backend::Flash),
        (Backend::Flash, Backend::Cudnn),
    ] {
        let before = counters_on_this_thread();
        let (o, g) = run(fwd, bwd, &gx, &gw, causal)?;
        let ran = delta(before);
        let want =
            |b: Backend, n_cudnn: u64, n_flash: u64| if b == Backend::Cudnn { n_cudnn == 1 } else { n_flash == 1 };
        if !(want(fwd, ran.cudnn_fwd, ran.flash_fwd) && want(bwd, ran.cudnn_bwd, ran.flash_bwd)) {
            return Err(Error::InvalidArgument(format!(
                "{what}: asked for {fwd:?} forward / {bwd:?} backward, ran {ran:?}; cuDNN said: {}",
                cudnn::last_plan_error().unwrap_or_else(|| "nothing".into())
            )));
        }
        let e = errors(&(o.clone(), g.clone()), &reference)?;
        ok &= e[0] < tf && e[1..].iter().all(|x| *x < tb);
        lines.push(format!("{fwd:?}/{bwd:?}: {}", show(&e)));
        results.push((o, g));
    }
    // cuDNN against our kernels, directly.
    let e = errors(&results[0], &results[1])?;
    ok &= e[0] < 2.0 * tf && e[1..].iter().all(|x| *x < 2.0 * tb);
    lines.push(format!("cudnn vs flash: {}", show(&e)));
    verdict(&what, &lines, ok, dtype)
}

fn show(e: &[f64]) -> String {
    format!("o {:.2e} dq {:.2e} dk {:.2e} dv {:.2e}", e[0], e[1], e[2], e[3])
}

/// The case's line, printed; `Err` with it when a tolerance was missed.
fn verdict(what: &str, lines: &[String], ok: bool, dtype: DType) -> Result<String> {
    let (tf, tb) = tol(dtype);
    let line = format!("{what}: {}", lines.join("; "));
    println!("{line}");
    if ok {
        Ok(line)
    } else {
        Err(Error::InvalidArgument(format!("{line} (tolerances {tf:.0e} / {tb:.0e} against f64)")))
    }
}

#[test]
fn cuda_cudnn_and_flash_agree_forward_and_backward() -> Result<()> {
    let Some(dev) = gpu_with_cudnn() else { return Ok(()) };
    let mut rng = Rng::new(21);
    let mut failures = vec![];
    let mut n = 0;
    for dtype in [DType::BF16, DType::F16] {
        for d in [64, 128] {
            for causal in [false, true] {
                for (i, &(tq, tk)) in [(129, 129), (300, 300), (77, 45), (45, 77)].iter().enumerate() {
                    let fused = tq == tk && i % 2 == 0;
                    n += 1;
                    if let Err(e) = case(dev, &mut rng, dtype, (2, 3, tq, tk, d), fused, causal) {
                        failures.push(e.to_string());
                    }
                }
            }
        }
    }
    assert!(failures.is_empty(), "{} of {n} cases failed:\n{}", failures.len(), failures.join("\n"));
    Ok(())
}

/// The default (no variable, no override) picks cuDNN for bf16 / f16 without dropout, our kernels
/// for f32, dropout and a single query (a decode step: cuDNN would build a plan per key length).
/// Output and gradients of `sum(out * w)` through our kernels, with dropout `drop = (p, seed)`
/// drawn from `Rng::new(seed)` (the same mask for every run with the same seed and shape).
fn run_flash(x: &[Tensor], w: &Tensor, causal: bool, drop: (f64, u64)) -> Result<(Tensor, Vec<Tensor>)> {
    let (q, k, v) = (x[0].requires_grad(), x[1].requires_grad(), x[2].requires_grad());
    let opts = AttentionOpts { causal, dropout_p: drop.0, ..Default::default() };
    set_backend(Some(Backend::Flash));
    let out = Tensor::scaled_dot_product_attention_with(&mut Rng::new(drop.1), &q, &k, &v, opts)
        .and_then(|o| o.mul(w)?.sum_all()?.backward().map(|g| (o, g)));
    set_backend(None);
    let (o, g) = out?;
    let grads = [&q, &k, &v].iter().map(|t| g.get(t).expect("gradient").clone()).collect();
    Ok((o, grads))
}

/// One problem on our kernels twice, the Hopper (`wgmma`) variant and the mma.sync one, each
/// against the float64 CPU op (with dropout `drop = (p, seed)`: the same mask) and against each
/// other; asserts which variant ran.
#[allow(clippy::too_many_arguments)]
fn wgmma_case(
    dev: Device,
    rng: &mut Rng,
    dtype: DType,
    dims: (usize, usize, usize, usize, usize),
    fused_qkv: bool,
    causal: bool,
    drop: (f64, u64),
) -> Result<String> {
    let Problem { what, x: gx, w: gw, reference } = problem(dev, rng, dtype, dims, fused_qkv, causal)?;
    let (what, reference) = if drop.0 > 0.0 {
        let f64s = |t: &Tensor| t.to_device(CPU).and_then(|t| t.to_dtype(DType::F64));
        let r = gx.iter().map(f64s).collect::<Result<Vec<_>>>()?;
        (format!("{what} p={}", drop.0), run_flash(&r, &f64s(&gw)?, causal, drop)?)
    } else {
        (what, reference)
    };
    let (tf, tb) = tol(dtype);
    let (mut lines, mut ok, mut results) = (vec![], true, vec![]);
    for wg in [true, false] {
        set_wgmma(Some(wg));
        let before = counters_on_this_thread();
        let out = run_flash(&gx, &gw, causal, drop);
        let ran = delta(before);
        set_wgmma(None);
        let out = out?;
        let n = u64::from(wg);
        if (ran.flash_fwd, ran.flash_bwd, ran.wgmma_fwd, ran.wgmma_bwd) != (1, 1, n, n) {
            return Err(Error::InvalidArgument(format!("{what}: wgmma {wg}: ran {ran:?}")));
        }
        let e = errors(&out, &reference)?;
        ok &= e[0] < tf && e[1..].iter().all(|x| *x < tb);
        lines.push(format!("{}: {}", if wg { "wgmma" } else { "mma" }, show(&e)));
        results.push(out);
    }
    let e = errors(&results[0], &results[1])?;
    ok &= e[0] < 2.0 * tf && e[1..].iter().all(|x| *x < 2.0 * tb);
    lines.push(format!("wgmma vs mma: {}", show(&e)));
    verdict(&what, &lines, ok, dtype)
}

/// On an sm_90 GPU the Hopper kernels run by default for bf16 / f16 at head dims 64 and 128 and
/// agree with the float64 op and with the mma.sync kernels: lengths below, at and past a block,
/// Tq != Tk both ways (causal is top-left), one query (full; causal, one query sees one key and
/// its dQ and dK are exactly 0 in float64: rounding's 1e-8 has no relative error to compare), q / k
/// / v as strided views of one QKV buffer.
#[test]
fn cuda_wgmma_kernels_match_float64_and_the_mma_kernels() -> Result<()> {
    let Some(dev) = hopper() else { return Ok(()) };
    let mut rng = Rng::new(23);
    let (mut failures, mut n) = (vec![], 0);
    for dtype in [DType::BF16, DType::F16] {
        for d in [64, 128] {
            for causal in [false, true] {
                for (i, &(b, h, tq, tk)) in [
                    (2, 3, 129, 129),
                    (1, 2, 300, 300),
                    (2, 2, 77, 45),
                    (1, 2, 45, 77),
                    (1, 2, 1, 77),
                    (1, 2, 520, 520),
                ]
                .iter()
                .enumerate()
                {
                    if causal && tq == 1 {
                        continue; // one visible key: dQ and dK are exactly 0, nothing relative to compare
                    }
                    let fused = tq == tk && i % 2 == 0;
                    n += 1;
                    if let Err(e) = wgmma_case(dev, &mut rng, dtype, (b, h, tq, tk, d), fused, causal, (0.0, 0)) {
                        failures.push(e.to_string());
                    }
                }
            }
        }
    }
    assert!(failures.is_empty(), "{} of {n} cases failed:\n{}", failures.len(), failures.join("\n"));
    Ok(())
}

/// With dropout the Hopper kernels run their `wgdrop` build, which draws the mma.sync kernels'
/// mask element for element: both against the float64 CPU op with the same seed (the CPU draws
/// the documented Philox mapping too), and against each other; asserts which kernels ran.
#[test]
fn cuda_wgmma_dropout_matches_float64_and_the_mma_kernels() -> Result<()> {
    let Some(dev) = hopper() else { return Ok(()) };
    let mut rng = Rng::new(29);
    let (mut failures, mut n) = (vec![], 0);
    for dtype in [DType::BF16, DType::F16] {
        for d in [64, 128] {
            for causal in [false, true] {
                let shapes = [(2, 3, 129, 129, 0.2), (1, 2, 77, 45, 0.1), (1, 2, 45, 300, 0.3), (1, 2, 300, 300, 0.2)];
                for (i, &(b, h, tq, tk, p)) in shapes.iter().enumerate() {
                    n += 1;
                    let fused = tq == tk && i % 2 == 0;
                    let drop = (p, 100 + n as u64);
                    if let Err(e) = wgmma_case(dev, &mut rng, dtype, (b, h, tq, tk, d), fused, causal, drop) {
                        failures.push(e.to_string());
                    }
                }
            }
        }
    }
    assert!(failures.is_empty(), "{} of {n} cases failed:\n{}", failures.len(), failures.join("\n"));
    Ok(())
}

/// The Hopper kernels inside a CUDA graph: the d = 128 forward's TMA tensor maps are encoded on
/// the host while the capture records, so a replay must read what the input buffers hold at
/// replay time (refilled in place between replays) and give the eager result bit for bit; at
/// d = 64 the same for the cp.async kernel; both on the grouped grids.
#[test]
fn cuda_wgmma_forward_replays_in_a_cuda_graph() -> Result<()> {
    let Some(dev) = hopper() else { return Ok(()) };
    let cdev = CudaDevice::get(0)?;
    let mut rng = Rng::new(31);
    with_wgmma(|| {
        for d in [64, 128] {
            let dims = [2, 3, 200, d];
            let sets: Vec<Vec<Tensor>> = (0..3)
                .map(|_| (0..3).map(|_| randn(&mut rng, &dims, DType::BF16).to_device(dev)).collect())
                .collect::<Result<_>>()?;
            let fixed: Vec<Tensor> = sets[0].iter().map(|t| t.zeros_like()).collect::<Result<_>>()?;
            let attn =
                |x: &[Tensor]| Tensor::scaled_dot_product_attention(&x[0], &x[1], &x[2], AttentionOpts::causal());
            let mut capture = Capture::new(&cdev)?;
            for (f, x) in fixed.iter().zip(&sets[0]) {
                f.set(x)?;
            }
            let before = counters_on_this_thread();
            drop(capture.warmup(|| attn(&fixed))?);
            let (graph, out) = capture.capture(|| attn(&fixed))?;
            assert_eq!(delta(before).wgmma_fwd, 2, "d = {d}: the warm-up and the capture ran the wgmma forward");
            for (i, set) in sets.iter().enumerate().rev() {
                for (f, x) in fixed.iter().zip(set) {
                    f.set(x)?;
                }
                graph.replay()?;
                let bits =
                    |t: &Tensor| -> Result<Vec<u64>> { Ok(t.to_f64_vec()?.iter().map(|v| v.to_bits()).collect()) };
                assert_eq!(bits(&out)?, bits(&attn(set)?)?, "d = {d}, input set {i}: the replay differs from eager");
            }
        }
        Ok(())
    })
}

/// K and V expanded over the heads (a zero stride, as multi-query attention passes them): the
/// d = 128 forward's tensor maps take a dense copy (d = 64's cp.async loads read the view), and
/// the result matches the float64 CPU op on the materialised tensors.
#[test]
fn cuda_wgmma_takes_k_and_v_expanded_over_heads() -> Result<()> {
    let Some(dev) = hopper() else { return Ok(()) };
    let mut rng = Rng::new(41);
    with_wgmma(|| {
        for d in [64, 128] {
            let q = randn(&mut rng, &[2, 4, 150, d], DType::BF16);
            let k1 = randn(&mut rng, &[2, 1, 150, d], DType::BF16);
            let v1 = randn(&mut rng, &[2, 1, 150, d], DType::BF16);
            let shape = [2usize, 4, 150, d];
            let reference = Tensor::scaled_dot_product_attention(
                &q.to_dtype(DType::F64)?,
                &k1.to_dtype(DType::F64)?.expand(shape)?.contiguous()?,
                &v1.to_dtype(DType::F64)?.expand(shape)?.contiguous()?,
                AttentionOpts::causal(),
            )?;
            let before = counters_on_this_thread();
            let o = Tensor::scaled_dot_product_attention(
                &q.to_device(dev)?,
                &k1.to_device(dev)?.expand(shape)?,
                &v1.to_device(dev)?.expand(shape)?,
                AttentionOpts::causal(),
            )?;
            assert_eq!(delta(before).wgmma_fwd, 1, "d = {d}: the wgmma forward ran");
            let e = rel_err(&o.to_dtype(DType::F64)?.to_device(CPU)?, &reference);
            assert!(e < tol(DType::BF16).0, "d = {d}: relative error {e:.2e} against float64");
        }
        Ok(())
    })
}

#[test]
fn cuda_auto_picks_cudnn_where_it_can() -> Result<()> {
    let Some(dev) = gpu_with_cudnn() else { return Ok(()) };
    let mut rng = Rng::new(22);
    let x: Vec<Tensor> =
        (0..3).map(|_| randn(&mut rng, &[1, 2, 64, 64], DType::BF16).to_device(dev).unwrap()).collect();
    let cases = [(DType::BF16, 0.0, 64, true), (DType::F32, 0.0, 64, false), (DType::BF16, 0.1, 64, false)];
    for (dtype, p, tq, expect_cudnn) in cases.into_iter().chain([(DType::BF16, 0.0, 1, false)]) {
        let mut x: Vec<Tensor> = x.iter().map(|t| t.to_dtype(dtype).unwrap()).collect();
        x[0] = x[0].narrow(2, 0, tq)?;
        let before = counters_on_this_thread();
        set_backend(Some(Backend::Auto));
        let o = Tensor::scaled_dot_product_attention(
            &x[0],
            &x[1],
            &x[2],
            AttentionOpts { dropout_p: p, ..Default::default() },
        );
        set_backend(None);
        o?.to_f64_vec()?;
        let ran = delta(before);
        let what = format!("{dtype} p={p} Tq={tq}: {ran:?}");
        assert_eq!((ran.cudnn_fwd == 1, ran.flash_fwd == 1), (expect_cudnn, !expect_cudnn), "{what}");
    }
    Ok(())
}

/// `math`: the composed definition, forward and backward, against the float64 CPU op (bf16 rounds
/// the materialised scores and probabilities: three times the fused tolerance).
#[test]
fn cuda_math_backend_matches_the_reference() -> Result<()> {
    let Some(dev) = gpu() else { return Ok(()) };
    let mut rng = Rng::new(23);
    for (dtype, causal) in [(DType::F32, true), (DType::BF16, false), (DType::F16, true)] {
        let x: Vec<Tensor> = (0..3).map(|_| randn(&mut rng, &[2, 3, 77, 64], dtype)).collect();
        let w = randn(&mut rng, &[2, 3, 77, 64], dtype);
        let r: Vec<Tensor> = x.iter().map(|t| t.to_dtype(DType::F64).unwrap()).collect();
        let (ro, rg) = run(Backend::Flash, Backend::Flash, &r, &w.to_dtype(DType::F64)?, causal)?;
        let gx: Vec<Tensor> = x.iter().map(|t| t.to_device(dev).unwrap()).collect();
        let before = counters_on_this_thread();
        let (o, g) = run(Backend::Math, Backend::Math, &gx, &w.to_device(dev)?, causal)?;
        let ran = delta(before);
        assert_eq!((ran.math, ran.flash_fwd, ran.cudnn_fwd), (1, 0, 0), "{ran:?}");
        let (tf, tb) = tol(dtype);
        let (tf, tb) = if dtype == DType::F32 { (tf, tb) } else { (3.0 * tf, 3.0 * tb) };
        let eo = rel_err(&o.to_dtype(DType::F64)?, &ro);
        assert!(eo < tf, "{dtype} math forward {eo:.2e}");
        for (a, r) in g.iter().zip(&rg) {
            let e = rel_err(&a.to_dtype(DType::F64)?, r);
            assert!(e < tb, "{dtype} math gradient {e:.2e}");
        }
    }
    // No dropout on the math path: a typed error, not a silent other backend.
    let x: Vec<Tensor> = (0..3).map(|_| randn(&mut rng, &[1, 1, 8, 64], DType::F32).to_device(dev).unwrap()).collect();
    set_backend(Some(Backend::Math));
    let e = Tensor::scaled_dot_product_attention(
        &x[0],
        &x[1],
        &x[2],
        AttentionOpts { dropout_p: 0.1, ..Default::default() },
    );
    set_backend(None);
    assert!(matches!(e, Err(Error::InvalidArgument(_))), "{e:?}");
    Ok(())
}

/// A small cuDNN case, forward and backward, for compute-sanitizer memcheck.
#[test]
fn cuda_cudnn_sanitizer_smoke() -> Result<()> {
    let Some(dev) = gpu_with_cudnn() else { return Ok(()) };
    let mut rng = Rng::new(24);
    case(dev, &mut rng, DType::BF16, (1, 2, 129, 129, 64), true, true)?;
    Ok(())
}

#[test]
fn backend_names_parse() {
    assert_eq!(Backend::parse("flash").unwrap(), Backend::Flash);
    assert_eq!(Backend::parse(" CUDNN ").unwrap(), Backend::Cudnn);
    assert_eq!(Backend::parse("math").unwrap(), Backend::Math);
    assert_eq!(Backend::parse("").unwrap(), Backend::Auto);
    let e = Backend::parse("fast").unwrap_err().to_string();
    assert!(e.contains("FERROGRAD_ATTENTION") && e.contains("fast"), "{e}");
    // Without cuDNN, asking for it is not an error: the reason is kept.
    if let Err(e) = cudnn::library() {
        assert!(matches!(e, Error::CudnnUnavailable { .. }), "{e}");
    }
}

/// A plan written to the disk cache (`cudnn/plan_cache.rs`) is restored once the in-memory plans
/// are dropped, as a new process would start, and runs the same kernel: the output and all three
/// gradients equal the built plan's bit for bit. Skipped where the cache is switched off.
#[test]
fn cuda_cudnn_plans_restore_from_the_disk_cache() -> Result<()> {
    let Some(dev) = gpu_with_cudnn() else { return Ok(()) };
    if std::env::var_os("FERROGRAD_CACHE_DIR").is_some_and(|v| v.is_empty()) {
        println!("skipping: the kernel cache is switched off (FERROGRAD_CACHE_DIR is empty)");
        return Ok(());
    }
    let mut rng = Rng::new(5);
    // A shape of this test's own, so that its plans are its own.
    let (b, h, t, d) = (1, 2, 93, 64);
    let x: Vec<Tensor> = (0..3).map(|_| randn(&mut rng, &[b, h, t, d], DType::BF16).to_device(dev).unwrap()).collect();
    let w = randn(&mut rng, &[b, h, t, d], DType::BF16).to_device(dev)?;
    let built = run(Backend::Cudnn, Backend::Cudnn, &x, &w, true)?;
    cudnn::forget_plans();
    let before = cudnn::plans_restored();
    let restored = run(Backend::Cudnn, Backend::Cudnn, &x, &w, true)?;
    let n = cudnn::plans_restored() - before;
    assert_eq!(n, 2, "the forward and backward plans should come from the disk cache, {n} did");
    let bits = |t: &Tensor| {
        t.to_dtype(DType::F32)
            .and_then(|t| t.to_vec::<f32>())
            .map(|v| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>())
    };
    assert_eq!(bits(&built.0)?, bits(&restored.0)?, "output");
    for (i, (a, r)) in built.1.iter().zip(&restored.1).enumerate() {
        assert_eq!(bits(a)?, bits(r)?, "gradient {i}");
    }
    Ok(())
}
