//! Gradcheck: every differentiable op's backward rule against central finite differences in f64,
//! with broadcast and non-contiguous (transposed, narrowed, permuted) inputs, plus the autograd
//! machinery itself (DAGs, accumulation over several backward calls, no-grad scopes, detach).
//! (Over 600 lines: one check per op rule, written once and run on every device present.)
//!
//! `gradcheck(name, f, inputs)` turns each input into a leaf variable (keeping its layout, so a
//! transposed input stays a strided leaf), runs `f`, and contracts the output with fixed random
//! weights into a scalar (a plain sum would give every element the same upstream gradient and hide
//! permutation bugs). Each input element is then nudged by ±h and the contracted output re-evaluated
//! under `no_grad`; the analytic and numeric derivatives must agree to `atol + rtol * max(|a|, |n|)`.
//!
//! The op checks are one backend suite (`backend_tests!` at the end): each runs as `on_cpu::NAME`
//! and, on a GPU machine, as `on_cuda::NAME` with every input made on that device (strided views
//! included) and the finite differences evaluated there, in f64. The checks of the checker and of
//! autograd's own machinery (deep graphs, threads) run on the CPU only.

use crate::common;

use common::{dev, gradcheck, gradcheck_tol, Tol};
use ferrograd_core::{no_grad, with_no_grad, AllDims, DType, Error, GradStore, Result, Rng, Tensor};

backend_tests!(
    unary_ops,
    unary_values_match_f64_reference,
    binary_ops_with_broadcasting,
    binary_same_tensor_both_sides,
    where_cond_and_masked_fill,
    reductions,
    reduction_of_broadcast_view_and_1d,
    max_min_ties_share_the_gradient,
    matmul_shapes_and_batch_broadcast,
    matmul_transposed_and_strided_operands,
    views,
    to_dtype_round_trips,
    to_dtype_gradient_has_the_input_dtype,
    cat_stack_chunk,
    index_select_embedding_gather,
    softmax_and_log_softmax,
    layer_norm,
    losses,
    fused_cross_entropy_equals_the_composed_definition,
    cross_entropy_edge_rows,
    cross_entropy_matches_definition,
    dropout_with_a_fixed_seed,
    dropout_mask_and_scale,
    dag_with_shared_subexpressions,
    tensor_used_twice_sums_gradients,
    gradients_accumulate_over_backward_calls,
    no_grad_scope_records_nothing,
    detach_stops_gradients,
    leaf_gradient_of_a_strided_leaf_has_its_shape,
);

#[test]
#[should_panic(expected = "mismatches")]
fn gradcheck_catches_a_wrong_gradient() {
    // Value x^2 but gradient 1 (the x^2 term is detached): the checker must reject it.
    let x = Tensor::from_vec(vec![0.5f64, -1.0, 2.0], 3, dev()).unwrap();
    gradcheck("wrong", |v| v[0].detach().sqr()?.add(&v[0])?.sub(&v[0].detach()), &[x]);
}

// ---- inputs -------------------------------------------------------------------------------------

fn randn<S: Into<ferrograd_core::Shape>>(rng: &mut Rng, shape: S) -> Tensor {
    Tensor::randn_with(rng, 0.0, 1.0, shape, DType::F64, dev()).unwrap()
}

fn uniform<S: Into<ferrograd_core::Shape>>(rng: &mut Rng, lo: f64, hi: f64, shape: S) -> Tensor {
    Tensor::rand_with(rng, lo, hi, shape, DType::F64, dev()).unwrap()
}

/// Values of either sign with `lo <= |x| < hi`: away from the kinks of abs, relu, sign at 0.
fn signed_away<S: Into<ferrograd_core::Shape>>(rng: &mut Rng, lo: f64, hi: f64, shape: S) -> Tensor {
    let mag = uniform(rng, lo, hi, shape);
    let sign = uniform(rng, -1.0, 1.0, mag.shape().clone()).to_f64_vec().unwrap();
    let v: Vec<f64> = mag.to_f64_vec().unwrap().iter().zip(sign).map(|(m, s)| if s < 0.0 { -m } else { *m }).collect();
    Tensor::from_vec(v, mag.shape().clone(), dev()).unwrap()
}

/// The three layouts every elementwise check runs on, all of logical shape [3, 4]: contiguous,
/// transposed (a [4, 3] buffer viewed as [3, 4]) and narrowed (columns 1..5 of a [3, 6] buffer).
fn layouts(make: &mut dyn FnMut(&[usize]) -> Tensor) -> Vec<(&'static str, Tensor)> {
    let c = make(&[3, 4]);
    let t = make(&[4, 3]).t().unwrap();
    let n = make(&[3, 6]).narrow(1, 1, 4).unwrap();
    assert!(!t.is_contiguous() && !n.is_contiguous());
    vec![("contiguous", c), ("transposed", t), ("narrowed", n)]
}

fn ids<S: Into<ferrograd_core::Shape>>(v: Vec<u32>, shape: S) -> Tensor {
    Tensor::from_vec(v, shape, dev()).unwrap()
}

// ---- unary --------------------------------------------------------------------------------------

type UnaryFn = fn(&Tensor) -> Result<Tensor>;

fn unary_ops() {
    // (name, op, domain): "any" = N(0, 1); "away" = |x| in [0.2, 2); "pos" = [0.5, 2).
    let ops: Vec<(&str, UnaryFn, &str)> = vec![
        ("neg", |x| x.neg(), "any"),
        ("abs", |x| x.abs(), "away"),
        ("sqr", |x| x.sqr(), "any"),
        ("relu", |x| x.relu(), "away"),
        ("exp", |x| x.exp(), "any"),
        ("log", |x| x.log(), "pos"),
        ("sqrt", |x| x.sqrt(), "pos"),
        ("rsqrt", |x| x.rsqrt(), "pos"),
        ("recip", |x| x.recip(), "pos"),
        ("recip_neg", |x| x.recip(), "away"),
        ("tanh", |x| x.tanh(), "any"),
        ("sigmoid", |x| x.sigmoid(), "any"),
        ("gelu", |x| x.gelu(), "any"),
        ("gelu_tanh", |x| x.gelu_tanh(), "any"),
        ("silu", |x| x.silu(), "any"),
        ("sin", |x| x.sin(), "any"),
        ("cos", |x| x.cos(), "any"),
        ("affine", |x| x.affine(-1.5, 0.25), "any"),
        ("add_scalar", |x| x.add_scalar(3.0), "any"),
        ("mul_scalar", |x| x.mul_scalar(-0.5), "any"),
        ("powf_2.5", |x| x.powf(2.5), "pos"),
        ("powf_-1.5", |x| x.powf(-1.5), "pos"),
        ("powf_3_neg_base", |x| x.powf(3.0), "away"),
        // Clamp bounds sit between the magnitudes the "any" inputs take; a value within h of a
        // bound is astronomically unlikely with these seeds and would show up as one mismatch.
        ("clamp", |x| x.clamp(-0.7, 0.4), "any"),
        ("clamp_wide", |x| x.clamp(-10.0, 10.0), "any"),
    ];
    let mut rng = Rng::new(1);
    for (name, op, domain) in ops {
        let mut make = |s: &[usize]| match domain {
            "any" => randn(&mut rng, s),
            "away" => signed_away(&mut rng, 0.2, 2.0, s),
            "pos" => uniform(&mut rng, 0.5, 2.0, s),
            _ => unreachable!(),
        };
        for (layout, x) in layouts(&mut make) {
            gradcheck(&format!("{name} ({layout})"), |v| op(&v[0]), &[x]);
        }
    }
}

fn unary_values_match_f64_reference() -> Result<()> {
    // The gradcheck only proves consistency; pin a few forward values too.
    let x = Tensor::from_vec(vec![-1.5f64, -0.3, 0.7, 2.0], 4, dev())?;
    let erf_gelu = |v: f64| 0.5 * v * (1.0 + libm_erf(v / std::f64::consts::SQRT_2));
    let got = x.gelu()?.to_vec::<f64>()?;
    for (g, v) in got.iter().zip([-1.5f64, -0.3, 0.7, 2.0]) {
        assert!((g - erf_gelu(v)).abs() < 1e-12, "gelu({v}) = {g}");
    }
    let s = x.silu()?.to_vec::<f64>()?;
    assert!((s[2] - 0.7 / (1.0 + (-0.7f64).exp())).abs() < 1e-15);
    assert_eq!(x.relu()?.to_vec::<f64>()?, vec![0.0, 0.0, 0.7, 2.0]);
    assert_eq!(x.clamp(-1.0, 1.0)?.to_vec::<f64>()?, vec![-1.0, -0.3, 0.7, 1.0]);
    Ok(())
}

/// erf by its Maclaurin series (|x| < 2 here), independent of the library's libm.
fn libm_erf(x: f64) -> f64 {
    let mut sum = 0.0;
    let mut term = x;
    for n in 0..80 {
        sum += term / (2 * n + 1) as f64;
        term *= -x * x / (n + 1) as f64;
    }
    sum * 2.0 / std::f64::consts::PI.sqrt()
}

// ---- binary -------------------------------------------------------------------------------------

type BinaryFn = fn(&Tensor, &Tensor) -> Result<Tensor>;

fn binary_ops_with_broadcasting() {
    let ops: Vec<(&str, BinaryFn)> = vec![
        ("add", |a, b| a.add(b)),
        ("sub", |a, b| a.sub(b)),
        ("mul", |a, b| a.mul(b)),
        ("div", |a, b| a.div(b)),
        ("maximum", |a, b| a.maximum(b)),
        ("minimum", |a, b| a.minimum(b)),
        // Piecewise smooth: seeded inputs keep a / b away from the integers where it jumps.
        ("remainder", |a, b| a.remainder(b)),
    ];
    let shapes: Vec<(Vec<usize>, Vec<usize>)> = vec![
        (vec![3, 4], vec![3, 4]),
        (vec![3, 4], vec![4]),
        (vec![4], vec![3, 4]),
        (vec![3, 1], vec![1, 4]),
        (vec![2, 3, 4], vec![3, 1]),
        (vec![1, 3, 1], vec![2, 1, 4]),
        (vec![], vec![3, 4]),
        (vec![3, 4], vec![]),
    ];
    let mut rng = Rng::new(2);
    for (name, op) in &ops {
        for (sa, sb) in &shapes {
            let a = randn(&mut rng, sa.as_slice());
            // Divisors stay away from zero; maximum/minimum operands are a.s. never tied.
            let b = signed_away(&mut rng, 0.5, 2.0, sb.as_slice());
            gradcheck(&format!("{name} {sa:?} {sb:?}"), |v| op(&v[0], &v[1]), &[a, b]);
        }
        // Non-contiguous operands: a transposed lhs against a narrowed rhs, and against a row.
        let a = randn(&mut rng, (4, 3)).t().unwrap();
        let b = signed_away(&mut rng, 0.5, 2.0, (3, 6)).narrow(1, 2, 4).unwrap();
        gradcheck(&format!("{name} transposed x narrowed"), |v| op(&v[0], &v[1]), &[a.clone(), b]);
        let row = signed_away(&mut rng, 0.5, 2.0, (2, 4)).narrow(0, 1, 1).unwrap();
        gradcheck(&format!("{name} transposed x narrowed row"), |v| op(&v[0], &v[1]), &[a.clone(), row]);
        let col = signed_away(&mut rng, 0.5, 2.0, (1, 3)).t().unwrap();
        gradcheck(&format!("{name} transposed x transposed col"), |v| op(&v[0], &v[1]), &[a, col]);
        // A broadcast (stride-0) view as a leaf.
        let e = signed_away(&mut rng, 0.5, 2.0, 4).broadcast_as((3, 4)).unwrap();
        let a = randn(&mut rng, (3, 4));
        gradcheck(&format!("{name} expanded leaf"), |v| op(&v[0], &v[1]), &[a, e]);
    }
}

fn binary_same_tensor_both_sides() {
    let mut rng = Rng::new(3);
    let x = signed_away(&mut rng, 0.5, 2.0, (3, 4));
    gradcheck("x + x", |v| v[0].add(&v[0]), std::slice::from_ref(&x));
    gradcheck("x * x", |v| v[0].mul(&v[0]), std::slice::from_ref(&x));
    gradcheck("x / x.t().t()", |v| v[0].div(&v[0].t()?.t()?), std::slice::from_ref(&x));
    gradcheck("x - x.t() broadcast", |v| v[0].narrow(1, 0, 3)?.sub(&v[0].narrow(1, 1, 3)?.t()?), &[x]);
}

fn where_cond_and_masked_fill() {
    let mut rng = Rng::new(4);
    let mask = ids(vec![1, 0, 0, 1, 1, 1, 0, 0, 0, 1, 0, 1], (3, 4)).to_dtype(DType::U8).unwrap();
    let t = randn(&mut rng, (3, 4));
    let f = randn(&mut rng, (3, 4));
    gradcheck("where_cond", |v| mask.where_cond(&v[0], &v[1]), &[t.clone(), f.clone()]);
    // Broadcast branches and a broadcast condition (a float condition: non-zero is true).
    let row = randn(&mut rng, 4);
    let col = randn(&mut rng, (3, 1));
    gradcheck("where_cond broadcast branches", |v| mask.where_cond(&v[0], &v[1]), &[row, col]);
    let cond = Tensor::from_vec(vec![0.0f64, 2.0, -1.0, 0.0], 4, dev()).unwrap();
    let tt = randn(&mut rng, (4, 3)).t().unwrap();
    gradcheck("where_cond broadcast cond", |v| cond.where_cond(&v[0], &v[1]), &[tt, f.clone()]);
    let m = ids(vec![0, 1, 1, 0], (1, 4));
    gradcheck("masked_fill", |v| v[0].masked_fill(&m, -3.0), std::slice::from_ref(&f));
    gradcheck("masked_fill transposed", |v| v[0].t()?.masked_fill(&m.t()?, 7.0), &[f]);
}

// ---- reductions ---------------------------------------------------------------------------------

fn reductions() {
    let mut rng = Rng::new(5);
    let x = randn(&mut rng, (2, 3, 4));
    let xp = randn(&mut rng, (4, 2, 3)).permute(&[1, 2, 0]).unwrap(); // [2, 3, 4], strided
    for (layout, x) in [("contiguous", x), ("permuted", xp)] {
        for keep in [false, true] {
            let tag = |op: &str, dims: &str| format!("{op}({dims}, keepdim={keep}) {layout}");
            gradcheck(&tag("sum", "0"), |v| v[0].sum(0usize, keep), std::slice::from_ref(&x));
            gradcheck(&tag("sum", "-1"), |v| v[0].sum(-1, keep), std::slice::from_ref(&x));
            gradcheck(&tag("sum", "[0, 2]"), |v| v[0].sum([0usize, 2], keep), std::slice::from_ref(&x));
            gradcheck(&tag("sum", "all"), |v| v[0].sum(AllDims, keep), std::slice::from_ref(&x));
            gradcheck(&tag("mean", "1"), |v| v[0].mean(1usize, keep), std::slice::from_ref(&x));
            gradcheck(&tag("mean", "[1, 2]"), |v| v[0].mean([1usize, 2], keep), std::slice::from_ref(&x));
            gradcheck(&tag("mean", "all"), |v| v[0].mean(AllDims, keep), std::slice::from_ref(&x));
            gradcheck(&tag("max", "0"), |v| v[0].max(0usize, keep), std::slice::from_ref(&x));
            gradcheck(&tag("max", "-1"), |v| v[0].max(-1, keep), std::slice::from_ref(&x));
            gradcheck(&tag("max", "[0, 1]"), |v| v[0].max([0usize, 1], keep), std::slice::from_ref(&x));
            gradcheck(&tag("max", "all"), |v| v[0].max(AllDims, keep), std::slice::from_ref(&x));
            gradcheck(&tag("min", "1"), |v| v[0].min(1usize, keep), std::slice::from_ref(&x));
            gradcheck(&tag("min", "[1, 2]"), |v| v[0].min([2usize, 1], keep), std::slice::from_ref(&x));
            gradcheck(&tag("min", "all"), |v| v[0].min(AllDims, keep), std::slice::from_ref(&x));
            gradcheck(&tag("var", "-1 unbiased"), |v| v[0].var(-1, keep, true), std::slice::from_ref(&x));
            gradcheck(&tag("var", "[0, 2] biased"), |v| v[0].var([0usize, 2], keep, false), std::slice::from_ref(&x));
            gradcheck(&tag("var", "all"), |v| v[0].var(AllDims, keep, true), std::slice::from_ref(&x));
            gradcheck(&tag("logsumexp", "-1"), |v| v[0].logsumexp(-1, keep), std::slice::from_ref(&x));
            gradcheck(&tag("logsumexp", "[0, 1]"), |v| v[0].logsumexp([0usize, 1], keep), std::slice::from_ref(&x));
            gradcheck(&tag("logsumexp", "all"), |v| v[0].logsumexp(AllDims, keep), std::slice::from_ref(&x));
        }
    }
}

fn reduction_of_broadcast_view_and_1d() {
    let mut rng = Rng::new(6);
    let row = randn(&mut rng, 4);
    gradcheck("sum of expanded", |v| v[0].expand((3, 4))?.sum(0usize, false), std::slice::from_ref(&row));
    gradcheck("max of 1-d", |v| v[0].max(0usize, false), std::slice::from_ref(&row));
    gradcheck("mean_all", |v| v[0].mean_all(), std::slice::from_ref(&row));
    gradcheck("sum_all", |v| v[0].sum_all(), &[row]);
}

fn max_min_ties_share_the_gradient() -> Result<()> {
    // PyTorch's amax rule: tied maxima split the gradient equally.
    let x = Tensor::from_vec(vec![1.0f64, 3.0, 3.0, 0.0], 4, dev())?.requires_grad();
    let g = x.max(0usize, false)?.backward()?;
    assert_eq!(g.get(&x).unwrap().to_vec::<f64>()?, vec![0.0, 0.5, 0.5, 0.0]);
    let g = x.min(0usize, false)?.backward()?;
    assert_eq!(g.get(&x).unwrap().to_vec::<f64>()?, vec![0.0, 0.0, 0.0, 1.0]);
    Ok(())
}

// ---- matmul -------------------------------------------------------------------------------------

fn matmul_shapes_and_batch_broadcast() {
    let cases: Vec<(Vec<usize>, Vec<usize>)> = vec![
        (vec![4], vec![4]),
        (vec![4], vec![4, 3]),
        (vec![2, 4], vec![4]),
        (vec![2, 4], vec![4, 3]),
        (vec![2, 2, 4], vec![4, 3]),
        (vec![4], vec![2, 4, 3]),
        (vec![2, 3, 4], vec![4]),
        (vec![2, 2, 4], vec![2, 4, 3]),
        (vec![2, 1, 2, 4], vec![3, 4, 2]),
        (vec![1, 2, 2, 4], vec![2, 1, 4, 3]),
        (vec![2, 3, 1, 4], vec![4, 1]),
    ];
    let mut rng = Rng::new(7);
    for (sa, sb) in &cases {
        let a = randn(&mut rng, sa.as_slice());
        let b = randn(&mut rng, sb.as_slice());
        gradcheck(&format!("matmul {sa:?} x {sb:?}"), |v| v[0].matmul(&v[1]), &[a, b]);
    }
}

fn matmul_transposed_and_strided_operands() {
    let mut rng = Rng::new(8);
    // Leaves that are themselves transposed views.
    let at = randn(&mut rng, (4, 3)).t().unwrap(); // [3, 4]
    let bt = randn(&mut rng, (2, 4)).t().unwrap(); // [4, 2]
    gradcheck("matmul a^T-leaf x b^T-leaf", |v| v[0].matmul(&v[1]), &[at, bt]);
    // Transposes taken inside the graph.
    let a = randn(&mut rng, (4, 3));
    let b = randn(&mut rng, (2, 4));
    gradcheck("matmul a.t() x b.t()", |v| v[0].t()?.matmul(&v[1].t()?), &[a, b]);
    // Batched with the batch dim not outermost in memory, and a narrowed operand.
    let a = randn(&mut rng, (3, 2, 4)).permute(&[1, 0, 2]).unwrap(); // [2, 3, 4]
    let b = randn(&mut rng, (2, 4, 5)).narrow(2, 1, 3).unwrap(); // [2, 4, 3]
    gradcheck("matmul permuted x narrowed", |v| v[0].matmul(&v[1]), &[a, b]);
    // One operand used on both sides: x^T x.
    let x = randn(&mut rng, (3, 2));
    gradcheck("matmul x^T x", |v| v[0].t()?.matmul(&v[0]), &[x]);
    // An expanded (stride-0) operand.
    let v = randn(&mut rng, (1, 4));
    let b = randn(&mut rng, (4, 2));
    gradcheck("matmul expanded rows", |t| t[0].expand((3, 4))?.matmul(&t[1]), &[v, b]);
}

// ---- views --------------------------------------------------------------------------------------

fn views() {
    let mut rng = Rng::new(9);
    let x = randn(&mut rng, (2, 3, 4));
    let xs = std::slice::from_ref(&x);
    gradcheck("reshape", |v| v[0].reshape((4, 6)), xs);
    gradcheck("reshape of transposed (copies)", |v| v[0].transpose(0, 2)?.reshape((6, 4)), xs);
    gradcheck("flatten", |v| v[0].flatten(1usize, 2usize), xs);
    gradcheck("flatten_all", |v| v[0].flatten_all(), xs);
    gradcheck("transpose", |v| v[0].transpose(0, 2), xs);
    gradcheck("transpose neg", |v| v[0].transpose(-1, -2), xs);
    gradcheck("permute", |v| v[0].permute(&[2, 0, 1]), xs);
    gradcheck("narrow 0", |v| v[0].narrow(0, 1, 1), xs);
    gradcheck("narrow 1", |v| v[0].narrow(1, 1, 2), xs);
    gradcheck("narrow -1", |v| v[0].narrow(-1, 0, 3), xs);
    gradcheck("narrow of narrow", |v| v[0].narrow(2, 1, 3)?.narrow(2, 1, 1), xs);
    gradcheck("unsqueeze", |v| v[0].unsqueeze(1)?.unsqueeze(-1), xs);
    gradcheck("squeeze", |v| v[0].narrow(1, 2, 1)?.squeeze(1), xs);
    gradcheck("broadcast_as", |v| v[0].narrow(0, 0, 1)?.broadcast_as((3, 2, 3, 4)), xs);
    gradcheck("expand", |v| v[0].narrow(1, 0, 1)?.expand((2, 5, 4)), xs);
    gradcheck("contiguous", |v| v[0].permute(&[1, 2, 0])?.contiguous(), xs);
    gradcheck("contiguous then math", |v| v[0].t()?.contiguous()?.sin(), xs);
    gradcheck("permute then narrow then reshape", |v| v[0].permute(&[2, 1, 0])?.narrow(0, 1, 2)?.reshape(12), xs);
    let xt = randn(&mut rng, (4, 3)).t().unwrap();
    gradcheck("reshape of a transposed leaf", |v| v[0].reshape(12), std::slice::from_ref(&xt));
    gradcheck("unsqueeze of a transposed leaf", |v| v[0].unsqueeze(0)?.exp(), &[xt]);
    gradcheck("reshape of an expanded view (copies)", |v| v[0].narrow(0, 0, 1)?.expand((3, 3, 4))?.reshape((9, 4)), xs);
}

fn to_dtype_round_trips() {
    let mut rng = Rng::new(10);
    let x = randn(&mut rng, (3, 4));
    // f64 -> f32 -> f64 rounds to 24 bits, so the finite difference needs a larger step; the
    // gradient itself is the identity's (rounded to f32).
    let loose = Tol { h: 1e-3, rtol: 1e-3, atol: 1e-4 };
    gradcheck_tol(
        "to f32 and back",
        |v| v[0].to_dtype(DType::F32)?.to_dtype(DType::F64),
        std::slice::from_ref(&x),
        loose,
    );
    gradcheck_tol(
        "to f32, tanh, back",
        |v| v[0].to_dtype(DType::F32)?.tanh()?.to_dtype(DType::F64),
        std::slice::from_ref(&x),
        loose,
    );
    let bf = Tol { h: 5e-2, rtol: 5e-2, atol: 5e-2 };
    gradcheck_tol(
        "to bf16 and back",
        |v| v[0].to_dtype(DType::BF16)?.to_dtype(DType::F64),
        std::slice::from_ref(&x),
        bf,
    );
    gradcheck("to f64 (no-op)", |v| v[0].to_dtype(DType::F64)?.sqr(), &[x]);
}

fn to_dtype_gradient_has_the_input_dtype() -> Result<()> {
    let x = Tensor::from_vec(vec![1.0f32, 2.0, 3.0], 3, dev())?.requires_grad();
    let y = x.to_dtype(DType::F64)?.sqr()?.sum_all()?;
    let g = y.backward()?;
    let gx = g.get(&x).unwrap();
    assert_eq!(gx.dtype(), DType::F32);
    assert_eq!(gx.to_vec::<f32>()?, vec![2.0, 4.0, 6.0]);
    // Casting to an integer dtype cuts the graph: no gradient can flow through rounding.
    let z = x.to_dtype(DType::I32)?;
    assert!(!z.tracks_grad());
    Ok(())
}

// ---- structure: cat, stack, chunk ---------------------------------------------------------------

fn cat_stack_chunk() {
    let mut rng = Rng::new(11);
    let a = randn(&mut rng, (2, 3));
    let b = randn(&mut rng, (1, 3));
    let c = randn(&mut rng, (3, 2)).t().unwrap(); // [2, 3], strided
    gradcheck("cat dim 0", |v| Tensor::cat(v, 0), &[a.clone(), b.clone(), c.clone()]);
    let d = randn(&mut rng, (2, 1));
    let e = randn(&mut rng, (2, 4)).narrow(1, 1, 2).unwrap();
    gradcheck("cat dim 1", |v| Tensor::cat(v, 1), &[a.clone(), d.clone(), e.clone(), c.clone()]);
    gradcheck("cat dim -1", |v| Tensor::cat(&[v[0].clone(), v[1].clone()], -1), &[a.clone(), d]);
    let x3 = randn(&mut rng, (2, 2, 3));
    let y3 = randn(&mut rng, (2, 1, 3));
    gradcheck("cat 3-d dim 1", |v| Tensor::cat(v, 1), &[x3.clone(), y3]);
    gradcheck("cat same tensor twice", |v| Tensor::cat(&[v[0].clone(), v[0].sin()?, v[0].clone()], 2), &[x3]);
    gradcheck("stack 0", |v| Tensor::stack(v, 0), &[a.clone(), c.clone()]);
    gradcheck("stack 1", |v| Tensor::stack(v, 1), &[a.clone(), c.clone()]);
    gradcheck("stack -1", |v| Tensor::stack(v, -1), &[a.clone(), c.clone()]);
    let x = randn(&mut rng, (6, 4));
    gradcheck(
        "chunk 3 dim 0",
        |v| {
            let ch = v[0].chunk(3, 0usize)?;
            assert_eq!(ch.len(), 3);
            ch[0].mul(&ch[1])?.add(&ch[2].sin()?)
        },
        std::slice::from_ref(&x),
    );
    gradcheck(
        "chunk 3 dim 1 (uneven: 2, 2)",
        |v| {
            let ch = v[0].chunk(3, 1usize)?;
            assert_eq!(ch.iter().map(|c| c.dims()[1]).collect::<Vec<_>>(), vec![2, 2]);
            ch[0].mul(&ch[1])
        },
        std::slice::from_ref(&x),
    );
    gradcheck(
        "chunk of transposed",
        |v| {
            let ch = v[0].t()?.chunk(3, -1)?;
            Tensor::cat(&[ch[2].clone(), ch[0].exp()?], 1)
        },
        &[x],
    );
}

// ---- indexing -----------------------------------------------------------------------------------

fn index_select_embedding_gather() {
    let mut rng = Rng::new(12);
    let x = randn(&mut rng, (4, 3));
    // Repeated indices: their gradients must add up.
    let i0 = ids(vec![2, 0, 2, 3, 2], 5);
    gradcheck("index_select dim 0", |v| v[0].index_select(&i0, 0usize), std::slice::from_ref(&x));
    let i1 = Tensor::from_vec(vec![1i32, 1, 0], 3, dev()).unwrap();
    gradcheck("index_select dim 1 (i32)", |v| v[0].index_select(&i1, 1usize), std::slice::from_ref(&x));
    gradcheck(
        "index_select of transposed",
        |v| v[0].t()?.index_select(&i0.narrow(0, 0, 2)?, 1usize),
        std::slice::from_ref(&x),
    );
    let tok = Tensor::from_vec(vec![3u8, 1, 1, 0, 3, 3], (2, 3), dev()).unwrap();
    gradcheck("embedding 2-d ids", |v| v[0].embedding(&tok), std::slice::from_ref(&x));
    let tok1 = ids(vec![0, 0, 2], 3);
    gradcheck("embedding of narrowed table", |v| v[0].narrow(1, 1, 2)?.embedding(&tok1), std::slice::from_ref(&x));
    let g1 = ids(vec![0, 2, 2, 1, 1, 1, 0, 0], (4, 2));
    gradcheck("gather dim 1", |v| v[0].gather(1usize, &g1), std::slice::from_ref(&x));
    let g0 = ids(vec![3, 0, 1, 3, 3, 2], (2, 3));
    gradcheck("gather dim 0", |v| v[0].gather(0usize, &g0), std::slice::from_ref(&x));
    let g0t = ids(vec![3, 0, 1, 3, 3, 2], (3, 2)).t().unwrap();
    gradcheck("gather with strided ids", |v| v[0].gather(0usize, &g0t), std::slice::from_ref(&x));
    gradcheck("gather from transposed", |v| v[0].t()?.gather(1usize, &g0), &[x]);
    let x3 = randn(&mut rng, (2, 3, 4));
    let g3 = ids(vec![0, 3, 1, 1, 2, 2, 3, 0, 0, 0, 1, 1], (2, 2, 3));
    gradcheck("gather 3-d dim 2", |v| v[0].gather(2usize, &g3), &[x3]);
}

// ---- nn ops -------------------------------------------------------------------------------------

fn softmax_and_log_softmax() {
    let mut rng = Rng::new(13);
    let x = randn(&mut rng, (3, 4));
    let x3 = randn(&mut rng, (2, 3, 4)).mul_scalar(2.0).unwrap();
    for (tag, t) in [("2-d", &x), ("3-d", &x3)] {
        let ts = std::slice::from_ref(t);
        gradcheck(&format!("softmax 0 {tag}"), |v| v[0].softmax(0usize), ts);
        gradcheck(&format!("softmax -1 {tag}"), |v| v[0].softmax(-1), ts);
        gradcheck(&format!("softmax 1 {tag}"), |v| v[0].softmax(1usize), ts);
        gradcheck(&format!("log_softmax 0 {tag}"), |v| v[0].log_softmax(0usize), ts);
        gradcheck(&format!("log_softmax -1 {tag}"), |v| v[0].log_softmax(-1), ts);
        gradcheck(&format!("log_softmax 1 {tag}"), |v| v[0].log_softmax(1usize), ts);
    }
    let xt = randn(&mut rng, (4, 3)).t().unwrap();
    gradcheck("softmax -1 of transposed leaf", |v| v[0].softmax(-1), std::slice::from_ref(&xt));
    gradcheck("log_softmax 0 of transposed leaf", |v| v[0].log_softmax(0usize), &[xt]);
    // A 1-element output of softmax is constant: the gradient is exactly zero.
    let s = randn(&mut rng, (3, 1));
    gradcheck("softmax over a size-1 dim", |v| v[0].softmax(-1), &[s]);
}

fn layer_norm() {
    let mut rng = Rng::new(14);
    let x = randn(&mut rng, (3, 5));
    let w = uniform(&mut rng, 0.5, 1.5, 5);
    let b = randn(&mut rng, 5);
    gradcheck(
        "layer_norm x, w, b",
        |v| v[0].layer_norm(Some(&v[1]), Some(&v[2]), 1e-5),
        &[x.clone(), w.clone(), b.clone()],
    );
    gradcheck("layer_norm x, w", |v| v[0].layer_norm(Some(&v[1]), None, 1e-5), &[x.clone(), w.clone()]);
    gradcheck("layer_norm x, b", |v| v[0].layer_norm(None, Some(&v[1]), 1e-5), &[x.clone(), b.clone()]);
    gradcheck("layer_norm x", |v| v[0].layer_norm(None, None, 1e-5), std::slice::from_ref(&x));
    let x3 = randn(&mut rng, (5, 2, 3)).permute(&[1, 2, 0]).unwrap(); // [2, 3, 5], strided
    gradcheck("layer_norm 3-d strided", |v| v[0].layer_norm(Some(&v[1]), Some(&v[2]), 1e-5), &[x3, w, b]);
    // The same weight used twice, and layer norm inside a larger expression.
    let w2 = uniform(&mut rng, 0.5, 1.5, 5);
    gradcheck("layer_norm shared weight", |v| v[0].layer_norm(Some(&v[1]), None, 1e-5)?.mul(&v[1])?.tanh(), &[x, w2]);
}

fn losses() {
    let mut rng = Rng::new(15);
    let p = randn(&mut rng, (4, 3));
    let y = randn(&mut rng, (4, 3));
    gradcheck("mse_loss", |v| v[0].mse_loss(&v[1]), &[p.clone(), y.clone()]);
    gradcheck("mse_loss transposed", |v| v[0].t()?.mse_loss(&v[1].t()?), &[p, y]);
    let logits = randn(&mut rng, (5, 4)).mul_scalar(2.0).unwrap();
    let t = ids(vec![0, 3, 1, 1, 2], 5);
    gradcheck("cross_entropy", |v| v[0].cross_entropy(&t, None), std::slice::from_ref(&logits));
    let ti = Tensor::from_vec(vec![0i32, -100, 1, -100, 3], 5, dev()).unwrap();
    gradcheck("cross_entropy ignore_index", |v| v[0].cross_entropy(&ti, Some(-100)), std::slice::from_ref(&logits));
    let tu = Tensor::from_vec(vec![2u8, 2, 1, 0, 2], 5, dev()).unwrap();
    gradcheck("cross_entropy ignore a real class", |v| v[0].cross_entropy(&tu, Some(2)), std::slice::from_ref(&logits));
    let lt = randn(&mut rng, (4, 5)).t().unwrap();
    gradcheck("cross_entropy of transposed logits", |v| v[0].cross_entropy(&t, None), std::slice::from_ref(&lt));
    gradcheck("cross_entropy transposed, ignore_index", |v| v[0].cross_entropy(&ti, Some(-100)), &[lt]);
    let ln = randn(&mut rng, (5, 7)).narrow(1, 2, 4).unwrap(); // [5, 4], strided rows
    gradcheck("cross_entropy narrowed, ignore a real class", |v| v[0].cross_entropy(&tu, Some(2)), &[ln]);
    // Inside a larger expression, the logits used twice.
    gradcheck(
        "cross_entropy in an expression",
        |v| v[0].tanh()?.mul_scalar(3.0)?.cross_entropy(&t, Some(1))?.mul(&v[0].sqr()?.mean_all()?),
        std::slice::from_ref(&logits),
    );
}

/// The definition the fused op replaced: log_softmax, gather, mask, mean over kept rows.
fn composed_cross_entropy(x: &Tensor, t: &Tensor, ignore_index: Option<i64>) -> Result<Tensor> {
    let t = t.to_dtype(DType::I32)?;
    let keep = match ignore_index {
        Some(ix) => t.ne(&t.scalar_like(ix as f64)?)?,
        None => Tensor::ones(t.shape().clone(), DType::U8, t.device())?,
    };
    let safe_t = keep.where_cond(&t, &t.scalar_like(0.0)?)?;
    let picked = x.log_softmax(1)?.gather(1, &safe_t.unsqueeze(1)?)?.squeeze(1)?;
    let keep = keep.to_dtype(x.dtype())?;
    picked.mul(&keep)?.sum_all()?.neg()?.div(&keep.sum_all()?)
}

fn fused_cross_entropy_equals_the_composed_definition() -> Result<()> {
    let mut rng = Rng::new(21);
    let close = |what: &str, a: &[f64], b: &[f64]| {
        assert_eq!(a.len(), b.len(), "{what}");
        for (i, (x, y)) in a.iter().zip(b).enumerate() {
            assert!((x - y).abs() <= 1e-12 * (1.0 + x.abs()), "{what} [{i}]: fused {x} vs composed {y}");
        }
    };
    let raw: Vec<i64> = vec![0, 6, -100, 3, 3, 1, -100, 5, 2, 0, 4];
    let cases: Vec<(&str, Tensor, Option<i64>)> = vec![
        ("i32", Tensor::from_vec(raw.iter().map(|&v| v as i32).collect::<Vec<_>>(), 11, dev())?, Some(-100)),
        ("i8", Tensor::from_vec(raw.iter().map(|&v| v as i8).collect::<Vec<_>>(), 11, dev())?, Some(-100)),
        ("u32", ids(raw.iter().map(|&v| v.rem_euclid(7) as u32).collect(), 11), None),
        (
            "u8 ignore 3",
            Tensor::from_vec(raw.iter().map(|&v| v.rem_euclid(7) as u8).collect::<Vec<_>>(), 11, dev())?,
            Some(3),
        ),
    ];
    let contiguous = randn(&mut rng, (11, 7)).mul_scalar(3.0)?;
    let transposed = randn(&mut rng, (7, 11)).mul_scalar(3.0)?.t()?;
    let narrowed = randn(&mut rng, (11, 10)).mul_scalar(3.0)?.narrow(1, 2, 7)?;
    for (layout, x) in [("contiguous", contiguous), ("transposed", transposed), ("narrowed", narrowed)] {
        for (name, t, ig) in &cases {
            let what = format!("{layout} {name}");
            let xv = x.requires_grad();
            let fused = xv.cross_entropy(t, *ig)?;
            let gf = fused.backward()?.get(&xv).cloned().expect("fused grad");
            let xc = x.requires_grad();
            let comp = composed_cross_entropy(&xc, t, *ig)?;
            let gc = comp.backward()?.get(&xc).cloned().expect("composed grad");
            assert_eq!(fused.dims(), comp.dims(), "{what}: loss shape");
            assert_eq!(fused.dtype(), DType::F64, "{what}: loss dtype");
            close(&format!("{what} loss"), &fused.to_f64_vec()?, &comp.to_f64_vec()?);
            close(&format!("{what} grad"), &gf.to_f64_vec()?, &gc.to_f64_vec()?);
        }
    }
    Ok(())
}

fn cross_entropy_edge_rows() -> Result<()> {
    // An ignored row of all -inf adds nothing and no NaN, to the loss or the gradient.
    let ninf = f64::NEG_INFINITY;
    let x = Tensor::from_vec(vec![1.0, 2.0, 0.5, ninf, ninf, ninf], (2, 3), dev())?.requires_grad();
    let t = Tensor::from_vec(vec![1i32, -100], 2, dev())?;
    let l = x.cross_entropy(&t, Some(-100))?;
    let lse = [1.0f64, 2.0, 0.5].iter().map(|v| v.exp()).sum::<f64>().ln();
    assert!((l.item::<f64>()? - (lse - 2.0)).abs() < 1e-12);
    let g = l.backward()?.get(&x).cloned().expect("grad").to_f64_vec()?;
    assert!(g.iter().all(|v| v.is_finite()), "{g:?}");
    assert_eq!(&g[3..], &[0.0, 0.0, 0.0]);
    // Every row ignored: 0 / 0, NaN as in PyTorch; the gradient is zero.
    let x = Tensor::from_vec(vec![1.0f32, 2.0, 3.0, 4.0], (2, 2), dev())?.requires_grad();
    let t = Tensor::from_vec(vec![-1i32, -1], 2, dev())?;
    let l = x.cross_entropy(&t, Some(-1))?;
    assert_eq!(l.dtype(), DType::F32);
    assert!(l.item::<f32>()?.is_nan());
    let g = l.backward()?.get(&x).cloned().expect("grad").to_f64_vec()?;
    assert_eq!(g, vec![0.0; 4]);
    // Half-precision logits give a loss of their dtype, computed in f32.
    let x = Tensor::from_vec(vec![1.0f64, 2.0, 0.5, -1.0, 0.0, 3.0], (2, 3), dev())?;
    let t = ids(vec![1, 2], 2);
    let want = x.cross_entropy(&t, None)?.item::<f64>()?;
    for d in [DType::F16, DType::BF16] {
        let l = x.to_dtype(d)?.cross_entropy(&t, None)?;
        assert_eq!(l.dtype(), d);
        assert!((l.item_f64()? - want).abs() < 2e-2, "{d}: {} vs {want}", l.item_f64()?);
    }
    Ok(())
}

fn cross_entropy_matches_definition() -> Result<()> {
    let logits = Tensor::from_vec(vec![1.0f64, 2.0, 0.5, -1.0, 0.0, 3.0], (2, 3), dev())?;
    let t = ids(vec![1, 2], 2);
    let l = logits.cross_entropy(&t, None)?.item::<f64>()?;
    let lse = |r: &[f64]| r.iter().map(|v| v.exp()).sum::<f64>().ln();
    let want = ((lse(&[1.0, 2.0, 0.5]) - 2.0) + (lse(&[-1.0, 0.0, 3.0]) - 3.0)) / 2.0;
    assert!((l - want).abs() < 1e-12, "{l} vs {want}");
    let t = Tensor::from_vec(vec![1i32, -1], 2, dev())?;
    let l = logits.cross_entropy(&t, Some(-1))?.item::<f64>()?;
    assert!((l - (lse(&[1.0, 2.0, 0.5]) - 2.0)).abs() < 1e-12);
    Ok(())
}

fn dropout_with_a_fixed_seed() {
    let mut rng = Rng::new(16);
    let x = randn(&mut rng, (4, 5));
    gradcheck("dropout p=0.3", |v| v[0].dropout_with(&mut Rng::new(99), 0.3, true), std::slice::from_ref(&x));
    gradcheck("dropout eval", |v| v[0].dropout_with(&mut Rng::new(99), 0.3, false), std::slice::from_ref(&x));
    gradcheck("dropout of transposed", |v| v[0].t()?.dropout_with(&mut Rng::new(5), 0.5, true), &[x]);
}

fn dropout_mask_and_scale() -> Result<()> {
    let x = Tensor::ones((100, 100), DType::F64, dev())?;
    let y = x.dropout_with(&mut Rng::new(7), 0.25, true)?.to_vec::<f64>()?;
    let kept = y.iter().filter(|&&v| v != 0.0).count();
    assert!(y.iter().all(|&v| v == 0.0 || (v - 1.0 / 0.75).abs() < 1e-12));
    assert!((kept as f64 / 1e4 - 0.75).abs() < 0.02, "kept {kept} of 10000");
    // Same seed, same mask.
    assert_eq!(y, x.dropout_with(&mut Rng::new(7), 0.25, true)?.to_vec::<f64>()?);
    Ok(())
}

// ---- autograd machinery -------------------------------------------------------------------------

fn dag_with_shared_subexpressions() {
    let mut rng = Rng::new(17);
    let x = randn(&mut rng, (3, 4));
    let w = randn(&mut rng, (4, 2));
    gradcheck(
        "shared subexpressions",
        |v| {
            let (x, w) = (&v[0], &v[1]);
            let h = x.matmul(w)?.tanh()?; // used three times below
            let z = h.mul(&h)?.add(&h.exp()?)?;
            let s = h.sum(0usize, true)?; // broadcast back against h
            z.sub(&s)?.add(&x.sum(1usize, true)?)?.mul(&x.narrow(1, 0, 2)?)
        },
        &[x, w],
    );
}

fn tensor_used_twice_sums_gradients() -> Result<()> {
    let x = Tensor::from_vec(vec![1.0f64, -2.0, 3.0], 3, dev())?.requires_grad();
    // y = x * 3 + x^2: dy/dx = 3 + 2x
    let y = x.mul_scalar(3.0)?.add(&x.sqr()?)?.sum_all()?;
    let g = y.backward()?;
    assert_eq!(g.get(&x).unwrap().to_vec::<f64>()?, vec![5.0, -1.0, 9.0]);
    // Only leaf variables reach the store: intermediate gradients are dropped during the walk.
    assert_eq!(g.len(), 1);
    // A diamond: a = x.exp(); loss = sum(a * a.sin()).
    let a = x.exp()?;
    let loss = a.mul(&a.sin()?)?.sum_all()?;
    let g = loss.backward()?.get(&x).unwrap().to_vec::<f64>()?;
    for (gi, xi) in g.iter().zip([1.0f64, -2.0, 3.0]) {
        let e = xi.exp();
        let want = e * (e.sin() + e * e.cos());
        assert!((gi - want).abs() < 1e-9 * want.abs().max(1.0), "{gi} vs {want}");
    }
    Ok(())
}

fn gradients_accumulate_over_backward_calls() -> Result<()> {
    let mut rng = Rng::new(18);
    let x = randn(&mut rng, (2, 3)).requires_grad();
    let w = randn(&mut rng, (3, 2)).requires_grad();
    let loss1 = x.matmul(&w)?.sin()?.sum_all()?;
    let loss2 = x.sqr()?.mean_all()?;
    let (g1, g2) = (loss1.backward()?, loss2.backward()?);
    assert!(g2.get(&w).is_none(), "loss2 does not depend on w");
    let mut store = GradStore::default();
    loss1.backward_into(&mut store)?;
    loss2.backward_into(&mut store)?;
    let want = g1.get(&x).unwrap().add(g2.get(&x).unwrap())?.to_vec::<f64>()?;
    assert_eq!(store.get(&x).unwrap().to_vec::<f64>()?, want);
    assert_eq!(store.get(&w).unwrap().to_vec::<f64>()?, g1.get(&w).unwrap().to_vec::<f64>()?);
    // Backward on the same graph again adds the same gradient once more (the graph is reusable).
    loss1.backward_into(&mut store)?;
    let want2 = g1.get(&w).unwrap().mul_scalar(2.0)?.to_vec::<f64>()?;
    let got2 = store.get(&w).unwrap().to_vec::<f64>()?;
    assert!(got2.iter().zip(&want2).all(|(a, b)| (a - b).abs() < 1e-12));
    Ok(())
}

fn no_grad_scope_records_nothing() -> Result<()> {
    let x = Tensor::from_vec(vec![1.0f64, 2.0], 2, dev())?.requires_grad();
    {
        let _g = no_grad();
        assert!(!ferrograd_core::is_grad_enabled());
        let y = x.sqr()?.sum_all()?;
        assert!(!y.tracks_grad() && y.op().is_none());
        assert!(matches!(y.backward(), Err(Error::Backward(_))));
        // Views made in the scope are not recorded either.
        assert!(x.unsqueeze(0)?.op().is_none() && x.narrow(0, 1, 1)?.op().is_none());
        {
            let _inner = no_grad();
        }
        assert!(!ferrograd_core::is_grad_enabled(), "an inner guard restores the outer state");
    }
    assert!(ferrograd_core::is_grad_enabled());
    let y = with_no_grad(|| x.exp())?;
    assert!(y.op().is_none());
    // Recording resumes after the scope.
    let y = x.sqr()?.sum_all()?;
    assert!(y.tracks_grad());
    assert_eq!(y.backward()?.get(&x).unwrap().to_vec::<f64>()?, vec![2.0, 4.0]);
    Ok(())
}

fn detach_stops_gradients() -> Result<()> {
    let x = Tensor::from_vec(vec![1.0f64, 2.0, 3.0], 3, dev())?.requires_grad();
    let d = x.detach();
    assert!(!d.tracks_grad() && !d.is_variable());
    assert_eq!(d.to_vec::<f64>()?, x.to_vec::<f64>()?);
    // Only the tracked factor contributes: d(x * stop(x))/dx = stop(x).
    let g = x.mul(&d)?.sum_all()?.backward()?;
    assert_eq!(g.get(&x).unwrap().to_vec::<f64>()?, vec![1.0, 2.0, 3.0]);
    // A loss that depends only on detached values cannot be differentiated.
    assert!(matches!(d.sqr()?.sum_all()?.backward(), Err(Error::Backward(_))));
    // Detaching an intermediate cuts everything below it.
    let w = Tensor::from_vec(vec![0.5f64, 0.5, 0.5], 3, dev())?.requires_grad();
    let h = x.mul(&w)?.detach();
    let g = h.mul(&w)?.sum_all()?.backward()?;
    assert!(g.get(&x).is_none());
    assert_eq!(g.get(&w).unwrap().to_vec::<f64>()?, vec![0.5, 1.0, 1.5]);
    Ok(())
}

fn leaf_gradient_of_a_strided_leaf_has_its_shape() -> Result<()> {
    let base = Tensor::arange(0.0, 6.0, 1.0, DType::F64, dev())?.reshape((2, 3))?;
    let x = base.t()?.requires_grad(); // [3, 2], non-contiguous leaf
    assert!(x.is_variable() && !x.is_contiguous());
    let w = Tensor::from_vec(vec![1.0f64, 2.0, 3.0, 4.0, 5.0, 6.0], (3, 2), dev())?;
    let g = x.mul(&w)?.sum_all()?.backward()?;
    assert_eq!(g.get(&x).unwrap().to_vec2::<f64>()?, vec![vec![1.0, 2.0], vec![3.0, 4.0], vec![5.0, 6.0]]);
    Ok(())
}

#[test]
fn deep_graphs_backward_and_drop_without_recursion() -> Result<()> {
    // 100k ops in a chain: backward walks it iteratively, and dropping it must not recurse once
    // per op (that overflowed the 2 MiB test-thread stack before `Drop for Inner` unlinked it).
    let x = Tensor::from_vec(vec![1.0f32, 2.0, 3.0], 3, dev())?.requires_grad();
    let mut y = x.clone();
    for _ in 0..100_000 {
        y = y.add_scalar(1e-3)?;
    }
    let loss = y.mul(&x)?.sum_all()?;
    let g = loss.backward()?;
    let gx = g.get(&x).unwrap().to_vec::<f32>()?;
    let want: Vec<f32> = y.to_vec::<f32>()?.iter().zip([1.0f32, 2.0, 3.0]).map(|(yi, xi)| yi + xi).collect();
    assert!(gx.iter().zip(&want).all(|(a, b)| (a - b).abs() < 1e-3), "{gx:?} vs {want:?}");
    drop((loss, y));
    // A graph shared between two outputs is unlinked only when the last owner goes.
    let a = x.exp()?;
    let (b, c) = (a.sin()?, a.cos()?);
    drop(b);
    let g = c.sum_all()?.backward()?;
    assert!(g.get(&x).is_some());
    Ok(())
}

#[test]
fn tensors_cross_threads_and_no_grad_is_per_thread() -> Result<()> {
    fn send_sync<T: Send + Sync>() {}
    send_sync::<Tensor>();
    send_sync::<GradStore>();
    let x = Tensor::from_vec(vec![1.0f64, 2.0], 2, dev())?.requires_grad();
    let _g = no_grad();
    let y = x.sqr()?;
    assert!(y.op().is_none());
    // Another thread is not inside this thread's no-grad scope.
    let xc = x.clone();
    let grad = std::thread::spawn(move || -> Result<Vec<f64>> {
        let g = xc.sqr()?.sum_all()?.backward()?;
        g.get(&xc).unwrap().to_vec::<f64>()
    })
    .join()
    .unwrap()?;
    assert_eq!(grad, vec![2.0, 4.0]);
    Ok(())
}
