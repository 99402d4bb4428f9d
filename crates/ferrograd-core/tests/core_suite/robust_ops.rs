//! Bad input to the ops, as a property: random small tensors of every dtype (empty, scalar and
//! mismatched shapes; NaN, infinities; negative, huge and fractional values where an op wants
//! indices) through random ops with random arguments (dims out of range either way, zero and
//! oversized counts, odd epsilons and probabilities). Every call returns `Ok` or a typed error
//! with a message, never a panic; an `Ok` tensor's storage covers its layout and reads back; a
//! result that tracks gradients goes through `backward`, which is again `Ok` or an error.
//! `FERROGRAD_PROPTEST_CASES` sets the number of cases (`.ci/run` runs more). The shaped cases
//! also run on a GPU where there is one (`robust_ops_shaped_cuda`), where every case ends with a
//! device synchronization that must succeed: a kernel that read or wrote out of bounds on bad
//! indices would leave the context's sticky error there, which is an abort in all but name.

use crate::common::cuda_device;
use ferrograd_core::fused::classifier::ClassifierOpts;
use ferrograd_core::fused::linear::{linear, Activation};
use ferrograd_core::fused::selective_scan::ScanArgs;
use ferrograd_core::{AttentionOpts, DType, Device, Error, FakeQuant, Result, Tensor};
use proptest::prelude::*;

fn cases(default: u32) -> u32 {
    std::env::var("FERROGRAD_PROPTEST_CASES").ok().and_then(|v| v.parse().ok()).unwrap_or(default)
}

/// A tensor to build: dtype, dims, how to fill it, whether it is a variable. `like` ties it to the
/// first tensor of the case (its dims, its last dim, its dims reversed or its first dim; its
/// dtype, or an index dtype), so that most cases get past the shape checks into the ops' bodies.
#[derive(Debug, Clone)]
struct Spec {
    dtype: DType,
    dims: Vec<usize>,
    fill: u8,
    grad: bool,
    like: (u8, u8),
}

fn spec() -> impl Strategy<Value = Spec> {
    (0..DType::ALL.len(), prop::collection::vec(0usize..5, 0..5), 0u8..4, any::<bool>(), (0u8..6, 0u8..5))
        .prop_map(|(d, dims, fill, grad, like)| Spec { dtype: DType::ALL[d], dims, fill, grad, like })
}

/// `s` with its `like` applied against the first spec.
fn resolve(s: &Spec, first: &Spec) -> Spec {
    let f = &first.dims;
    let dims = match s.like.0 {
        1 | 2 => f.clone(),
        3 => f.last().map_or(vec![], |&k| vec![k]),
        4 => f.iter().rev().copied().collect(),
        5 => f.first().map_or(vec![], |&k| vec![k]),
        _ => s.dims.clone(),
    };
    let dtype = match s.like.1 {
        1 | 2 => first.dtype,
        3 => DType::U32,
        4 => DType::I32,
        _ => s.dtype,
    };
    Spec { dtype, dims, ..s.clone() }
}

/// Element `i` under fill kind `k`: ordinary values, specials (NaN, infinities, huge), small
/// non-negative integers (valid-looking indices), or negative and out-of-range integers.
fn value(k: u8, i: usize) -> f64 {
    match k {
        0 => (i as f64 * 0.37).sin() * 2.0,
        1 => [f64::NAN, f64::INFINITY, f64::NEG_INFINITY, 1e30, -0.0, 3.5][i % 6],
        2 => (i % 3) as f64,
        _ => [-1.0, 7.0, 1e9, 2.5, -300.0][i % 5],
    }
}

fn build(s: &Spec, device: Device) -> Result<Tensor> {
    let n: usize = s.dims.iter().product();
    let v: Vec<f64> = (0..n).map(|i| value(s.fill, i)).collect();
    let t = Tensor::from_vec(v, s.dims.clone(), device)?.to_dtype(s.dtype)?;
    Ok(if s.grad && s.dtype.is_float() { t.requires_grad() } else { t })
}

/// One op and its scalar arguments; tensors come from the case's list, picked by index.
#[derive(Debug, Clone)]
enum OpCase {
    Unary(u8),
    Binary(u8),
    Scalar(u8, f64),
    Reduce(u8, isize, bool),
    Argmax(isize, bool),
    ToDtype(usize),
    Matmul,
    Softmax(bool, isize),
    LayerNorm(u8, f64),
    AddLayerNorm(u8, f64),
    CrossEntropy(Option<i64>),
    Classifier(Option<usize>, Option<i64>),
    Mse,
    Conv1d(bool),
    Dropout(f64, bool),
    Cat(isize),
    Stack(isize),
    Chunk(usize, isize),
    IndexSelect(isize),
    IndexCopy(isize),
    Embedding,
    Gather(isize),
    IndexAdd(isize),
    ScatterAdd(isize),
    WhereCond,
    MaskedFill(f64),
    View(u8, isize, usize, usize),
    Attention(bool, Option<f64>, f64),
    Linear(u8, bool),
    BiasGelu,
    FakeQuantize(i32, i32, Option<usize>),
    Scan(bool, bool),
}

fn dim() -> impl Strategy<Value = isize> {
    -5isize..6
}

fn scalar() -> impl Strategy<Value = f64> {
    prop_oneof![Just(0.0), Just(-1.5), Just(2.0), Just(f64::NAN), Just(f64::INFINITY), Just(1e-300), Just(0.5)]
}

fn op_case() -> impl Strategy<Value = OpCase> {
    prop_oneof![
        (0u8..20).prop_map(OpCase::Unary),
        (0u8..12).prop_map(OpCase::Binary),
        (0u8..5, scalar()).prop_map(|(k, v)| OpCase::Scalar(k, v)),
        (0u8..6, dim(), any::<bool>()).prop_map(|(k, d, keep)| OpCase::Reduce(k, d, keep)),
        (dim(), any::<bool>()).prop_map(|(d, k)| OpCase::Argmax(d, k)),
        (0..DType::ALL.len()).prop_map(OpCase::ToDtype),
        Just(OpCase::Matmul),
        (any::<bool>(), dim()).prop_map(|(l, d)| OpCase::Softmax(l, d)),
        (0u8..4, scalar()).prop_map(|(k, e)| OpCase::LayerNorm(k, e)),
        (0u8..4, scalar()).prop_map(|(k, e)| OpCase::AddLayerNorm(k, e)),
        prop::option::of(-3i64..3).prop_map(OpCase::CrossEntropy),
        (prop::option::of(0usize..6), prop::option::of(-3i64..3)).prop_map(|(c, i)| OpCase::Classifier(c, i)),
        Just(OpCase::Mse),
        any::<bool>().prop_map(OpCase::Conv1d),
        (scalar(), any::<bool>()).prop_map(|(p, t)| OpCase::Dropout(p, t)),
        dim().prop_map(OpCase::Cat),
        dim().prop_map(OpCase::Stack),
        (0usize..5, dim()).prop_map(|(n, d)| OpCase::Chunk(n, d)),
        dim().prop_map(OpCase::IndexSelect),
        dim().prop_map(OpCase::IndexCopy),
        Just(OpCase::Embedding),
        dim().prop_map(OpCase::Gather),
        dim().prop_map(OpCase::IndexAdd),
        dim().prop_map(OpCase::ScatterAdd),
        Just(OpCase::WhereCond),
        scalar().prop_map(OpCase::MaskedFill),
        (0u8..8, dim(), 0usize..6, 0usize..6).prop_map(|(k, d, a, b)| OpCase::View(k, d, a, b)),
        (any::<bool>(), prop::option::of(scalar()), scalar()).prop_map(|(c, s, p)| OpCase::Attention(c, s, p)),
        (0u8..3, any::<bool>()).prop_map(|(a, b)| OpCase::Linear(a, b)),
        Just(OpCase::BiasGelu),
        (-200i32..300, -200i32..300, prop::option::of(0usize..5)).prop_map(|(a, b, x)| OpCase::FakeQuantize(a, b, x)),
        (any::<bool>(), any::<bool>()).prop_map(|(d, s)| OpCase::Scan(d, s)),
    ]
}

fn dims_of(d: isize) -> [isize; 1] {
    [d]
}

/// Runs `op` on tensors `t` (at least 5; the op takes what it needs from the front).
fn run(op: &OpCase, t: &[Tensor]) -> Result<Vec<Tensor>> {
    let (a, b, c, d, e) = (&t[0], &t[1], &t[2], &t[3], &t[4]);
    let one = |r: Result<Tensor>| r.map(|x| vec![x]);
    match *op {
        OpCase::Unary(k) => one(match k {
            0 => a.neg(),
            1 => a.abs(),
            2 => a.sqr(),
            3 => a.sign(),
            4 => a.relu(),
            5 => a.exp(),
            6 => a.log(),
            7 => a.sqrt(),
            8 => a.rsqrt(),
            9 => a.recip(),
            10 => a.tanh(),
            11 => a.sigmoid(),
            12 => a.silu(),
            13 => a.sin(),
            14 => a.cos(),
            15 => a.gelu_tanh(),
            16 => a.gelu(),
            17 => a.sum_all(),
            18 => a.mean_all(),
            _ => a.contiguous(),
        }),
        OpCase::Binary(k) => one(match k {
            0 => a.add(b),
            1 => a.sub(b),
            2 => a.mul(b),
            3 => a.div(b),
            4 => a.maximum(b),
            5 => a.minimum(b),
            6 => a.remainder(b),
            7 => a.eq(b),
            8 => a.lt(b),
            9 => a.ge(b),
            10 => a.ne(b),
            _ => a.broadcast_pair(b, "robust_ops").map(|(x, _)| x),
        }),
        OpCase::Scalar(k, v) => one(match k {
            0 => a.affine(v, v),
            1 => a.add_scalar(v),
            2 => a.mul_scalar(v),
            3 => a.powf(v),
            _ => a.clamp(v, -v),
        }),
        OpCase::Reduce(k, dd, keep) => one(match k {
            0 => a.sum(dims_of(dd), keep),
            1 => a.max(dims_of(dd), keep),
            2 => a.min(dims_of(dd), keep),
            3 => a.mean(dims_of(dd), keep),
            4 => a.var(dims_of(dd), keep, keep),
            _ => a.logsumexp([dd, dd], keep),
        }),
        OpCase::Argmax(dd, keep) => one(if keep { a.argmax(dd, keep) } else { a.argmin(dd, keep) }),
        OpCase::ToDtype(i) => one(a.to_dtype(DType::ALL[i])),
        OpCase::Matmul => one(a.matmul(b)),
        OpCase::Softmax(log, dd) => one(if log { a.log_softmax(dd) } else { a.softmax(dd) }),
        OpCase::LayerNorm(k, eps) => one(a.layer_norm((k & 1 == 1).then_some(b), (k & 2 == 2).then_some(c), eps)),
        OpCase::AddLayerNorm(k, eps) => {
            a.add_layer_norm(b, (k & 1 == 1).then_some(c), (k & 2 == 2).then_some(d), eps).map(|(x, y)| vec![x, y])
        }
        OpCase::CrossEntropy(ignore) => one(a.cross_entropy(b, ignore)),
        OpCase::Classifier(classes, ignore_index) => {
            let opts = ClassifierOpts { classes, ignore_index, ..ClassifierOpts::default() };
            a.classifier_loss_grad(b, opts).map(|(x, y)| vec![x, y])
        }
        OpCase::Mse => one(a.mse_loss(b)),
        OpCase::Conv1d(bias) => one(a.conv1d_causal(b, bias.then_some(c))),
        OpCase::Dropout(p, train) => one(a.dropout(p, train)),
        OpCase::Cat(dd) => one(Tensor::cat(&[a.clone(), b.clone(), c.clone()], dd)),
        OpCase::Stack(dd) => one(Tensor::stack(&[a.clone(), b.clone()], dd)),
        OpCase::Chunk(n, dd) => a.chunk(n, dd),
        OpCase::IndexSelect(dd) => one(a.index_select(b, dd)),
        OpCase::IndexCopy(dd) => {
            let dst = a.detach().contiguous()?;
            dst.index_copy_(dd, b, c).map(|()| vec![dst])
        }
        OpCase::Embedding => one(a.embedding(b)),
        OpCase::Gather(dd) => one(a.gather(dd, b)),
        OpCase::IndexAdd(dd) => one(a.index_add(b, c, dd)),
        OpCase::ScatterAdd(dd) => one(a.scatter_add(dd, b, c)),
        OpCase::WhereCond => one(a.where_cond(b, c)),
        OpCase::MaskedFill(v) => one(a.masked_fill(b, v)),
        OpCase::View(k, dd, x, y) => one(match k {
            0 => a.narrow(dd, x, y),
            1 => a.squeeze(dd),
            2 => a.unsqueeze(dd),
            3 => a.transpose(dd, x as isize - 2),
            4 => a.permute(&[x, y, 0, 1][..a.rank().min(4)]),
            5 => a.flatten(dd, x as isize - 3),
            6 => a.broadcast_as(b.dims().to_vec()),
            _ => a.reshape(vec![x, y]),
        }),
        OpCase::Attention(causal, scale, dropout_p) => {
            one(Tensor::scaled_dot_product_attention(a, b, c, AttentionOpts { causal, scale, dropout_p }))
        }
        OpCase::Linear(act, bias) => {
            let act = [Activation::None, Activation::GeluTanh, Activation::Relu][act as usize];
            one(linear(a, b, bias.then_some(c), act))
        }
        OpCase::BiasGelu => one(a.bias_gelu(b)),
        OpCase::FakeQuantize(qmin, qmax, axis) => {
            one(a.fake_quantize(b, c, FakeQuant { qmin, qmax, axis, grad_factor: None }))
        }
        OpCase::Scan(skip, softplus) => {
            let args = ScanArgs { d: skip.then_some(e), delta_softplus: softplus, ..ScanArgs::default() };
            one(a.selective_scan(b, c, d, e, args))
        }
    }
}

/// The five tensors' shapes in the roles `run` gives them, for `op` at sizes `n` (each 0..4), and
/// which of them hold indices: calls that get past the shape checks, so that the ops' bodies see
/// empty and one-sized dims, specials and bad indices.
fn shapes_for(op: &OpCase, n: [usize; 4]) -> [(Vec<usize>, bool); 5] {
    let [b, h, t, d] = n;
    let f = |v: &[usize]| (v.to_vec(), false);
    let i = |v: &[usize]| (v.to_vec(), true);
    match op {
        OpCase::Attention(..) => [f(&[b, h, t, d]), f(&[b, h, t + 1, d]), f(&[b, h, t + 1, d]), f(&[d]), f(&[d])],
        OpCase::Linear(..) => [f(&[b, t, d]), f(&[h, d]), f(&[h]), f(&[h]), f(&[h])],
        OpCase::BiasGelu => [f(&[b, t, d]), f(&[d]), f(&[d]), f(&[d]), f(&[d])],
        OpCase::LayerNorm(..) => [f(&[b, t, d]), f(&[d]), f(&[d]), f(&[d]), f(&[d])],
        OpCase::AddLayerNorm(..) => [f(&[b, t, d]), f(&[b, t, d]), f(&[d]), f(&[d]), f(&[d])],
        OpCase::CrossEntropy(..) | OpCase::Classifier(..) => [f(&[t, d]), i(&[t]), f(&[d]), f(&[d]), f(&[d])],
        OpCase::Conv1d(..) => [f(&[b, d, t]), f(&[d, h + 1]), f(&[d]), f(&[d]), f(&[d])],
        OpCase::Scan(..) => [f(&[b, d, t]), f(&[b, d, t]), f(&[d, h]), f(&[b, 1, h, t]), f(&[b, 1, h, t])],
        OpCase::Embedding => [f(&[h, d]), i(&[b, t]), f(&[d]), f(&[d]), f(&[d])],
        OpCase::IndexSelect(..) => [f(&[t, d]), i(&[h]), f(&[d]), f(&[d]), f(&[d])],
        OpCase::IndexCopy(..) | OpCase::IndexAdd(..) => [f(&[t, d]), i(&[h]), f(&[h, d]), f(&[d]), f(&[d])],
        OpCase::Gather(..) | OpCase::ScatterAdd(..) => [f(&[t, d]), i(&[t, h]), f(&[t, h]), f(&[d]), f(&[d])],
        OpCase::FakeQuantize(..) => [f(&[t, d]), f(&[d]), f(&[d]), f(&[d]), f(&[d])],
        OpCase::Matmul => [f(&[b, t, d]), f(&[b, d, h]), f(&[d]), f(&[d]), f(&[d])],
        OpCase::WhereCond | OpCase::MaskedFill(..) => [i(&[t, d]), f(&[t, d]), f(&[1, d]), f(&[d]), f(&[d])],
        _ => [f(&[b, t, d]), f(&[b, t, d]), f(&[b, t, d]), f(&[d]), f(&[d])],
    }
}

/// A shaped case: sizes, the float dtype, fills, whether the floats are variables, and at most
/// one corruption (tensor, kind: drop its last dim, append a dim, grow its first dim, or change
/// its dtype).
#[derive(Debug, Clone)]
struct Shaped {
    n: [usize; 4],
    float: usize,
    fill: (u8, u8),
    grad: bool,
    corrupt: Option<(usize, u8)>,
}

fn shaped() -> impl Strategy<Value = Shaped> {
    (
        [0usize..4, 0usize..4, 0usize..4, 0usize..4],
        0usize..4,
        (0u8..2, 2u8..4),
        any::<bool>(),
        prop::option::of((0usize..5, 0u8..4)),
    )
        .prop_map(|(n, float, fill, grad, corrupt)| Shaped { n, float, fill, grad, corrupt })
}

fn build_shaped(op: &OpCase, c: &Shaped, device: Device) -> Result<Vec<Tensor>> {
    let floats = [DType::F32, DType::F64, DType::F16, DType::BF16];
    let mut out = Vec::new();
    for (k, (mut dims, index)) in shapes_for(op, c.n).into_iter().enumerate() {
        let mut dtype = if index { DType::U32 } else { floats[c.float] };
        match c.corrupt {
            Some((j, 0)) if j == k => {
                dims.pop();
            }
            Some((j, 1)) if j == k => dims.push(2),
            Some((j, 2)) if j == k => {
                if let Some(x) = dims.first_mut() {
                    *x += 1;
                }
            }
            Some((j, 3)) if j == k => dtype = if index { DType::F32 } else { DType::I32 },
            _ => {}
        }
        let fill = if index { c.fill.1 } else { c.fill.0 };
        out.push(build(&Spec { dtype, dims, fill, grad: c.grad && !index, like: (0, 0) }, device)?);
    }
    Ok(out)
}

/// An `Ok` tensor is well formed: its storage covers its layout and it reads back. On CUDA the
/// read may instead return the typed error of a check the device made (indices are validated by
/// the kernels that read them, and reported at the next host read or synchronization).
fn check_tensor(t: &Tensor) {
    let need = t.layout().required_len().expect("a result's layout has a size");
    assert!(need <= t.storage_len(), "{:?} reaches {need} elements of a storage of {}", t.layout(), t.storage_len());
    match t.to_f64_vec() {
        Ok(v) => assert_eq!(v.len(), t.elem_count()),
        Err(e) if t.device().is_cuda() => check_err(&e),
        Err(e) => panic!("a CPU result does not read back: {e}"),
    }
}

fn check_err(e: &Error) {
    assert!(!e.to_string().is_empty(), "an error without a message: {e:?}");
}

/// Runs `op` on `ts` and checks the outcome (see the module documentation).
fn check_case(op: &OpCase, ts: &[Tensor]) -> std::result::Result<(), TestCaseError> {
    match run(op, ts) {
        Ok(outs) => {
            for t in &outs {
                check_tensor(t);
                if t.tracks_grad() {
                    match t.sum_all().and_then(|s| s.backward()) {
                        Ok(grads) => {
                            for s in ts {
                                if let Some(g) = grads.get(s) {
                                    check_tensor(g);
                                    prop_assert_eq!(g.dims(), s.dims());
                                }
                            }
                        }
                        Err(e) => check_err(&e),
                    }
                }
            }
        }
        Err(e) => check_err(&e),
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: cases(512), failure_persistence: None, ..ProptestConfig::default() })]

    /// Tensors of each op's own shapes, at most one of them corrupted.
    #[test]
    fn robust_ops_shaped(c in shaped(), op in op_case()) {
        match build_shaped(&op, &c, Device::Cpu) {
            Ok(ts) => check_case(&op, &ts)?,
            Err(e) => check_err(&e),
        }
    }

    /// Tensors of random shapes and dtypes.
    #[test]
    fn robust_ops(specs in prop::collection::vec(spec(), 5), op in op_case()) {
        let mut ts = Vec::new();
        for s in &specs {
            match build(&resolve(s, &specs[0]), Device::Cpu) {
                Ok(t) => ts.push(t),
                Err(e) => {
                    check_err(&e);
                    return Ok(());
                }
            }
        }
        check_case(&op, &ts)?;
    }
}

/// The shaped cases on CUDA device 0 (skipped without one), each ending with a synchronization.
#[test]
fn robust_ops_shaped_cuda() {
    let Some(dev) = cuda_device() else { return };
    let config = ProptestConfig { cases: cases(256), failure_persistence: None, ..ProptestConfig::default() };
    let mut runner = proptest::test_runner::TestRunner::new(config);
    let outcome = runner.run(&(shaped(), op_case()), |(c, op)| {
        match build_shaped(&op, &c, Device::Cuda(0)) {
            Ok(ts) => check_case(&op, &ts)?,
            Err(e) => check_err(&e),
        }
        // A device-side check may surface here as a typed error; after it the device must work.
        if let Err(e) = dev.synchronize() {
            check_err(&e);
        }
        let probe = Tensor::ones(5, DType::F32, Device::Cuda(0)).and_then(|t| t.sum_all()).and_then(|t| t.to_f64_vec());
        prop_assert!(matches!(probe.as_deref(), Ok([5.0])), "the device is broken after {op:?} on {c:?}: {probe:?}");
        prop_assert!(dev.synchronize().is_ok(), "the device is broken after {op:?} on {c:?}");
        Ok(())
    });
    if let Err(e) = outcome {
        panic!("{e}");
    }
}
