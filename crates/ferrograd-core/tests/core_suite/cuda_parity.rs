//! CPU <-> CUDA parity: every op, dtype and backward on random inputs, contiguous and strided.
//! Device outputs are poisoned (NaN bytes) before every kernel, so an unwritten element fails.
//! Without a usable GPU every test prints one line and passes.

use crate::common;

use common::{assert_close, gpu, on, randn};
use ferrograd_core::cuda::CudaDevice;
use ferrograd_core::{DType, Device, Error, Result, Rng, Tensor};

const FLOATS: [DType; 4] = [DType::F32, DType::F64, DType::F16, DType::BF16];

/// Run `f` on CPU inputs and on their CUDA copies; compare.
fn check(what: &str, dev: Device, inputs: &[Tensor], scale: f64, f: impl Fn(&[Tensor]) -> Result<Tensor>) {
    let cpu = f(inputs).unwrap_or_else(|e| panic!("{what} on cpu: {e}"));
    let g: Vec<Tensor> = inputs.iter().map(|t| on(t, dev)).collect();
    let out = f(&g).unwrap_or_else(|e| panic!("{what} on cuda: {e}"));
    assert_eq!(out.device(), dev, "{what}: result device");
    assert_close(what, &cpu, &out, scale);
}

#[test]
fn creation_and_transfer() -> Result<()> {
    let Some(dev) = gpu() else { return Ok(()) };
    for d in DType::ALL {
        for v in [0.0, 1.0, 7.0] {
            let c = Tensor::full(v, (3, 5), d, Device::Cpu)?;
            let g = Tensor::full(v, (3, 5), d, dev)?;
            assert_close("full", &c, &g, 1.0);
        }
        let c = Tensor::arange(0.0, 40.0, 3.0, d, Device::Cpu)?;
        assert_close("arange", &c, &Tensor::arange(0.0, 40.0, 3.0, d, dev)?, 1.0);
        assert_close("round trip", &c, &on(&on(&c, dev), Device::Cpu), 1.0);
    }
    let e = Tensor::zeros(3, DType::F32, Device::Cuda(99)).unwrap_err();
    assert!(matches!(e, Error::CudaDeviceNotFound { ordinal: 99, .. }), "{e}");
    assert!(e.to_string().contains("99"), "{e}");
    Ok(())
}

#[test]
fn random_numbers_match_cpu() -> Result<()> {
    let Some(dev) = gpu() else { return Ok(()) };
    for d in FLOATS {
        let c = Tensor::rand_with(&mut Rng::new(42), -2.0, 3.0, (7, 33), d, Device::Cpu)?;
        let g = Tensor::rand_with(&mut Rng::new(42), -2.0, 3.0, (7, 33), d, dev)?;
        assert_close("rand", &c, &g, 0.01);
        let c = Tensor::randn_with(&mut Rng::new(7), 1.0, 2.0, 1001, d, Device::Cpu)?;
        let g = Tensor::randn_with(&mut Rng::new(7), 1.0, 2.0, 1001, d, dev)?;
        assert_close("randn", &c, &g, 0.01);
    }
    Ok(())
}

#[test]
fn casts_between_all_dtypes() -> Result<()> {
    let Some(dev) = gpu() else { return Ok(()) };
    let vals: Vec<f64> = (0..60).map(|i| (i as f64) * 2.0 - 10.0).chain([0.5, -0.5, 100.0, 127.0]).collect();
    for from in DType::ALL {
        let src = Tensor::from_vec(vals.clone(), vals.len(), Device::Cpu)?.to_dtype(from)?;
        for to in DType::ALL {
            check(&format!("cast {from}->{to}"), dev, std::slice::from_ref(&src), 1.0, |x| x[0].to_dtype(to));
            // A transposed view exercises the strided cast path.
            let m = src.narrow(0, 0, 60)?.reshape((6, 10))?;
            check(&format!("cast strided {from}->{to}"), dev, &[m], 1.0, |x| x[0].t()?.to_dtype(to));
        }
    }
    Ok(())
}

#[test]
fn unary_ops() -> Result<()> {
    let Some(dev) = gpu() else { return Ok(()) };
    let mut rng = Rng::new(1);
    type F = fn(&Tensor) -> Result<Tensor>;
    let any: Vec<(&str, F)> = vec![
        ("neg", |x| x.neg()),
        ("abs", |x| x.abs()),
        ("sqr", |x| x.sqr()),
        ("sign", |x| x.sign()),
        ("relu", |x| x.relu()),
        ("exp", |x| x.exp()),
        ("tanh", |x| x.tanh()),
        ("sigmoid", |x| x.sigmoid()),
        ("gelu", |x| x.gelu()),
        ("gelu_tanh", |x| x.gelu_tanh()),
        ("silu", |x| x.silu()),
        ("sin", |x| x.sin()),
        ("cos", |x| x.cos()),
        ("affine", |x| x.affine(1.5, -0.25)),
        ("clamp", |x| x.clamp(-0.5, 0.7)),
        ("powf", |x| x.abs()?.powf(1.7)),
        ("log", |x| x.abs()?.add_scalar(0.1)?.log()),
        ("sqrt", |x| x.abs()?.sqrt()),
        ("rsqrt", |x| x.abs()?.add_scalar(0.1)?.rsqrt()),
        ("recip", |x| x.abs()?.add_scalar(0.1)?.recip()),
    ];
    for d in FLOATS {
        let x = randn(&mut rng, &[17, 33], d);
        for (name, f) in &any {
            check(&format!("{name} contiguous"), dev, std::slice::from_ref(&x), 2.0, |t| f(&t[0]));
            check(&format!("{name} transposed"), dev, std::slice::from_ref(&x), 2.0, |t| f(&t[0].t()?));
        }
    }
    for d in [DType::I32, DType::U32, DType::U8, DType::I8] {
        let x = Tensor::arange(0.0, 60.0, 1.0, d, Device::Cpu)?.reshape((6, 10))?;
        for (name, f) in &any[..5] {
            check(&format!("{name} int"), dev, std::slice::from_ref(&x), 1.0, |t| f(&t[0].t()?));
        }
        check("affine int", dev, std::slice::from_ref(&x), 1.0, |t| t[0].affine(2.0, 1.0));
        check("clamp int", dev, std::slice::from_ref(&x), 1.0, |t| t[0].clamp(3.0, 40.0));
        let g = on(&x, dev);
        assert!(matches!(g.exp(), Err(Error::UnsupportedDType { .. })));
    }
    Ok(())
}

#[test]
fn binary_and_compare_with_broadcast() -> Result<()> {
    let Some(dev) = gpu() else { return Ok(()) };
    let mut rng = Rng::new(2);
    type F = fn(&Tensor, &Tensor) -> Result<Tensor>;
    let ops: Vec<(&str, F)> = vec![
        ("add", |a, b| a.add(b)),
        ("sub", |a, b| a.sub(b)),
        ("mul", |a, b| a.mul(b)),
        ("div", |a, b| a.div(b)),
        ("maximum", |a, b| a.maximum(b)),
        ("minimum", |a, b| a.minimum(b)),
        ("remainder", |a, b| a.remainder(b)),
        ("eq", |a, b| a.eq(b)),
        ("ne", |a, b| a.ne(b)),
        ("lt", |a, b| a.lt(b)),
        ("le", |a, b| a.le(b)),
        ("gt", |a, b| a.gt(b)),
        ("ge", |a, b| a.ge(b)),
    ];
    for d in DType::ALL {
        let (a, b) = if d.is_float() {
            (randn(&mut rng, &[3, 1, 5], d), randn(&mut rng, &[4, 5], d).affine(1.0, 3.0)?)
        } else {
            let a = Tensor::rand_with(&mut rng, 0.0, 100.0, (3, 1, 5), DType::F32, Device::Cpu)?.to_dtype(d)?;
            let b = Tensor::rand_with(&mut rng, 1.0, 9.0, (4, 5), DType::F32, Device::Cpu)?.to_dtype(d)?;
            (a, b)
        };
        for (name, f) in &ops {
            check(&format!("{name} broadcast"), dev, &[a.clone(), b.clone()], 1.0, |t| f(&t[0], &t[1]));
            check(&format!("{name} transposed"), dev, &[b.clone(), b.clone()], 1.0, |t| {
                f(&t[0].t()?, &t[1].t()?.contiguous()?)
            });
        }
    }
    Ok(())
}

/// The 16-byte path of same-shape binary ops (both operands contiguous and aligned) against the
/// element-by-element path (the same values at an odd offset, so misaligned) and the CPU: bitwise
/// equal, on lengths with and without a tail (n % V) and shorter than one vector.
#[test]
fn binary_vectorized_path_is_bitwise_the_scalar_one() -> Result<()> {
    let Some(dev) = gpu() else { return Ok(()) };
    let mut rng = Rng::new(31);
    for dtype in [DType::BF16, DType::F16, DType::F32, DType::F64, DType::I32, DType::U8] {
        for n in [1usize, 7, 8, 9, 33, 4096 + 5] {
            // b away from 0 so that div stays finite in the float types.
            let a = randn(&mut rng, &[n + 1], DType::F64).mul_scalar(20.0)?.to_dtype(dtype)?;
            let b = randn(&mut rng, &[n + 1], DType::F64).abs()?.add_scalar(0.5)?.mul_scalar(3.0)?.to_dtype(dtype)?;
            let (ga, gb) = (a.to_device(dev)?, b.to_device(dev)?);
            // Offset 1 into device buffers: contiguous but misaligned, the element-by-element path.
            let (sa, sb) = (ga.narrow(0, 1, n)?, gb.narrow(0, 1, n)?);
            // The same values in fresh device buffers (aligned): the 16-byte path.
            let (ca, cb) = (a.narrow(0, 1, n)?, b.narrow(0, 1, n)?);
            let (va2, vb2) = (ca.to_device(dev)?, cb.to_device(dev)?);
            for (name, f) in [
                ("add", Tensor::add as fn(&Tensor, &Tensor) -> Result<Tensor>),
                ("sub", Tensor::sub),
                ("mul", Tensor::mul),
                ("div", Tensor::div),
            ] {
                let what = format!("{name} {dtype} n={n}");
                let scalar = f(&sa, &sb)?.to_f64_vec()?;
                let vector = f(&va2, &vb2)?.to_f64_vec()?;
                let cpu = f(&ca, &cb)?.to_f64_vec()?;
                let bits = |v: &[f64]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                assert_eq!(bits(&vector), bits(&scalar), "{what}: 16-byte path vs element path");
                assert_eq!(bits(&vector), bits(&cpu), "{what}: 16-byte path vs CPU");
                assert!(vector.iter().all(|x| x.is_finite()), "{what}: non-finite output");
            }
        }
    }
    Ok(())
}

/// The maps on a grid sized to their 16-byte vectors (`cfg_map`: one unrolled step of four
/// vectors a thread, the last threads in the remainder loop), which only lengths past about 4M
/// (f32) / 9M (f16, bf16) elements reach: add, mul and relu bitwise equal to the CPU's, on a
/// length with a tail (n % V != 0) in every floating dtype.
#[test]
fn maps_on_the_vector_sized_grid_match_the_cpu() -> Result<()> {
    let Some(dev) = gpu() else { return Ok(()) };
    let mut rng = Rng::new(32);
    let n = 9 * (1 << 20) + 7;
    for dtype in [DType::BF16, DType::F16, DType::F32, DType::F64] {
        let a = randn(&mut rng, &[n], dtype);
        let b = randn(&mut rng, &[n], dtype);
        let (ga, gb) = (a.to_device(dev)?, b.to_device(dev)?);
        let bits = |t: &Tensor| -> Result<Vec<u64>> { Ok(t.to_f64_vec()?.iter().map(|x| x.to_bits()).collect()) };
        for (name, gpu_out, cpu_out) in
            [("add", ga.add(&gb)?, a.add(&b)?), ("mul", ga.mul(&gb)?, a.mul(&b)?), ("relu", ga.relu()?, a.relu()?)]
        {
            let (g, c) = (bits(&gpu_out)?, bits(&cpu_out)?);
            let bad = g.iter().zip(&c).position(|(x, y)| x != y);
            assert!(bad.is_none(), "{name} {dtype} n={n}: first difference at element {bad:?}");
        }
    }
    Ok(())
}

#[test]
fn where_and_masked_fill() -> Result<()> {
    let Some(dev) = gpu() else { return Ok(()) };
    let mut rng = Rng::new(3);
    for d in DType::ALL {
        let t = randn(&mut rng, &[4, 6], DType::F32).affine(10.0, 50.0)?.to_dtype(d)?;
        let f = randn(&mut rng, &[6], DType::F32).affine(10.0, 50.0)?.to_dtype(d)?;
        let c = randn(&mut rng, &[4, 1], DType::F32);
        check("where f32 cond", dev, &[c.clone(), t.clone(), f.clone()], 1.0, |x| x[0].where_cond(&x[1], &x[2]));
        let mask = c.gt(&Tensor::zeros((), DType::F32, Device::Cpu)?)?;
        check("where u8 cond", dev, &[mask.clone(), t.clone(), f.clone()], 1.0, |x| x[0].where_cond(&x[1], &x[2]));
        check("masked_fill", dev, &[t.clone(), mask], 1.0, |x| x[0].masked_fill(&x[1], 3.0));
    }
    Ok(())
}

#[test]
fn reductions() -> Result<()> {
    let Some(dev) = gpu() else { return Ok(()) };
    let mut rng = Rng::new(4);
    for d in DType::ALL {
        let x = if d.is_float() {
            randn(&mut rng, &[5, 7, 9], d)
        } else {
            Tensor::rand_with(&mut rng, 0.0, 100.0, (5, 7, 9), DType::F32, Device::Cpu)?.to_dtype(d)?
        };
        let scale = if d.is_float() { 10.0 } else { 1.0 };
        for dims in [vec![0usize], vec![1], vec![2], vec![0, 2], vec![0, 1, 2]] {
            check(&format!("sum {dims:?}"), dev, std::slice::from_ref(&x), scale, |t| t[0].sum(dims.clone(), false));
            check(&format!("max {dims:?}"), dev, std::slice::from_ref(&x), 1.0, |t| t[0].max(dims.clone(), true));
            check(&format!("min {dims:?} permuted"), dev, std::slice::from_ref(&x), 1.0, |t| {
                t[0].permute(&[2, 0, 1])?.min(dims.clone(), false)
            });
        }
        for dim in 0..3 {
            check("argmax", dev, std::slice::from_ref(&x), 1.0, |t| t[0].argmax(dim, false));
            check("argmin", dev, std::slice::from_ref(&x), 1.0, |t| t[0].argmin(dim, true));
        }
    }
    // Long rows take the two-stage path.
    let big = randn(&mut rng, &[3, 300_001], DType::F32);
    check("sum long rows", dev, std::slice::from_ref(&big), 20.0, |t| t[0].sum(1, false));
    check("mean all", dev, std::slice::from_ref(&big), 20.0, |t| t[0].mean_all());
    check("max all", dev, std::slice::from_ref(&big), 1.0, |t| t[0].max(ferrograd_core::AllDims, false));
    check("var", dev, std::slice::from_ref(&big), 20.0, |t| t[0].var(1, false, true));
    check("logsumexp", dev, std::slice::from_ref(&big), 20.0, |t| t[0].logsumexp(1, false));
    Ok(())
}

#[test]
fn softmax_and_layer_norm() -> Result<()> {
    let Some(dev) = gpu() else { return Ok(()) };
    let mut rng = Rng::new(5);
    for d in FLOATS {
        for cols in [1usize, 7, 100, 1000, 20_000] {
            let x = randn(&mut rng, &[6, cols], d).affine(3.0, 0.0)?;
            check(&format!("softmax {cols}"), dev, std::slice::from_ref(&x), 2.0, |t| t[0].softmax(-1));
            check(&format!("log_softmax {cols}"), dev, std::slice::from_ref(&x), 2.0, |t| t[0].log_softmax(-1));
            check(&format!("softmax dim0 {cols}"), dev, std::slice::from_ref(&x), 2.0, |t| t[0].softmax(0));
            let w = randn(&mut rng, &[cols], d);
            let b = randn(&mut rng, &[cols], d);
            check(&format!("layer_norm {cols}"), dev, &[x.clone(), w.clone(), b.clone()], 4.0, |t| {
                t[0].layer_norm(Some(&t[1]), Some(&t[2]), 1e-5)
            });
            check(&format!("layer_norm bare {cols}"), dev, std::slice::from_ref(&x), 4.0, |t| {
                t[0].layer_norm(None, None, 1e-5)
            });
        }
    }
    Ok(())
}

#[test]
fn matmul_shapes_and_dtypes() -> Result<()> {
    let Some(dev) = gpu() else { return Ok(()) };
    let mut rng = Rng::new(6);
    let cases: Vec<(Vec<usize>, Vec<usize>)> = vec![
        (vec![33, 47], vec![47, 29]),
        (vec![4, 33, 47], vec![4, 47, 29]),
        (vec![2, 1, 8, 16], vec![3, 16, 5]),
        (vec![47], vec![47, 29]),
        (vec![33, 47], vec![47]),
        (vec![1, 64], vec![64, 1]),
    ];
    for d in FLOATS {
        let scale = 50.0;
        for (sa, sb) in &cases {
            let (a, b) = (randn(&mut rng, sa, d), randn(&mut rng, sb, d));
            check(&format!("matmul {sa:?} {sb:?}"), dev, &[a, b], scale, |t| t[0].matmul(&t[1]));
        }
        // Transposed operands are read in place (OP_T) and must agree too.
        let (a, b) = (randn(&mut rng, &[47, 33], d), randn(&mut rng, &[29, 47], d));
        check("matmul transposed", dev, &[a, b], scale, |t| t[0].t()?.matmul(&t[1].t()?));
        let (a, b) = (randn(&mut rng, &[3, 16, 8], d), randn(&mut rng, &[16, 5], d));
        check("matmul broadcast rhs", dev, &[a, b], scale, |t| t[0].transpose(1, 2)?.matmul(&t[1]));
    }
    Ok(())
}

#[test]
fn indexing_and_structure() -> Result<()> {
    let Some(dev) = gpu() else { return Ok(()) };
    let mut rng = Rng::new(7);
    for d in DType::ALL {
        let x = Tensor::rand_with(&mut rng, 0.0, 50.0, (5, 6, 4), DType::F32, Device::Cpu)?.to_dtype(d)?;
        let ids = Tensor::from_vec(vec![4u32, 0, 2, 2], 4, Device::Cpu)?;
        check("index_select 0", dev, &[x.clone(), ids.clone()], 1.0, |t| t[0].index_select(&t[1], 0));
        check("index_select 1", dev, &[x.clone(), ids.clone()], 1.0, |t| t[0].index_select(&t[1], 1));
        check("index_select transposed", dev, &[x.clone(), ids.clone()], 1.0, |t| {
            t[0].transpose(0, 2)?.index_select(&t[1], 2)
        });
        let gi = Tensor::from_vec((0..40i32).map(|i| i * 7 % 6).collect::<Vec<_>>(), (5, 2, 4), Device::Cpu)?;
        check("gather", dev, &[x.clone(), gi.clone()], 1.0, |t| t[0].gather(1, &t[1]));
        check("cat 0", dev, &[x.clone(), x.clone()], 1.0, |t| Tensor::cat(&[t[0].clone(), t[1].narrow(0, 1, 2)?], 0));
        check("cat 2", dev, &[x.clone(), x.clone()], 1.0, |t| Tensor::cat(&[t[0].clone(), t[1].clone()], 2));
        check("stack", dev, &[x.clone(), x.clone()], 1.0, |t| Tensor::stack(&[t[0].clone(), t[1].clone()], 1));
        check("contiguous permute", dev, std::slice::from_ref(&x), 1.0, |t| t[0].permute(&[2, 0, 1])?.contiguous());
        check("broadcast copy", dev, std::slice::from_ref(&x), 1.0, |t| {
            t[0].narrow(1, 2, 1)?.broadcast_as((5, 3, 4))?.contiguous()
        });
        // In place, into rows 1..5 of a larger buffer (the view's offset honoured), ids unique.
        let rows = Tensor::rand_with(&mut rng, 0.0, 9.0, (5, 3, 4), DType::F32, Device::Cpu)?.to_dtype(d)?;
        let into = Tensor::from_vec(vec![3u32, 0, 2], 3, Device::Cpu)?;
        check("index_copy_", dev, &[x.clone(), into, rows], 1.0, |t| {
            let buf = t[0].transpose(0, 1)?.contiguous()?.reshape((6, 5, 4))?;
            let view = buf.narrow(0, 1, 5)?;
            view.index_copy_(0, &t[1].to_dtype(DType::I32)?, &t[2].transpose(0, 1)?.narrow(0, 0, 3)?.contiguous()?)?;
            Ok(buf)
        });
        if matches!(d, DType::U8 | DType::I8) {
            continue;
        }
        let src = Tensor::rand_with(&mut rng, 0.0, 9.0, (5, 4, 4), DType::F32, Device::Cpu)?.to_dtype(d)?;
        check("index_add", dev, &[x.clone(), ids.clone(), src.clone()], 1.0, |t| t[0].index_add(&t[1], &t[2], 1));
        let s2 = Tensor::rand_with(&mut rng, 0.0, 9.0, (5, 2, 4), DType::F32, Device::Cpu)?.to_dtype(d)?;
        check("scatter_add", dev, &[x.clone(), gi.clone(), s2], 1.0, |t| t[0].scatter_add(1, &t[1], &t[2]));
    }
    // Out-of-range ids are checked on the device: tests/cuda_device_checks.rs (its own binary, as
    // the error reaches whichever host read comes next).
    let g = on(&Tensor::zeros((3, 2), DType::F32, Device::Cpu)?, dev);
    let cpu = Tensor::zeros((3, 2), DType::F32, Device::Cpu)?;
    assert!(matches!(g.add(&cpu), Err(Error::DeviceMismatch { .. })));
    Ok(())
}

/// The gradient of `f(x)` with respect to `x` (a fresh leaf per call).
fn grad_of(x: &Tensor, f: impl Fn(&Tensor) -> Result<Tensor>) -> Result<Tensor> {
    let v = x.requires_grad();
    let g = f(&v)?.backward()?;
    g.get(&v).cloned().ok_or_else(|| Error::Backward("missing grad".into()))
}

#[test]
fn cross_entropy_fused() -> Result<()> {
    let Some(dev) = gpu() else { return Ok(()) };
    let mut rng = Rng::new(11);
    // Warp-per-row (cols <= 1024) and block-per-row shapes, ragged and aligned columns.
    for &(n, c) in &[(7usize, 5usize), (33, 40), (5, 1024), (9, 1500), (3, 5000)] {
        let raw: Vec<i32> = (0..n as i32).map(|i| if i % 4 == 2 { -100 } else { (i * 7 + 3) % c as i32 }).collect();
        let ti = Tensor::from_vec(raw.clone(), n, Device::Cpu)?;
        let tu = Tensor::from_vec(
            raw.iter().map(|&v| v.rem_euclid(c as i32) as u8 as u32).collect::<Vec<_>>(),
            n,
            Device::Cpu,
        )?;
        let tb = Tensor::from_vec(
            raw.iter().map(|&v| v.rem_euclid(c.min(200) as i32) as u8).collect::<Vec<_>>(),
            n,
            Device::Cpu,
        )?;
        for d in FLOATS {
            let x = randn(&mut rng, &[n, c], d).mul_scalar(2.0)?;
            let xt = randn(&mut rng, &[c, n], d).mul_scalar(2.0)?;
            let what = |s: &str| format!("cross_entropy {s} [{n}, {c}]");
            check(&what("i32 ignore"), dev, &[x.clone(), ti.clone()], 2.0, |t| t[0].cross_entropy(&t[1], Some(-100)));
            check(&what("u32"), dev, &[x.clone(), tu.clone()], 2.0, |t| t[0].cross_entropy(&t[1], None));
            check(&what("u8 ignore a class"), dev, &[x.clone(), tb.clone()], 2.0, |t| {
                t[0].cross_entropy(&t[1], Some(1))
            });
            check(&what("transposed"), dev, &[xt.clone(), ti.clone()], 2.0, |t| {
                t[0].t()?.cross_entropy(&t[1], Some(-100))
            });
            check(&what("backward ignore"), dev, &[x.clone(), ti.clone()], 4.0, |t| {
                grad_of(&t[0], |v| v.cross_entropy(&t[1], Some(-100))?.mul_scalar(3.0))
            });
            check(&what("backward transposed"), dev, &[xt.clone(), tu.clone()], 4.0, |t| {
                grad_of(&t[0], |v| v.t()?.cross_entropy(&t[1], None))
            });
            check(&what("acc transposed"), dev, &[xt.clone(), ti.clone()], 2.0, |t| {
                t[0].t()?.cross_entropy_acc(&t[1], Some(-100))
            });
            check(&what("acc backward"), dev, &[x.clone(), tu.clone()], 4.0, |t| {
                grad_of(&t[0], |v| v.cross_entropy_acc(&t[1], None))
            });
        }
    }
    // An ignored row of all -inf: no NaN; every row ignored: NaN loss, zero gradient.
    let ninf = f32::NEG_INFINITY;
    for d in FLOATS {
        let x = Tensor::from_vec(vec![1.0f32, 2.0, 0.5, ninf, ninf, ninf], (2, 3), Device::Cpu)?.to_dtype(d)?;
        let t = Tensor::from_vec(vec![1i32, -100], 2, Device::Cpu)?;
        check("cross_entropy -inf ignored row", dev, &[x.clone(), t.clone()], 1.0, |t| {
            t[0].cross_entropy(&t[1], Some(-100))
        });
        check("cross_entropy -inf ignored row backward", dev, &[x.clone(), t.clone()], 1.0, |t| {
            grad_of(&t[0], |v| v.cross_entropy(&t[1], Some(-100)))
        });
        let all = Tensor::from_vec(vec![-100i32, -100], 2, Device::Cpu)?;
        check("cross_entropy all ignored", dev, &[x.clone(), all.clone()], 1.0, |t| {
            t[0].cross_entropy(&t[1], Some(-100))
        });
        check("cross_entropy all ignored backward", dev, &[x.clone(), all], 1.0, |t| {
            grad_of(&t[0], |v| v.cross_entropy(&t[1], Some(-100)))
        });
    }
    // Out-of-range targets: tests/cuda_device_checks.rs.
    let x = on(&Tensor::zeros((2, 4), DType::F32, Device::Cpu)?, dev);
    let cpu_t = Tensor::from_vec(vec![1u32, 2], 2, Device::Cpu)?;
    assert!(matches!(x.cross_entropy(&cpu_t, None), Err(Error::DeviceMismatch { .. })));
    Ok(())
}

#[test]
fn backward_matches_cpu() -> Result<()> {
    let Some(dev) = gpu() else { return Ok(()) };
    let mut rng = Rng::new(8);
    let x = randn(&mut rng, &[16, 24], DType::F32);
    let w1 = randn(&mut rng, &[24, 32], DType::F32).mul_scalar(0.2)?;
    let g = randn(&mut rng, &[32], DType::F32);
    let b = randn(&mut rng, &[32], DType::F32);
    let w2 = randn(&mut rng, &[32, 10], DType::F32).mul_scalar(0.2)?;
    let emb = randn(&mut rng, &[20, 24], DType::F32);
    let tok = Tensor::from_vec((0..16u32).map(|i| i * 3 % 20).collect::<Vec<_>>(), 16, Device::Cpu)?;
    let y = Tensor::from_vec((0..16u32).map(|i| i % 10).collect::<Vec<_>>(), 16, Device::Cpu)?;
    let run = |d: Device| -> Result<Vec<Tensor>> {
        let leaves: Vec<Tensor> = [&x, &w1, &g, &b, &w2, &emb].iter().map(|t| on(t, d).requires_grad()).collect();
        let [x, w1, g, b, w2, emb] = &leaves[..] else { unreachable!() };
        let h = x.add(&emb.embedding(&on(&tok, d))?)?.matmul(w1)?.gelu()?;
        let h = h.layer_norm(Some(g), Some(b), 1e-5)?.silu()?.maximum(&h.tanh()?)?;
        let logits = h.matmul(w2)?;
        let loss = logits.cross_entropy(&on(&y, d), Some(3))?.add(&logits.softmax(-1)?.sqr()?.mean_all()?)?;
        let grads = loss.backward()?;
        let mut out = vec![loss];
        for l in &leaves {
            out.push(grads.get(l).cloned().ok_or_else(|| Error::Backward("missing grad".into()))?);
        }
        Ok(out)
    };
    let (c, gg) = (run(Device::Cpu)?, run(dev)?);
    for (i, (a, b)) in c.iter().zip(&gg).enumerate() {
        assert_close(&format!("backward output {i}"), a, b, 20.0);
    }
    Ok(())
}

#[test]
fn out_of_memory_is_an_error_and_keeps_tensors() -> Result<()> {
    let Some(dev) = gpu() else { return Ok(()) };
    let cd = CudaDevice::get(0)?;
    let keep = Tensor::randn_with(&mut Rng::new(9), 0.0, 1.0, 1 << 20, DType::F32, dev)?;
    let before = keep.to_vec::<f32>()?;
    let reserved = cd.memory_stats().reserved_bytes.current;
    cd.set_memory_limit(Some(reserved + (64 << 20)));
    let big = Tensor::zeros(1usize << 30, DType::F32, dev);
    cd.set_memory_limit(None);
    match big {
        Err(Error::OutOfMemory { requested, .. }) => assert_eq!(requested, 4 << 30),
        other => panic!("expected OutOfMemory, got {other:?}"),
    }
    assert_eq!(keep.to_vec::<f32>()?, before);
    // The failed allocation emptied the cache, so the first small tensor takes a fresh segment.
    drop(Tensor::zeros(1000, DType::F32, dev)?);
    let s0 = cd.memory_stats();
    for _ in 0..10 {
        let t = Tensor::zeros(1000, DType::F32, dev)?;
        drop(t);
    }
    assert_eq!(cd.memory_stats().device_allocs, s0.device_allocs, "cached blocks are reused");
    Ok(())
}

/// A model's kernel named like a core kernel (`fill_b32`, which `Tensor::full` launches) is its
/// own: kernels are cached by (module, name), not by name alone.
#[test]
fn a_model_kernel_named_like_a_core_kernel_is_its_own() -> Result<()> {
    use ferrograd_core::cuda::modules::Module;
    const SHADOW: Module = Module::new(
        "shadow_test",
        r#"extern "C" __global__ void fill_b32(unsigned int* p, unsigned long long bits, unsigned long long n) {
             for (unsigned long long i = threadIdx.x; i < n; i += blockDim.x) p[i] = 7u + (unsigned int)bits;
           }"#,
    );
    let Some(dev) = gpu() else { return Ok(()) };
    let cd = CudaDevice::get(0)?;
    let out = Tensor::full(3.0, 40, DType::U32, dev)?;
    assert_eq!(out.to_vec::<u32>()?, vec![3; 40], "core fill_b32");
    let (mut p, mut bits, mut n) = (out.cuda_ptr()?, 100u64, 40u64);
    let arg = |v: &mut u64| v as *mut u64 as *mut std::ffi::c_void;
    // SAFETY: the arguments match the kernel above; `out` holds 40 u32.
    unsafe { cd.launch_raw(&SHADOW, "fill_b32", 1, 32, 0, &mut [arg(&mut p), arg(&mut bits), arg(&mut n)])? };
    assert_eq!(out.to_vec::<u32>()?, vec![107; 40], "the model's fill_b32");
    assert_eq!(Tensor::full(5.0, 40, DType::U32, dev)?.to_vec::<u32>()?, vec![5; 40], "core fill_b32 again");
    // Another module under a taken name is a typed error, not the wrong kernel.
    const IMPOSTOR: Module = Module::new("shadow_test", "extern \"C\" __global__ void other() {}");
    let e = unsafe { cd.launch_raw(&IMPOSTOR, "other", 1, 32, 0, &mut []) }.unwrap_err();
    assert!(e.to_string().contains("two different kernel modules"), "{e}");
    Ok(())
}
