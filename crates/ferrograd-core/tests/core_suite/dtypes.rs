//! Every dtype: creation, casts between every pair, elementwise ops and reductions where they make
//! sense, half-precision matmul against f32, and the Philox generator behind rand/randn.
//!
//! One backend suite (`backend_tests!`): each check runs as `on_cpu::NAME` and, on a GPU machine,
//! as `on_cuda::NAME` with its tensors made on the device; tolerances are per dtype (the process-
//! global generator's check runs on the CPU only: two instances would race on its state).

use crate::common;

use common::dev;
use ferrograd_core::rng::{philox4x32_10, uniform_at};
use ferrograd_core::{bf16, f16, DType, Device, Error, Result, Rng, Tensor, WithDType};

backend_tests!(
    creation_in_every_dtype,
    casts_between_every_pair,
    lossy_casts_round_and_saturate,
    arithmetic_in_every_dtype,
    transcendental_ops_on_floats_only,
    reductions_in_every_dtype,
    half_matmul_matches_f32,
    philox_same_seed_same_numbers,
    philox_known_answer_at_the_tensor_level,
    rand_is_in_range_and_randn_has_the_right_moments,
    backward_in_every_float_dtype_matches_f64,
    cross_entropy_acc_keeps_the_mean_in_the_accumulation_dtype,
);

const ALL: [DType; 8] = DType::ALL;

fn floats() -> [DType; 4] {
    [DType::F32, DType::F64, DType::F16, DType::BF16]
}

fn signed(d: DType) -> bool {
    !matches!(d, DType::U32 | DType::U8)
}

/// Values that every dtype holds exactly (bf16 has 8 significant bits, i8 tops out at 127).
const EXACT: [f64; 8] = [0.0, 1.0, 2.0, 3.0, 5.0, 7.0, 100.0, 127.0];

fn t(v: &[f64], d: DType) -> Tensor {
    Tensor::from_vec(v.to_vec(), v.len(), dev()).unwrap().to_dtype(d).unwrap()
}

// ---- creation -----------------------------------------------------------------------------------

fn from_vec_round_trip<T: WithDType>(vals: &[f64]) -> Result<()> {
    let data: Vec<T> = vals.iter().map(|&v| T::from_f64(v)).collect();
    let x = Tensor::from_vec(data.clone(), (2, vals.len() / 2), dev())?;
    assert_eq!(x.dtype(), T::DTYPE);
    assert_eq!(x.dims(), &[2, vals.len() / 2]);
    assert_eq!(x.to_vec::<T>()?, data);
    assert_eq!(x.to_f64_vec()?, vals);
    let s = Tensor::from_slice(&data, vals.len(), dev())?;
    assert_eq!(s.to_vec::<T>()?, data);
    assert_eq!(Tensor::scalar(data[3], dev())?.item::<T>()?, data[3]);
    Ok(())
}

fn creation_in_every_dtype() -> Result<()> {
    for d in ALL {
        let z = Tensor::zeros((2, 3), d, dev())?;
        assert_eq!((z.dtype(), z.dims()), (d, &[2usize, 3][..]));
        assert_eq!(z.to_f64_vec()?, vec![0.0; 6], "{d}");
        assert_eq!(Tensor::ones(4, d, dev())?.to_f64_vec()?, vec![1.0; 4], "{d}");
        assert_eq!(Tensor::full(7.0, (1, 2), d, dev())?.to_f64_vec()?, vec![7.0; 2], "{d}");
        assert_eq!(Tensor::arange(0.0, 5.0, 1.0, d, dev())?.to_f64_vec()?, vec![0.0, 1.0, 2.0, 3.0, 4.0], "{d}");
        assert_eq!(Tensor::arange(10.0, 2.0, -3.0, d, dev())?.to_f64_vec()?, vec![10.0, 7.0, 4.0], "{d}");
        assert_eq!(Tensor::arange(3.0, 3.0, 1.0, d, dev())?.elem_count(), 0, "{d}");
        assert_eq!(z.zeros_like()?.dtype(), d);
        assert_eq!(z.ones_like()?.to_f64_vec()?, vec![1.0; 6]);
        assert_eq!(z.full_like(3.0)?.to_f64_vec()?, vec![3.0; 6]);
        assert_eq!(Tensor::zeros((), d, dev())?.item_f64()?, 0.0);
        assert_eq!(Tensor::zeros((0, 3), d, dev())?.to_f64_vec()?, Vec::<f64>::new());
    }
    let fl = Tensor::arange(0.0, 1.0, 0.25, DType::F32, dev())?.to_vec::<f32>()?;
    assert_eq!(fl, vec![0.0, 0.25, 0.5, 0.75]);
    let v = [0.0, 1.0, 2.0, 3.0, 5.0, 7.0];
    from_vec_round_trip::<f32>(&v)?;
    from_vec_round_trip::<f64>(&v)?;
    from_vec_round_trip::<f16>(&v)?;
    from_vec_round_trip::<bf16>(&v)?;
    from_vec_round_trip::<i32>(&[-5.0, 1.0, 2.0, 3.0, 1e9, -7.0])?;
    from_vec_round_trip::<u32>(&[0.0, 1.0, 2.0, 3.0, 4e9, 7.0])?;
    from_vec_round_trip::<u8>(&[0.0, 1.0, 2.0, 3.0, 255.0, 7.0])?;
    from_vec_round_trip::<i8>(&[-128.0, 1.0, 2.0, 3.0, 127.0, -7.0])?;
    Ok(())
}

#[test]
fn dtype_names_and_sizes() {
    for d in ALL {
        assert_eq!(d.as_str().parse::<DType>().unwrap(), d);
        assert_eq!(d.to_string(), d.as_str());
    }
    let sizes: Vec<usize> = ALL.iter().map(|d| d.size_in_bytes()).collect();
    assert_eq!(sizes, vec![4, 8, 2, 2, 4, 4, 1, 1]);
    assert!(matches!("f8".parse::<DType>(), Err(Error::InvalidArgument(_))));
}

// ---- casts --------------------------------------------------------------------------------------

fn casts_between_every_pair() -> Result<()> {
    for from in ALL {
        let x = t(&EXACT, from);
        for to in ALL {
            let y = x.to_dtype(to)?;
            assert_eq!(y.dtype(), to);
            assert_eq!(y.to_f64_vec()?, EXACT.to_vec(), "{from} -> {to}");
            // And back, through a strided view of the source.
            let xt = x.reshape((2, 4))?.t()?;
            let back = xt.to_dtype(to)?.to_dtype(from)?;
            assert_eq!(back.to_f64_vec()?, xt.to_f64_vec()?, "{from} -> {to} -> {from} (strided)");
        }
    }
    // Negative values among the signed dtypes.
    let neg = [-1.0, -2.0, -100.0, -128.0];
    for from in ALL.into_iter().filter(|&d| signed(d)) {
        for to in ALL.into_iter().filter(|&d| signed(d)) {
            assert_eq!(t(&neg, from).to_dtype(to)?.to_f64_vec()?, neg.to_vec(), "{from} -> {to}");
        }
    }
    Ok(())
}

fn lossy_casts_round_and_saturate() -> Result<()> {
    // Float to int truncates toward zero and saturates, like Rust's `as` (and the CUDA kernels).
    let x = Tensor::from_vec(vec![2.7f32, -2.7, 300.0, -300.0, 1e10, f32::NAN], 6, dev())?;
    assert_eq!(x.to_dtype(DType::I32)?.to_vec::<i32>()?, vec![2, -2, 300, -300, i32::MAX, 0]);
    assert_eq!(x.to_dtype(DType::U8)?.to_vec::<u8>()?, vec![2, 0, 255, 0, 255, 0]);
    assert_eq!(x.to_dtype(DType::I8)?.to_vec::<i8>()?, vec![2, -2, 127, -128, 127, 0]);
    assert_eq!(x.to_dtype(DType::U32)?.to_vec::<u32>()?, vec![2, 0, 300, 0, u32::MAX, 0]);
    // Int to int saturates too.
    let i = Tensor::from_vec(vec![-1i32, 256, 70000], 3, dev())?;
    assert_eq!(i.to_dtype(DType::U8)?.to_vec::<u8>()?, vec![0, 255, 255]);
    // f32 -> f16/bf16 rounds to nearest.
    let f = Tensor::from_vec(vec![1.0f32 + 1.0 / 4096.0, 65504.0, 1e6, 1.0 / 3.0], 4, dev())?;
    let h = f.to_dtype(DType::F16)?.to_vec::<f16>()?;
    assert_eq!(h[0], f16::from_f32(1.0 + 1.0 / 4096.0));
    assert_eq!(h[1], f16::MAX);
    assert!(h[2].is_infinite());
    let b = f.to_dtype(DType::BF16)?.to_vec::<bf16>()?;
    assert_eq!(b[3], bf16::from_f32(1.0 / 3.0));
    assert!((b[2].to_f32() - 1e6).abs() / 1e6 < 4e-3);
    // f16 -> bf16 and back keep values both can hold.
    let hb = Tensor::from_vec(vec![f16::from_f32(0.5), f16::from_f32(-3.0)], 2, dev())?;
    assert_eq!(hb.to_dtype(DType::BF16)?.to_dtype(DType::F16)?.to_vec::<f16>()?, hb.to_vec::<f16>()?);
    Ok(())
}

// ---- elementwise --------------------------------------------------------------------------------

fn arithmetic_in_every_dtype() -> Result<()> {
    for d in ALL {
        let a = t(&[6.0, 7.0, 9.0, 100.0], d);
        let b = t(&[3.0, 2.0, 4.0, 10.0], d);
        assert_eq!(a.add(&b)?.to_f64_vec()?, vec![9.0, 9.0, 13.0, 110.0], "{d} add");
        assert_eq!(a.sub(&b)?.to_f64_vec()?, vec![3.0, 5.0, 5.0, 90.0], "{d} sub");
        assert_eq!(a.narrow(0, 0, 3)?.mul(&b.narrow(0, 0, 3)?)?.to_f64_vec()?, vec![18.0, 14.0, 36.0], "{d} mul");
        let div = a.div(&b)?.to_f64_vec()?;
        if d.is_float() {
            assert_eq!(div, vec![2.0, 3.5, 2.25, 10.0], "{d} div");
        } else {
            assert_eq!(div, vec![2.0, 3.0, 2.0, 10.0], "{d} integer division truncates");
        }
        assert_eq!(a.maximum(&b.mul_scalar(3.0)?)?.to_f64_vec()?, vec![9.0, 7.0, 12.0, 100.0], "{d} maximum");
        assert_eq!(a.minimum(&b.mul_scalar(3.0)?)?.to_f64_vec()?, vec![6.0, 6.0, 9.0, 30.0], "{d} minimum");
        assert_eq!(a.add_scalar(1.0)?.to_f64_vec()?, vec![7.0, 8.0, 10.0, 101.0], "{d} add_scalar");
        assert_eq!(a.sqr()?.narrow(0, 0, 2)?.to_f64_vec()?, vec![36.0, 49.0], "{d} sqr");
        assert_eq!(a.clamp(7.0, 9.0)?.to_f64_vec()?, vec![7.0, 7.0, 9.0, 9.0], "{d} clamp");
        // Broadcasting against a scalar of the same dtype.
        assert_eq!(a.add(&a.scalar_like(1.0)?)?.to_f64_vec()?, vec![7.0, 8.0, 10.0, 101.0], "{d}");
        // Comparisons give u8 masks.
        let lt = a.lt(&b.mul_scalar(3.0)?)?;
        assert_eq!(lt.dtype(), DType::U8);
        assert_eq!(lt.to_vec::<u8>()?, vec![1, 0, 1, 0], "{d} lt");
        assert_eq!(a.eq(&a)?.to_vec::<u8>()?, vec![1; 4]);
        assert_eq!(a.ne(&b)?.to_vec::<u8>()?, vec![1; 4]);
        assert_eq!(a.ge(&b)?.to_vec::<u8>()?, vec![1; 4]);
        assert_eq!(a.le(&b)?.to_vec::<u8>()?, vec![0; 4]);
        assert_eq!(a.gt(&a)?.to_vec::<u8>()?, vec![0; 4]);
        // where_cond with a mask of another dtype.
        assert_eq!(lt.where_cond(&a, &b)?.to_f64_vec()?, vec![6.0, 2.0, 9.0, 10.0], "{d} where");
        assert_eq!(a.masked_fill(&lt, 1.0)?.to_f64_vec()?, vec![1.0, 7.0, 1.0, 100.0], "{d} masked_fill");
        if signed(d) {
            let n = t(&[-3.0, 0.0, 2.0], d);
            assert_eq!(n.neg()?.to_f64_vec()?, vec![3.0, 0.0, -2.0], "{d} neg");
            assert_eq!(n.abs()?.to_f64_vec()?, vec![3.0, 0.0, 2.0], "{d} abs");
            assert_eq!(n.relu()?.to_f64_vec()?, vec![0.0, 0.0, 2.0], "{d} relu");
            assert_eq!(n.sign()?.to_f64_vec()?, vec![-1.0, 0.0, 1.0], "{d} sign");
        }
    }
    Ok(())
}

type RefFn = fn(f64) -> f64;

fn transcendental_ops_on_floats_only() -> Result<()> {
    let x = [0.5, 1.0, 1.5, 2.0];
    for d in floats() {
        let tol = match d {
            DType::F64 => 1e-14,
            DType::F32 => 1e-6,
            DType::F16 => 2e-3,
            _ => 1.6e-2,
        };
        let a = t(&x, d);
        let cases: [(&str, Tensor, RefFn); 8] = [
            ("exp", a.exp()?, f64::exp),
            ("log", a.log()?, f64::ln),
            ("sqrt", a.sqrt()?, f64::sqrt),
            ("rsqrt", a.rsqrt()?, |v| 1.0 / v.sqrt()),
            ("tanh", a.tanh()?, f64::tanh),
            ("sigmoid", a.sigmoid()?, |v| 1.0 / (1.0 + (-v).exp())),
            ("sin", a.sin()?, f64::sin),
            ("powf", a.powf(1.5)?, |v| v.powf(1.5)),
        ];
        for (name, y, f) in cases {
            assert_eq!(y.dtype(), d);
            for (got, &v) in y.to_f64_vec()?.iter().zip(&x) {
                let want = f(v);
                assert!((got - want).abs() <= tol * want.abs().max(1.0), "{d} {name}({v}) = {got}, want {want}");
            }
        }
    }
    for d in [DType::I32, DType::U32, DType::U8, DType::I8] {
        let a = t(&[1.0, 2.0], d);
        for (name, r) in [("exp", a.exp()), ("log", a.log()), ("tanh", a.tanh()), ("gelu", a.gelu())] {
            assert!(matches!(r, Err(Error::UnsupportedDType { dtype, .. }) if dtype == d), "{d} {name}");
        }
        assert!(matches!(a.softmax(0usize), Err(Error::UnsupportedDType { .. })), "{d} softmax");
    }
    Ok(())
}

// ---- reductions ---------------------------------------------------------------------------------

fn reductions_in_every_dtype() -> Result<()> {
    let vals = [3.0, 1.0, 4.0, 1.0, 5.0, 9.0, 2.0, 6.0];
    for d in ALL {
        let x = t(&vals, d).reshape((2, 4))?;
        assert_eq!(x.sum(1usize, false)?.to_f64_vec()?, vec![9.0, 22.0], "{d} sum");
        assert_eq!(x.sum(0usize, true)?.to_f64_vec()?, vec![8.0, 10.0, 6.0, 7.0], "{d} sum 0");
        assert_eq!(x.sum_all()?.item_f64()?, 31.0, "{d} sum_all");
        assert_eq!(x.sum_all()?.dtype(), d);
        assert_eq!(x.max(1usize, false)?.to_f64_vec()?, vec![4.0, 9.0], "{d} max");
        assert_eq!(x.min(0usize, false)?.to_f64_vec()?, vec![3.0, 1.0, 2.0, 1.0], "{d} min");
        assert_eq!(x.t()?.max(0usize, false)?.to_f64_vec()?, vec![4.0, 9.0], "{d} max of transposed");
        assert_eq!(x.argmax(1usize, false)?.to_vec::<u32>()?, vec![2, 1], "{d} argmax");
        assert_eq!(x.argmin(1usize, true)?.to_vec::<u32>()?, vec![1, 2], "{d} argmin (first of ties)");
        assert_eq!(x.argmin(1usize, true)?.dims(), &[2, 1]);
        if d.is_float() {
            assert_eq!(x.mean(1usize, false)?.to_f64_vec()?, vec![2.25, 5.5], "{d} mean");
            let v = x.var(1usize, false, false)?.to_f64_vec()?;
            let tol = if d == DType::BF16 { 2e-2 } else { 1e-3 };
            assert!((v[0] - 1.6875).abs() < tol && (v[1] - 6.25).abs() < tol * 7.0, "{d} var {v:?}");
            let lse = x.logsumexp(1usize, false)?.to_f64_vec()?;
            let want = vals[..4].iter().map(|v: &f64| v.exp()).sum::<f64>().ln();
            assert!((lse[0] - want).abs() < 3e-2, "{d} logsumexp");
        }
    }
    // A million 0.1s add to 100000 within f32 rounding: the CPU accumulates f32 in f64; CUDA in
    // f32 over a tree of per-thread and per-block sums, whose error grows with the log of the
    // length rather than the length (1e-5 relative here).
    let big = Tensor::full(0.1, 1_000_000, DType::F32, dev())?;
    let s = big.sum_all()?.item::<f32>()?;
    let bound = if dev() == Device::Cpu { 0.05 } else { 1.0 };
    assert!((s - 100_000.0).abs() < bound, "{s}");
    let bh = Tensor::ones(4096, DType::BF16, dev())?.sum_all()?.item::<bf16>()?;
    assert_eq!(bh.to_f32(), 4096.0);
    Ok(())
}

// ---- matmul in half precision -------------------------------------------------------------------

fn half_matmul_matches_f32() -> Result<()> {
    let mut rng = Rng::new(21);
    // Shapes include a batch, a transposed operand and a size past gemm's small-matrix path.
    for (ad, bd, trans) in [
        (vec![8, 16], vec![16, 5], false),
        (vec![3, 7, 9], vec![9, 4], false),
        (vec![2, 5, 6], vec![2, 6, 3], true),
        (vec![100, 120], vec![120, 90], false),
    ] {
        let a32 = Tensor::randn_with(&mut rng, 0.0, 1.0, ad.clone(), DType::F32, dev())?;
        let b32 = Tensor::randn_with(&mut rng, 0.0, 1.0, bd.clone(), DType::F32, dev())?;
        let b32 = if trans { b32.transpose(-2, -1)?.contiguous()?.transpose(-2, -1)? } else { b32 };
        for (d, tol) in [(DType::F16, 2e-3), (DType::BF16, 1e-2)] {
            // Compare against f32 on the same rounded inputs: only the product's rounding differs.
            let (a, b) = (a32.to_dtype(d)?, b32.to_dtype(d)?);
            let want = a.to_dtype(DType::F32)?.matmul(&b.to_dtype(DType::F32)?)?.to_vec::<f32>()?;
            let got = a.matmul(&b)?;
            assert_eq!(got.dtype(), d);
            let got = got.to_f64_vec()?;
            let k = ad[ad.len() - 1] as f64;
            for (g, w) in got.iter().zip(&want) {
                let w = *w as f64;
                assert!((g - w).abs() <= tol * (w.abs() + k.sqrt()), "{d} {ad:?}x{bd:?}: {g} vs {w}");
            }
        }
    }
    // Integer matmul is not supported.
    let i = Tensor::ones((2, 2), DType::I32, dev())?;
    assert!(matches!(i.matmul(&i), Err(Error::UnsupportedDType { .. })));
    Ok(())
}

// ---- Philox -------------------------------------------------------------------------------------

fn philox_same_seed_same_numbers() -> Result<()> {
    for d in floats() {
        let a = Tensor::rand_with(&mut Rng::new(42), -1.0, 1.0, (7, 9), d, dev())?.to_f64_vec()?;
        let b = Tensor::rand_with(&mut Rng::new(42), -1.0, 1.0, (7, 9), d, dev())?.to_f64_vec()?;
        assert_eq!(a, b, "{d}");
        let c = Tensor::rand_with(&mut Rng::new(43), -1.0, 1.0, (7, 9), d, dev())?.to_f64_vec()?;
        assert!(a.iter().zip(&c).filter(|(x, y)| x != y).count() > 50, "{d}: seeds 42 and 43 agree");
        let n1 = Tensor::randn_with(&mut Rng::new(42), 0.0, 1.0, 63, d, dev())?.to_f64_vec()?;
        let n2 = Tensor::randn_with(&mut Rng::new(42), 0.0, 1.0, 63, d, dev())?.to_f64_vec()?;
        assert_eq!(n1, n2, "{d}");
    }
    // Successive draws from one stream differ, and draws of 4 line up with one draw of 8 (each
    // draw consumes whole 4-value blocks).
    let mut r = Rng::new(7);
    let a = Tensor::rand_with(&mut r, 0.0, 1.0, 4, DType::F64, dev())?.to_vec::<f64>()?;
    let b = Tensor::rand_with(&mut r, 0.0, 1.0, 4, DType::F64, dev())?.to_vec::<f64>()?;
    assert_ne!(a, b);
    let ab = Tensor::rand_with(&mut Rng::new(7), 0.0, 1.0, 8, DType::F64, dev())?.to_vec::<f64>()?;
    assert_eq!([a, b].concat(), ab);
    // A draw of 3 still consumes a whole block.
    let mut r = Rng::new(7);
    Tensor::rand_with(&mut r, 0.0, 1.0, 3, DType::F64, dev())?;
    let next = Tensor::rand_with(&mut r, 0.0, 1.0, 4, DType::F64, dev())?.to_vec::<f64>()?;
    assert_eq!(next, ab[4..].to_vec());
    Ok(())
}

fn philox_known_answer_at_the_tensor_level() -> Result<()> {
    // Random123's test vector: philox4x32_10(ctr 0, key 0) = 6627e8d5 e169c58d bc57ac4c 9b00dbd8.
    let block = philox4x32_10([0; 4], [0; 2]);
    assert_eq!(block, [0x6627e8d5, 0xe169c58d, 0xbc57ac4c, 0x9b00dbd8]);
    let u = Tensor::rand_with(&mut Rng::new(0), 0.0, 1.0, 4, DType::F64, dev())?.to_vec::<f64>()?;
    let want: Vec<f64> = block.iter().map(|&x| (x >> 8) as f64 / 16_777_216.0).collect();
    assert_eq!(u, want);
    assert_eq!(u[1], uniform_at(0, 0, 1));
    Ok(())
}

fn rand_is_in_range_and_randn_has_the_right_moments() -> Result<()> {
    let n = 200_000;
    let mut rng = Rng::new(1234);
    for d in floats() {
        let u = Tensor::rand_with(&mut rng, -2.0, 3.0, n, d, dev())?.to_f64_vec()?;
        // [lo, hi) in f32/f64; rounding to f16/bf16 may land on hi itself.
        let half = matches!(d, DType::F16 | DType::BF16);
        assert!(u.iter().all(|&v| v >= -2.0 && (v < 3.0 || (half && v == 3.0))), "{d} out of range");
        let mean = u.iter().sum::<f64>() / n as f64;
        assert!((mean - 0.5).abs() < 0.02, "{d} uniform mean {mean}");
        let z = Tensor::randn_with(&mut rng, 1.5, 2.0, n, d, dev())?.to_f64_vec()?;
        let m = z.iter().sum::<f64>() / n as f64;
        let sd = (z.iter().map(|v| (v - m) * (v - m)).sum::<f64>() / n as f64).sqrt();
        assert!((m - 1.5).abs() < 0.02 && (sd - 2.0).abs() < 0.02, "{d} normal mean {m} std {sd}");
        // Roughly 68% within one std.
        let within = z.iter().filter(|v| (*v - 1.5).abs() < 2.0).count() as f64 / n as f64;
        assert!((within - 0.6827).abs() < 0.01, "{d} {within}");
    }
    // Integer dtypes take the values truncated.
    let i = Tensor::rand_with(&mut rng, 0.0, 10.0, 1000, DType::I32, dev())?.to_vec::<i32>()?;
    assert!(i.iter().all(|v| (0..10).contains(v)) && i.contains(&9));
    Ok(())
}

#[test]
fn global_generator_is_reproducible() -> Result<()> {
    // The only test in this binary that touches the global generator.
    ferrograd_core::manual_seed(99);
    let a = Tensor::randn(0.0, 1.0, 16, DType::F32, dev())?.to_vec::<f32>()?;
    let a2 = Tensor::rand(0.0, 1.0, 16, DType::F32, dev())?.to_vec::<f32>()?;
    ferrograd_core::manual_seed(99);
    assert_eq!(Tensor::randn(0.0, 1.0, 16, DType::F32, dev())?.to_vec::<f32>()?, a);
    assert_eq!(Tensor::rand(0.0, 1.0, 16, DType::F32, dev())?.to_vec::<f32>()?, a2);
    let explicit = Tensor::randn_with(&mut Rng::new(99), 0.0, 1.0, 16, DType::F32, dev())?.to_vec::<f32>()?;
    assert_eq!(explicit, a, "manual_seed(s) is Rng::new(s)");
    Ok(())
}

// ---- autograd in every float dtype --------------------------------------------------------------

/// Gradients of a small network (matmul, bias, layer norm, gelu, softmax cross-entropy) in each
/// float dtype, against the same computation in f64 on the same (rounded) inputs.
fn backward_in_every_float_dtype_matches_f64() -> Result<()> {
    let mut rng = Rng::new(77);
    let x = Tensor::randn_with(&mut rng, 0.0, 1.0, (6, 5), DType::F64, dev())?;
    let w = Tensor::randn_with(&mut rng, 0.0, 0.5, (5, 4), DType::F64, dev())?;
    let b = Tensor::randn_with(&mut rng, 0.0, 0.5, 4, DType::F64, dev())?;
    let lw = Tensor::rand_with(&mut rng, 0.5, 1.5, 4, DType::F64, dev())?;
    let targets = Tensor::from_vec(vec![0u32, 3, 1, 2, 2, 0], 6, dev())?;
    let grads = |d: DType| -> Result<Vec<Vec<f64>>> {
        // Round the inputs to `d` first so that both runs see the same numbers.
        let leaves: Vec<Tensor> =
            [&x, &w, &b, &lw].iter().map(|t| Ok(t.to_dtype(d)?.requires_grad())).collect::<Result<_>>()?;
        let h = leaves[0].matmul(&leaves[1])?.add(&leaves[2])?;
        let h = h.layer_norm(Some(&leaves[3]), None, 1e-5)?.gelu()?.dropout_with(&mut Rng::new(3), 0.2, true)?;
        let loss = h.cross_entropy(&targets, None)?.add(&h.sqr()?.mean_all()?)?;
        let g = loss.backward()?;
        leaves
            .iter()
            .map(|l| {
                let gl = g.get(l).expect("gradient");
                assert_eq!(gl.dtype(), d, "gradient dtype");
                gl.to_f64_vec()
            })
            .collect()
    };
    for (d, tol) in [(DType::F32, 1e-5), (DType::F16, 2e-2), (DType::BF16, 8e-2)] {
        let round = |t: &Tensor| t.to_dtype(d).and_then(|t| t.to_dtype(DType::F64));
        let (xr, wr, br, lwr) = (round(&x)?, round(&w)?, round(&b)?, round(&lw)?);
        let want = {
            let leaves: Vec<Tensor> = [&xr, &wr, &br, &lwr].iter().map(|t| t.requires_grad()).collect();
            let h = leaves[0].matmul(&leaves[1])?.add(&leaves[2])?;
            let h = h.layer_norm(Some(&leaves[3]), None, 1e-5)?.gelu()?.dropout_with(&mut Rng::new(3), 0.2, true)?;
            let loss = h.cross_entropy(&targets, None)?.add(&h.sqr()?.mean_all()?)?;
            let g = loss.backward()?;
            leaves.iter().map(|l| g.get(l).unwrap().to_f64_vec()).collect::<Result<Vec<_>>>()?
        };
        for (i, (got, want)) in grads(d)?.iter().zip(&want).enumerate() {
            let scale = want.iter().fold(0.0f64, |m, v| m.max(v.abs()));
            for (g, w) in got.iter().zip(want) {
                assert!((g - w).abs() <= tol * scale, "{d} leaf {i}: {g} vs {w} (scale {scale})");
            }
        }
    }
    Ok(())
}

/// `cross_entropy_acc` on half-precision logits: the mean in f32 (what `cross_entropy` of the
/// logits cast to f32 gives, without that cast), the gradient in the logits' dtype and equal to
/// the f32 path's gradient rounded to it; f32 and f64 logits give what `cross_entropy` gives.
fn cross_entropy_acc_keeps_the_mean_in_the_accumulation_dtype() -> Result<()> {
    let mut rng = Rng::new(5);
    let (n, c) = (6, 37);
    let x = Tensor::randn_with(&mut rng, 0.0, 2.0, (n, c), DType::F32, dev())?;
    let t = Tensor::from_vec((0..n as u32).map(|i| (i * 11 + 2) % c as u32).collect::<Vec<_>>(), n, dev())?;
    for d in floats() {
        let xd = x.to_dtype(d)?.requires_grad();
        let acc = if d == DType::F64 { DType::F64 } else { DType::F32 };
        let loss = xd.cross_entropy_acc(&t, None)?;
        assert_eq!(loss.dtype(), acc, "{d}");
        let up = xd.detach().to_dtype(acc)?.requires_grad();
        let want = up.cross_entropy(&t, None)?;
        let (a, b) = (loss.item_f64()?, want.item_f64()?);
        assert!((a - b).abs() <= 1e-6 * b.abs(), "{d}: {a} vs {b}");
        let g = loss.backward()?.get(&xd).expect("gradient").clone();
        assert_eq!(g.dtype(), d, "gradient dtype");
        let gw = want.backward()?.get(&up).expect("gradient").to_dtype(d)?.to_f64_vec()?;
        let scale = gw.iter().fold(0.0f64, |m, v| m.max(v.abs()));
        let tol = if matches!(d, DType::F16 | DType::BF16) { 1e-2 } else { 1e-6 };
        for (p, q) in g.to_f64_vec()?.iter().zip(&gw) {
            assert!((p - q).abs() <= tol * scale, "{d}: gradient {p} vs {q}");
        }
    }
    Ok(())
}
