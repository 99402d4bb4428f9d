//! Property tests for shapes, broadcasting, views and the loops that read them: every result is
//! compared with a naive reference (`Nd`, a row-major array indexed one element at a time).
//! Values are small integers stored as f64, so sums and products are exact and compared with `==`.
//!
//! One backend suite (`backend_tests!`): each property runs as `on_cpu::NAME` and, on a GPU
//! machine, as `on_cuda::NAME` with its tensors (and the views of them) made on the device.

use ferrograd_core::{AllDims, DType, Error, Shape, Tensor};
use proptest::prelude::*;

use crate::common;

use common::dev;

backend_tests!(
    broadcast_shape_matches_reference,
    broadcast_binary_ops_equal_explicit_loops,
    permute_round_trips,
    reshape_round_trips,
    narrow_pieces_cat_back,
    any_view_reads_like_the_reference,
    sum_over_dims_matches_reference,
    matmul_matches_triple_loop,
    matmul_vector_promotion,
    large_strided_tensors_match_the_reference,
    large_matmul_matches_triple_loop,
    empty_tensors,
    set_overwrites_in_place_even_from_a_view_of_itself,
);

// ---- the reference ------------------------------------------------------------------------------

/// Every index of `dims` in row-major order.
fn indices(dims: &[usize]) -> Vec<Vec<usize>> {
    let n: usize = dims.iter().product();
    let mut out = Vec::with_capacity(n);
    let mut idx = vec![0; dims.len()];
    for _ in 0..n {
        out.push(idx.clone());
        for d in (0..dims.len()).rev() {
            idx[d] += 1;
            if idx[d] < dims[d] {
                break;
            }
            idx[d] = 0;
        }
    }
    out
}

#[derive(Clone, Debug, PartialEq)]
struct Nd {
    dims: Vec<usize>,
    data: Vec<f64>,
}

impl Nd {
    fn iota(dims: &[usize]) -> Nd {
        let n = dims.iter().product();
        // Small distinct integers, some negative: exact in every float dtype we compare with.
        Nd { dims: dims.to_vec(), data: (0..n).map(|i| ((i * 7) % 23) as f64 - 11.0).collect() }
    }
    fn from_fn(dims: &[usize], f: impl Fn(&[usize]) -> f64) -> Nd {
        Nd { dims: dims.to_vec(), data: indices(dims).iter().map(|i| f(i)).collect() }
    }
    fn get(&self, idx: &[usize]) -> f64 {
        let mut flat = 0;
        for (&i, &d) in idx.iter().zip(&self.dims) {
            assert!(i < d);
            flat = flat * d + i;
        }
        self.data[flat]
    }
    fn tensor(&self) -> Tensor {
        Tensor::from_vec(self.data.clone(), self.dims.clone(), dev()).unwrap()
    }
    fn permute(&self, p: &[usize]) -> Nd {
        let dims: Vec<usize> = p.iter().map(|&q| self.dims[q]).collect();
        Nd::from_fn(&dims, |i| {
            let mut src = vec![0; p.len()];
            for (k, &q) in p.iter().enumerate() {
                src[q] = i[k];
            }
            self.get(&src)
        })
    }
    fn narrow(&self, d: usize, start: usize, len: usize) -> Nd {
        let mut dims = self.dims.clone();
        dims[d] = len;
        Nd::from_fn(&dims, |i| {
            let mut src = i.to_vec();
            src[d] += start;
            self.get(&src)
        })
    }
    fn reshape(&self, dims: &[usize]) -> Nd {
        Nd { dims: dims.to_vec(), data: self.data.clone() }
    }
    fn broadcast(&self, dims: &[usize]) -> Nd {
        let lead = dims.len() - self.dims.len();
        Nd::from_fn(dims, |i| {
            let src: Vec<usize> =
                self.dims.iter().enumerate().map(|(k, &d)| if d == 1 { 0 } else { i[lead + k] }).collect();
            self.get(&src)
        })
    }
    fn sum(&self, red: &[usize], keepdim: bool) -> Nd {
        let kept: Vec<usize> =
            self.dims.iter().enumerate().map(|(k, &d)| if red.contains(&k) { 1 } else { d }).collect();
        let mut out = Nd::from_fn(&kept, |_| 0.0);
        for i in indices(&self.dims) {
            let o: Vec<usize> = i.iter().enumerate().map(|(k, &v)| if red.contains(&k) { 0 } else { v }).collect();
            let mut flat = 0;
            for (&v, &d) in o.iter().zip(&kept) {
                flat = flat * d + v;
            }
            out.data[flat] += self.get(&i);
        }
        if !keepdim {
            out.dims = self.dims.iter().enumerate().filter(|(k, _)| !red.contains(k)).map(|(_, &d)| d).collect();
        }
        out
    }
}

/// NumPy's rule, written independently of the library's.
fn ref_broadcast(a: &[usize], b: &[usize]) -> Option<Vec<usize>> {
    let r = a.len().max(b.len());
    let pad = |s: &[usize]| [vec![1; r - s.len()], s.to_vec()].concat();
    let (a, b) = (pad(a), pad(b));
    a.iter()
        .zip(&b)
        .map(|(&x, &y)| {
            if x == y || y == 1 {
                Some(x)
            } else if x == 1 {
                Some(y)
            } else {
                None
            }
        })
        .collect()
}

// ---- strategies ---------------------------------------------------------------------------------

fn shape(max_rank: usize, max_dim: usize) -> impl Strategy<Value = Vec<usize>> {
    prop::collection::vec(1..=max_dim, 0..=max_rank)
}

/// A shape and another that broadcasts with it more often than chance would: each dim of the
/// second is copied, set to 1, or random; its rank may differ.
fn broadcast_pair(max_rank: usize, max_dim: usize) -> impl Strategy<Value = (Vec<usize>, Vec<usize>)> {
    (shape(max_rank, max_dim), prop::collection::vec((0u8..4, 1usize..=max_dim), 0..=max_rank)).prop_map(|(a, spec)| {
        let b: Vec<usize> = spec
            .iter()
            .enumerate()
            .map(|(i, &(kind, d))| {
                let aligned = (a.len() + i).checked_sub(spec.len()).and_then(|j| a.get(j).copied());
                match (kind, aligned) {
                    (0 | 1, Some(x)) => x,
                    (2, _) => 1,
                    _ => d,
                }
            })
            .collect();
        (a, b)
    })
}

/// A random permutation of `0..n` from a seed.
fn perm_from(n: usize, mut seed: u64) -> Vec<usize> {
    let mut p: Vec<usize> = (0..n).collect();
    for i in (1..n).rev() {
        seed = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        p.swap(i, (seed >> 33) as usize % (i + 1));
    }
    p
}

fn cfg(cases: u32) -> ProptestConfig {
    ProptestConfig { cases, failure_persistence: None, ..ProptestConfig::default() }
}

// ---- properties ---------------------------------------------------------------------------------

proptest! {
    #![proptest_config(cfg(128))]

        fn broadcast_shape_matches_reference((a, b) in broadcast_pair(4, 4)) {
        let got = Shape::from(a.clone()).broadcast_with(&Shape::from(b.clone()), "add");
        match ref_broadcast(&a, &b) {
            Some(want) => prop_assert_eq!(got.unwrap().to_vec(), want),
            None => {
                let is_shape_mismatch = matches!(got, Err(Error::ShapeMismatch { .. }));
                prop_assert!(is_shape_mismatch);
            }
        }
    }

        fn broadcast_binary_ops_equal_explicit_loops((a, b) in broadcast_pair(4, 4)) {
        let (na, nb) = (Nd::iota(&a), Nd::iota(&b));
        let (ta, tb) = (na.tensor(), nb.tensor().affine(1.0, 0.5).unwrap()); // no zero divisors
        let Some(out) = ref_broadcast(&a, &b) else {
            prop_assert!(ta.add(&tb).is_err());
            return Ok(());
        };
        let (ra, rb) = (na.broadcast(&out), nb.broadcast(&out));
        for (name, f, r) in [
            ("add", Tensor::add as fn(&Tensor, &Tensor) -> _, (|x: f64, y: f64| x + y) as fn(f64, f64) -> f64),
            ("sub", Tensor::sub, |x, y| x - y),
            ("mul", Tensor::mul, |x, y| x * y),
            ("div", Tensor::div, |x, y| x / y),
            ("maximum", Tensor::maximum, f64::max),
        ] {
            let got = f(&ta, &tb).unwrap();
            prop_assert_eq!(got.dims(), out.as_slice(), "{}", name);
            let want: Vec<f64> = ra.data.iter().zip(&rb.data).map(|(&x, &y)| r(x, y + 0.5)).collect();
            prop_assert_eq!(got.to_vec::<f64>().unwrap(), want, "{}", name);
        }
        // Comparisons broadcast the same way.
        let lt = ta.lt(&tb).unwrap().to_vec::<u8>().unwrap();
        let want: Vec<u8> = ra.data.iter().zip(&rb.data).map(|(&x, &y)| (x < y + 0.5) as u8).collect();
        prop_assert_eq!(lt, want);
    }

        fn permute_round_trips(dims in shape(4, 4), seed in any::<u64>()) {
        let nd = Nd::iota(&dims);
        let x = nd.tensor();
        let p = perm_from(dims.len(), seed);
        let y = x.permute(&p).unwrap();
        prop_assert!(y.same_storage(&x), "permute must be a view");
        prop_assert_eq!(y.to_vec::<f64>().unwrap(), nd.permute(&p).data);
        let mut inv = vec![0; p.len()];
        for (i, &q) in p.iter().enumerate() {
            inv[q] = i;
        }
        prop_assert_eq!(y.permute(&inv).unwrap().to_vec::<f64>().unwrap(), nd.data.clone());
        if dims.len() >= 2 {
            let t = x.transpose(0, -1).unwrap();
            prop_assert_eq!(t.transpose(0, -1).unwrap().to_vec::<f64>().unwrap(), nd.data.clone());
        }
    }

        fn reshape_round_trips(dims in shape(4, 4), seed in any::<u64>(), split in 0usize..4) {
        let nd = Nd::iota(&dims);
        let n = nd.data.len();
        // A random shape with the same element count: n split into two factors, maybe with 1s.
        let divisors: Vec<usize> = (1..=n).filter(|&d| n.is_multiple_of(d)).collect();
        let d0 = divisors[(seed as usize) % divisors.len()];
        let target: Vec<usize> = match split {
            0 => vec![n],
            1 => vec![d0, n / d0],
            2 => vec![1, d0, 1, n / d0],
            _ => vec![],
        };
        let target = if target.is_empty() && n != 1 { vec![n] } else { target };
        // From a contiguous tensor and from a permuted (strided) one.
        for x in [nd.tensor(), nd.permute(&perm_from(dims.len(), seed)).tensor()] {
            let src = x.to_vec::<f64>().unwrap();
            let y = x.reshape(target.clone()).unwrap();
            prop_assert_eq!(y.dims(), target.as_slice());
            prop_assert_eq!(y.to_vec::<f64>().unwrap(), src.clone());
            prop_assert_eq!(y.reshape(x.dims().to_vec()).unwrap().to_vec::<f64>().unwrap(), src);
        }
        let p = perm_from(dims.len(), seed);
        let xp = nd.tensor().permute(&p).unwrap();
        prop_assert_eq!(xp.flatten_all().unwrap().to_vec::<f64>().unwrap(), nd.permute(&p).data);
    }

        fn narrow_pieces_cat_back(dims in shape(4, 5).prop_filter("rank >= 1", |d| !d.is_empty()), seed in any::<u64>()) {
        let nd = Nd::iota(&dims);
        let x = nd.tensor();
        let d = (seed as usize) % dims.len();
        let size = dims[d];
        let cut = (seed as usize / 7) % (size + 1);
        let a = x.narrow(d, 0, cut).unwrap();
        let b = x.narrow(d, cut, size - cut).unwrap();
        prop_assert_eq!(a.to_vec::<f64>().unwrap(), nd.narrow(d, 0, cut).data);
        prop_assert_eq!(b.to_vec::<f64>().unwrap(), nd.narrow(d, cut, size - cut).data);
        let pieces: Vec<Tensor> = [a, b].into_iter().filter(|t| t.elem_count() > 0).collect();
        let back = Tensor::cat(&pieces, d).unwrap();
        prop_assert_eq!(back.dims(), dims.as_slice());
        prop_assert_eq!(back.to_vec::<f64>().unwrap(), nd.data.clone());
        let chunks = x.chunk(3, d).unwrap();
        prop_assert_eq!(Tensor::cat(&chunks, d).unwrap().to_vec::<f64>().unwrap(), nd.data);
    }

    /// A random chain of views; reading it (to_vec), copying it (contiguous), and feeding it to a
    /// strided kernel (affine, sum) all agree with the reference.
        fn any_view_reads_like_the_reference(
        dims in shape(3, 4).prop_filter("rank >= 1", |d| !d.is_empty()),
        ops in prop::collection::vec((0u8..6, any::<u64>()), 0..6),
    ) {
        let mut nd = Nd::iota(&dims);
        let mut x = nd.tensor();
        for (kind, s) in ops {
            let r = nd.dims.len();
            match kind {
                0 if r > 0 => {
                    let p = perm_from(r, s);
                    x = x.permute(&p).unwrap();
                    nd = nd.permute(&p);
                }
                1 if r > 0 => {
                    let d = s as usize % r;
                    let size = nd.dims[d];
                    let start = (s as usize / 5) % size;
                    let len = 1 + (s as usize / 11) % (size - start);
                    x = x.narrow(d, start, len).unwrap();
                    nd = nd.narrow(d, start, len);
                }
                2 if r < 5 => {
                    let at = s as usize % (r + 1);
                    x = x.unsqueeze(at as isize).unwrap();
                    let mut dims = nd.dims.clone();
                    dims.insert(at, 1);
                    nd = nd.reshape(&dims);
                }
                3 if r < 5 => {
                    // Expand size-1 dims and add a leading dim.
                    let mut dims: Vec<usize> = nd.dims.iter().map(|&d| if d == 1 { 1 + s as usize % 3 } else { d }).collect();
                    dims.insert(0, 1 + (s as usize / 3) % 2);
                    x = x.broadcast_as(dims.clone()).unwrap();
                    nd = nd.broadcast(&dims);
                }
                4 if r > 0 => {
                    let d = s as usize % r;
                    x = x.squeeze(d).unwrap();
                    if nd.dims[d] == 1 {
                        let mut dims = nd.dims.clone();
                        dims.remove(d);
                        nd = nd.reshape(&dims);
                    }
                }
                5 => {
                    let n = nd.data.len();
                    x = x.reshape(n).unwrap();
                    nd = nd.reshape(&[n]);
                }
                _ => {}
            }
            prop_assert_eq!(x.dims(), nd.dims.as_slice());
        }
        prop_assert_eq!(x.to_vec::<f64>().unwrap(), nd.data.clone());
        let c = x.contiguous().unwrap();
        prop_assert!(c.is_contiguous());
        prop_assert_eq!(c.to_vec::<f64>().unwrap(), nd.data.clone());
        let want: Vec<f64> = nd.data.iter().map(|v| v * 2.0 + 1.0).collect();
        prop_assert_eq!(x.affine(2.0, 1.0).unwrap().to_vec::<f64>().unwrap(), want);
        let f32s: Vec<f32> = nd.data.iter().map(|&v| v as f32).collect();
        prop_assert_eq!(x.to_dtype(DType::F32).unwrap().to_vec::<f32>().unwrap(), f32s);
        prop_assert_eq!(x.sum_all().unwrap().to_vec::<f64>().unwrap(), vec![nd.data.iter().sum::<f64>()]);
    }

        fn sum_over_dims_matches_reference(
        dims in shape(4, 4).prop_filter("rank >= 1", |d| !d.is_empty()),
        mask in any::<u8>(),
        keepdim in any::<bool>(),
        permuted in any::<bool>(),
    ) {
        let mut nd = Nd::iota(&dims);
        let mut x = nd.tensor();
        if permuted {
            let p = perm_from(dims.len(), mask as u64);
            x = x.permute(&p).unwrap();
            nd = nd.permute(&p);
        }
        let red: Vec<usize> = (0..dims.len()).filter(|d| mask & (1 << d) != 0).collect();
        let want = nd.sum(&red, keepdim);
        let got = x.sum(red.clone(), keepdim).unwrap();
        prop_assert_eq!(got.dims(), want.dims.as_slice());
        prop_assert_eq!(got.to_vec::<f64>().unwrap(), want.data.clone());
        // f32 goes through the same loops; these sums are exact in f32 too.
        let got32 = x.to_dtype(DType::F32).unwrap().sum(red.clone(), keepdim).unwrap();
        let want32: Vec<f32> = want.data.iter().map(|&v| v as f32).collect();
        prop_assert_eq!(got32.to_vec::<f32>().unwrap(), want32);
        // max over the same dims is >= every element it covers and equals one of them.
        if !red.is_empty() {
            let m = x.max(red.clone(), true).unwrap();
            let ge = x.ge(&m).unwrap().sum(red.clone(), false).unwrap().to_f64_vec().unwrap();
            prop_assert!(ge.iter().all(|&c| c >= 1.0));
            let le = x.le(&m).unwrap().to_vec::<u8>().unwrap();
            prop_assert!(le.iter().all(|&b| b == 1));
        }
        let all = x.sum(AllDims, false).unwrap();
        prop_assert_eq!(all.dims(), &[] as &[usize]);
    }
}

proptest! {
    #![proptest_config(cfg(96))]

        fn matmul_matches_triple_loop(
        m in 1usize..6, k in 1usize..6, n in 1usize..6,
        (ba, bb) in broadcast_pair(2, 3).prop_filter("batch dims broadcast", |(a, b)| ref_broadcast(a, b).is_some()),
        ta in any::<bool>(), tb in any::<bool>(),
        dtype in prop::sample::select(vec![DType::F64, DType::F32]),
    ) {
        let adims = [ba.clone(), vec![m, k]].concat();
        let bdims = [bb.clone(), vec![k, n]].concat();
        let (na, nb) = (Nd::iota(&adims), Nd::iota(&bdims));
        // Operands are optionally built transposed in memory, then viewed back: strided inputs.
        let build = |nd: &Nd, t: bool| {
            let r = nd.dims.len();
            if t {
                let mut p: Vec<usize> = (0..r).collect();
                p.swap(r - 2, r - 1);
                nd.permute(&p).tensor().transpose(-2, -1).unwrap()
            } else {
                nd.tensor()
            }
        };
        let (a, b) = (build(&na, ta).to_dtype(dtype).unwrap(), build(&nb, tb).to_dtype(dtype).unwrap());
        let batch = ref_broadcast(&ba, &bb).unwrap();
        let (ra, rb) = (na.broadcast(&[batch.clone(), vec![m, k]].concat()), nb.broadcast(&[batch.clone(), vec![k, n]].concat()));
        let odims = [batch.clone(), vec![m, n]].concat();
        let want = Nd::from_fn(&odims, |i| {
            let r = i.len();
            (0..k).map(|p| {
                let mut ia = i.to_vec();
                ia[r - 1] = p;
                let mut ib = i.to_vec();
                ib[r - 2] = p;
                ra.get(&ia) * rb.get(&ib)
            }).sum()
        });
        let got = a.matmul(&b).unwrap();
        prop_assert_eq!(got.dims(), odims.as_slice());
        prop_assert_eq!(got.to_f64_vec().unwrap(), want.data);
    }

        fn matmul_vector_promotion(k in 1usize..6, n in 1usize..6, batch in 0usize..3) {
        // [k] @ [.., k, n] -> [.., n] and [.., n, k] @ [k] -> [.., n]
        let v = Nd::iota(&[k]);
        let bd: Vec<usize> = [vec![2; batch], vec![k, n]].concat();
        let b = Nd::iota(&bd);
        let got = v.tensor().matmul(&b.tensor()).unwrap();
        let mut od = vec![2; batch];
        od.push(n);
        prop_assert_eq!(got.dims(), od.as_slice());
        let want = Nd::from_fn(&od, |i| {
            (0..k).map(|p| {
                let mut ib = i[..batch].to_vec();
                ib.extend([p, i[batch]]);
                v.data[p] * b.get(&ib)
            }).sum()
        });
        prop_assert_eq!(got.to_vec::<f64>().unwrap(), want.data.clone());
        let bt = b.tensor().transpose(-2, -1).unwrap();
        let got2 = bt.matmul(&v.tensor()).unwrap();
        prop_assert_eq!(got2.dims(), od.as_slice());
        prop_assert_eq!(got2.to_vec::<f64>().unwrap(), want.data.clone());
        let dot = v.tensor().matmul(&v.tensor()).unwrap();
        prop_assert_eq!(dot.dims(), &[] as &[usize]);
        prop_assert_eq!(dot.item::<f64>().unwrap(), v.data.iter().map(|x| x * x).sum::<f64>());
    }
}

// ---- fixed cases: the parallel paths and empty tensors -----------------------------------------

/// Tensors past `PAR_MIN` (32768 elements) take the rayon paths of the strided loops, the
/// reductions and matmul; the properties above only see small ones.
fn large_strided_tensors_match_the_reference() {
    let (r, c) = (300, 200);
    let nd = Nd::iota(&[r, c]);
    let x = nd.tensor();
    let xt = x.t().unwrap(); // [200, 300], strided
    let ndt = nd.permute(&[1, 0]);
    assert_eq!(xt.to_vec::<f64>().unwrap(), ndt.data);
    assert_eq!(xt.contiguous().unwrap().to_vec::<f64>().unwrap(), ndt.data);
    // Strided + strided, strided + contiguous, and a broadcast scalar read from an offset.
    let sum2: Vec<f64> = ndt.data.iter().map(|v| 2.0 * v).collect();
    assert_eq!(xt.add(&xt).unwrap().to_vec::<f64>().unwrap(), sum2);
    let other = Nd::iota(&[c, r]);
    let want: Vec<f64> = ndt.data.iter().zip(&other.data).map(|(a, b)| a - b).collect();
    assert_eq!(xt.sub(&other.tensor()).unwrap().to_vec::<f64>().unwrap(), want);
    let s = x.narrow(0, 5, 1).unwrap().narrow(1, 7, 1).unwrap(); // [1, 1] at offset 1007
    let sv = nd.get(&[5, 7]);
    let want: Vec<f64> = nd.data.iter().map(|v| v * sv).collect();
    assert_eq!(x.mul(&s).unwrap().to_vec::<f64>().unwrap(), want);
    let want: Vec<f64> = ndt.data.iter().map(|v| v * sv).collect();
    assert_eq!(xt.mul(&s).unwrap().to_vec::<f64>().unwrap(), want);
    // Reductions: many outputs, and few outputs with many inputs each.
    for dims in [vec![0usize], vec![1], vec![0, 1]] {
        let want = ndt.sum(&dims, false);
        assert_eq!(xt.sum(dims.clone(), false).unwrap().to_vec::<f64>().unwrap(), want.data, "sum {dims:?}");
    }
    let mx = xt.max(AllDims, false).unwrap().item::<f64>().unwrap();
    assert_eq!(mx, nd.data.iter().copied().fold(f64::MIN, f64::max));
    let am = xt.argmax(1usize, false).unwrap().to_vec::<u32>().unwrap();
    for (i, &j) in am.iter().enumerate() {
        let row = &ndt.data[i * r..(i + 1) * r];
        let best = row.iter().copied().fold(f64::MIN, f64::max);
        assert_eq!(row[j as usize], best);
        assert!(row[..j as usize].iter().all(|&v| v < best), "argmax takes the first maximum");
    }
    // A cast of a large strided view.
    let f: Vec<f32> = ndt.data.iter().map(|&v| v as f32).collect();
    assert_eq!(xt.to_dtype(DType::F32).unwrap().to_vec::<f32>().unwrap(), f);
}

fn large_matmul_matches_triple_loop() {
    // Past the small-matrix threshold (96^3), with transposed operands and a broadcast batch.
    let (m, k, n) = (120, 130, 110);
    let a = Nd::iota(&[k, m]); // stored transposed
    let b = Nd::iota(&[2, n, k]); // stored transposed, batch 2
    let at = a.tensor().t().unwrap(); // [m, k]
    let bt = b.tensor().transpose(1, 2).unwrap(); // [2, k, n]
    let got = at.unsqueeze(0).unwrap().matmul(&bt).unwrap();
    assert_eq!(got.dims(), &[2, m, n]);
    let got = got.to_vec::<f64>().unwrap();
    for bi in 0..2 {
        for i in (0..m).step_by(7) {
            for j in (0..n).step_by(5) {
                let want: f64 = (0..k).map(|p| a.get(&[p, i]) * b.get(&[bi, j, p])).sum();
                assert_eq!(got[(bi * m + i) * n + j], want, "[{bi}, {i}, {j}]");
            }
        }
    }
    // f32 through the same path (exact: small integers, |sum| < 2^24).
    let g32 = at.to_dtype(DType::F32).unwrap().matmul(&bt.to_dtype(DType::F32).unwrap()).unwrap();
    let g32: Vec<f64> = g32.to_f64_vec().unwrap();
    assert_eq!(g32, got);
}

fn empty_tensors() {
    let a = Tensor::zeros((2, 0), DType::F32, dev()).unwrap();
    let b = Tensor::zeros((0, 3), DType::F32, dev()).unwrap();
    // An inner dim of 0 gives a product of zeros, not garbage.
    assert_eq!(a.matmul(&b).unwrap().to_vec2::<f32>().unwrap(), vec![vec![0.0; 3]; 2]);
    let s = b.sum(0usize, false).unwrap().to_vec::<f32>().unwrap();
    assert_eq!(s, vec![0.0; 3]);
    assert!(s.iter().all(|v| v.is_sign_positive()), "an empty sum is +0, not -0: {s:?}");
    assert_eq!(b.softmax(0usize).unwrap().dims(), &[0, 3]);
    assert_eq!(a.softmax(-1).unwrap().dims(), &[2, 0]);
    assert_eq!(b.layer_norm(None, None, 1e-5).unwrap().dims(), &[0, 3]);
    let one = Tensor::ones((1, 3), DType::F32, dev()).unwrap();
    assert_eq!(Tensor::cat(&[b.clone(), one], 0).unwrap().to_vec2::<f32>().unwrap(), vec![vec![1.0; 3]]);
    assert_eq!(a.t().unwrap().narrow(0, 0, 0).unwrap().contiguous().unwrap().dims(), &[0, 2]);
    assert!(matches!(b.max(0usize, false), Err(Error::Shape { .. })), "max over an empty dim has no value");
    // Gradients through an empty slice are zeros of the input's shape.
    let x = Tensor::ones((2, 3), DType::F32, dev()).unwrap().requires_grad();
    let g = x.narrow(1, 1, 0).unwrap().sum_all().unwrap().backward().unwrap();
    assert_eq!(g.get(&x).unwrap().to_vec::<f32>().unwrap(), vec![0.0; 6]);
}

fn set_overwrites_in_place_even_from_a_view_of_itself() {
    let nd = Nd::iota(&[3, 3]);
    let w = nd.tensor();
    let alias = w.reshape(9).unwrap();
    assert!(alias.same_storage(&w));
    // The source reads the destination's own buffer: it must be copied before the write.
    w.set(&w.t().unwrap()).unwrap();
    assert_eq!(w.to_vec::<f64>().unwrap(), nd.permute(&[1, 0]).data);
    assert_eq!(alias.to_vec::<f64>().unwrap(), nd.permute(&[1, 0]).data, "views see the new values");
    // A contiguous narrowed destination writes only its own window.
    let v = Nd::iota(&[4, 3]).tensor();
    let row = Tensor::from_vec(vec![100.0f64, 200.0, 300.0], (1, 3), dev()).unwrap();
    v.narrow(0, 2, 1).unwrap().set(&row).unwrap();
    let got = v.to_vec2::<f64>().unwrap();
    assert_eq!(got[2], vec![100.0, 200.0, 300.0]);
    assert_eq!(got[1], Nd::iota(&[4, 3]).data[3..6].to_vec());
    assert!(v.t().unwrap().set(&v).is_err(), "a strided destination is refused");
}
