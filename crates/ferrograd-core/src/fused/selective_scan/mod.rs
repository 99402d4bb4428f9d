//! The selective scan of Mamba as one fused op: [`selective_scan`], with the semantics of
//! `mamba_ssm`'s `selective_scan_fn` (real `A`, variable `B` and `C`) and its own backward.
//!
//! - `cpu.rs`: the CPU forward and backward (rayon over channels); in f64 it is the reference the
//!   gradcheck and the CUDA parity tests use.
//! - `cuda.rs`: the launches; `selective_scan.cu` holds the kernels (one block per (batch,
//!   channel), the sequence in chunks of up to 2048 steps, a warp-shuffle scan of the
//!   linear-recurrence pairs within a chunk, the state carried across chunks).
//! - `bench.rs`: the workload of `ferrograd bench selective-scan` (twin:
//!   `bench/torch_selective_scan.py`).
//!
//! The recurrence, per batch `b`, channel `d`, state `n`, step `l` (`g = d / (dim / groups)`):
//! `dt = softplus?(delta[b,d,l] + delta_bias[d])`, `x[n] = exp(dt A[d,n]) x[n] + dt B[b,g,n,l]
//! u[b,d,l]` from `x = 0`, `y = sum_n C[b,g,n,l] x[n] + D[d] u[b,d,l]`, `out = y * silu(z[b,d,l])`
//! when `z` is given. The forward saves only the state at the end of each chunk of [`CHUNK`] steps
//! (`[batch, dim, ceil(len / CHUNK), state]`, f32; f64 for f64 inputs on the CPU); the backward
//! recomputes the states within a chunk from it.

pub mod bench;
mod cpu;
mod cuda;

use super::{apply, apply_all, FusedCtx, FusedOp, FusedOutputs};
use crate::cpu::CpuStorage;
use crate::cuda::modules::headers::COMMON;
use crate::cuda::modules::{Define, Header, Module};
use crate::cuda::CudaStorage;
use crate::{shape_err, DType, Error, Layout, Result, Shape, Tensor};
use std::sync::Arc;

/// The kernels, `fg_sscan_{fwd,bwd}_{NT}x{K}_{f32,bf16}` (`selective_scan.cu` documents them),
/// in six NVRTC modules built from the one source (`-D FG_SSCAN_PART=<n>`): the forward per
/// dtype, the backward per dtype and short / long chunks. One module of all of them took 9 s of NVRTC, the longest
/// pole of a cold `ferrograd kernels --precompile`; the parts compile in parallel in about 1.5-2.5 s
/// each, and a run compiles only the parts it launches. `cuda.rs` `module` picks the part.
macro_rules! sscan_module {
    ($id:ident, $name:literal, $part:literal, $ms:literal) => {
        /// One part of the selective-scan kernels (see above).
        pub const $id: Module = Module::new($name, include_str!("selective_scan.cu"))
            .with_headers(&[COMMON, SSCAN_COMMON, SSCAN_FWD])
            .with_defines(&[
                Define::int("FG_SSCAN_MAX_STATE", MAX_CUDA_STATE as i64),
                Define::int("FG_SSCAN_PART", $part),
            ])
            .with_cost_ms($ms);
    };
}

/// The kernels' own headers (`selective_scan.cu` includes them): shared helpers, the forward.
const SSCAN_COMMON: Header = Header::new("sscan_common.cuh", include_str!("sscan_common.cuh"));
const SSCAN_FWD: Header = Header::new("sscan_fwd.cuh", include_str!("sscan_fwd.cuh"));

sscan_module!(FWD_F32, "selective_scan_fwd_f32", 0, 1750);
sscan_module!(FWD_BF16, "selective_scan_fwd_bf16", 1, 1850);
sscan_module!(BWD_F32_SHORT, "selective_scan_bwd_f32_short", 2, 1450);
sscan_module!(BWD_F32_LONG, "selective_scan_bwd_f32_long", 3, 2500);
sscan_module!(BWD_BF16_SHORT, "selective_scan_bwd_bf16_short", 4, 1300);
sscan_module!(BWD_BF16_LONG, "selective_scan_bwd_bf16_long", 5, 2600);

/// Every part (for `cuda::modules::ALL`).
pub const MODULES: [&Module; 6] = [&FWD_F32, &FWD_BF16, &BWD_F32_SHORT, &BWD_F32_LONG, &BWD_BF16_SHORT, &BWD_BF16_LONG];

/// The most states the CUDA kernels carry (`FG_SSCAN_MAX_STATE`: shared memory per block).
pub const MAX_CUDA_STATE: usize = 256;

/// Steps per chunk: the forward saves the state at the end of each chunk, the backward walks the
/// chunks in reverse. The CUDA kernels' longest chunk (128 threads x 16 steps); shorter sequences
/// are one chunk on every backend.
pub const CHUNK: usize = 2048;

const OP: &str = "selective_scan";

/// The optional inputs and the flag of [`selective_scan`], `selective_scan_fn`'s keyword arguments.
#[derive(Debug, Clone, Copy, Default)]
pub struct ScanArgs<'a> {
    /// `D`, `[dim]`: the skip connection `y += D u`.
    pub d: Option<&'a Tensor>,
    /// `z`, `[batch, dim, len]`: the gate, `out = y * silu(z)`.
    pub z: Option<&'a Tensor>,
    /// `delta_bias`, `[dim]`, added to `delta` before the softplus.
    pub delta_bias: Option<&'a Tensor>,
    /// Apply `softplus` (PyTorch's, threshold 20) to `delta + delta_bias`.
    pub delta_softplus: bool,
}

/// One call's resolved problem, shared by both backends' forward and backward.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Problem {
    /// Batch.
    pub batch: usize,
    /// Channels (`D`).
    pub dim: usize,
    /// Sequence length (`L`).
    pub len: usize,
    /// State size (`N`).
    pub state: usize,
    /// Groups sharing one `B` / `C`.
    pub groups: usize,
    /// Whether the skip `D` is given.
    pub has_d: bool,
    /// Whether the gate `z` is given.
    pub has_z: bool,
    /// Whether `delta_bias` is given.
    pub has_bias: bool,
    /// Whether softplus is applied to `delta`.
    pub softplus: bool,
}

impl Problem {
    /// Chunks of the sequence the kernels scan (`len / CHUNK`, rounded up).
    pub fn chunks(&self) -> usize {
        self.len.div_ceil(CHUNK)
    }

    /// Channels per group of `B` / `C`.
    pub fn dim_per_group(&self) -> usize {
        self.dim / self.groups
    }

    /// Inputs of the forward: u, delta, A, B, C, then D, z, delta_bias where present.
    fn n_inputs(&self) -> usize {
        5 + self.has_d as usize + self.has_z as usize + self.has_bias as usize
    }
}

/// The inputs of one call in a fixed order, with the optional ones resolved.
struct Inputs<S> {
    u: S,
    delta: S,
    a: S,
    b: S,
    c: S,
    d: Option<S>,
    z: Option<S>,
    bias: Option<S>,
}

fn split<'a, S: Copy>(pb: &Problem, x: &'a [S], op: &str) -> Result<(Inputs<S>, &'a [S])> {
    let n = pb.n_inputs();
    if x.len() < n {
        return Err(Error::InvalidArgument(format!("{op}: {} inputs, expected at least {n}", x.len())));
    }
    let mut i = 5;
    let mut next = |present: bool| {
        present.then(|| {
            i += 1;
            x[i - 1]
        })
    };
    let (d, z, bias) = (next(pb.has_d), next(pb.has_z), next(pb.has_bias));
    Ok((Inputs { u: x[0], delta: x[1], a: x[2], b: x[3], c: x[4], d, z, bias }, &x[n..]))
}

fn check_dims(name: &str, t: &Tensor, want: &[usize]) -> Result<()> {
    if t.dims() == want {
        Ok(())
    } else {
        Err(shape_err!(OP, "{name} must have shape {want:?}, got {:?}", t.dims()))
    }
}

/// Shapes, dtypes and devices checked; the problem they describe.
fn resolve(u: &Tensor, delta: &Tensor, a: &Tensor, b: &Tensor, c: &Tensor, args: &ScanArgs) -> Result<Problem> {
    if u.rank() != 3 {
        return Err(shape_err!(OP, "u must be [batch, dim, len], got {:?}", u.dims()));
    }
    let (batch, dim, len) = (u.dims()[0], u.dims()[1], u.dims()[2]);
    if a.rank() != 2 || a.dims()[0] != dim {
        return Err(shape_err!(OP, "A must be [dim, state] = [{dim}, state], got {:?}", a.dims()));
    }
    let state = a.dims()[1];
    if state == 0 {
        return Err(shape_err!(OP, "A has no state dimension (shape {:?})", a.dims()));
    }
    if b.rank() != 4 {
        return Err(shape_err!(OP, "B must be [batch, groups, state, len], got {:?}", b.dims()));
    }
    let groups = b.dims()[1];
    if groups == 0 || dim % groups != 0 {
        return Err(shape_err!(OP, "B has {groups} groups, which does not divide dim {dim}"));
    }
    let x_dims = [batch, dim, len];
    let bc_dims = [batch, groups, state, len];
    check_dims("delta", delta, &x_dims)?;
    check_dims("B", b, &bc_dims)?;
    check_dims("C", c, &bc_dims)?;
    if let Some(z) = args.z {
        check_dims("z", z, &x_dims)?;
    }
    for (name, t) in [("D", args.d), ("delta_bias", args.delta_bias)] {
        if let Some(t) = t {
            check_dims(name, t, &[dim])?;
        }
    }
    let dtype = u.dtype();
    if !dtype.is_float() {
        return Err(Error::UnsupportedDType { op: OP, dtype });
    }
    let all = [Some(u), Some(delta), Some(a), Some(b), Some(c), args.d, args.z, args.delta_bias];
    for t in all.iter().flatten() {
        if t.device() != u.device() {
            return Err(Error::DeviceMismatch { op: OP, lhs: u.device(), rhs: t.device() });
        }
    }
    // delta, B, C and z are activations of u's dtype; A, D and delta_bias are parameters, which
    // mamba keeps in f32 under mixed precision: u's dtype or f32.
    for t in [Some(delta), Some(b), Some(c), args.z].iter().flatten() {
        if t.dtype() != dtype {
            return Err(Error::DTypeMismatch { op: OP, lhs: dtype, rhs: t.dtype() });
        }
    }
    for t in [Some(a), args.d, args.delta_bias].iter().flatten() {
        if t.dtype() != dtype && t.dtype() != DType::F32 {
            return Err(Error::DTypeMismatch { op: OP, lhs: dtype, rhs: t.dtype() });
        }
    }
    let pb = Problem {
        batch,
        dim,
        len,
        state,
        groups,
        has_d: args.d.is_some(),
        has_z: args.z.is_some(),
        has_bias: args.delta_bias.is_some(),
        softplus: args.delta_softplus,
    };
    // The saved states are the one output whose size no input bounds.
    Shape::from(vec![batch, dim, pb.chunks(), state]).checked_elem_count(OP)?;
    if u.device().is_cuda() {
        cuda::check(dtype, &pb)?;
    }
    Ok(pb)
}

/// The kernel modules a CUDA training call over `len` steps in `dtype` loads (its forward's and
/// its backward's, whose block sizes follow `len`): what a training run's warm start compiles
/// ahead (`CudaDevice::warm`).
pub fn training_modules(dtype: DType, len: usize) -> Result<Vec<&'static Module>> {
    let (fwd, _) = cuda::config(len, false);
    let (bwd, _) = cuda::config(len, true);
    Ok(vec![cuda::module("fwd", dtype, fwd)?, cuda::module("bwd", dtype, bwd)?])
}

/// The selective scan of Mamba, `mamba_ssm.ops.selective_scan_interface.selective_scan_fn(u,
/// delta, A, B, C, D, z, delta_bias, delta_softplus)` with real `A` and variable `B` / `C`
/// (the recurrence is in the module documentation). Recorded as one op with its own backward
/// (gradients of every input).
///
/// - Shapes: `u`, `delta` and `z` are `[batch, dim, len]`, `A` is `[dim, state]`, `B` and `C` are
///   `[batch, groups, state, len]` (channel `d` uses group `d / (dim / groups)`; a `[batch, state,
///   len]` `B` is one group: unsqueeze it), `D` and `delta_bias` are `[dim]`; the result is
///   `[batch, dim, len]`. Any len (0, 1, odd, longer than a chunk).
/// - Dtypes: `u`, `delta`, `B`, `C`, `z` share one float dtype; `A`, `D`, `delta_bias` have it
///   or f32 (mamba keeps them f32). The state and every sum are f32 (f64 for f64 on the CPU).
///   CUDA: f32 and bf16; the CPU: every float dtype.
/// - Strides: any; on CUDA, views of u, delta, B, C and z that are not contiguous are copied once
///   (the backward reads the same copies).
/// - Errors: `Error::Shape` naming the input with a wrong shape (or groups not dividing dim, or
///   more than [`MAX_CUDA_STATE`] states on CUDA), `Error::DTypeMismatch`,
///   `Error::DeviceMismatch`, `Error::UnsupportedDType` (integers; f16 and f64 on CUDA).
pub fn selective_scan(
    u: &Tensor,
    delta: &Tensor,
    a: &Tensor,
    b: &Tensor,
    c: &Tensor,
    args: ScanArgs,
) -> Result<Tensor> {
    let pb = resolve(u, delta, a, b, c, &args)?;
    // The CUDA kernels read contiguous operands: a strided view (Mamba's z, delta, B and C are
    // permuted slices of projections) is copied here, once, and the copy recorded, so that the
    // backward reads it too instead of copying the view again.
    let own = |t: &Tensor| if t.device().is_cuda() { t.contiguous() } else { Ok(t.clone()) };
    let (u, delta, b, c) = (own(u)?, own(delta)?, own(b)?, own(c)?);
    let z = args.z.map(own).transpose()?;
    let mut inputs = vec![&u, &delta, a, &b, &c];
    inputs.extend([args.d, z.as_ref(), args.delta_bias].into_iter().flatten());
    apply(Arc::new(Scan(pb)), &inputs)
}

impl Tensor {
    /// [`selective_scan`] with `self` as `u`.
    pub fn selective_scan(&self, delta: &Tensor, a: &Tensor, b: &Tensor, c: &Tensor, args: ScanArgs) -> Result<Tensor> {
        selective_scan(self, delta, a, b, c, args)
    }
}

/// The forward: inputs u, delta, A, B, C[, D][, z][, delta_bias]; outputs out `[batch, dim, len]`
/// (the op's value) and the saved chunk-end states `[batch, dim, chunks, state]`.
struct Scan(Problem);

/// The backward: the forward's inputs, then the saved states and dout; outputs the gradients of
/// the forward's inputs, in their order, each in its input's dtype.
struct ScanBackward(Problem);

impl FusedOp for Scan {
    fn name(&self) -> &'static str {
        OP
    }

    fn cpu_fwd(&self, inputs: &[(&CpuStorage, &Layout)]) -> Result<FusedOutputs<CpuStorage>> {
        let (x, _) = split(&self.0, inputs, OP)?;
        cpu::forward(&self.0, &x)
    }

    fn cuda_fwd(&self, inputs: &[(&CudaStorage, &Layout)]) -> Result<FusedOutputs<CudaStorage>> {
        let (x, _) = split(&self.0, inputs, OP)?;
        cuda::forward(&self.0, &x)
    }

    fn backward(&self, ctx: &FusedCtx<'_>, grad: &Tensor) -> Result<Vec<Option<Tensor>>> {
        let states = ctx.saved.first().ok_or_else(|| Error::Backward(format!("{OP}: the states were not saved")))?;
        let u = ctx.inputs.first().ok_or_else(|| Error::Backward(format!("{OP}: no inputs recorded")))?;
        let grad = if grad.dtype() == u.dtype() { grad.clone() } else { grad.to_dtype(u.dtype())? };
        let mut inputs: Vec<&Tensor> = ctx.inputs.iter().collect();
        inputs.extend([states, &grad]);
        let grads = apply_all(&ScanBackward(self.0), &inputs)?;
        Ok(grads.into_iter().map(Some).collect())
    }
}

impl FusedOp for ScanBackward {
    fn name(&self) -> &'static str {
        "selective_scan_backward"
    }

    fn cpu_fwd(&self, inputs: &[(&CpuStorage, &Layout)]) -> Result<FusedOutputs<CpuStorage>> {
        let (x, rest) = split(&self.0, inputs, self.name())?;
        let [states, dout] = rest else {
            return Err(Error::InvalidArgument(format!("{}: expected the states and dout", self.name())));
        };
        cpu::backward(&self.0, &x, *states, *dout)
    }

    fn cuda_fwd(&self, inputs: &[(&CudaStorage, &Layout)]) -> Result<FusedOutputs<CudaStorage>> {
        let (x, rest) = split(&self.0, inputs, self.name())?;
        let [states, dout] = rest else {
            return Err(Error::InvalidArgument(format!("{}: expected the states and dout", self.name())));
        };
        cuda::backward(&self.0, &x, *states, *dout)
    }
}
