//! Launches of the attention kernels (`attention_common.cuh` documents the ABI): the forward, and the backward's three
//! kernels (delta = rowsum(dO * O) with dQ's f32 accumulator zeroed, the main kernel, dQ's
//! conversion). Everything is enqueued on `CudaDevice::stream()` with no host synchronization, so
//! a training step that uses attention can be captured as a CUDA graph.

use super::{Problem, CUDA_HEAD_DIMS, MODULES, OP, WG_MODULES};
use crate::backend::BackendStorage;
use crate::cuda::device::driver_err;
use crate::cuda::launch::{cfg_1d, cfg_warp_rows, launch};
use crate::cuda::modules::Module;
use crate::cuda::nvrtc::Arch;
use crate::cuda::tma::{self, TensorMap};
use crate::cuda::{CudaDevice, CudaStorage};
use crate::fused::FusedOutputs;
use crate::{shape_err, DType, Error, Layout, Result, Shape};
use cudarc::driver::{DeviceRepr, LaunchConfig};
use std::sync::Arc;

/// Element strides of a `[B, H, T, D]` operand (`FgStride4`).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub(super) struct Stride4 {
    pub b: i64,
    pub h: i64,
    pub t: i64,
    pub d: i64,
}

/// `FgAttnParams` of attention_common.cuh, field for field.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
struct AttnParams {
    q: Stride4,
    k: Stride4,
    v: Stride4,
    o: Stride4,
    dout: Stride4,
    dq: Stride4,
    dk: Stride4,
    dv: Stride4,
    seed: u64,
    rng_offset: u64,
    b: u32,
    h: u32,
    tq: u32,
    tk: u32,
    scale: f32,
    scale_log2: f32,
    rp_keep: f32,
    drop_thr: u32,
    causal: u32,
    /// Hopper kernels: heads a group of blocks walks together ([`wg_group`]); 0 = all.
    group: u32,
}

// SAFETY: plain-old-data with the C layout the kernels declare (312 bytes, no padding holes
// that the kernel reads).
unsafe impl DeviceRepr for AttnParams {}

/// Tile shapes of `FgAttnTile<D>` and the f32 kernels; the dynamic shared memory each kernel needs.
struct Tiles {
    fwd_bq: usize,
    /// Key rows per step of the forward (its kernel's `k` tile), query rows per step of the backward.
    fwd_bkv: usize,
    bwd_bq: usize,
    bwd_bkv: usize,
    fwd_smem: usize,
    bwd_smem: usize,
}

/// The tensor-core tiles per head dim, as `FG_ATTN_FWD_TILES` / `FG_ATTN_BWD_TILES` build them
/// (the measurements behind them are noted there, in attention.cu): forward key rows per step, backward query
/// rows per step.
fn tile_choice(d: usize) -> (usize, usize) {
    match d {
        ..=64 => (64, 32),
        65..=80 => (32, 64),
        _ => (64, 32),
    }
}

fn tiles(d: usize, dtype: DType) -> Tiles {
    if dtype == DType::F32 {
        // FG_SIMT_FWD_BQ = 64 query rows, FG_SIMT_FWD_BK = 32 keys; FG_SIMT_BWD_B = 32; rows padded
        // by one float.
        let ds = d + 1;
        return Tiles {
            fwd_bq: 64,
            fwd_bkv: 32,
            bwd_bq: 32,
            bwd_bkv: 32,
            fwd_smem: ((64 + 2 * 32) * ds + 64 * 33) * 4,
            bwd_smem: (4 * 32 * ds + 2 * 32 * 33 + 2 * 32) * 4,
        };
    }
    let mt = if d <= 128 { 2 } else { 1 };
    let fwd_bq = 4 * 16 * mt;
    let (fwd_bkv, bwd_bq) = tile_choice(d);
    let bwd_bkv = 64;
    let dp = d + 8;
    Tiles {
        fwd_bq,
        fwd_bkv,
        bwd_bq,
        bwd_bkv,
        fwd_smem: (fwd_bq + 4 * fwd_bkv) * dp * 2,
        bwd_smem: (2 * bwd_bkv + 4 * bwd_bq) * dp * 2 + bwd_bkv * (bwd_bq + 8) * 2 + 4 * bwd_bq * 4,
    }
}

/// The Hopper kernels' shapes (attention_wgmma.cu `FG_WG_*`; change both together): the forward
/// takes 64 query rows a warpgroup ([`wg_fwd_warpgroups`]) and 64 keys a step; the backward, two
/// warpgroups, [`wg_bwd_bkv`] keys a block and 64 queries a step. Dynamic shared memory includes
/// 1 KiB for aligning the base to the 128-byte swizzle's 1024-byte period.
const WG_BWD_THREADS: u32 = 256;
const WG_FWD_BKV: usize = 64;
const WG_BWD_BQ: usize = 64;

/// Warpgroups of a forward block (`FG_WG_FWD_WGS`): three at d = 128, two at d = 64.
fn wg_fwd_warpgroups(d: usize) -> usize {
    if d > 64 {
        3
    } else {
        2
    }
}

/// Keys a backward block owns (`FG_WG_BWD_BKVD`): two 64-key m-tiles a warpgroup at d = 64, one
/// at d = 128.
fn wg_bwd_bkv(d: usize) -> usize {
    if d <= 64 {
        256
    } else {
        128
    }
}

/// Whether the forward at head dim `d` takes K and V by TMA (`FG_WG_FWD_TMA`: at d = 128), from
/// tensor maps ([`kv_maps`]) and a producer warp; d = 64 loads them by cp.async.
fn wg_fwd_tma(d: usize) -> bool {
    d > 64
}

/// Stages of the TMA forward's K / V ring (`FG_WG_FWD_STAGES`).
const WG_FWD_STAGES: usize = 4;

fn wg_fwd_threads(d: usize) -> u32 {
    (128 * wg_fwd_warpgroups(d) + if wg_fwd_tma(d) { 32 } else { 0 }) as u32
}

/// Q, then two K / V stages (cp.async) or the TMA ring and its mbarriers (16 bytes a stage).
fn wg_fwd_smem(d: usize) -> usize {
    if wg_fwd_tma(d) {
        (64 * wg_fwd_warpgroups(d) + 2 * WG_FWD_STAGES * WG_FWD_BKV) * d * 2 + 1024 + 16 * WG_FWD_STAGES
    } else {
        (64 * wg_fwd_warpgroups(d) + 4 * WG_FWD_BKV) * d * 2 + 1024
    }
}

/// The TMA forward's tensor maps of K and V: `[B][H][Tk][D]` at their strides, boxes of 64 head
/// dims by [`WG_FWD_BKV`] keys (one 128-byte-swizzled atom of the kernel's tiles). `operand` has
/// made both 16-byte aligned with a contiguous head dim (copying a view that is not).
fn kv_maps(pb: &Problem, dtype: DType, k: (u64, Stride4), v: (u64, Stride4)) -> Result<(TensorMap, TensorMap)> {
    let elem = dtype.size_in_bytes() as u64;
    let map = |(ptr, st): (u64, Stride4)| {
        let dims = [pb.d as u64, pb.tk.max(1) as u64, pb.h as u64, pb.b as u64];
        let strides = [st.t as u64 * elem, st.h as u64 * elem, st.b as u64 * elem];
        tma::tiled_4d_swizzle128(ptr, dtype, dims, strides, [64, WG_FWD_BKV as u32, 1, 1])
    };
    Ok((map(k)?, map(v)?))
}

/// A K / V operand as [`kv_maps`] takes it: a view with a zero stride (K or V expanded over heads
/// or batch without copying) is copied to a dense `[B, H, T, D]` buffer first, returned to live
/// until the launch is enqueued; a tensor map describes a walk over distinct rows, and the driver
/// documents no broadcast dimension.
fn tma_operand(x: Operand, ptr: u64, st: Stride4) -> Result<(u64, Stride4, Option<CudaStorage>)> {
    if st.t != 0 && st.h != 0 && st.b != 0 {
        return Ok((ptr, st, None));
    }
    let c = x.0.copy_strided(x.1)?;
    let l = Layout::contiguous(x.1.shape().clone());
    let d: Vec<i64> = l.strides().iter().map(|&v| v as i64).collect();
    Ok((c.buf.ptr(), Stride4 { b: d[0], h: d[1], t: d[2], d: d[3] }, Some(c)))
}

/// K, V, two stages of Q and dO, dS^T, log-sum-exp and delta, two dQ tiles (f32), alignment.
fn wg_bwd_smem(d: usize) -> usize {
    let bkv = wg_bwd_bkv(d);
    (2 * bkv + 4 * WG_BWD_BQ) * d * 2 + bkv * WG_BWD_BQ * 2 + 4 * WG_BWD_BQ * 4 + 2 * WG_BWD_BQ * d * 4 + 1024
}

/// Heads that a group of the Hopper kernels' blocks walks together (`FgAttnParams::group`,
/// attention_wgmma.cu `fg_wg_tile`, which explains the order): about one wave of blocks at d = 128
/// and two at d = 64 (measured: at d = 64 one-wave groups lost 10% under a causal mask at T = 4096,
/// two waves were level or faster everywhere), never more than all heads.
fn wg_group(dev: &CudaDevice, bh: usize, ntiles: usize, blocks_per_sm: usize, d: usize) -> u32 {
    let waves = if d > 64 { 1 } else { 2 };
    (waves * dev.sm_count() * blocks_per_sm).div_ceil(ntiles.max(1)).clamp(1, bh.max(1)) as u32
}

/// The module of the Hopper kernels for head dim `d` (64 or 128) and `dtype` (bf16, f16), without
/// or with dropout.
fn wg_module(d: usize, dtype: DType, drop: bool) -> Result<&'static Module> {
    let i = match (d, dtype) {
        (64, DType::BF16) => 0,
        (64, DType::F16) => 1,
        (128, DType::BF16) => 2,
        (128, DType::F16) => 3,
        _ => return Err(shape_err!(OP, "no Hopper attention kernels for head dim {d} and {dtype}")),
    };
    Ok(WG_MODULES[i + if drop { 4 } else { 0 }])
}

/// Whether this call runs the Hopper (`wgmma`) kernels: an sm_90 device, bf16 / f16, head dim 64
/// or 128, and not turned off ([`super::select::set_wgmma`]). With dropout it runs their `wgdrop`
/// build, whose draws are the mma.sync kernels' (the same mask, element by element).
fn wgmma(dev: &CudaDevice, pb: &Problem, dtype: DType) -> bool {
    matches!(dtype, DType::BF16 | DType::F16)
        && matches!(pb.d, 64 | 128)
        && dev.arch == Arch::SM90
        && super::select::wgmma_allowed()
        // Their grid is one-dimensional: B * H * ceil(T / 64) blocks at most.
        && pb.b * pb.h * pb.tq.max(pb.tk).div_ceil(64) <= i32::MAX as usize
}

/// The module our kernels load for `pb` in `dtype` on `dev` (the Hopper build where it runs the
/// call); none for a head dim or dtype CUDA has no kernel for.
pub(super) fn modules_for(dev: &CudaDevice, pb: &Problem, dtype: DType) -> Vec<&'static Module> {
    let m = if wgmma(dev, pb, dtype) { wg_module(pb.d, dtype, pb.dropout.is_some()) } else { module(pb.d, dtype) };
    m.ok().into_iter().collect()
}

/// The Hopper forward's and backward's name infix: `wgdrop` for the build with dropout.
fn wg_kind(pb: &Problem) -> &'static str {
    if pb.dropout.is_some() {
        "wgdrop"
    } else {
        "wg"
    }
}

/// The forward and backward kernels' names for this head dim, dtype and tiles.
fn kernel_names(d: usize, dtype: DType, t: &Tiles) -> Result<(String, String)> {
    let sfx = suffix(dtype)?;
    Ok(if dtype == DType::F32 {
        (format!("fg_attn_fwd_d{d}_{sfx}"), format!("fg_attn_bwd_d{d}_{sfx}"))
    } else {
        (format!("fg_attn_fwd_d{d}_k{}_{sfx}", t.fwd_bkv), format!("fg_attn_bwd_d{d}_q{}_{sfx}", t.bwd_bq))
    })
}

fn suffix(dtype: DType) -> Result<&'static str> {
    match dtype {
        DType::F32 => Ok("f32"),
        DType::F16 => Ok("f16"),
        DType::BF16 => Ok("bf16"),
        dtype => Err(Error::UnsupportedDType { op: OP, dtype }),
    }
}

/// The module holding the kernels of head dim `d` and `dtype` (`mod.rs` `MODULES`).
fn module(d: usize, dtype: DType) -> Result<&'static Module> {
    let j = match suffix(dtype)? {
        "bf16" => 0,
        "f16" => 1,
        _ => 2,
    };
    let i = CUDA_HEAD_DIMS.iter().position(|&x| x == d).ok_or_else(|| {
        shape_err!(
            OP,
            "head dim {d} is not supported on CUDA (supported: {CUDA_HEAD_DIMS:?}; any head dim runs on the CPU)"
        )
    })?;
    Ok(MODULES[3 * i + j])
}

/// The largest grid dimension y the launches use is ceil(T / 32) (65535 at most).
const MAX_T: usize = 65535 * 32;

/// What the CUDA kernels accept, checked before anything is recorded.
pub(super) fn check(dtype: DType, b: usize, h: usize, tq: usize, tk: usize, d: usize) -> Result<()> {
    module(d, dtype)?;
    if b * h > i32::MAX as usize || tq > MAX_T || tk > MAX_T {
        return Err(shape_err!(
            OP,
            "B * H = {} and T = {tq} / {tk} exceed the CUDA kernels' grid ({MAX_T} rows at most)",
            b * h
        ));
    }
    Ok(())
}

/// An operand's device address and strides as a `[B, H, T, D]` tensor. `bthd`: the layout's dims
/// are `[B, T, H, D]`. For the tensor-core kernels (`rows16`) a view whose head dim is not
/// contiguous or whose rows are not 16-byte aligned is copied first; the copy is returned so that
/// it lives until the launch has been enqueued.
pub(super) fn operand(
    s: &CudaStorage,
    l: &Layout,
    bthd: bool,
    rows16: bool,
) -> Result<(u64, Stride4, Option<CudaStorage>)> {
    let strides = |l: &Layout| {
        let st: Vec<i64> = l.strides().iter().map(|&x| x as i64).collect();
        if bthd {
            Stride4 { b: st[0], h: st[2], t: st[1], d: st[3] }
        } else {
            Stride4 { b: st[0], h: st[1], t: st[2], d: st[3] }
        }
    };
    let st = strides(l);
    let ptr = s.buf.ptr_at(l.offset());
    let elem = s.dtype().size_in_bytes() as i64;
    let aligned = st.d == 1 && [st.b, st.h, st.t].iter().all(|x| (x * elem) % 16 == 0) && ptr.is_multiple_of(16);
    if !rows16 || aligned {
        return Ok((ptr, st, None));
    }
    let c = s.copy_strided(l)?;
    Ok((c.buf.ptr(), strides(&Layout::contiguous(l.shape().clone())), Some(c)))
}

/// Strides of a contiguous `[B, T, H, D]` buffer, as a `[B, H, T, D]` operand.
fn bthd_strides(t: usize, h: usize, d: usize) -> Stride4 {
    Stride4 { b: (t * h * d) as i64, h: d as i64, t: (h * d) as i64, d: 1 }
}

fn params(pb: &Problem) -> AttnParams {
    let (rp_keep, drop_thr, seed, rng_offset) = match pb.dropout {
        Some(dr) => ((1.0 / (1.0 - dr.p)) as f32, dr.thr, dr.seed, dr.offset),
        None => (1.0, 0, 0, 0),
    };
    AttnParams {
        b: pb.b as u32,
        h: pb.h as u32,
        tq: pb.tq as u32,
        tk: pb.tk as u32,
        scale: pb.scale as f32,
        scale_log2: (pb.scale * std::f64::consts::LOG2_E) as f32,
        rp_keep,
        drop_thr,
        seed,
        rng_offset,
        causal: pb.causal as u32,
        ..Default::default()
    }
}

/// Raise a kernel's dynamic shared-memory limit when it needs more than the default 48 KiB.
fn allow_smem(dev: &Arc<CudaDevice>, m: &Module, name: &str, bytes: usize) -> Result<()> {
    if bytes <= 48 * 1024 {
        return Ok(());
    }
    let max = dev.max_shared_memory_per_block()?;
    if bytes > max {
        return Err(Error::Kernel {
            name: name.to_string(),
            msg: format!("needs {bytes} bytes of shared memory; this GPU allows {max} a block"),
        });
    }
    dev.func(m, name)?
        .set_attribute(
            cudarc::driver::sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
            bytes as i32,
        )
        .map_err(|e| driver_err(&format!("cuFuncSetAttribute({name})"), e))
}

fn cfg(grid: (usize, usize), block: u32, smem: usize) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (grid.0 as u32, grid.1 as u32, 1),
        block_dim: (block, 1, 1),
        shared_mem_bytes: smem as u32,
    }
}

type Operand<'a> = (&'a CudaStorage, &'a Layout);

/// Outputs: O `[B, Tq, H, D]`, the log-sum-exp `[B, H, Tq]` (f32).
pub(super) fn forward(pb: &Problem, q: Operand, k: Operand, v: Operand) -> Result<FusedOutputs<CudaStorage>> {
    let dtype = q.0.dtype();
    let dev = q.0.dev().clone();
    let wg = wgmma(&dev, pb, dtype);
    let m = if wg { wg_module(pb.d, dtype, pb.dropout.is_some())? } else { module(pb.d, dtype)? };
    let Problem { b, h, tq, d, .. } = *pb;
    let o = CudaStorage::uninit(&dev, b * tq * h * d, dtype)?;
    let lse = CudaStorage::uninit(&dev, b * h * tq, DType::F32)?;
    let tc = dtype != DType::F32;
    if b * h * tq > 0 {
        let (qp, qs, _qc) = operand(q.0, q.1, false, tc)?;
        let (kp, ks, _kc) = operand(k.0, k.1, false, tc)?;
        let (vp, vs, _vc) = operand(v.0, v.1, false, tc)?;
        let mut p = AttnParams { q: qs, k: ks, v: vs, o: bthd_strides(tq, h, d), ..params(pb) };
        let (name, c) = if wg {
            super::select::count(|c| c.wgmma_fwd += 1);
            let ntiles = tq.div_ceil(64 * wg_fwd_warpgroups(d));
            p.group = wg_group(&dev, b * h, ntiles, if d > 64 { 1 } else { 2 }, d);
            let c = cfg((b * h * ntiles, 1), wg_fwd_threads(d), wg_fwd_smem(d));
            (format!("fg_attn_fwd_d{d}_{}_{}", wg_kind(pb), suffix(dtype)?), c)
        } else {
            let t = tiles(d, dtype);
            let (name, _) = kernel_names(d, dtype, &t)?;
            (name, cfg((b * h, tq.div_ceil(t.fwd_bq)), if tc { 128 } else { 256 }, t.fwd_smem))
        };
        allow_smem(&dev, m, &name, c.shared_mem_bytes as usize)?;
        if wg && wg_fwd_tma(d) {
            let (kp, ks, _kd) = tma_operand(k, kp, ks)?;
            let (vp, vs, _vd) = tma_operand(v, vp, vs)?;
            let (tk, tv) = kv_maps(pb, dtype, (kp, ks), (vp, vs))?;
            launch!(dev, *m, name, c; qp, tk, tv, o.buf.ptr(), lse.buf.ptr(), p);
        } else {
            launch!(dev, *m, name, c; qp, kp, vp, o.buf.ptr(), lse.buf.ptr(), p);
        }
    }
    Ok(vec![(o, Shape::from(vec![b, tq, h, d])), (lse, Shape::from(vec![b, h, tq]))])
}

/// The forward's log-sum-exp as both backwards (ours and cuDNN's) read it: f32, else a typed
/// error; its address, through a contiguous copy (kept alive by the second value) when `lse` is a
/// strided view.
pub(super) fn lse_ptr(lse: Operand) -> Result<(u64, Option<CudaStorage>)> {
    if lse.0.dtype() != DType::F32 {
        return Err(Error::DTypeMismatch {
            op: "scaled_dot_product_attention_backward",
            lhs: DType::F32,
            rhs: lse.0.dtype(),
        });
    }
    lse.0.contiguous_ptr(lse.1)
}

/// Outputs: dq `[B, Tq, H, D]`, dk and dv `[B, Tk, H, D]`, or (`packed`) one `[B, T, 3, H, D]`
/// gradient holding all three ([`grad_out`]). `o` and `dout` have `[B, Tq, H, D]` dims; `lse` is
/// the forward's `[B, H, Tq]` f32.
#[allow(clippy::too_many_arguments)]
pub(super) fn backward(
    pb: &Problem,
    q: Operand,
    k: Operand,
    v: Operand,
    o: Operand,
    dout: Operand,
    lse: Operand,
    packed: bool,
) -> Result<FusedOutputs<CudaStorage>> {
    let dtype = q.0.dtype();
    let dev = q.0.dev().clone();
    let wg = wgmma(&dev, pb, dtype);
    let sfx = suffix(dtype)?;
    let m = if wg { wg_module(pb.d, dtype, pb.dropout.is_some())? } else { module(pb.d, dtype)? };
    let Problem { b, h, tq, tk, d, .. } = *pb;
    let (lp, _lse) = lse_ptr(lse)?;
    let out = grad_out(&dev, pb, dtype, packed)?;
    let tc = dtype != DType::F32;
    if b * h * tk > 0 {
        let (qp, qs, _qc) = operand(q.0, q.1, false, tc)?;
        let (kp, ks, _kc) = operand(k.0, k.1, false, tc)?;
        let (vp, vs, _vc) = operand(v.0, v.1, false, tc)?;
        let (op, os, _oc) = operand(o.0, o.1, true, false)?;
        let (gp, gs, _gc) = operand(dout.0, dout.1, true, tc)?;
        let rows = b * h * tq;
        // The Hopper backward's dq_acc: rows padded to whole 64-row tiles, each tile in fragment
        // order (attention_wgmma.cu `fg_wg_dq_pos`); its own helpers zero and convert it.
        let (acc_rows, helper) = if wg { (b * h * tq.div_ceil(WG_BWD_BQ) * WG_BWD_BQ, "_wg") } else { (rows, "") };
        let delta = CudaStorage::uninit(&dev, rows, DType::F32)?;
        let dq_acc = CudaStorage::uninit(&dev, acc_rows * d, DType::F32)?;
        let mut p = AttnParams {
            q: qs,
            k: ks,
            v: vs,
            o: os,
            dout: gs,
            dq: out.strides[0],
            dk: out.strides[1],
            dv: out.strides[2],
            ..params(pb)
        };
        if rows > 0 {
            launch!(dev, *m, format!("fg_attn_bwd_pre_d{d}{helper}_{sfx}"), cfg_warp_rows(&dev, rows);
                op, gp, delta.buf.ptr(), dq_acc.buf.ptr(), p);
        }
        let (name, c) = if wg {
            super::select::count(|c| c.wgmma_bwd += 1);
            let ntiles = tk.div_ceil(wg_bwd_bkv(d));
            p.group = wg_group(&dev, b * h, ntiles, 1, d);
            let name = format!("fg_attn_bwd_d{d}_{}_{sfx}", wg_kind(pb));
            (name, cfg((b * h * ntiles, 1), WG_BWD_THREADS, wg_bwd_smem(d)))
        } else {
            let t = tiles(d, dtype);
            let (_, name) = kernel_names(d, dtype, &t)?;
            (name, cfg((b * h, tk.div_ceil(t.bwd_bkv)), 128, t.bwd_smem))
        };
        allow_smem(&dev, m, &name, c.shared_mem_bytes as usize)?;
        launch!(dev, *m, name, c; qp, kp, vp, gp, lp, delta.buf.ptr(), dq_acc.buf.ptr(), out.ptrs[1], out.ptrs[2], p);
        if rows > 0 {
            let c = cfg_1d(&dev, rows * d);
            launch!(dev, *m, format!("fg_attn_dq_d{d}{helper}_{sfx}"), c; dq_acc.buf.ptr(), out.ptrs[0], p);
        }
    }
    Ok(out.outs)
}

/// Where one backward writes dq, dk and dv: the outputs that hold them, each one's first element
/// and its `[B, H, T, D]` strides.
pub(super) struct GradOut {
    pub outs: FusedOutputs<CudaStorage>,
    pub ptrs: [u64; 3],
    pub strides: [Stride4; 3],
}

/// Three `[B, T, H, D]` buffers, or (`packed`, the packed-QKV op's gradient, Tq == Tk) one
/// `[B, T, 3, H, D]` buffer that dq, dk and dv are interleaved into, as the forward's QKV was.
pub(super) fn grad_out(dev: &Arc<CudaDevice>, pb: &Problem, dtype: DType, packed: bool) -> Result<GradOut> {
    let Problem { b, h, tq, tk, d, .. } = *pb;
    if packed {
        if tq != tk {
            return Err(shape_err!(OP, "a packed QKV buffer needs as many queries as keys, got {tq} and {tk}"));
        }
        let row = 3 * h * d;
        let s = CudaStorage::uninit(dev, b * tq * row, dtype)?;
        let base = s.buf.ptr();
        let part = (h * d * dtype.size_in_bytes()) as u64;
        let st = Stride4 { b: (tq * row) as i64, h: d as i64, t: row as i64, d: 1 };
        return Ok(GradOut {
            outs: vec![(s, Shape::from(vec![b, tq, 3, h, d]))],
            ptrs: [base, base + part, base + 2 * part],
            strides: [st; 3],
        });
    }
    let dq = CudaStorage::uninit(dev, b * tq * h * d, dtype)?;
    let dk = CudaStorage::uninit(dev, b * tk * h * d, dtype)?;
    let dv = CudaStorage::uninit(dev, b * tk * h * d, dtype)?;
    Ok(GradOut {
        ptrs: [dq.buf.ptr(), dk.buf.ptr(), dv.buf.ptr()],
        strides: [bthd_strides(tq, h, d), bthd_strides(tk, h, d), bthd_strides(tk, h, d)],
        outs: vec![
            (dq, Shape::from(vec![b, tq, h, d])),
            (dk, Shape::from(vec![b, tk, h, d])),
            (dv, Shape::from(vec![b, tk, h, d])),
        ],
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every kernel the launches can name is in the module `module` picks for its head dim and dtype.
    #[test]
    fn each_launch_finds_its_kernel_in_the_module_it_picks() {
        let mut routes = vec![];
        for d in CUDA_HEAD_DIMS {
            for dtype in [DType::BF16, DType::F16, DType::F32] {
                let m = module(d, dtype).unwrap();
                let (fwd, bwd) = kernel_names(d, dtype, &tiles(d, dtype)).unwrap();
                let sfx = suffix(dtype).unwrap();
                for name in [fwd, bwd, format!("fg_attn_bwd_pre_d{d}_{sfx}"), format!("fg_attn_dq_d{d}_{sfx}")] {
                    routes.push((name, m));
                }
                // The Hopper kernels: their own modules, built for sm_90a (check_routes compiles for sm_90).
                // Without dropout (`wg`) and with it (`wgdrop`); both carry the backward's helpers.
                if matches!(d, 64 | 128) && dtype != DType::F32 {
                    for (drop, kind) in [(false, "wg"), (true, "wgdrop")] {
                        let w = wg_module(d, dtype, drop).unwrap();
                        assert!(w.options.sm90a && !m.options.sm90a, "{}: only the wgmma part is Hopper-only", w.name);
                        for stem in ["fwd", "bwd"] {
                            routes.push((format!("fg_attn_{stem}_d{d}_{kind}_{sfx}"), w));
                        }
                        for stem in ["bwd_pre", "dq"] {
                            routes.push((format!("fg_attn_{stem}_d{d}_wg_{sfx}"), w));
                        }
                    }
                }
            }
        }
        assert!(module(48, DType::F32).is_err() && module(64, DType::F64).is_err());
        let parts: Vec<&Module> = MODULES.iter().chain(WG_MODULES.iter()).copied().collect();
        crate::cuda::modules::check_routes(&parts, &routes);
    }
}
