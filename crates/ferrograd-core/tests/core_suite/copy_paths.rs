//! The strided copy's CUDA kernels (`kernels/copy.cu`): permuted views take `copy_transpose_*`
//! (32 x 32 tiles through shared memory, src/cuda/ops/copy.rs `TransposePlan`), every other
//! strided view `copy_strided_*`. Both must give the CPU's bits for every width, at sizes that are
//! not multiples of the tile, with offsets (narrowed views), size-1 dims between, and more outer
//! tiles than a grid's z dimension holds. And `cat` along any dim (each input straight into its
//! slice of the output: `copy_into_view`, `copy_view_*` on a GPU), with the narrow gradient that
//! is built from it: on the CPU against slices of the result, on a GPU against the CPU.

use crate::common;

use common::{bits, gpu};
use ferrograd_core::{DType, Device, Result, Rng, Tensor};
use proptest::prelude::*;

/// `view(x)` made contiguous on the GPU and on the CPU: the same bits.
fn check(name: &str, x: &Tensor, view: impl Fn(&Tensor) -> Result<Tensor>) -> Result<()> {
    let dev = gpu().expect("checked by the caller");
    let want = view(x)?.contiguous()?;
    let got = view(&x.to_device(dev)?)?.contiguous()?;
    assert_eq!(got.dims(), want.dims(), "{name}");
    assert!(bits(&got) == bits(&want), "{name}: the CUDA copy differs from the CPU's");
    Ok(())
}

fn values(rng: &mut Rng, dims: &[usize], dtype: DType) -> Result<Tensor> {
    Tensor::randn_with(rng, 0.0, 1.0, dims.to_vec(), DType::F64, ferrograd_core::Device::Cpu)?
        .affine(37.0, 100.0)?
        .clamp(0.0, 255.0)?
        .to_dtype(dtype)
}

#[test]
fn cuda_permuted_copies_match_the_cpu() -> Result<()> {
    if gpu().is_none() {
        return Ok(());
    }
    let mut rng = Rng::new(31);
    for dtype in [DType::F64, DType::F32, DType::BF16, DType::U8] {
        let x = values(&mut rng, &[33, 47], dtype)?;
        check(&format!("{dtype} [33, 47]^T"), &x, |t| t.t())?;
        let x = values(&mut rng, &[3, 5, 37, 19], dtype)?;
        for perm in [[0, 3, 1, 2], [2, 0, 3, 1], [3, 2, 1, 0], [1, 0, 2, 3], [0, 1, 3, 2]] {
            check(&format!("{dtype} [3, 5, 37, 19] permuted {perm:?}"), &x, |t| t.permute(&perm))?;
            check(&format!("{dtype} [3, 5, 37, 19] narrowed, permuted {perm:?}"), &x, |t| {
                t.narrow(2, 3, 30)?.narrow(0, 1, 2)?.permute(&perm)
            })?;
        }
        // Mamba's views: [B, L, 2 di] narrowed to one half and permuted to [B, di, L]; B and C
        // as [B, 1, n, L] from [B, L, r + 2n].
        let xz = values(&mut rng, &[4, 70, 2 * 48], dtype)?;
        check(&format!("{dtype} xz half"), &xz, |t| t.narrow(2, 48, 48)?.permute(&[0, 2, 1]))?;
        let dbl = values(&mut rng, &[4, 70, 48], dtype)?;
        check(&format!("{dtype} B of dbl"), &dbl, |t| t.narrow(2, 16, 16)?.permute(&[0, 2, 1])?.unsqueeze(1))?;
    }
    // More outer tiles than gridDim.z's 65,535 (the kernel's batch loop).
    let x = values(&mut rng, &[66_000, 17, 16], DType::F32)?;
    check("f32 [66000, 17, 16] permuted [0, 2, 1]", &x, |t| t.permute(&[0, 2, 1]))?;
    Ok(())
}

/// The inputs of a cat along `dim` of `[2, 3, 5, 4]`-like shapes, each made a different kind of
/// view: contiguous, permuted, narrowed, broadcast.
fn cat_inputs(rng: &mut Rng, dims: &[usize], dim: usize, widths: &[usize], dtype: DType) -> Result<Vec<Tensor>> {
    let mut out = vec![];
    for (k, &w) in widths.iter().enumerate() {
        let mut d = dims.to_vec();
        d[dim] = w;
        let t = match k % 4 {
            0 => values(rng, &d, dtype)?,
            1 => {
                // The same values built transposed, then viewed back: a permuted view.
                let mut rev = d.clone();
                rev.reverse();
                let perm: Vec<usize> = (0..d.len()).rev().collect();
                values(rng, &rev, dtype)?.permute(&perm)?
            }
            2 => {
                let mut wide = d.clone();
                wide[0] += 2;
                values(rng, &wide, dtype)?.narrow(0, 1, d[0])?
            }
            _ => {
                let mut one = d.clone();
                one[0] = 1;
                values(rng, &one, dtype)?.broadcast_as(d.clone())?
            }
        };
        out.push(t);
    }
    Ok(out)
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]
    /// `cat` on the CPU: each input equals its slice of the result, along every dim, whatever
    /// view each input is.
    #[test]
    fn cat_puts_each_input_in_its_slice(
        dims in proptest::collection::vec(1usize..6, 1..5),
        dim_seed in any::<usize>(),
        widths in proptest::collection::vec(0usize..5, 1..5),
        seed in any::<u64>(),
    ) {
        let dim = dim_seed % dims.len();
        let mut rng = Rng::new(seed);
        let parts = cat_inputs(&mut rng, &dims, dim, &widths, DType::F32).unwrap();
        let out = Tensor::cat(&parts, dim).unwrap();
        prop_assert_eq!(out.dims()[dim], widths.iter().sum::<usize>());
        let mut off = 0;
        for (p, &w) in parts.iter().zip(&widths) {
            let slice = out.narrow(dim, off, w).unwrap();
            prop_assert_eq!(bits(&slice.contiguous().unwrap()), bits(&p.contiguous().unwrap()));
            off += w;
        }
    }
}

#[test]
fn cuda_cat_matches_the_cpu() -> Result<()> {
    let Some(dev) = gpu() else { return Ok(()) };
    let mut rng = Rng::new(37);
    for dtype in [DType::F64, DType::F32, DType::BF16, DType::U8] {
        for (dims, widths) in
            [(vec![3usize, 37, 5, 41], vec![7usize, 1, 33, 0, 2]), (vec![2, 70, 96], vec![48, 16, 32])]
        {
            for dim in 0..dims.len() {
                let parts = cat_inputs(&mut rng, &dims, dim, &widths, dtype)?;
                let want = Tensor::cat(&parts, dim)?;
                let on_gpu = parts.iter().map(|p| p.to_device(dev)).collect::<Result<Vec<_>>>()?;
                let got = Tensor::cat(&on_gpu, dim)?;
                assert!(bits(&got) == bits(&want), "{dtype} cat of {dims:?} along {dim}: the GPU differs");
            }
        }
    }
    Ok(())
}

/// The narrow gradient: g placed between zeros (stride-0 views of one zero), two narrows of one
/// tensor (Mamba's split of its input projection) summed; on the CPU and, where there is one, a GPU.
#[test]
fn narrow_gradients_are_g_between_zeros() -> Result<()> {
    let mut rng = Rng::new(41);
    let devices = std::iter::once(Device::Cpu).chain(gpu());
    for device in devices {
        let x = values(&mut rng, &[4, 70, 96], DType::F32)?.to_device(device)?.requires_grad();
        let w = values(&mut rng, &[4, 70, 40], DType::F32)?;
        let wd = w.to_device(device)?;
        let (a, b) = (x.narrow(2, 0, 40)?, x.narrow(2, 50, 40)?);
        let loss = a.mul(&wd)?.add(&b.mul(&wd.sqr()?)?)?.sum_all()?;
        let g = loss.backward()?.get(&x).expect("x's gradient").to_device(Device::Cpu)?;
        let zeros = |n: usize| Tensor::zeros((4, 70, n), DType::F32, Device::Cpu);
        let want = Tensor::cat(&[w.clone(), zeros(10)?, w.sqr()?, zeros(6)?], 2)?;
        assert!(bits(&g) == bits(&want), "the narrow gradient on {device:?}");
    }
    Ok(())
}

/// Slices of one tensor's gradient that the walk joins (narrow_grads.rs) or, overlapping or along
/// different dims, pads and sums; with a plain use of the tensor besides. Against the gradient
/// written out element by element, on the CPU and a GPU.
#[test]
fn narrow_gradients_overlapping_and_along_other_dims() -> Result<()> {
    let mut rng = Rng::new(43);
    let (a, b, c) = (5usize, 6usize, 7usize);
    let x0 = values(&mut rng, &[a, b, c], DType::F64)?;
    let ws: Vec<Tensor> = [[a, 4, c], [a, 4, c], [a, b, 3], [a, b, c], [a, 1, c]]
        .iter()
        .map(|d| values(&mut rng, d, DType::F64))
        .collect::<Result<_>>()?;
    let wv: Vec<Vec<f64>> = ws.iter().map(|w| w.to_vec::<f64>()).collect::<Result<_>>()?;
    let mut want = vec![0.0f64; a * b * c];
    for i in 0..a {
        for j in 0..b {
            for k in 0..c {
                let mut g = wv[3][(i * b + j) * c + k]; // x * w3
                if j < 4 {
                    g += wv[0][(i * 4 + j) * c + k]; // narrow(1, 0, 4)
                }
                if (2..6).contains(&j) {
                    g += wv[1][(i * 4 + j - 2) * c + k]; // narrow(1, 2, 4), overlapping the first
                }
                if (1..4).contains(&k) {
                    g += wv[2][(i * b + j) * 3 + k - 1]; // narrow(2, 1, 3)
                }
                if j == 5 {
                    g += wv[4][i * c + k]; // narrow(1, 5, 1), disjoint from the first
                }
                want[(i * b + j) * c + k] = g;
            }
        }
    }
    let devices = std::iter::once(Device::Cpu).chain(gpu());
    for device in devices {
        let x = x0.to_device(device)?.requires_grad();
        let w: Vec<Tensor> = ws.iter().map(|w| w.to_device(device)).collect::<Result<_>>()?;
        let terms = [
            x.narrow(1, 0, 4)?.mul(&w[0])?,
            x.narrow(1, 2, 4)?.mul(&w[1])?,
            x.narrow(2, 1, 3)?.mul(&w[2])?,
            x.mul(&w[3])?,
            x.narrow(1, 5, 1)?.mul(&w[4])?,
        ];
        let mut loss = terms[0].sum_all()?;
        for t in &terms[1..] {
            loss = loss.add(&t.sum_all()?)?;
        }
        let g = loss.backward()?.get(&x).expect("x's gradient").to_vec::<f64>()?;
        let worst = g.iter().zip(&want).map(|(p, q)| (p - q).abs()).fold(0.0f64, f64::max);
        assert!(worst < 1e-9, "{device:?}: the gradient is off by {worst}");
    }
    Ok(())
}

/// Large enough for the CPU's parallel rows (`strided::rows_of`): each input equals its slice of
/// the result along every dim, from contiguous, permuted, narrowed and broadcast inputs.
#[test]
fn large_cats_put_each_input_in_its_slice() -> Result<()> {
    let mut rng = Rng::new(47);
    let dims = [24usize, 37, 40];
    for dim in 0..3 {
        let widths = [29usize, 3, 40, 17];
        let parts = cat_inputs(&mut rng, &dims, dim, &widths, DType::F32)?;
        let out = Tensor::cat(&parts, dim)?;
        let mut off = 0;
        for (p, &w) in parts.iter().zip(&widths) {
            let slice = out.narrow(dim, off, w)?.contiguous()?;
            assert!(bits(&slice) == bits(&p.contiguous()?), "cat along {dim}: the slice at {off} differs");
            off += w;
        }
    }
    Ok(())
}
