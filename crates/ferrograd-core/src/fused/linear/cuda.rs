//! The CUDA linear: cuBLASLt matmuls with epilogues (`cuda/blaslt`) and the activation-gradient
//! kernel (`linear.cu`).
//!
//! Row-major to cuBLASLt: a row-major `[r, c]` matrix with row stride `ld` is, to column-major
//! cuBLASLt, its own transpose (`c x r`, leading dim `ld`). So with `x [M, K]`, `w [N, K]`,
//! `y [M, N]` all row-major:
//! - forward `y^T (N x M) = W (N x K) · x^T (K x M)`: A = w read transposed, B = x as stored;
//!   the bias has one entry per row of `y^T`, i.e. per output feature.
//! - `dx^T (K x M) = W^T (K x N) · dz^T (N x M)`: both as stored.
//! - `dW^T (K x N) = x^T (K x M) · dz (M x N)`: dz read transposed, and BGRADB sums op(B) = dz
//!   over M into `db` (one entry per column of `dW^T`, i.e. per output feature).
//! - a weight stored transposed gets `dW` written transposed (`[K, N]` row-major, column-major
//!   `dW (N x K) = dz^T (N x M) · x (M x K)`), and BGRADA sums op(A) = dz^T over M into `db`.
//! - master weights: `dW` and `db` are D and the bias of an f16/bf16 product written in f32.
//!
//! A transposed view (unit row stride) flips its operand's transpose flag instead of being copied.

use super::{cpu, out_dims, sizes, Activation, Need, WGrad, LINEAR_BF16, LINEAR_F16, LINEAR_F32, LINEAR_F64};
use crate::backend::BackendStorage;
use crate::cuda::blaslt::{self, Aux, Epilogue, Gemm, Operand};
use crate::cuda::launch::{cfg_col_sums, cfg_map, launch};
use crate::cuda::modules::Module;
use crate::cuda::CudaStorage;
use crate::fused::FusedOutputs;
use crate::{DType, Layout, Result, Shape};
use cudarc::driver::LaunchConfig;

/// Whether cuBLASLt takes this dtype (f64 goes to the cuBLAS fallback).
pub(super) fn lt_dtype(dtype: DType) -> bool {
    matches!(dtype, DType::F32 | DType::F16 | DType::BF16) && blaslt::available()
}

/// A row-major matrix operand as cuBLASLt reads it: its address, leading dim, and whether it is
/// stored row-major (`ld` = row stride) or column-major (a transposed view: `ld` = column stride).
pub(super) struct Mat {
    pub(super) ptr: u64,
    pub(super) ld: usize,
    pub(super) row_major: bool,
    /// A contiguous copy when the view had no matrix form; kept alive until the launch is queued
    /// (frees are stream-ordered, so the kernel still reads it safely).
    _own: Option<CudaStorage>,
}

impl Mat {
    /// `(s, l)` (dims `[..., cols]`) as a `[rows, cols]` matrix, copied only when no stride pair
    /// describes it.
    pub(super) fn new(s: &CudaStorage, l: &Layout) -> Result<Mat> {
        if let Some(m) = cpu::as_matrix(l) {
            let (r, c) = (m.dims()[0], m.dims()[1]);
            let (rs, cs) = (m.strides()[0], m.strides()[1]);
            let ptr = s.buf.ptr_at(m.offset());
            if (cs == 1 || c == 1) && (rs >= c || r == 1) {
                let ld = if r == 1 { c } else { rs };
                return Ok(Mat { ptr, ld: ld.max(1), row_major: true, _own: None });
            }
            if (rs == 1 || r == 1) && (cs >= r || c == 1) {
                let ld = if c == 1 { r } else { cs };
                return Ok(Mat { ptr, ld: ld.max(1), row_major: false, _own: None });
            }
        }
        let own = s.copy_strided(l)?;
        let cols = l.dims()[l.dims().len() - 1];
        Ok(Mat { ptr: own.buf.ptr(), ld: cols.max(1), row_major: true, _own: Some(own) })
    }

    /// As cuBLASLt's A or B operand, where the product reads this matrix (`transposed` = false)
    /// or its transpose, in column-major terms.
    pub(super) fn operand(&self, transposed: bool) -> Operand {
        // Stored row-major, the column-major view is already the transpose.
        Operand { ptr: self.ptr, ld: self.ld, trans: transposed != self.row_major }
    }
}

/// The bias as a contiguous, 16-byte aligned vector (cuBLASLt's epilogue reads it in vectors; a
/// strided or oddly placed view is copied, which costs `out` elements).
fn bias_vec(b: (&CudaStorage, &Layout)) -> Result<(u64, Option<CudaStorage>)> {
    let (s, l) = b;
    let ptr = s.buf.ptr_at(l.offset());
    if (l.strides()[0] == 1 || l.dims()[0] == 1) && ptr.is_multiple_of(16) {
        return Ok((ptr, None));
    }
    let own = s.copy_strided(l)?;
    Ok((own.buf.ptr(), Some(own)))
}

pub(super) fn forward(
    x: (&CudaStorage, &Layout),
    w: (&CudaStorage, &Layout),
    b: Option<(&CudaStorage, &Layout)>,
    act: Activation,
    save_pre: bool,
) -> Result<FusedOutputs<CudaStorage>> {
    let dtype = x.0.dtype();
    let (m, k, n) = sizes(x.1, w.1);
    if !lt_dtype(dtype) || m == 0 || n == 0 || k == 0 {
        return cpu::forward(x, w, b, act, save_pre, false);
    }
    let dev = x.0.dev();
    let (xm, wm) = (Mat::new(x.0, x.1)?, Mat::new(w.0, w.1)?);
    let bias = b.map(bias_vec).transpose()?;
    let y = CudaStorage::uninit(dev, m * n, dtype)?;
    // The GELU aux buffer's leading dim must be a multiple of 8 (cuBLASLt); the padding columns
    // are never read.
    let ld_aux = n.next_multiple_of(8);
    let aux = if save_pre { Some(CudaStorage::uninit(dev, m * ld_aux, dtype)?) } else { None };
    let has_bias = bias.is_some();
    let epilogue = match (act, has_bias, save_pre) {
        (Activation::None, false, _) => Epilogue::Default,
        (Activation::None, true, _) => Epilogue::Bias,
        (Activation::Relu, false, _) => Epilogue::Relu,
        (Activation::Relu, true, _) => Epilogue::ReluBias,
        (Activation::GeluTanh, false, false) => Epilogue::Gelu,
        (Activation::GeluTanh, true, false) => Epilogue::GeluBias,
        (Activation::GeluTanh, false, true) => Epilogue::GeluAux,
        (Activation::GeluTanh, true, true) => Epilogue::GeluAuxBias,
    };
    let g = Gemm {
        dtype,
        d_dtype: dtype,
        m: n,
        n: m,
        k,
        a: wm.operand(false),
        b: xm.operand(true),
        d: Operand { ptr: y.buf.ptr(), ld: n, trans: false },
        epilogue,
        bias: bias.as_ref().map(|b| b.0),
        aux: aux.as_ref().map(|a| Aux { ptr: a.buf.ptr(), ld: ld_aux }),
    };
    if !blaslt::gemm(dev, &g)? {
        return cpu::forward(x, w, b, act, save_pre, false);
    }
    let mut out = vec![(y, Shape::from(out_dims(x.1, n)))];
    if let Some(aux) = aux {
        out.push((aux, Shape::from((m, ld_aux))));
    }
    Ok(out)
}

/// `[dz]` or `[dz, db]`: `dz = dy * act'(s)` in one kernel (`s`: the pre-activation for GELU,
/// the output for ReLU); with `db` (its dtype: dy's, or f32 for master weights) the same kernel
/// leaves per-row-block column sums (in f32, or f64) that a second, small kernel adds into `db`.
///
/// `emit_h` (GELU only): a last output `h = gelu_tanh(z)` (dy's shape, z's rounding to dy's
/// dtype), written by the same kernel: the hidden activation `mlp_recompute` did not keep.
pub(super) fn act_backward(
    dy: (&CudaStorage, &Layout),
    s: (&CudaStorage, &Layout),
    act: Activation,
    db: Option<DType>,
    emit_h: bool,
) -> Result<FusedOutputs<CudaStorage>> {
    if emit_h && act != Activation::GeluTanh {
        return Err(crate::Error::InvalidArgument(format!("linear: no hidden activation to emit for {act:?}")));
    }
    let name = match act {
        Activation::GeluTanh => "dgelu",
        Activation::Relu => "drelu",
        Activation::None => return cpu::act_backward(dy, s, act, db, false),
    };
    let dtype = dy.0.dtype();
    let acc = if dtype == DType::F64 { DType::F64 } else { DType::F32 };
    // The partial sums are in `acc`; the sum kernel of dtype `acc` writes them out unrounded.
    let db_dtype = match db {
        Some(d) if d == dtype || d == acc => Some(d),
        Some(d) => return Err(crate::Error::DTypeMismatch { op: "linear (bias gradient)", lhs: dtype, rhs: d }),
        None => None,
    };
    let cols = dy.1.dims()[dy.1.dims().len() - 1];
    let rows = dy.1.elem_count().checked_div(cols).unwrap_or(0);
    let dev = dy.0.dev();
    let dz = CudaStorage::uninit(dev, rows * cols, dtype)?;
    let mut out = vec![(dz, dy.1.shape().clone())];
    let h = if emit_h { Some(CudaStorage::uninit(dev, rows * cols, dtype)?) } else { None };
    let h_ptr = h.as_ref().map_or(0u64, |h| h.buf.ptr());
    let with_h = |mut out: FusedOutputs<CudaStorage>| {
        out.extend(h.map(|h| (h, dy.1.shape().clone())));
        out
    };
    if rows * cols == 0 {
        if let Some(d) = db_dtype {
            out.push((CudaStorage::full(dev, 0.0, cols, d)?, Shape::from(cols)));
        }
        return Ok(with_h(out));
    }
    // dy must be contiguous rows; s may have padded rows (the aux buffer) but unit column stride.
    let dy_own = if dy.1.is_contiguous() { None } else { Some(dy.0.copy_strided(dy.1)?) };
    let dy_ptr = dy_own.as_ref().map_or_else(|| dy.0.buf.ptr_at(dy.1.offset()), |o| o.buf.ptr());
    let sm = Mat::new(s.0, s.1)?;
    let (s_ptr, lds, _s_own) = if sm.row_major {
        (sm.ptr, sm.ld, None)
    } else {
        let own = s.0.copy_strided(s.1)?;
        (own.buf.ptr(), cols, Some(own))
    };
    let dz_ptr = out[0].0.buf.ptr();
    let per_pack = 16 / dtype.size_in_bytes();
    let Some(db_dtype) = db_dtype else {
        // The unary maps' grid (a pack of this dtype is one 16-byte vector, four a thread: every
        // thread one unrolled step) ran dz at 16384 x 3072 bf16 in 104 µs against 113 with
        // cfg_1d's chip-sized grid (H100, bench/kernels/linear_dzdb.sh).
        let cfg = cfg_map(dev, rows * cols, dtype, true, 4);
        match act {
            Activation::GeluTanh => launch!(dev, *module(dtype)?, format!("linear_dgelu_{dtype}"), cfg;
                dy_ptr, s_ptr, dz_ptr, h_ptr, rows as u64, cols as u64, lds as u64),
            _ => launch!(dev, *module(dtype)?, format!("linear_{name}_{dtype}"), cfg;
                dy_ptr, s_ptr, dz_ptr, rows as u64, cols as u64, lds as u64),
        }
        return Ok(with_h(out));
    };
    // Columns across threads (16-byte packs where everything lines up), rows split across
    // grid.y so the chip fills: each block leaves one row of partial sums.
    let vec = cols.is_multiple_of(per_pack)
        && lds.is_multiple_of(per_pack)
        && [dy_ptr, s_ptr, dz_ptr].iter().all(|p| p.is_multiple_of(16));
    let units = if vec { cols / per_pack } else { cols };
    let kernel = format!("linear_{name}_db_{dtype}");
    // A grid of one wave at the kernel's occupancy (6 blocks an SM, not cfg_col_sums' 8) ran the
    // one-row loop 15% faster but this two-row one no faster (H100, bench/kernels/linear_dzdb.sh).
    let (cfg, rps, splits) = cfg_col_sums(dev, rows, units);
    let part = CudaStorage::uninit(dev, splits * cols, acc)?;
    match act {
        Activation::GeluTanh => launch!(dev, *module(dtype)?, kernel, cfg;
            dy_ptr, s_ptr, dz_ptr, h_ptr, part.buf.ptr(), rows as u64, cols as u64, lds as u64, rps as u64,
            vec as i32),
        _ => launch!(dev, *module(dtype)?, kernel, cfg;
            dy_ptr, s_ptr, dz_ptr, part.buf.ptr(), rows as u64, cols as u64, lds as u64, rps as u64, vec as i32),
    }
    let db = CudaStorage::uninit(dev, cols, db_dtype)?;
    // 32 columns x 32 lanes over the splits a block (col_sums.cuh): a thread per column adding
    // all of them in turn was latency-bound (~90 of the 173 µs of dz + db at 16384 x 3072 on an H200).
    let sums = LaunchConfig {
        grid_dim: (cols.div_ceil(32).min(65535) as u32, 1, 1),
        block_dim: (32, 32, 1),
        shared_mem_bytes: 0,
    };
    let sum_dtype = if db_dtype == dtype { dtype } else { acc };
    launch!(dev, *module(sum_dtype)?, format!("linear_colsum_{sum_dtype}"), sums;
        part.buf.ptr(), db.buf.ptr(), splits as u64, cols as u64);
    out.push((db, Shape::from(cols)));
    Ok(with_h(out))
}

/// dx, dw (with db through BGRADB / BGRADA when both are wanted), db; dw and db in `wg.dtype`, dw
/// transposed when `wg.transposed`.
pub(super) fn grads(
    dz: (&CudaStorage, &Layout),
    x: (&CudaStorage, &Layout),
    w: (&CudaStorage, &Layout),
    need: Need,
    wg: WGrad,
) -> Result<FusedOutputs<CudaStorage>> {
    let dtype = dz.0.dtype();
    let (m, k, n) = sizes(x.1, w.1);
    let wide_ok = wg.dtype == dtype || (wg.dtype == DType::F32 && matches!(dtype, DType::F16 | DType::BF16));
    if !lt_dtype(dtype) || !wide_ok || m == 0 || n == 0 || k == 0 {
        return cpu::grads(dz, x, w, need, wg, false);
    }
    let dev = dz.0.dev();
    let zm = Mat::new(dz.0, dz.1)?;
    let mut out = vec![];
    if need.dx {
        let wm = Mat::new(w.0, w.1)?;
        let dx = CudaStorage::uninit(dev, m * k, dtype)?;
        let g = Gemm {
            dtype,
            d_dtype: dtype,
            m: k,
            n: m,
            k: n,
            a: wm.operand(true),
            b: zm.operand(true),
            d: Operand { ptr: dx.buf.ptr(), ld: k, trans: false },
            epilogue: Epilogue::Default,
            bias: None,
            aux: None,
        };
        if !blaslt::gemm(dev, &g)? {
            return cpu::grads(dz, x, w, need, wg, false);
        }
        out.push((dx, x.1.shape().clone()));
    }
    if need.dw {
        let xm = Mat::new(x.0, x.1)?;
        let dw = CudaStorage::uninit(dev, n * k, wg.dtype)?;
        let db = if need.db { Some(CudaStorage::uninit(dev, n, wg.dtype)?) } else { None };
        let (g, shape) = if wg.transposed {
            // dW (N x K) column-major, i.e. `[K, N]` row-major; db sums op(A) = dz^T over M.
            let g = Gemm {
                dtype,
                d_dtype: wg.dtype,
                m: n,
                n: k,
                k: m,
                a: zm.operand(true),
                b: xm.operand(false),
                d: Operand { ptr: dw.buf.ptr(), ld: n, trans: false },
                epilogue: if db.is_some() { Epilogue::BGradA } else { Epilogue::Default },
                bias: db.as_ref().map(|d| d.buf.ptr()),
                aux: None,
            };
            (g, Shape::from((k, n)))
        } else {
            let g = Gemm {
                dtype,
                d_dtype: wg.dtype,
                m: k,
                n,
                k: m,
                a: xm.operand(true),
                b: zm.operand(false),
                d: Operand { ptr: dw.buf.ptr(), ld: k, trans: false },
                epilogue: if db.is_some() { Epilogue::BGradB } else { Epilogue::Default },
                bias: db.as_ref().map(|d| d.buf.ptr()),
                aux: None,
            };
            (g, Shape::from((n, k)))
        };
        let mut db = db;
        if !blaslt::gemm(dev, &g)? {
            // No kernel with the bias-gradient epilogue for this layout and dtype: the plain
            // product, and db as a column sum below.
            let plain = Gemm { epilogue: Epilogue::Default, bias: None, ..g };
            if db.is_none() || !blaslt::gemm(dev, &plain)? {
                return cpu::grads(dz, x, w, need, wg, false);
            }
            db = None;
        }
        out.push((dw, shape));
        match db {
            Some(db) => out.push((db, Shape::from(n))),
            None if need.db => out.push((col_sums(dz, m, n, wg.dtype)?, Shape::from(n))),
            None => {}
        }
    } else if need.db {
        // Only the bias trains: a column sum, no matmul.
        out.push((col_sums(dz, m, n, wg.dtype)?, Shape::from(n)));
    }
    Ok(out)
}

/// The column sums of `dz` (`[m, n]`) in `to`: summed in f32 at least (an f32 bias gradient of a
/// half-precision dz is not rounded to the half type on the way).
fn col_sums(dz: (&CudaStorage, &Layout), m: usize, n: usize, to: DType) -> Result<CudaStorage> {
    let dtype = dz.0.dtype();
    let zl = cpu::as_matrix(dz.1);
    let own = match (&zl, to != dtype) {
        (_, true) => Some(dz.0.to_dtype(dz.1, to)?),
        (None, false) => Some(dz.0.copy_strided(dz.1)?),
        (Some(_), false) => None,
    };
    let zl = match own {
        Some(_) => Layout::contiguous((m, n)),
        None => zl.unwrap_or_else(|| Layout::contiguous((m, n))),
    };
    own.as_ref().unwrap_or(dz.0).reduce(&zl, crate::op::ReduceOp::Sum, &[0])
}

/// The part of `linear.cu` compiled for `dtype` (mod.rs `MODULES`). A kernel's part is the dtype of
/// its name's suffix, so a bf16 backward whose bias sums are f32 loads the bf16 and the f32 parts.
fn module(dtype: DType) -> Result<&'static Module> {
    Ok(match dtype {
        DType::F32 => &LINEAR_F32,
        DType::F64 => &LINEAR_F64,
        DType::F16 => &LINEAR_F16,
        DType::BF16 => &LINEAR_BF16,
        d => return Err(crate::Error::UnsupportedDType { op: "linear", dtype: d }),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every kernel the launches above can name is in the part they pick, and every part is picked.
    #[test]
    fn each_launch_finds_its_kernel_in_the_part_it_picks() {
        assert!(module(DType::I32).is_err());
        let mut routes = vec![];
        for dtype in [DType::F32, DType::F64, DType::F16, DType::BF16] {
            let part = module(dtype).expect("a float dtype has a part");
            for kernel in ["dgelu", "drelu", "dgelu_db", "drelu_db", "colsum"] {
                routes.push((format!("linear_{kernel}_{dtype}"), part));
            }
        }
        crate::cuda::modules::check_routes(&super::super::MODULES, &routes);
    }
}
