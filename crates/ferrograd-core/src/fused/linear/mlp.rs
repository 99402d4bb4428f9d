//! `mlp(x, w1, b1, w2, b2)`: `gelu(x W1^T + b1) W2^T + b2`, GPT-2's MLP block, as one fused op.
//! The second layer's input gradient `dh = dy W2` is a matmul, so cuBLASLt's DGELU epilogue can
//! turn it into the first layer's pre-activation gradient `dz = dh * gelu'(z)` in the same call;
//! with `db1` to sum, the plain GEMM and our one-pass `dz` + `db1` kernel are faster than the
//! DGELU_BGRAD epilogue on Hopper (measured; see `HiddenGrad`).
//!
//! Forward: two cuBLASLt calls (GELU_AUX_BIAS keeping `z` and `h = gelu(z)`, then BIAS). Backward:
//! `dW2` + `db2` (BGRADB), `dz` + `db1` (GEMM, then `linear_dgelu_db`), `dW1`, `dx`. The backward
//! reads `z` and `h`; [`mlp_recompute`] keeps only `z` and recomputes `h = gelu(z)` there (one
//! elementwise pass for `rows x hidden` elements fewer held between the passes). CPU and
//! fallback: the same composition as `linear` (`cpu.rs`). Master weights (f32 parameters over an
//! f16/bf16 `x`) as `linear` takes them (`master.rs`): both weights cast down in the forward and
//! kept, the four parameter gradients in f32.

use super::master::view_as;
use super::{check, cpu, cuda, with_params_lowered, Activation, Grads, Need, WGrad};
use crate::backend::BackendStorage;
use crate::backprop::track;
use crate::cpu::CpuStorage;
use crate::cuda::blaslt::{self, Aux, Epilogue, Gemm, Operand};
use crate::cuda::CudaStorage;
use crate::fused::{apply, apply_all, FusedCtx, FusedOp, FusedOutputs};
use crate::op::UnaryOp;
use crate::{DType, Error, Layout, Result, Shape, Tensor};
use std::sync::Arc;

/// `gelu(x W1^T + b1) W2^T + b2` (GELU in its tanh form) with PyTorch's layouts: `x` is
/// `[..., in]`, `w1` is `[hidden, in]`, `b1` is `[hidden]`, `w2` is `[out, hidden]`, `b2` is
/// `[out]`; the result is `[..., out]`. The same values and gradients as two [`super::linear`]
/// calls, with one elementwise pass fewer in the backward. All four parameters share one dtype:
/// x's, or f32 over an f16/bf16 `x` (master weights).
pub fn mlp(x: &Tensor, w1: &Tensor, b1: Option<&Tensor>, w2: &Tensor, b2: Option<&Tensor>) -> Result<Tensor> {
    mlp_with(x, w1, b1, w2, b2, true)
}

/// [`mlp`] that keeps only the pre-activation `z` for the backward, which recomputes the hidden
/// activation `h = gelu_tanh(z)` from it: `rows x hidden` elements less memory held from the
/// forward to the backward (GPT-2 124M at 16 x 1024 in bf16: 100 MB a block, 1.2 GB for 12; what
/// PyTorch's compiled GPT-2 does), for one elementwise pass over `z` in the backward. `h` is then
/// gelu of `z` as stored (rounded to x's dtype) rather than of the GEMM's f32 accumulator, so the
/// gradients differ from [`mlp`]'s in the last bits (and more in f16 / bf16, whose z is rounded).
pub fn mlp_recompute(x: &Tensor, w1: &Tensor, b1: Option<&Tensor>, w2: &Tensor, b2: Option<&Tensor>) -> Result<Tensor> {
    mlp_with(x, w1, b1, w2, b2, false)
}

fn mlp_with(
    x: &Tensor,
    w1: &Tensor,
    b1: Option<&Tensor>,
    w2: &Tensor,
    b2: Option<&Tensor>,
    keep_h: bool,
) -> Result<Tensor> {
    let master = check(x, w1, b1)?;
    // The hidden activation has x's leading dims and w1's rows: check the second layer against it.
    let hidden: Vec<usize> = x.dims()[..x.rank() - 1].iter().copied().chain([w1.dims()[0]]).collect();
    if w2.rank() != 2 || w2.dims()[1] != w1.dims()[0] {
        return Err(Error::ShapeMismatch { op: "mlp (second layer)", lhs: hidden, rhs: w2.dims().to_vec() });
    }
    if w2.dtype() != w1.dtype() {
        return Err(Error::DTypeMismatch { op: "mlp", lhs: w1.dtype(), rhs: w2.dtype() });
    }
    let leading = &x.dims()[..x.rank() - 1];
    Shape::from(leading.iter().copied().chain([w2.dims()[0]]).collect::<Vec<_>>()).checked_elem_count("mlp")?;
    if let Some(b2) = b2 {
        if b2.dims() != [w2.dims()[0]] {
            return Err(Error::ShapeMismatch {
                op: "mlp (second bias)",
                lhs: w2.dims().to_vec(),
                rhs: b2.dims().to_vec(),
            });
        }
        if b2.dtype() != w1.dtype() {
            return Err(Error::DTypeMismatch { op: "mlp", lhs: w1.dtype(), rhs: b2.dtype() });
        }
    }
    let mut inputs = vec![x, w1];
    inputs.extend(b1);
    inputs.push(w2);
    inputs.extend(b2);
    let save = track(&inputs);
    let op = MlpOp { has_b1: b1.is_some(), has_b2: b2.is_some(), save, keep_h, master };
    apply(Arc::new(op), &inputs)
}

/// Inputs `[x, w1, (b1), w2, (b2)]`; outputs `[y]`, plus (when `save`) `h` (unless not `keep_h`)
/// and `z` (`[rows, ld]`), plus the two weights cast to x's dtype when also `master`.
struct MlpOp {
    has_b1: bool,
    has_b2: bool,
    save: bool,
    keep_h: bool,
    master: bool,
}

impl MlpOp {
    /// (x, w1, b1, w2, b2) from the inputs in their order.
    #[allow(clippy::type_complexity)]
    fn split<T: Copy>(&self, inputs: &[T]) -> Result<(T, T, Option<T>, T, Option<T>)> {
        let want = 3 + self.has_b1 as usize + self.has_b2 as usize;
        if inputs.len() != want {
            return Err(Error::InvalidArgument(format!("mlp: {} inputs, expected {want}", inputs.len())));
        }
        let mut it = inputs.iter().copied();
        let mut next = || it.next().unwrap_or(inputs[0]); // (the count was checked above)
        let (x, w1) = (next(), next());
        let b1 = self.has_b1.then(&mut next);
        let w2 = next();
        let b2 = self.has_b2.then(&mut next);
        Ok((x, w1, b1, w2, b2))
    }

    /// Both layers through `layer` (the CPU's or the GPU's linear forward).
    fn run<S: BackendStorage>(
        &self,
        inputs: &[(&S, &Layout)],
        layer: impl Fn((&S, &Layout), (&S, &Layout), Option<(&S, &Layout)>, Activation, bool) -> Result<FusedOutputs<S>>,
    ) -> Result<FusedOutputs<S>> {
        self.split(inputs)?;
        let (mut out, low) = with_params_lowered(inputs, self.master, |a| {
            let (x, w1, b1, w2, b2) = self.split(a)?;
            let mut first = layer(x, w1, b1, Activation::GeluTanh, self.save)?.into_iter();
            let (h, hshape) = first.next().ok_or_else(|| Error::Backward("mlp: no hidden activation".into()))?;
            let hl = Layout::contiguous(hshape.clone());
            let mut out = layer((&h, &hl), w2, b2, Activation::None, false)?;
            if self.save {
                if self.keep_h {
                    out.push((h, hshape));
                }
                out.extend(first);
            }
            Ok(out)
        })?;
        if self.save && self.master {
            // w1 and w2: the backward's dx and dh read them as the forward did.
            let w2_at = 2 + self.has_b1 as usize;
            for (i, lo) in low.into_iter().enumerate() {
                if let (true, Some(lo)) = (i == 1 || i == w2_at, lo) {
                    out.push((lo.s, lo.saved));
                }
            }
        }
        Ok(out)
    }
}

impl FusedOp for MlpOp {
    fn name(&self) -> &'static str {
        "mlp"
    }

    fn cpu_fwd(&self, inputs: &[(&CpuStorage, &Layout)]) -> Result<FusedOutputs<CpuStorage>> {
        self.run(inputs, |x, w, b, act, save| cpu::forward(x, w, b, act, save, true))
    }

    fn cuda_fwd(&self, inputs: &[(&CudaStorage, &Layout)]) -> Result<FusedOutputs<CudaStorage>> {
        self.run(inputs, cuda::forward)
    }

    fn backward(&self, ctx: &FusedCtx<'_>, dy: &Tensor) -> Result<Vec<Option<Tensor>>> {
        let refs: Vec<&Tensor> = ctx.inputs.iter().collect();
        let (x, w1, b1, w2, b2) = self.split(&refs)?;
        let missing = || Error::Backward("mlp: the hidden activation was not saved".into());
        // saved: [h,] z, [w1, w2 cast]
        let k = self.keep_h as usize;
        let z = ctx.saved.get(k).ok_or_else(missing)?.narrow(1, 0, w1.dims()[0])?;
        // The weights as the forward read them: the saved casts of master weights.
        let (w1l, w2l) = match self.master {
            true => {
                let w = |i: usize| ctx.saved.get(i).ok_or_else(|| Error::Backward("mlp: no cast weight".into()));
                (view_as(w(k + 1)?, w1)?, view_as(w(k + 2)?, w2)?)
            }
            false => (w1.clone(), w2.clone()),
        };
        let tracks = |t: Option<&Tensor>| t.is_some_and(|t| t.tracks_grad());
        let (wg1, wg2) = (WGrad::of(w1), WGrad::of(w2));
        let second = Need { dx: false, dw: w2.tracks_grad(), db: tracks(b2) };
        let first = Need { dx: x.tracks_grad(), dw: w1.tracks_grad(), db: tracks(b1) };
        // First layer's dz and db1 from dy W2 (see `HiddenGrad`). Without a kept h, the same kernel
        // writes h = gelu(z) for dW2 below: one more store instead of an elementwise pass.
        let emit_h = !self.keep_h && (second.dw || second.db);
        let (mut dz, mut db1, mut h_new) = (None, None, None);
        if first.dx || first.dw || first.db {
            let hg = HiddenGrad { with_db: first.db, db_dtype: wg1.dtype, emit_h };
            let mut o = apply_all(&hg, &[dy, &w2l, &z])?.into_iter();
            dz = Some(o.next().ok_or_else(|| Error::Backward("mlp: no hidden gradient".into()))?);
            db1 = if first.db { o.next() } else { None };
            h_new = if emit_h { o.next() } else { None };
        }
        // Second layer: dW2 and db2 in one matmul (BGRADB).
        let mut outs2 = if second.dw || second.db {
            // h: kept, written beside dz, or (no first-layer gradient) recomputed here.
            let h = match (self.keep_h, h_new) {
                (true, _) => ctx.saved.first().ok_or_else(missing)?.clone(),
                (false, Some(h)) => h,
                (false, None) => z.gelu_tanh()?,
            };
            apply_all(&Grads { need: second, wg: wg2 }, &[dy, &h, &w2l])?
        } else {
            vec![]
        }
        .into_iter();
        let (dw2, db2) = (second.dw.then(|| outs2.next()).flatten(), second.db.then(|| outs2.next()).flatten());
        let dw2 = dw2.map(|d| wg2.as_weight(d)).transpose()?;
        // First layer: dW1 and dx.
        let (mut dx, mut dw1) = (None, None);
        let mm = Need { db: false, ..first };
        if let (Some(dz), true) = (&dz, mm.dx || mm.dw) {
            let mut o = apply_all(&Grads { need: mm, wg: wg1 }, &[dz, x, &w1l])?.into_iter();
            dx = mm.dx.then(|| o.next()).flatten();
            dw1 = mm.dw.then(|| o.next()).flatten().map(|d| wg1.as_weight(d)).transpose()?;
        }
        let mut grads = vec![dx, dw1];
        if self.has_b1 {
            grads.push(db1);
        }
        grads.push(dw2);
        if self.has_b2 {
            grads.push(db2);
        }
        Ok(grads)
    }
}

/// The first layer's pre-activation gradient `dz = (dy W2) * gelu'(z)` and, `with_db`, its column
/// sums `db1` (in `db_dtype`: dy's, or f32 for master weights), and, `emit_h`, the hidden
/// activation `h = gelu_tanh(z)`: inputs `[dy, w2, z]` (w2 in dy's dtype, z viewable as `[rows,
/// hidden]`), outputs `[dz]`, then `db1`, then `h` where asked.
struct HiddenGrad {
    with_db: bool,
    db_dtype: DType,
    emit_h: bool,
}

impl HiddenGrad {
    /// `out` with `h = gelu_tanh(z)` appended when `emit_h` (the paths whose kernel does not write
    /// it: the CPU, cuBLASLt's epilogue).
    fn with_h<S: BackendStorage>(&self, mut out: FusedOutputs<S>, z: (&S, &Layout)) -> Result<FusedOutputs<S>> {
        if self.emit_h {
            out.push((z.0.unary(z.1, UnaryOp::GeluTanh)?, z.1.shape().clone()));
        }
        Ok(out)
    }
}

/// The composition: `dh = dy W2` (z stands in for the hidden activation: only its shape is read),
/// then the activation-gradient op.
fn hidden_grad_ref<S: BackendStorage>(
    inputs: &[(&S, &Layout)],
    widen: bool,
    act_backward: impl Fn((&S, &Layout), (&S, &Layout)) -> Result<FusedOutputs<S>>,
) -> Result<FusedOutputs<S>> {
    let (dy, w2, z) = (inputs[0], inputs[1], inputs[2]);
    let need = Need { dx: true, dw: false, db: false };
    let wg = WGrad { dtype: dy.0.dtype(), transposed: false };
    let (dh, shape) = cpu::grads(dy, z, w2, need, wg, widen)?.remove(0);
    act_backward((&dh, &Layout::contiguous(shape)), z)
}

/// Whether `FERROGRAD_MLP_BACKWARD=epilogue` asks for cuBLASLt's DGELU_BGRAD (read once).
fn epilogue_db() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| std::env::var("FERROGRAD_MLP_BACKWARD").is_ok_and(|v| v.trim() == "epilogue"))
}

impl FusedOp for HiddenGrad {
    fn name(&self) -> &'static str {
        "mlp_hidden_backward"
    }

    fn cpu_fwd(&self, inputs: &[(&CpuStorage, &Layout)]) -> Result<FusedOutputs<CpuStorage>> {
        let db = self.with_db.then_some(self.db_dtype);
        let out = hidden_grad_ref(inputs, true, |dh, z| cpu::act_backward(dh, z, Activation::GeluTanh, db, true))?;
        self.with_h(out, inputs[2])
    }

    fn cuda_fwd(&self, inputs: &[(&CudaStorage, &Layout)]) -> Result<FusedOutputs<CudaStorage>> {
        let (with_db, db) = (self.with_db, self.with_db.then_some(self.db_dtype));
        let emit = self.emit_h;
        let fallback =
            || hidden_grad_ref(inputs, false, |dh, z| cuda::act_backward(dh, z, Activation::GeluTanh, db, emit));
        let (dy, w2, z) = (inputs[0], inputs[1], inputs[2]);
        let dtype = dy.0.dtype();
        // dz has z's rows and w2's columns.
        let (m, n, hidden) =
            (z.1.elem_count().checked_div(w2.1.dims()[1]).unwrap_or(0), w2.1.dims()[0], w2.1.dims()[1]);
        let zm = cuda::Mat::new(z.0, z.1)?;
        if !cuda::lt_dtype(dtype) || m == 0 || n == 0 || hidden == 0 || !zm.row_major || !zm.ld.is_multiple_of(8) {
            return fallback();
        }
        // With db1: DGELU_BGRAD's column sums run far slower than the GEMM itself (GPT-2's
        // 16384 x 3072 x 768 on an H200: 450 us against 107 us for the plain GEMM), so by default
        // the plain GEMM is followed by our one-pass dz + db1 kernel (`linear_dgelu_db`, ~0.1 ms)
        // instead. `FERROGRAD_MLP_BACKWARD=epilogue` keeps the epilogue (for benchmarks).
        // (An f32 db1 of master weights is not the epilogue's: its bias has D's dtype.)
        if with_db && (!epilogue_db() || self.db_dtype != dtype) {
            return fallback();
        }
        let dev = dy.0.dev();
        let (dym, w2m) = (cuda::Mat::new(dy.0, dy.1)?, cuda::Mat::new(w2.0, w2.1)?);
        let dz = CudaStorage::uninit(dev, m * hidden, dtype)?;
        let db = if with_db { Some(CudaStorage::uninit(dev, hidden, dtype)?) } else { None };
        // dz^T (hidden x M) = W2^T (hidden x N) · dy^T (N x M), then * gelu'(z^T); db1 = row sums.
        let g = Gemm {
            dtype,
            d_dtype: dtype,
            m: hidden,
            n: m,
            k: n,
            a: w2m.operand(true),
            b: dym.operand(true),
            d: Operand { ptr: dz.buf.ptr(), ld: hidden, trans: false },
            epilogue: if with_db { Epilogue::DGeluBGrad } else { Epilogue::DGelu },
            bias: db.as_ref().map(|d| d.buf.ptr()),
            aux: Some(Aux { ptr: zm.ptr, ld: zm.ld }),
        };
        if !blaslt::gemm(dev, &g)? {
            return fallback();
        }
        let mut out = vec![(dz, Shape::from((m, hidden)))];
        if let Some(db) = db {
            out.push((db, Shape::from(hidden)));
        }
        self.with_h(out, z)
    }
}
