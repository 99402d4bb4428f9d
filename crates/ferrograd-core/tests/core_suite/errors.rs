//! Bad input gets a typed error naming what was wrong, never a panic. Each test checks the
//! variant, the fields, and that the message shows the offending numbers.

use ferrograd_core::{DType, Device, Error, Result, Rng, Tensor};

const CPU: Device = Device::Cpu;

fn f32s<S: Into<ferrograd_core::Shape>>(shape: S) -> Tensor {
    Tensor::zeros(shape, DType::F32, CPU).unwrap()
}

fn u32s(v: Vec<u32>) -> Tensor {
    let n = v.len();
    Tensor::from_vec(v, n, CPU).unwrap()
}

/// The error of `r`, with its message checked to contain every needle.
#[track_caller]
fn err<T: std::fmt::Debug>(r: Result<T>, needles: &[&str]) -> Error {
    let e = r.expect_err("expected an error");
    let msg = e.to_string();
    for n in needles {
        assert!(msg.contains(n), "message {msg:?} does not mention {n:?}");
    }
    e
}

#[test]
fn shape_mismatch_in_binary_ops() {
    let (a, b) = (f32s((2, 3)), f32s((4, 3)));
    let e = err(a.add(&b), &["add", "[2, 3]", "[4, 3]"]);
    assert!(matches!(e, Error::ShapeMismatch { op: "add", ref lhs, ref rhs } if lhs == &[2, 3] && rhs == &[4, 3]));
    err(a.mul(&f32s(4)), &["mul", "[2, 3]", "[4]"]);
    err(a.maximum(&f32s((3, 2))), &["maximum", "[2, 3]", "[3, 2]"]);
    err(a.lt(&f32s(2)), &["[2, 3]", "[2]"]);
    err(a.where_cond(&a, &f32s(5)), &["where_cond", "[5]"]);
    let e = err(a.mse_loss(&f32s(6)), &["mse_loss", "[2, 3]", "[6]"]);
    assert!(matches!(e, Error::ShapeMismatch { op: "mse_loss", .. }));
}

#[test]
fn shape_mismatch_in_matmul() {
    let e = err(f32s((2, 3)).matmul(&f32s((4, 5))), &["matmul", "[2, 3]", "[4, 5]"]);
    assert!(matches!(e, Error::ShapeMismatch { op: "matmul", .. }));
    err(f32s(3).matmul(&f32s(4)), &["matmul", "[3]", "[4]"]);
    err(f32s((2, 3)).matmul(&f32s(2)), &["matmul", "[2, 3]", "[2]"]);
    err(f32s(()).matmul(&f32s(2)), &["matmul", "[]", "[2]"]);
    // Batch dims that do not broadcast: the message shows both full shapes.
    let e = err(f32s((2, 2, 3)).matmul(&f32s((3, 3, 4))), &["matmul", "[2, 2, 3]", "[3, 3, 4]"]);
    assert!(matches!(e, Error::ShapeMismatch { op: "matmul", .. }));
}

#[test]
fn shape_errors_in_cat_stack_reshape_and_views() {
    let e = err(Tensor::cat(&[f32s((2, 3)), f32s((2, 4))], 0), &["cat", "[2, 3]", "[2, 4]"]);
    assert!(matches!(e, Error::ShapeMismatch { op: "cat", .. }));
    err(Tensor::cat(&[f32s((2, 3)), f32s(3)], 0), &["cat", "[2, 3]", "[3]"]);
    err(Tensor::cat(&[], 0), &["cat"]);
    err(Tensor::stack(&[f32s((2, 3)), f32s((3, 2))], 0), &["cat", "[1, 2, 3]", "[1, 3, 2]"]);
    let e = err(f32s((2, 3)).reshape((4, 2)), &["reshape", "[2, 3]", "[4, 2]"]);
    assert!(matches!(e, Error::ShapeMismatch { op: "reshape", .. }));
    let e = err(f32s((2, 3)).broadcast_as((4, 3)), &["[2, 3]", "[4, 3]"]);
    assert!(matches!(e, Error::Broadcast { .. }));
    err(f32s((2, 3)).broadcast_as(3), &["[2, 3]", "[3]"]);
    let e = err(f32s((2, 3)).permute(&[0, 0]), &["permute", "[0, 0]"]);
    assert!(matches!(e, Error::Shape { op: "permute", .. }));
    err(f32s((2, 3)).permute(&[0]), &["permute", "[0]"]);
    err(f32s(3).t(), &["t", "[3]"]);
    let e = err(Tensor::from_vec(vec![1f32, 2., 3.], (2, 2), CPU), &["from_vec", "4", "3"]);
    assert!(matches!(e, Error::ElementCount { expected: 4, got: 3, .. }));
    let e = err(f32s((2, 3)).set(&f32s((3, 2))), &["set", "[2, 3]", "[3, 2]"]);
    assert!(matches!(e, Error::ShapeMismatch { op: "set", .. }));
    err(f32s(3).to_vec2::<f32>(), &["to_vec2", "[3]"]);
}

#[test]
fn narrow_out_of_range() {
    let x = f32s((2, 5));
    let e = err(x.narrow(1, 3, 4), &["narrow", "3..7", "5"]);
    assert!(matches!(e, Error::Shape { op: "narrow", .. }));
    err(x.narrow(0, 2, 1), &["narrow", "2..3", "2"]);
    // A start/length whose sum overflows is an error too, not an arithmetic panic.
    err(x.narrow(1, usize::MAX, 2), &["narrow"]);
    let e = err(x.narrow(2, 0, 1), &["narrow", "2", "rank 2"]);
    assert!(matches!(e, Error::DimOutOfRange { dim: 2, rank: 2, .. }));
}

#[test]
fn dtype_mismatch() {
    let (a, b) = (f32s(3), Tensor::zeros(3, DType::F64, CPU).unwrap());
    let e = err(a.add(&b), &["add", "F32", "F64"]);
    assert!(matches!(e, Error::DTypeMismatch { op: "add", lhs: DType::F32, rhs: DType::F64 }));
    err(a.reshape((3, 1)).unwrap().matmul(&b.reshape((1, 3)).unwrap()), &["matmul", "F32", "F64"]);
    err(Tensor::cat(&[a.clone(), b.clone()], 0), &["cat", "F32", "F64"]);
    err(a.lt(&b), &["F32", "F64"]);
    err(a.where_cond(&a, &b), &["where_cond", "F32", "F64"]);
    err(a.set(&b), &["set", "F32", "F64"]);
    let w = Tensor::ones(3, DType::F64, CPU).unwrap();
    err(a.reshape((1, 3)).unwrap().layer_norm(Some(&w), None, 1e-5), &["layer_norm", "F32", "F64"]);
    let e = err(a.to_vec::<f64>(), &["to_vec", "F32", "F64"]);
    assert!(matches!(e, Error::DTypeMismatch { op: "to_vec", lhs: DType::F32, rhs: DType::F64 }));
    err(f32s(()).item::<i32>(), &["F32", "I32"]);
}

#[test]
fn unsupported_dtype() {
    let i = Tensor::ones((2, 2), DType::I32, CPU).unwrap();
    let e = err(i.exp(), &["exp", "I32"]);
    assert!(matches!(e, Error::UnsupportedDType { op: "exp", dtype: DType::I32 }));
    err(i.matmul(&i), &["matmul", "I32"]);
    err(i.softmax(0usize), &["softmax", "I32"]);
    err(i.layer_norm(None, None, 1e-5), &["layer_norm", "I32"]);
}

#[test]
fn dim_out_of_range() {
    let x = f32s((2, 3));
    for (r, op, dim) in [
        (x.sum(2usize, false), "sum", "2"),
        (x.sum(-3, false), "sum", "-3"),
        (x.max([0usize, 5], true), "max", "5"),
        (x.mean(7usize, false), "mean", "7"),
        (x.softmax(2usize), "softmax", "2"),
        (x.log_softmax(-3), "softmax", "-3"),
        (x.transpose(0, 5), "transpose", "5"),
        (x.unsqueeze(4), "unsqueeze", "4"),
        (x.unsqueeze(-4), "unsqueeze", "-4"),
        (x.squeeze(2usize), "squeeze", "2"),
        (x.flatten(0usize, 3usize), "flatten", "3"),
        (x.index_select(&u32s(vec![0]), 2usize), "index_select", "2"),
        (x.gather(3usize, &Tensor::zeros((2, 3), DType::U32, CPU).unwrap()), "gather", "3"),
        (Tensor::cat(&[x.clone(), x.clone()], 2usize), "cat", "2"),
        (x.argmax(-3, false), "argmax", "-3"),
    ] {
        let e = err(r, &[op, dim, "rank 2"]);
        assert!(matches!(e, Error::DimOutOfRange { rank: 2, .. }), "{op}: {e:?}");
    }
    let e = err(x.dim(2usize), &["2", "rank 2"]);
    assert!(matches!(e, Error::DimOutOfRange { .. }));
    let chunk = x.chunk(2, 2usize).map(|_| ());
    assert!(matches!(chunk, Err(Error::DimOutOfRange { .. })));
    err(x.sum([0usize, 0], false), &["sum", "dim 0 given twice"]);
}

#[test]
fn index_out_of_range() {
    let x = f32s((4, 3));
    let e = err(x.index_select(&u32s(vec![1, 4]), 0usize), &["index_select", "index 4", "size 4"]);
    assert!(matches!(e, Error::IndexOutOfRange { op: "index_select", index: 4, size: 4 }));
    err(x.index_select(&u32s(vec![3]), 1usize), &["index_select", "3", "size 3"]);
    let neg = Tensor::from_vec(vec![0i32, -1], 2, CPU).unwrap();
    let e = err(x.index_select(&neg, 0usize), &["index_select", "-1", "4"]);
    assert!(matches!(e, Error::IndexOutOfRange { index: -1, .. }));
    let e = err(x.embedding(&Tensor::from_vec(vec![0u8, 9], (1, 2), CPU).unwrap()), &["embedding", "9", "size 4"]);
    assert!(matches!(e, Error::IndexOutOfRange { op: "embedding", index: 9, size: 4 }));
    let ids = Tensor::from_vec(vec![0u32, 1, 3, 2], (2, 2), CPU).unwrap();
    let e = err(x.gather(1usize, &ids), &["gather", "index 3", "size 3"]);
    assert!(matches!(e, Error::IndexOutOfRange { op: "gather", index: 3, size: 3 }));
    // index_copy_: a bad id writes nothing at all on the CPU (all ids checked first).
    let dst = f32s((4, 3));
    let before = dst.to_vec::<f32>().unwrap();
    let ones = Tensor::ones((2, 3), DType::F32, CPU).unwrap();
    let e = err(dst.index_copy_(0usize, &u32s(vec![2, 4]), &ones), &["index_copy_", "index 4", "size 4"]);
    assert!(matches!(e, Error::IndexOutOfRange { op: "index_copy_", index: 4, size: 4 }));
    assert_eq!(dst.to_vec::<f32>().unwrap(), before);
    err(dst.index_copy_(0usize, &u32s(vec![2]), &f32s((2, 3))), &["index_copy_"]);
    err(dst.index_copy_(0usize, &u32s(vec![1]), &dst.narrow(0, 0, 1).unwrap()), &["index_copy_", "share"]);
    err(dst.t().unwrap().index_copy_(0usize, &u32s(vec![1]), &f32s((1, 4))), &["index_copy_", "contiguous"]);
    // Cross-entropy targets: a class past C, and a negative one that is not the ignore index.
    let logits = f32s((2, 4));
    let e = err(logits.cross_entropy(&u32s(vec![1, 7]), None), &["cross_entropy target", "7", "size 4"]);
    assert!(matches!(e, Error::IndexOutOfRange { op: "cross_entropy target", index: 7, size: 4 }));
    let t = Tensor::from_vec(vec![-5i32, 1], 2, CPU).unwrap();
    let e = err(logits.cross_entropy(&t, Some(-100)), &["cross_entropy", "-5", "size 4"]);
    assert!(matches!(e, Error::IndexOutOfRange { index: -5, .. }));
    // And the ignore index itself is fine.
    let t = Tensor::from_vec(vec![-100i32, 1], 2, CPU).unwrap();
    assert!(logits.cross_entropy(&t, Some(-100)).is_ok());
}

#[test]
fn float_indices_are_rejected() {
    let x = f32s((4, 3));
    let fi = Tensor::from_vec(vec![0f32, 1.0], 2, CPU).unwrap();
    for (r, op) in [
        (x.index_select(&fi, 0usize), "index_select"),
        (x.embedding(&fi), "embedding"),
        (x.gather(0usize, &fi.reshape((2, 1)).unwrap()), "gather"),
        (x.narrow(0, 0, 2).unwrap().cross_entropy(&fi, None), "cross_entropy"),
    ] {
        let e = err(r, &[op, "F32"]);
        assert!(matches!(e, Error::UnsupportedDType { dtype: DType::F32, .. }), "{op}: {e:?}");
    }
    err(x.index_select(&u32s(vec![0, 1]).reshape((1, 2)).unwrap(), 0usize), &["index_select", "1-D", "[1, 2]"]);
}

#[test]
fn gather_and_cross_entropy_shapes() {
    let x = f32s((2, 3));
    let ids = Tensor::zeros((3, 3), DType::U32, CPU).unwrap();
    err(x.gather(1usize, &ids), &["gather", "[3, 3]", "[2, 3]"]);
    err(f32s((2, 3, 4)).cross_entropy(&u32s(vec![0, 0]), None), &["cross_entropy", "[2, 3, 4]"]);
    err(x.cross_entropy(&u32s(vec![0, 0, 0]), None), &["cross_entropy", "[2, 3]", "[3]"]);
    err(x.layer_norm(Some(&f32s(4)), None, 1e-5), &["layer_norm", "weight", "[4]", "[3]"]);
    err(x.layer_norm(None, Some(&f32s((1, 3))), 1e-5), &["layer_norm", "bias", "[1, 3]"]);
    err(f32s(()).layer_norm(None, None, 1e-5), &["layer_norm"]);
    err(f32s(3).embedding(&u32s(vec![0])), &["embedding", "[3]"]);
}

#[test]
fn scalars_item_and_backward() {
    let x = f32s((2, 3));
    let e = err(x.item::<f32>(), &["item", "[2, 3]"]);
    assert!(matches!(e, Error::NotAScalar { op: "item", ref shape } if shape == &[2, 3]));
    err(x.item_f64(), &["item", "[2, 3]"]);
    assert_eq!(f32s((1, 1)).item::<f32>().unwrap(), 0.0);
    let v = x.requires_grad();
    let e = err(v.sqr().unwrap().backward(), &["backward", "scalar", "[2, 3]"]);
    assert!(matches!(e, Error::Backward(_)));
    let e = err(x.sum_all().unwrap().backward(), &["backward", "requires grad"]);
    assert!(matches!(e, Error::Backward(_)));
}

#[test]
fn invalid_arguments() {
    let x = f32s(3);
    let e = err(x.clamp(2.0, 1.0), &["clamp", "2", "1"]);
    assert!(matches!(e, Error::InvalidArgument(_)));
    err(x.clamp(f64::NAN, 1.0), &["clamp", "NaN"]);
    for p in [1.0, -0.1, 1.5] {
        let e = err(x.dropout_with(&mut Rng::new(0), p, true), &["dropout", &p.to_string()]);
        assert!(matches!(e, Error::InvalidArgument(_)));
    }
    // p is checked in eval mode too, so a bad config fails at once.
    err(x.dropout_with(&mut Rng::new(0), 2.0, false), &["dropout", "2"]);
    let e = err(Tensor::arange(0.0, 1.0, 0.0, DType::F32, CPU), &["arange", "0"]);
    assert!(matches!(e, Error::InvalidArgument(_)));
    err(Tensor::arange(0.0, f64::INFINITY, 1.0, DType::F32, CPU), &["arange", "inf"]);
    err(x.chunk(0, 0usize), &["chunk"]);
    err(x.reshape((1, 3)).unwrap().flatten(1usize, 0usize), &["flatten", "1", "0"]);
    let e = err("cuda:x".parse::<Device>(), &["cuda:x"]);
    assert!(matches!(e, Error::InvalidArgument(_)));
    err("tpu".parse::<Device>(), &["tpu"]);
}

#[test]
fn errors_are_std_errors_and_debuggable() {
    let e = f32s(2).add(&f32s(3)).unwrap_err();
    let boxed: Box<dyn std::error::Error + Send + Sync> = Box::new(e);
    assert!(format!("{boxed:?}").contains("ShapeMismatch"));
}

#[test]
fn missing_cuda_device_is_an_error_not_a_panic() {
    // Ordinal 99 exists nowhere; on a machine without CUDA every ordinal fails the same way.
    let r = Tensor::zeros(3, DType::F32, Device::Cuda(99));
    let e = r.expect_err("cuda:99 cannot exist");
    assert!(
        matches!(e, Error::CudaUnavailable { .. } | Error::CudaDeviceNotFound { ordinal: 99, .. } | Error::Cuda(_)),
        "{e:?}"
    );
    assert!(e.to_string().contains("CUDA"), "{e}");
    let x = f32s(3);
    assert!(x.to_device(Device::Cuda(99)).is_err());
}
