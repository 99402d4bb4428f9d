//! The unary maps' CUDA kernels (`kernels/unary.cu`): `unary_vec_*` and `unary_vec_math_*`,
//! PyTorch's block-tile traversal for contiguous 16-byte-aligned float tensors (relu / sigmoid /
//! silu / affine, and every other op but sin, cos and powf), and `unary_*`, which takes every
//! other case (here: the same values one element into a buffer, so misaligned). Both apply the
//! same per-element function, so they must give the same bits, at sizes below one vector, around
//! the 256-vector tile and past it, and the vector kernels must follow the CPU.

use crate::common;

use common::{assert_close, bits, gpu, randn};
use ferrograd_core::{DType, Result, Rng, Tensor};

type F = fn(&Tensor) -> Result<Tensor>;

#[test]
fn cuda_unary_vector_and_general_kernels_agree() -> Result<()> {
    let Some(dev) = gpu() else { return Ok(()) };
    let mut rng = Rng::new(23);
    let ops: [(&str, F); 16] = [
        ("relu", |x| x.relu()),
        ("sigmoid", |x| x.sigmoid()),
        ("silu", |x| x.silu()),
        ("affine", |x| x.affine(-1.75, 0.5)),
        ("neg", |x| x.neg()),
        ("abs", |x| x.abs()),
        ("sqr", |x| x.sqr()),
        ("sign", |x| x.sign()),
        ("exp", |x| x.exp()),
        ("log", |x| x.log()),
        ("sqrt", |x| x.sqrt()),
        ("recip", |x| x.recip()),
        ("tanh", |x| x.tanh()),
        ("gelu_tanh", |x| x.gelu_tanh()),
        ("gelu", |x| x.gelu()),
        ("clamp", |x| x.clamp(-0.3, 0.4)),
    ];
    for dtype in [DType::F32, DType::F16, DType::BF16] {
        // Less than one vector (4 f32, 8 halves), one 128 x 2 tile of vectors and around it, many.
        for n in [1usize, 3, 7, 1023, 1024, 1025, 2048, 2049, 4097, 70_003] {
            let vals = randn(&mut rng, &[n], dtype);
            let aligned = vals.to_device(dev)?; // offset 0: a vector kernel
                                                // The same values one element into a buffer: misaligned, so `unary_*`.
            let padded = Tensor::cat(&[vals.narrow(0, 0, 1)?, vals.clone()], 0)?.to_device(dev)?;
            let misaligned = padded.narrow(0, 1, n)?;
            for (name, f) in &ops {
                let (fast, general) = (f(&aligned)?, f(&misaligned)?);
                assert_close(&format!("{name} {dtype} n={n} vector kernel"), &f(&vals)?, &fast, 2.0);
                assert_eq!(bits(&fast), bits(&general), "{name} {dtype} n={n}: the two kernels differ");
            }
        }
    }
    Ok(())
}
