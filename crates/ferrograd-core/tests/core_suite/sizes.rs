//! Sizes: every constructor and view checks its element count (a shape whose product wraps or
//! exceeds `MAX_ELEMS` is `Error::SizeOverflow` naming it), host allocations that cannot fit are
//! `Error::HostOutOfMemory`, and a tensor's storage always covers its layout.
//!
//! The regression cases are issue 11's (`bench elementwise --shapes 3x6148914691236517206` made a
//! [3, 6.1e18] tensor over 2 elements of storage). The property harness (`robust_views`) builds
//! random tensors, including huge and empty dims, applies random chains of views and checks that
//! nothing panics, every result's storage covers its layout, and values equal a reference
//! computed element by element. `FERROGRAD_PROPTEST_CASES` sets the number of cases (CI runs more).

use ferrograd_core::shape::MAX_ELEMS;
use ferrograd_core::{DType, Device, Error, Layout, Result, Shape, Tensor};
use proptest::prelude::*;

fn cases(default: u32) -> u32 {
    std::env::var("FERROGRAD_PROPTEST_CASES").ok().and_then(|v| v.parse().ok()).unwrap_or(default)
}

fn is_size_error(e: &Error) -> bool {
    matches!(e, Error::SizeOverflow { .. } | Error::HostOutOfMemory { .. })
}

/// The layout's storage reach fits the storage: the invariant every tensor keeps.
fn covered(t: &Tensor) {
    let need = t.layout().required_len().expect("required_len overflows");
    assert!(need <= t.storage_len(), "{:?} reaches {need} elements of a storage of {}", t.layout(), t.storage_len());
    assert!(t.elem_count() <= MAX_ELEMS);
}

#[test]
fn element_counts_never_wrap() {
    // 3 * 6148914691236517206 = 2 (mod 2^64): the shape that passed for two elements.
    let s = Shape::from((3, 6_148_914_691_236_517_206));
    assert_eq!(s.elem_count(), usize::MAX, "saturates instead of wrapping");
    let e = s.checked_elem_count("test").unwrap_err();
    assert!(matches!(e, Error::SizeOverflow { op: "test", .. }), "{e}");
    assert!(e.to_string().contains("6148914691236517206"), "{e}");
    assert_eq!(Shape::from((0, usize::MAX, usize::MAX)).checked_elem_count("t").unwrap(), 0);
    assert!(Shape::from((MAX_ELEMS + 1,)).checked_elem_count("t").is_err());
    assert_eq!(Shape::from((MAX_ELEMS,)).checked_elem_count("t").unwrap(), MAX_ELEMS);
}

#[test]
fn constructors_refuse_huge_shapes_with_a_typed_error() {
    let huge = (3usize, 6_148_914_691_236_517_206usize);
    let d = Device::Cpu;
    for r in [
        Tensor::zeros(huge, DType::F32, d),
        Tensor::ones(huge, DType::U8, d),
        Tensor::rand(0.0, 1.0, huge, DType::F32, d),
        Tensor::randn(0.0, 1.0, huge, DType::F32, d),
        Tensor::from_vec(vec![0f32, 1.0], huge, d),
        Tensor::arange(0.0, 1e300, 1.0, DType::F32, d),
    ] {
        let e = r.unwrap_err();
        assert!(is_size_error(&e), "{e}");
    }
    // The other sizes: u64::MAX elements, and 1e10 f32 (40 GB) on a small machine.
    let e = Tensor::zeros(usize::MAX, DType::F32, d).unwrap_err();
    assert!(is_size_error(&e), "{e}");
}

#[test]
fn views_that_would_grow_a_tensor_are_checked() -> Result<()> {
    let d = Device::Cpu;
    let x = Tensor::ones((2, 1), DType::F32, d)?;
    let e = x.reshape((3, 6_148_914_691_236_517_206usize)).unwrap_err();
    assert!(is_size_error(&e), "reshape: {e}");
    let e = x.broadcast_as((2, usize::MAX)).unwrap_err();
    assert!(is_size_error(&e), "broadcast: {e}");
    let e = x.expand((1 << 40, 1 << 40)).unwrap_err();
    assert!(is_size_error(&e), "expand: {e}");
    // Both operands valid (broadcast views of one element), their broadcast product 2^66.
    let one = Tensor::ones((1, 1), DType::U8, d)?;
    let (a, b) = (one.broadcast_as((1usize << 33, 1))?, one.broadcast_as((1, 1usize << 33))?);
    let e = a.add(&b).unwrap_err();
    assert!(matches!(e, Error::SizeOverflow { .. }), "broadcast add: {e}");
    // matmul [2^20, 1] x [1, 2^45]: the output [2^20, 2^45] is checked before anything runs.
    let m = Tensor::ones((1 << 20, 1), DType::F32, d)?;
    let wide = Tensor::ones((1, 1), DType::F32, d)?.broadcast_as((1, 1usize << 45))?;
    let e = m.matmul(&wide).unwrap_err();
    assert!(matches!(e, Error::SizeOverflow { op: "matmul", .. }), "matmul: {e}");
    // 2^41 elements pass the shape check; the host memory check refuses 16 TiB of f64.
    let v = one.broadcast_as((1usize << 21, 1usize << 20))?;
    let e = v.to_dtype(DType::F64).unwrap_err();
    assert!(matches!(e, Error::HostOutOfMemory { .. }), "{e}");
    let e = Tensor::cat(&[v.clone(), v], 0).unwrap_err();
    assert!(is_size_error(&e), "cat: {e}");
    Ok(())
}

#[test]
fn a_host_allocation_larger_than_the_machine_is_an_error() {
    // 40 GB of f32 (issue 11: `bench elementwise --shapes 100000x100000` aborted with SIGABRT).
    // A machine with that much free memory passes; then try a size no machine has.
    let n = match ferrograd_core::host::host_memory() {
        Some(m) if m.available < 40_000_000_000 => 10_000_000_000usize,
        _ => MAX_ELEMS / 2,
    };
    let e = Tensor::zeros(n, DType::F32, Device::Cpu).unwrap_err();
    assert!(matches!(e, Error::HostOutOfMemory { .. }), "{e}");
    assert!(e.to_string().contains("host out of memory"), "{e}");
}

#[test]
fn layout_reach_and_checked_narrow() {
    let l = Layout::contiguous((2, 3));
    assert_eq!(l.required_len(), Some(6));
    assert_eq!(Layout::contiguous((0, 3)).required_len(), Some(0));
    let t = l.transpose(0, 1).unwrap();
    assert_eq!(t.required_len(), Some(6));
    assert!(l.transpose(0, 2).is_err());
    assert!(l.narrow(5, 0, 1).is_err());
    let huge = Layout::new(Shape::from((2, 2)), vec![usize::MAX, 1], 1);
    assert_eq!(huge.required_len(), None);
    assert!(huge.narrow(0, 1, 1).is_err());
}

// ---- property harness: random view chains ---------------------------------------------------

#[derive(Debug, Clone)]
enum View {
    Transpose(usize, usize),
    Narrow(usize, usize, usize),
    Reshape(Vec<usize>),
    Unsqueeze(isize),
    Squeeze(usize),
    Broadcast(Vec<usize>),
    Permute(Vec<usize>),
    Flatten,
    Contiguous,
}

fn dim() -> impl Strategy<Value = usize> {
    prop_oneof![8 => 0usize..5, 1 => Just(usize::MAX), 1 => Just(1usize << 40), 1 => Just(6_148_914_691_236_517_206usize)]
}

fn view() -> impl Strategy<Value = View> {
    prop_oneof![
        (0usize..5, 0usize..5).prop_map(|(a, b)| View::Transpose(a, b)),
        (0usize..5, 0usize..4, 0usize..4).prop_map(|(d, s, l)| View::Narrow(d, s, l)),
        prop::collection::vec(dim(), 0..4).prop_map(View::Reshape),
        (-4isize..5).prop_map(View::Unsqueeze),
        (0usize..5).prop_map(View::Squeeze),
        prop::collection::vec(dim(), 0..5).prop_map(View::Broadcast),
        prop::collection::vec(0usize..5, 0..5).prop_map(View::Permute),
        Just(View::Flatten),
        Just(View::Contiguous),
    ]
}

fn apply(t: &Tensor, v: &View) -> Result<Tensor> {
    match v {
        View::Transpose(a, b) => t.transpose(*a, *b),
        View::Narrow(d, s, l) => t.narrow(*d, *s, *l),
        View::Reshape(s) => t.reshape(s.clone()),
        View::Unsqueeze(d) => t.unsqueeze(*d),
        View::Squeeze(d) => t.squeeze(*d),
        View::Broadcast(s) => t.broadcast_as(s.clone()),
        View::Permute(p) => t.permute(p),
        View::Flatten => t.flatten_all(),
        View::Contiguous => t.contiguous(),
    }
}

/// The value of logical element `i` of a view, read by walking the layout by hand: what every
/// view must agree with.
fn reference(base: &[f64], l: &Layout) -> Vec<f64> {
    let n = l.elem_count();
    (0..n)
        .map(|mut i| {
            let mut off = l.offset();
            for (&d, &s) in l.dims().iter().zip(l.strides()).rev() {
                off += (i % d) * s;
                i /= d;
            }
            base[off]
        })
        .collect()
}

proptest! {
    #![proptest_config(ProptestConfig { cases: cases(256), failure_persistence: None, ..ProptestConfig::default() })]

    #[test]
    fn robust_views(dims in prop::collection::vec(dim(), 0..4), views in prop::collection::vec(view(), 0..6)) {
        // Building the base either succeeds (small) or is a typed size error (never a panic).
        let base = match Tensor::arange(0.0, Shape::from(&dims).elem_count().min(1 << 16) as f64, 1.0, DType::F64, Device::Cpu)
            .and_then(|a| a.reshape(dims.clone()))
        {
            Ok(t) => t,
            Err(e) => {
                prop_assert!(is_size_error(&e) || matches!(e, Error::ShapeMismatch { .. }), "{e}");
                return Ok(());
            }
        };
        let mut t = base.clone();
        for v in &views {
            match apply(&t, v) {
                Ok(next) => {
                    covered(&next);
                    if next.same_storage(&base) && next.elem_count() <= 1 << 16 {
                        let values = base.to_vec::<f64>().expect("base values");
                        let want = reference(&values, next.layout());
                        prop_assert_eq!(next.to_vec::<f64>().expect("values"), want);
                    }
                    t = next;
                }
                Err(e) => {
                    let msg = e.to_string();
                    prop_assert!(!msg.is_empty());
                }
            }
            if t.elem_count() > 1 << 16 {
                break; // a broadcast this large is fine as a view; reading it is not the point
            }
        }
    }
}

#[test]
fn empty_views_at_the_end_of_their_storage() -> Result<()> {
    // Found by `robust_views`: narrow(d, size, 0) is an empty view whose offset lies one past the
    // storage; copying it sliced `src[offset..offset]` out of range and panicked.
    let x = Tensor::arange(0.0, 6.0, 1.0, DType::F32, Device::Cpu)?.reshape((2, 3))?;
    let e = x.narrow(0, 2, 0)?;
    covered(&e);
    assert_eq!(e.contiguous()?.dims(), &[0, 3]);
    assert_eq!(e.t()?.contiguous()?.to_vec::<f32>()?, Vec::<f32>::new());
    assert_eq!(e.relu()?.dims(), &[0, 3]);
    assert_eq!(x.narrow(1, 3, 0)?.sum_all()?.item::<f32>()?, 0.0);
    // Two empty narrows put the offset past the end (6 + 3 > 6).
    let past = e.narrow(1, 3, 0)?;
    assert!(past.layout().offset() > past.storage_len());
    covered(&past);
    assert_eq!(past.relu()?.dims(), &[0, 0]);
    assert_eq!(past.add(&past)?.dims(), &[0, 0]);
    assert_eq!(past.to_vec::<f32>()?, Vec::<f32>::new());
    // The case the harness found: an empty tensor with a huge dim; its saturated strides put a
    // narrow's offset at usize::MAX, and the view still counts as contiguous.
    let z = Tensor::zeros((0, 2, usize::MAX), DType::F64, Device::Cpu)?;
    let n = z.narrow(1, 1, 1)?;
    covered(&n);
    assert_eq!(n.relu()?.elem_count(), 0);
    assert_eq!(n.to_vec::<f64>()?, Vec::<f64>::new());
    Ok(())
}
