//! The strided copy's CUDA kernels (`kernels/copy.cu`): permuted views take `copy_transpose_*`
//! (32 x 32 tiles through shared memory, src/cuda/ops/copy.rs `TransposePlan`), every other
//! strided view `copy_strided_*`. Both must give the CPU's bits for every width, at sizes that are
//! not multiples of the tile, with offsets (narrowed views), size-1 dims between, and more outer
//! tiles than a grid's z dimension holds.

use crate::common;

use common::gpu;
use ferrograd_core::{DType, Result, Rng, Tensor};

fn bits(t: &Tensor) -> Result<Vec<u64>> {
    Ok(t.to_dtype(DType::F64)?.to_vec::<f64>()?.iter().map(|x| x.to_bits()).collect())
}

/// `view(x)` made contiguous on the GPU and on the CPU: the same bits.
fn check(name: &str, x: &Tensor, view: impl Fn(&Tensor) -> Result<Tensor>) -> Result<()> {
    let dev = gpu().expect("checked by the caller");
    let want = view(x)?.contiguous()?;
    let got = view(&x.to_device(dev)?)?.contiguous()?;
    assert_eq!(got.dims(), want.dims(), "{name}");
    assert!(bits(&got)? == bits(&want)?, "{name}: the CUDA copy differs from the CPU's");
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
