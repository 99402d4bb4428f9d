//! Launches of the selective-scan kernels (`selective_scan.cu` documents the ABI): one forward,
//! one backward, each a block per (batch, channel). Views that are not contiguous are copied, and
//! A, D and delta_bias are converted to f32 when they are not (they are `[dim, state]` and `[dim]`:
//! small). The backward's parameter and B / C gradients are f32 sums (atomics), converted to each
//! input's dtype afterwards. Everything is enqueued on `CudaDevice::stream()` with no host
//! synchronization.

use super::{Inputs, Problem, MAX_CUDA_STATE, OP};
use crate::backend::BackendStorage;
use crate::cuda::launch::launch;
use crate::cuda::modules::Module;
use crate::cuda::CudaStorage;
use crate::fused::FusedOutputs;
use crate::{shape_err, DType, Error, Layout, Result, Shape};
use cudarc::driver::{DeviceRepr, LaunchConfig};

/// `FgScanParams` of selective_scan.cu, field for field.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
struct ScanParams {
    batch: u32,
    dim: u32,
    len: u32,
    state: u32,
    groups: u32,
    dim_per_group: u32,
    chunks: u32,
    has_d: u32,
    has_z: u32,
    has_bias: u32,
    softplus: u32,
    pad: u32,
}

// SAFETY: twelve u32, the C layout the kernels declare.
unsafe impl DeviceRepr for ScanParams {}

fn params(pb: &Problem) -> ScanParams {
    ScanParams {
        batch: pb.batch as u32,
        dim: pb.dim as u32,
        len: pb.len as u32,
        state: pb.state as u32,
        groups: pb.groups as u32,
        dim_per_group: pb.dim_per_group() as u32,
        chunks: pb.chunks() as u32,
        has_d: pb.has_d as u32,
        has_z: pb.has_z as u32,
        has_bias: pb.has_bias as u32,
        softplus: pb.softplus as u32,
        pad: 0,
    }
}

/// Threads and steps a thread: the smallest chunk that holds the sequence, else 128 x 16 = 2048
/// steps (`CHUNK`), as mamba_ssm picks its kernel. Every choice gives `ceil(len / CHUNK)` chunks.
/// The backward runs chunks of more than 256 steps with twice the threads and half the steps a
/// thread (selective_scan.cu says why).
pub(super) fn config(len: usize, backward: bool) -> (usize, usize) {
    let (nt, k) = match len {
        ..=128 => (32, 4),
        129..=256 => (32, 8),
        257..=512 => (32, 16),
        513..=1024 => (64, 16),
        _ => (128, 16),
    };
    if backward && k == 16 {
        (2 * nt, 8)
    } else {
        (nt, k)
    }
}

/// The module (`mod.rs` `MODULES`) that holds the kernel `kind` (`fwd` or `bwd`) of this
/// dtype and block size.
pub(super) fn module(kind: &str, dtype: DType, threads: usize) -> Result<&'static Module> {
    use super::{BWD_BF16_LONG, BWD_BF16_SHORT, BWD_F32_LONG, BWD_F32_SHORT, FWD_BF16, FWD_F32};
    // The backward's short chunks are the 32-thread configurations (`config`).
    Ok(match (kind, suffix(dtype)?, threads <= 32) {
        ("fwd", "f32", _) => &FWD_F32,
        ("fwd", _, _) => &FWD_BF16,
        (_, "f32", true) => &BWD_F32_SHORT,
        (_, "f32", false) => &BWD_F32_LONG,
        (_, _, true) => &BWD_BF16_SHORT,
        (_, _, false) => &BWD_BF16_LONG,
    })
}

fn suffix(dtype: DType) -> Result<&'static str> {
    match dtype {
        DType::F32 => Ok("f32"),
        DType::BF16 => Ok("bf16"),
        dtype => Err(Error::UnsupportedDType { op: OP, dtype }),
    }
}

/// What the CUDA kernels accept, checked before anything is recorded.
pub(super) fn check(dtype: DType, pb: &Problem) -> Result<()> {
    suffix(dtype)?;
    if pb.state > MAX_CUDA_STATE {
        return Err(shape_err!(
            OP,
            "state size {} exceeds the CUDA kernels' {MAX_CUDA_STATE} (any state size runs on the CPU)",
            pb.state
        ));
    }
    if pb.batch * pb.dim > i32::MAX as usize || pb.len > (u32::MAX / 2) as usize {
        return Err(shape_err!(
            OP,
            "batch * dim = {} or len = {} exceeds the CUDA kernels' grid",
            pb.batch * pb.dim,
            pb.len
        ));
    }
    Ok(())
}

type Operand<'a> = (&'a CudaStorage, &'a Layout);

/// A contiguous `dtype` operand's address; the copy (kept alive by the caller until the launch is
/// enqueued) when the view is strided or of another dtype.
fn contig((s, l): Operand, dtype: DType) -> Result<(u64, Option<CudaStorage>)> {
    if s.dtype() == dtype && l.is_contiguous() {
        return Ok((s.buf.ptr_at(l.offset()), None));
    }
    let c = s.to_dtype(l, dtype)?;
    Ok((c.buf.ptr(), Some(c)))
}

/// An optional operand's address (0 when absent).
fn opt(x: Option<Operand>, dtype: DType) -> Result<(u64, Option<CudaStorage>)> {
    x.map_or(Ok((0, None)), |x| contig(x, dtype))
}

/// The operands every kernel reads, as contiguous device addresses (and the copies behind them).
struct Ptrs {
    u: u64,
    delta: u64,
    a: u64,
    b: u64,
    c: u64,
    d: u64,
    z: u64,
    bias: u64,
    _copies: Vec<CudaStorage>,
}

fn ptrs(x: &Inputs<Operand>, dtype: DType) -> Result<Ptrs> {
    let mut copies = vec![];
    let mut keep = |(p, c): (u64, Option<CudaStorage>)| {
        copies.extend(c);
        p
    };
    let u = keep(contig(x.u, dtype)?);
    let delta = keep(contig(x.delta, dtype)?);
    let a = keep(contig(x.a, DType::F32)?);
    let b = keep(contig(x.b, dtype)?);
    let c = keep(contig(x.c, dtype)?);
    let d = keep(opt(x.d, DType::F32)?);
    let z = keep(opt(x.z, dtype)?);
    let bias = keep(opt(x.bias, DType::F32)?);
    Ok(Ptrs { u, delta, a, b, c, d, z, bias, _copies: copies })
}

fn cfg(pb: &Problem, backward: bool) -> (LaunchConfig, String) {
    let (nt, k) = config(pb.len, backward);
    let c = LaunchConfig {
        grid_dim: ((pb.batch * pb.dim) as u32, 1, 1),
        block_dim: (nt as u32, 1, 1),
        shared_mem_bytes: 0,
    };
    (c, format!("{nt}x{k}"))
}

/// Outputs: out `[batch, dim, len]` in u's dtype, the chunk-end states `[batch, dim, chunks,
/// state]` (f32).
pub(super) fn forward(pb: &Problem, x: &Inputs<Operand>) -> Result<FusedOutputs<CudaStorage>> {
    let dtype = x.u.0.dtype();
    let sfx = suffix(dtype)?;
    let dev = x.u.0.dev().clone();
    let n_x = pb.batch * pb.dim * pb.len;
    let out = CudaStorage::uninit(&dev, n_x, dtype)?;
    let states = CudaStorage::uninit(&dev, pb.batch * pb.dim * pb.chunks() * pb.state, DType::F32)?;
    if n_x > 0 {
        let p = ptrs(x, dtype)?;
        let (c, tag) = cfg(pb, false);
        let m = module("fwd", dtype, c.block_dim.0 as usize)?;
        launch!(dev, *m, format!("fg_sscan_fwd_{tag}_{sfx}"), c;
            p.u, p.delta, p.a, p.b, p.c, p.d, p.z, p.bias, out.buf.ptr(), states.buf.ptr(), params(pb));
    }
    Ok(vec![
        (out, Shape::from(vec![pb.batch, pb.dim, pb.len])),
        (states, Shape::from(vec![pb.batch, pb.dim, pb.chunks(), pb.state])),
    ])
}

/// An f32 sum converted to `dtype` (as is when `dtype` is f32).
fn cast(s: CudaStorage, dims: Vec<usize>, dtype: DType) -> Result<(CudaStorage, Shape)> {
    let shape = Shape::from(dims);
    if dtype == DType::F32 {
        return Ok((s, shape));
    }
    let c = s.to_dtype(&Layout::contiguous(shape.clone()), dtype)?;
    Ok((c, shape))
}

/// Outputs: the gradients of the forward's inputs in their order (du, ddelta, dA, dB, dC, then
/// dD, dz, d delta_bias where present), each in its input's dtype.
pub(super) fn backward(
    pb: &Problem,
    x: &Inputs<Operand>,
    states: Operand,
    dout: Operand,
) -> Result<FusedOutputs<CudaStorage>> {
    let dtype = x.u.0.dtype();
    let sfx = suffix(dtype)?;
    let want = [pb.batch, pb.dim, pb.chunks(), pb.state];
    if states.1.dims() != want {
        return Err(Error::ShapeMismatch {
            op: "selective_scan_backward",
            lhs: want.to_vec(),
            rhs: states.1.dims().to_vec(),
        });
    }
    let dev = x.u.0.dev().clone();
    let n_x = pb.batch * pb.dim * pb.len;
    let n_bc = pb.batch * pb.groups * pb.state * pb.len;
    let zero = |n: usize| CudaStorage::full(&dev, 0.0, n, DType::F32);
    let du = CudaStorage::uninit(&dev, n_x, dtype)?;
    let ddelta = CudaStorage::uninit(&dev, n_x, dtype)?;
    let dz = CudaStorage::uninit(&dev, if pb.has_z { n_x } else { 0 }, dtype)?;
    let (da, db, dc) = (zero(pb.dim * pb.state)?, zero(n_bc)?, zero(n_bc)?);
    let dd = zero(if pb.has_d { pb.dim } else { 0 })?;
    let dbias = zero(if pb.has_bias { pb.dim } else { 0 })?;
    if n_x > 0 {
        let p = ptrs(x, dtype)?;
        let (sp, _sc) = contig(states, DType::F32)?;
        let (gp, _gc) = contig(dout, dtype)?;
        let ptr_or_null = |s: &CudaStorage, present: bool| if present { s.buf.ptr() } else { 0 };
        let (c, tag) = cfg(pb, true);
        let m = module("bwd", dtype, c.block_dim.0 as usize)?;
        launch!(dev, *m, format!("fg_sscan_bwd_{tag}_{sfx}"), c;
            p.u, p.delta, p.a, p.b, p.c, p.d, p.z, p.bias, sp, gp,
            du.buf.ptr(), ddelta.buf.ptr(), da.buf.ptr(), db.buf.ptr(), dc.buf.ptr(),
            ptr_or_null(&dd, pb.has_d), ptr_or_null(&dz, pb.has_z), ptr_or_null(&dbias, pb.has_bias), params(pb));
    }
    let xdims = vec![pb.batch, pb.dim, pb.len];
    let bcdims = vec![pb.batch, pb.groups, pb.state, pb.len];
    let mut res = vec![
        (du, Shape::from(xdims.clone())),
        (ddelta, Shape::from(xdims.clone())),
        cast(da, vec![pb.dim, pb.state], x.a.0.dtype())?,
        cast(db, bcdims.clone(), x.b.0.dtype())?,
        cast(dc, bcdims, x.c.0.dtype())?,
    ];
    if let Some(d) = x.d {
        res.push(cast(dd, vec![pb.dim], d.0.dtype())?);
    }
    if pb.has_z {
        res.push((dz, Shape::from(xdims)));
    }
    if let Some(b) = x.bias {
        res.push(cast(dbias, vec![pb.dim], b.0.dtype())?);
    }
    Ok(res)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every configuration's chunk holds the sequence or is `CHUNK` long, forward and backward
    /// alike, so the saved states line up.
    #[test]
    fn configs_agree_on_the_chunk_length() {
        for len in [1, 127, 128, 129, 256, 257, 512, 513, 1024, 1025, 2048, 2049, 10_000] {
            let (f, b) = (config(len, false), config(len, true));
            assert_eq!(f.0 * f.1, b.0 * b.1, "len {len}");
            let chunk = f.0 * f.1;
            assert!(chunk >= len.min(super::super::CHUNK) && chunk <= super::super::CHUNK, "len {len}");
            assert_eq!(len.div_ceil(chunk).max(1), len.div_ceil(super::super::CHUNK).max(1), "len {len}");
        }
    }

    /// Every kernel a launch can name is in the part `module` picks for it.
    #[test]
    fn each_launch_finds_its_kernel_in_the_module_it_picks() {
        let mut routes = vec![];
        for dtype in [DType::F32, DType::BF16] {
            for len in [1, 200, 400, 1000, 5000] {
                for (kind, backward) in [("fwd", false), ("bwd", true)] {
                    let (nt, k) = config(len, backward);
                    let name = format!("fg_sscan_{kind}_{nt}x{k}_{}", suffix(dtype).unwrap());
                    routes.push((name, module(kind, dtype, nt).unwrap()));
                }
            }
        }
        assert!(module("fwd", DType::F16, 32).is_err());
        crate::cuda::modules::check_routes(&super::super::MODULES, &routes);
    }
}
