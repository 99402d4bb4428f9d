//! The SDPA forward and backward as cuDNN backend operation graphs, and their execution plans.
//!
//! The graphs are the ones cudnn-frontend's `CompositeSDPANode` / `CompositeSDPABackwardNode`
//! lower `sdpa` / `sdpa_backward` to for cuDNN 9.0 .. 9.20 (`node/scaled_dot_product_flash_attention.h`
//! at v1.15, the frontend recommended for 9.13+): matmul, pointwise and reduction operations whose
//! pattern the backend's fused flash-attention engines recognise. Tensor by tensor and operation by
//! operation they follow that lowering (dims, strides, dtypes, the by-value scalars, the order of
//! the operations): the engines match the pattern, so a different but equivalent graph may find no
//! engine. Dims are `[B, H, T, D]`; strides are whatever the operands have (elements).

use super::desc::{Desc, TensorSpec};
use super::lib::{CudnnLib, Handle};
use crate::Result;
use cudarc::cudnn::sys::{
    cudnnBackendAttributeName_t as A, cudnnBackendAttributeType_t as T, cudnnBackendDescriptorType_t as D,
    cudnnBackendHeurMode_t, cudnnDataType_t as Dt, cudnnPointwiseMode_t as Pw, cudnnReduceTensorOp_t as Red,
};
use std::sync::Arc;

/// Unique ids of the graph's non-virtual tensors (the variant pack binds pointers to these).
pub(super) mod uid {
    pub const Q: i64 = 1;
    pub const K: i64 = 2;
    pub const V: i64 = 3;
    pub const O: i64 = 4;
    pub const STATS: i64 = 5;
    pub const SCALE: i64 = 6;
    pub const NEG_INF: i64 = 7;
    pub const DO: i64 = 8;
    pub const DQ: i64 = 9;
    pub const DK: i64 = 10;
    pub const DV: i64 = 11;
    pub const ONE: i64 = 12;
    /// `rowsum(dO * O)`, f32 `[B, H, Tq, 1]`: scratch the caller provides.
    pub const SOFTMAX_SUM: i64 = 13;
    /// dQ accumulated in f32 `[B, H, Tq, D]`: scratch the caller provides.
    pub const DQ_ACCUM: i64 = 14;
    /// The backward's padding-mask workaround: int32 `[B, 1, 1, 1]` sequence lengths (all Tq, all
    /// Tk) in device memory, and its own -inf.
    pub const SEQ_LEN_Q: i64 = 15;
    pub const SEQ_LEN_KV: i64 = 16;
    pub const NEG_INF_PAD: i64 = 17;
}

fn as_refs(o: &[Option<Arc<Desc>>; 3]) -> [Option<&Desc>; 3] {
    [o[0].as_deref(), o[1].as_deref(), o[2].as_deref()]
}

/// Whether the backward needs cudnn-frontend's padding-mask workaround: cuDNN up to 9.15 has a
/// backward bug for sequence lengths that are not multiples of 128 without a padding mask, so the
/// frontend adds one with every length full (`CompositeSDPABackwardNode::pre_validate_node`, v1.15
/// for Tq, later versions for Tk; both are covered here). Functionally it masks nothing.
pub(super) fn backward_needs_padding(version: usize, tq: i64, tk: i64) -> bool {
    version <= 91500 && (tq % 128 != 0 || tk % 128 != 0)
}

/// Element strides of a `[B, H, T, D]` operand, in that order.
pub(super) type Strides = [i64; 4];

/// One attention problem as a plan is built for it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(super) struct Shape {
    pub b: i64,
    pub h: i64,
    pub tq: i64,
    pub tk: i64,
    pub d: i64,
    /// CUDNN_DATA_HALF or CUDNN_DATA_BFLOAT16, as u32 (for hashing).
    pub io: u32,
    pub causal: bool,
}

impl Shape {
    fn io(&self) -> Dt {
        if self.io == Dt::CUDNN_DATA_HALF as u32 {
            Dt::CUDNN_DATA_HALF
        } else {
            Dt::CUDNN_DATA_BFLOAT16
        }
    }
}

/// Builds one operation graph, keeping every descriptor alive (the finalized operations refer to
/// the tensors and sub-descriptors they were given).
pub(super) struct Builder {
    lib: &'static CudnnLib,
    keep: Vec<Arc<Desc>>,
    ops: Vec<Arc<Desc>>,
    next_virtual: i64,
    /// Non-virtual uids in the order they were declared (the variant pack's order).
    pub io_uids: Vec<i64>,
}

fn keep(keep: &mut Vec<Arc<Desc>>, d: Desc) -> Arc<Desc> {
    let d = Arc::new(d);
    keep.push(d.clone());
    d
}

impl Builder {
    pub(super) fn new(lib: &'static CudnnLib) -> Builder {
        Builder { lib, keep: vec![], ops: vec![], next_virtual: 100, io_uids: vec![] }
    }

    fn tensor(&mut self, spec: TensorSpec) -> Result<Arc<Desc>> {
        if !spec.is_virtual {
            self.io_uids.push(spec.uid);
        }
        let d = spec.build(self.lib)?;
        Ok(keep(&mut self.keep, d))
    }

    /// A tensor in memory (an input, an output, or caller-provided scratch).
    fn io(&mut self, uid: i64, dtype: Dt, dims: [i64; 4], strides: Strides) -> Result<Arc<Desc>> {
        self.tensor(TensorSpec {
            uid,
            dtype,
            dims: dims.to_vec(),
            strides: strides.to_vec(),
            is_virtual: false,
            by_value: false,
        })
    }

    /// An intermediate that lives only inside the fused kernel.
    fn virt(&mut self, dtype: Dt, dims: [i64; 4], strides: Strides) -> Result<Arc<Desc>> {
        let uid = self.next_virtual;
        self.next_virtual += 1;
        self.tensor(TensorSpec {
            uid,
            dtype,
            dims: dims.to_vec(),
            strides: strides.to_vec(),
            is_virtual: true,
            by_value: false,
        })
    }

    /// A host f32 scalar passed by value at execution (`[1, 1, 1, 1]`: the backend wants the rank of
    /// the tensors it broadcasts against).
    fn scalar(&mut self, uid: i64) -> Result<Arc<Desc>> {
        self.tensor(TensorSpec {
            uid,
            dtype: Dt::CUDNN_DATA_FLOAT,
            dims: vec![1; 4],
            strides: vec![1; 4],
            is_virtual: false,
            by_value: true,
        })
    }

    fn push(&mut self, op: Desc) {
        let op = keep(&mut self.keep, op);
        self.ops.push(op);
    }

    #[allow(clippy::too_many_arguments)]
    fn pointwise(
        &mut self,
        mode: Pw,
        prec: Dt,
        axis: Option<i64>,
        x: &Desc,
        b: Option<&Desc>,
        t: Option<&Desc>,
        y: &Desc,
    ) -> Result<()> {
        let lib = self.lib;
        let pw = Desc::new(lib, D::CUDNN_BACKEND_POINTWISE_DESCRIPTOR, "pointwise")?;
        pw.enum32(A::CUDNN_ATTR_POINTWISE_MODE, T::CUDNN_TYPE_POINTWISE_MODE, mode as u32)?;
        pw.dtype(A::CUDNN_ATTR_POINTWISE_MATH_PREC, prec)?;
        if let Some(a) = axis {
            pw.i64(A::CUDNN_ATTR_POINTWISE_AXIS, a)?;
        }
        let pw = keep(&mut self.keep, pw.finalize()?);
        let op = Desc::new(lib, D::CUDNN_BACKEND_OPERATION_POINTWISE_DESCRIPTOR, "pointwise operation")?;
        op.desc(A::CUDNN_ATTR_OPERATION_POINTWISE_PW_DESCRIPTOR, &pw)?;
        op.desc(A::CUDNN_ATTR_OPERATION_POINTWISE_XDESC, x)?;
        op.desc(A::CUDNN_ATTR_OPERATION_POINTWISE_YDESC, y)?;
        op.f32(A::CUDNN_ATTR_OPERATION_POINTWISE_ALPHA1, 1.0)?;
        op.f32(A::CUDNN_ATTR_OPERATION_POINTWISE_ALPHA2, 1.0)?;
        if let Some(b) = b {
            op.desc(A::CUDNN_ATTR_OPERATION_POINTWISE_BDESC, b)?;
        }
        if let Some(t) = t {
            op.desc(A::CUDNN_ATTR_OPERATION_POINTWISE_TDESC, t)?;
        }
        let op = op.finalize()?;
        self.push(op);
        Ok(())
    }

    /// `y = mode(x)` in f32 (unary).
    fn unary(&mut self, mode: Pw, x: &Desc, y: &Desc) -> Result<()> {
        self.pointwise(mode, Dt::CUDNN_DATA_FLOAT, None, x, None, None, y)
    }

    /// `y = mode(x, b)` in f32 (binary).
    fn binary(&mut self, mode: Pw, x: &Desc, b: &Desc, y: &Desc) -> Result<()> {
        self.pointwise(mode, Dt::CUDNN_DATA_FLOAT, None, x, Some(b), None, y)
    }

    fn reduction(&mut self, mode: Red, x: &Desc, y: &Desc) -> Result<()> {
        let lib = self.lib;
        let r = Desc::new(lib, D::CUDNN_BACKEND_REDUCTION_DESCRIPTOR, "reduction")?;
        r.dtype(A::CUDNN_ATTR_REDUCTION_COMP_TYPE, Dt::CUDNN_DATA_FLOAT)?;
        r.enum32(A::CUDNN_ATTR_REDUCTION_OPERATOR, T::CUDNN_TYPE_REDUCTION_OPERATOR_TYPE, mode as u32)?;
        let r = keep(&mut self.keep, r.finalize()?);
        let op = Desc::new(lib, D::CUDNN_BACKEND_OPERATION_REDUCTION_DESCRIPTOR, "reduction operation")?;
        op.desc(A::CUDNN_ATTR_OPERATION_REDUCTION_DESC, &r)?;
        op.desc(A::CUDNN_ATTR_OPERATION_REDUCTION_XDESC, x)?;
        op.desc(A::CUDNN_ATTR_OPERATION_REDUCTION_YDESC, y)?;
        let op = op.finalize()?;
        self.push(op);
        Ok(())
    }

    fn matmul(&mut self, a: &Desc, b: &Desc, c: &Desc) -> Result<()> {
        self.matmul_over(a, b, c, [None, None, None])
    }

    /// A matmul whose m, n, k may be overridden per batch by int32 tensors (the padding mask's
    /// sequence lengths).
    fn matmul_over(&mut self, a: &Desc, b: &Desc, c: &Desc, mnk: [Option<&Desc>; 3]) -> Result<()> {
        let lib = self.lib;
        let m = Desc::new(lib, D::CUDNN_BACKEND_MATMUL_DESCRIPTOR, "matmul")?;
        m.dtype(A::CUDNN_ATTR_MATMUL_COMP_TYPE, Dt::CUDNN_DATA_FLOAT)?;
        m.f64(A::CUDNN_ATTR_MATMUL_PADDING_VALUE, 0.0)?;
        let m = keep(&mut self.keep, m.finalize()?);
        let op = Desc::new(lib, D::CUDNN_BACKEND_OPERATION_MATMUL_DESCRIPTOR, "matmul operation")?;
        op.desc(A::CUDNN_ATTR_OPERATION_MATMUL_ADESC, a)?;
        op.desc(A::CUDNN_ATTR_OPERATION_MATMUL_BDESC, b)?;
        op.desc(A::CUDNN_ATTR_OPERATION_MATMUL_CDESC, c)?;
        let names = [
            A::CUDNN_ATTR_OPERATION_MATMUL_GEMM_M_OVERRIDE_DESC,
            A::CUDNN_ATTR_OPERATION_MATMUL_GEMM_N_OVERRIDE_DESC,
            A::CUDNN_ATTR_OPERATION_MATMUL_GEMM_K_OVERRIDE_DESC,
        ];
        for (name, t) in names.into_iter().zip(mnk) {
            if let Some(t) = t {
                op.desc(name, t)?;
            }
        }
        op.desc(A::CUDNN_ATTR_OPERATION_MATMUL_DESC, &m)?;
        let op = op.finalize()?;
        self.push(op);
        Ok(())
    }

    fn reshape(&mut self, x: &Desc, y: &Desc) -> Result<()> {
        let op = Desc::new(self.lib, D::CUDNN_BACKEND_OPERATION_RESHAPE_DESCRIPTOR, "reshape operation")?;
        op.desc(A::CUDNN_ATTR_OPERATION_RESHAPE_XDESC, x)?;
        op.desc(A::CUDNN_ATTR_OPERATION_RESHAPE_YDESC, y)?;
        let op = op.finalize()?;
        self.push(op);
        Ok(())
    }

    /// Top-left causal mask (`sliding_window_mask` with right bound 0): keys `j > i` of query `i`
    /// get -inf. Returns the masked scores.
    fn causal_mask(&mut self, s: &Desc, dims: [i64; 4], strides: Strides) -> Result<Arc<Desc>> {
        let row = self.virt(Dt::CUDNN_DATA_INT32, dims, strides)?;
        self.pointwise(Pw::CUDNN_POINTWISE_GEN_INDEX, Dt::CUDNN_DATA_FLOAT, Some(2), s, None, None, &row)?;
        let col = self.virt(Dt::CUDNN_DATA_INT32, dims, strides)?;
        self.pointwise(Pw::CUDNN_POINTWISE_GEN_INDEX, Dt::CUDNN_DATA_FLOAT, Some(3), s, None, None, &col)?;
        let keep_mask = self.virt(Dt::CUDNN_DATA_BOOLEAN, dims, strides)?;
        self.pointwise(Pw::CUDNN_POINTWISE_CMP_GE, Dt::CUDNN_DATA_BOOLEAN, None, &row, Some(&col), None, &keep_mask)?;
        let neg_inf = self.scalar(uid::NEG_INF)?;
        let out = self.virt(Dt::CUDNN_DATA_FLOAT, dims, strides)?;
        self.pointwise(
            Pw::CUDNN_POINTWISE_BINARY_SELECT,
            Dt::CUDNN_DATA_FLOAT,
            None,
            s,
            Some(&neg_inf),
            Some(&keep_mask),
            &out,
        )?;
        Ok(out)
    }

    /// The padding mask (`attn::score_modifiers::padding_mask`): rows `>= seq_q` and columns
    /// `>= seq_kv` get -inf. Returns the masked scores.
    fn padding_mask(
        &mut self,
        s: &Desc,
        seq_q: &Desc,
        seq_kv: &Desc,
        dims: [i64; 4],
        strides: Strides,
    ) -> Result<Arc<Desc>> {
        let (i32_, bool_) = (Dt::CUDNN_DATA_INT32, Dt::CUDNN_DATA_BOOLEAN);
        let row = self.virt(i32_, dims, strides)?;
        self.pointwise(Pw::CUDNN_POINTWISE_GEN_INDEX, i32_, Some(2), s, None, None, &row)?;
        let col = self.virt(i32_, dims, strides)?;
        self.pointwise(Pw::CUDNN_POINTWISE_GEN_INDEX, i32_, Some(3), s, None, None, &col)?;
        let rmask = self.virt(bool_, dims, strides)?;
        self.pointwise(Pw::CUDNN_POINTWISE_CMP_LT, bool_, None, &row, Some(seq_q), None, &rmask)?;
        let cmask = self.virt(bool_, dims, strides)?;
        self.pointwise(Pw::CUDNN_POINTWISE_CMP_LT, bool_, None, &col, Some(seq_kv), None, &cmask)?;
        let mask = self.virt(bool_, dims, strides)?;
        self.pointwise(Pw::CUDNN_POINTWISE_LOGICAL_AND, bool_, None, &rmask, Some(&cmask), None, &mask)?;
        let neg_inf = self.scalar(uid::NEG_INF_PAD)?;
        let out = self.virt(Dt::CUDNN_DATA_FLOAT, dims, strides)?;
        self.pointwise(
            Pw::CUDNN_POINTWISE_BINARY_SELECT,
            Dt::CUDNN_DATA_FLOAT,
            None,
            s,
            Some(&neg_inf),
            Some(&mask),
            &out,
        )?;
        Ok(out)
    }

    /// The forward: `O = softmax(scale Q K^T [masked]) V` and `Stats = rowmax + log(rowsum exp)`
    /// (f32 `[B, H, Tq, 1]`, the natural-log log-sum-exp our kernel saves too).
    pub(super) fn sdpa_forward(&mut self, sh: &Shape, q: Strides, k: Strides, v: Strides, o: Strides) -> Result<()> {
        let Shape { b, h, tq, tk, d, causal, .. } = *sh;
        let io = sh.io();
        let f32_ = Dt::CUDNN_DATA_FLOAT;
        let qd = self.io(uid::Q, io, [b, h, tq, d], q)?;
        // The backend takes K^T: K's dims and strides with the last two swapped.
        let kt = self.io(uid::K, io, [b, h, d, tk], [k[0], k[1], k[3], k[2]])?;
        let vd = self.io(uid::V, io, [b, h, tk, d], v)?;
        let s_dims = [b, h, tq, tk];
        let s_str = [h * tq * tk, tq * tk, tk, 1];
        let row_dims = [b, h, tq, 1];
        let row_str = [h * tq, tq, 1, 1];
        let s = self.virt(f32_, s_dims, s_str)?;
        self.matmul(&qd, &kt, &s)?;
        let scale = self.scalar(uid::SCALE)?;
        let s1 = self.virt(f32_, s_dims, s_str)?;
        self.binary(Pw::CUDNN_POINTWISE_MUL, &s, &scale, &s1)?;
        let s2 = if causal { self.causal_mask(&s1, s_dims, s_str)? } else { s1 };
        // softmax, keeping the statistics.
        let m = self.virt(f32_, row_dims, row_str)?;
        self.reduction(Red::CUDNN_REDUCE_TENSOR_MAX, &s2, &m)?;
        let sub = self.virt(f32_, s_dims, s_str)?;
        self.binary(Pw::CUDNN_POINTWISE_SUB, &s2, &m, &sub)?;
        let e = self.virt(f32_, s_dims, s_str)?;
        self.unary(Pw::CUDNN_POINTWISE_EXP, &sub, &e)?;
        let z = self.virt(f32_, row_dims, row_str)?;
        self.reduction(Red::CUDNN_REDUCE_TENSOR_ADD, &e, &z)?;
        let logz = self.virt(f32_, row_dims, row_str)?;
        self.unary(Pw::CUDNN_POINTWISE_LOG, &z, &logz)?;
        let stats = self.io(uid::STATS, f32_, row_dims, row_str)?;
        self.binary(Pw::CUDNN_POINTWISE_ADD, &m, &logz, &stats)?;
        // P in the input dtype (the second matmul's A operand).
        let p = self.virt(io, s_dims, s_str)?;
        self.binary(Pw::CUDNN_POINTWISE_DIV, &e, &z, &p)?;
        let od = self.io(uid::O, io, [b, h, tq, d], o)?;
        self.matmul(&p, &vd, &od)
    }

    /// The backward: dQ, dK, dV from Q, K, V, O, dO and the forward's Stats. `softmax_sum` and
    /// `dq_accum` are f32 scratch in memory (as cudnn-frontend places them in its workspace).
    /// `padded`: with the padding-mask workaround ([`backward_needs_padding`]).
    #[allow(clippy::too_many_arguments)]
    pub(super) fn sdpa_backward(
        &mut self,
        sh: &Shape,
        padded: bool,
        q: Strides,
        k: Strides,
        v: Strides,
        o: Strides,
        dout: Strides,
        dq: Strides,
        dk: Strides,
        dv: Strides,
    ) -> Result<()> {
        let Shape { b, h, tq, tk, d, causal, .. } = *sh;
        let io = sh.io();
        let f32_ = Dt::CUDNN_DATA_FLOAT;
        let qd = self.io(uid::Q, io, [b, h, tq, d], q)?;
        let kt = self.io(uid::K, io, [b, h, d, tk], [k[0], k[1], k[3], k[2]])?;
        let vt = self.io(uid::V, io, [b, h, d, tk], [v[0], v[1], v[3], v[2]])?;
        let od = self.io(uid::O, io, [b, h, tq, d], o)?;
        let dod = self.io(uid::DO, io, [b, h, tq, d], dout)?;
        let row_dims = [b, h, tq, 1];
        let row_str = [h * tq, tq, 1, 1];
        let stats = self.io(uid::STATS, f32_, row_dims, row_str)?;
        let s_dims = [b, h, tq, tk];
        let s_str = [h * tq * tk, tq * tk, tk, 1];
        let st_dims = [b, h, tk, tq];
        let st_str = [h * tq * tk, tq * tk, 1, tk];
        let seq = if padded {
            let one4 = [1, 1, 1, 1];
            let q = self.io(uid::SEQ_LEN_Q, Dt::CUDNN_DATA_INT32, [b, 1, 1, 1], one4)?;
            let kv = self.io(uid::SEQ_LEN_KV, Dt::CUDNN_DATA_INT32, [b, 1, 1, 1], one4)?;
            Some((q, kv))
        } else {
            None
        };
        // m, n, k overrides of each matmul: (rows, cols, inner) as sequence lengths.
        let over = |m: Option<bool>, n: Option<bool>, k: Option<bool>| -> [Option<Arc<Desc>>; 3] {
            let pick = |x: Option<bool>| match (&seq, x) {
                (Some((q, _)), Some(true)) => Some(q.clone()),
                (Some((_, kv)), Some(false)) => Some(kv.clone()),
                _ => None,
            };
            [pick(m), pick(n), pick(k)]
        };
        // (true = Tq, false = Tk)
        let (qkt, ptdo, dovt, dstq, dsk) = (
            over(Some(true), Some(false), None),
            over(Some(false), None, Some(true)),
            over(Some(true), Some(false), None),
            over(Some(false), None, Some(true)),
            over(Some(true), None, Some(false)),
        );

        // softmax_sum = rowsum(dO * O) (times the dropout's 1 - p: here 1).
        let one = self.scalar(uid::ONE)?;
        let dodo = self.virt(f32_, [b, h, tq, d], [h * tq * d, tq * d, h * d, 1])?;
        self.binary(Pw::CUDNN_POINTWISE_MUL, &dod, &od, &dodo)?;
        let red = self.virt(f32_, row_dims, row_str)?;
        self.reduction(Red::CUDNN_REDUCE_TENSOR_ADD, &dodo, &red)?;
        let softmax_sum = self.io(uid::SOFTMAX_SUM, f32_, row_dims, row_str)?;
        self.binary(Pw::CUDNN_POINTWISE_MUL, &red, &one, &softmax_sum)?;

        // P = exp(scale Q K^T [masked] - Stats); dV = P^T dO.
        let s = self.virt(f32_, s_dims, s_str)?;
        self.matmul_over(&qd, &kt, &s, as_refs(&qkt))?;
        let scale = self.scalar(uid::SCALE)?;
        let s1 = self.virt(f32_, s_dims, s_str)?;
        self.binary(Pw::CUDNN_POINTWISE_MUL, &s, &scale, &s1)?;
        let s1 = match &seq {
            Some((q, kv)) => self.padding_mask(&s1, q, kv, s_dims, s_str)?,
            None => s1,
        };
        let s2 = self.virt(f32_, s_dims, s_str)?;
        self.binary(Pw::CUDNN_POINTWISE_SUB, &s1, &stats, &s2)?;
        let s3 = if causal { self.causal_mask(&s2, s_dims, s_str)? } else { s2 };
        let p = self.virt(f32_, s_dims, s_str)?;
        self.unary(Pw::CUDNN_POINTWISE_EXP, &s3, &p)?;
        let pt = self.virt(io, st_dims, st_str)?;
        self.reshape(&p, &pt)?;
        let dvd = self.io(uid::DV, io, [b, h, tk, d], dv)?;
        self.matmul_over(&pt, &dod, &dvd, as_refs(&ptdo))?;

        // dS = scale * P (dO V^T - softmax_sum); dK = dS^T Q.
        let dp = self.virt(f32_, s_dims, s_str)?;
        self.matmul_over(&dod, &vt, &dp, as_refs(&dovt))?;
        let t3 = self.virt(f32_, s_dims, s_str)?;
        self.binary(Pw::CUDNN_POINTWISE_SUB, &dp, &softmax_sum, &t3)?;
        let t4 = self.virt(f32_, s_dims, s_str)?;
        self.binary(Pw::CUDNN_POINTWISE_MUL, &t3, &p, &t4)?;
        let ds = self.virt(f32_, s_dims, s_str)?;
        self.binary(Pw::CUDNN_POINTWISE_MUL, &t4, &scale, &ds)?;
        let dst = self.virt(io, st_dims, st_str)?;
        self.reshape(&ds, &dst)?;
        let dkd = self.io(uid::DK, io, [b, h, tk, d], dk)?;
        self.matmul_over(&dst, &qd, &dkd, as_refs(&dstq))?;

        // dQ = dS K, accumulated in f32, then converted.
        let kr = self.virt(f32_, [b, h, tk, d], k)?;
        self.reshape(&kt, &kr)?;
        let acc = self.io(uid::DQ_ACCUM, f32_, [b, h, tq, d], [h * tq * d, tq * d, d, 1])?;
        self.matmul_over(&ds, &kr, &acc, as_refs(&dsk))?;
        let dqd = self.io(uid::DQ, io, [b, h, tq, d], dq)?;
        self.unary(Pw::CUDNN_POINTWISE_IDENTITY, &acc, &dqd)
    }

    /// The operation graph of everything built so far.
    pub(super) fn operation_graph(&mut self, handle: Option<Handle>) -> Result<Arc<Desc>> {
        let g = Desc::new(self.lib, D::CUDNN_BACKEND_OPERATIONGRAPH_DESCRIPTOR, "operation graph")?;
        let ops: Vec<&Desc> = self.ops.iter().map(|o| o.as_ref()).collect();
        g.descs(A::CUDNN_ATTR_OPERATIONGRAPH_OPS, &ops)?;
        if let Some(h) = handle {
            g.handle(A::CUDNN_ATTR_OPERATIONGRAPH_HANDLE, h)?;
        }
        let g = g.finalize()?;
        Ok(keep(&mut self.keep, g))
    }

    pub(super) fn into_kept(self) -> Vec<Arc<Desc>> {
        self.keep
    }
}

/// An execution plan and everything it refers to.
pub(super) struct Plan {
    pub plan: Desc,
    pub workspace: usize,
    /// The uids of the tensors the variant pack binds, in the graph's order.
    pub uids: Vec<i64>,
    /// The engine config's index in the heuristic's list (0 = its first choice; 0 too for a plan
    /// restored from disk, which was that run's choice).
    pub choice: usize,
    /// Restored from the plan cache (`plan_cache.rs`) rather than built.
    pub from_disk: bool,
    _kept: Vec<Arc<Desc>>,
}

/// A plan restored from disk for the graph `builder` declared (its uids bind the variant pack).
pub(super) fn restored(builder: Builder, plan: Desc, workspace: usize) -> Plan {
    let uids = builder.io_uids.clone();
    Plan { plan, workspace, uids, choice: 0, from_disk: true, _kept: builder.into_kept() }
}

/// Heuristic mode A's engine configs for the graph, tried in order; the first one that finalizes
/// as a plan is kept. `Err` carries every config's failure (the last cuDNN message of each).
pub(super) fn plan(lib: &'static CudnnLib, handle: Handle, mut builder: Builder) -> Result<Plan> {
    let graph = builder.operation_graph(Some(handle))?;
    let heur = Desc::new(lib, D::CUDNN_BACKEND_ENGINEHEUR_DESCRIPTOR, "engine heuristics")?;
    heur.desc(A::CUDNN_ATTR_ENGINEHEUR_OPERATION_GRAPH, &graph)?;
    heur.enum32(
        A::CUDNN_ATTR_ENGINEHEUR_MODE,
        T::CUDNN_TYPE_HEUR_MODE,
        cudnnBackendHeurMode_t::CUDNN_HEUR_MODE_A as u32,
    )?;
    let heur = heur.finalize()?;
    // SAFETY: a count query (no output array).
    let n = unsafe {
        lib.get_attribute(
            heur.raw,
            A::CUDNN_ATTR_ENGINEHEUR_RESULTS,
            T::CUDNN_TYPE_BACKEND_DESCRIPTOR,
            0,
            std::ptr::null_mut(),
        )
    }?;
    let cfgs: Vec<Desc> = (0..n.max(0))
        .map(|_| Desc::new(lib, D::CUDNN_BACKEND_ENGINECFG_DESCRIPTOR, "engine config"))
        .collect::<Result<_>>()?;
    let mut raw: Vec<super::lib::Descriptor> = cfgs.iter().map(|c| c.raw).collect();
    // SAFETY: `raw` holds `n` created engine-config descriptors for cuDNN to fill.
    let got = unsafe {
        lib.get_attribute(
            heur.raw,
            A::CUDNN_ATTR_ENGINEHEUR_RESULTS,
            T::CUDNN_TYPE_BACKEND_DESCRIPTOR,
            n,
            raw.as_mut_ptr() as *mut std::ffi::c_void,
        )
    }?;
    let mut why = vec![];
    for (i, cfg) in cfgs.iter().enumerate().take(got.max(0) as usize) {
        let attempt = (|| -> Result<Plan> {
            let p = Desc::new(lib, D::CUDNN_BACKEND_EXECUTION_PLAN_DESCRIPTOR, "execution plan")?;
            p.handle(A::CUDNN_ATTR_EXECUTION_PLAN_HANDLE, handle)?;
            p.desc(A::CUDNN_ATTR_EXECUTION_PLAN_ENGINE_CONFIG, cfg)?;
            let p = p.finalize()?;
            let workspace = workspace(lib, &p)?;
            Ok(Plan { plan: p, workspace, uids: vec![], choice: i, from_disk: false, _kept: vec![] })
        })();
        match attempt {
            Ok(mut p) => {
                p.uids = builder.io_uids.clone();
                let mut kept = builder.into_kept();
                kept.push(graph);
                kept.extend(cfgs.into_iter().map(Arc::new));
                p._kept = kept;
                return Ok(p);
            }
            Err(e) => why.push(format!("engine config {i}: {e}")),
        }
    }
    Err(crate::Error::Cudnn {
        call: "execution plan".into(),
        status: -1,
        msg: if why.is_empty() {
            format!("the heuristic offered no engine config for this graph ({got} of {n})")
        } else {
            format!("no engine config finalized: {}", why.join(" | "))
        },
    })
}

/// The finalized plan's workspace bytes.
pub(super) fn workspace(lib: &'static CudnnLib, plan: &Desc) -> Result<usize> {
    let mut ws = 0i64;
    // SAFETY: one INT64 into `ws`.
    unsafe {
        lib.get_attribute(
            plan.raw,
            A::CUDNN_ATTR_EXECUTION_PLAN_WORKSPACE_SIZE,
            T::CUDNN_TYPE_INT64,
            1,
            &mut ws as *mut i64 as *mut std::ffi::c_void,
        )
    }?;
    Ok(ws.max(0) as usize)
}
