//! Scaled dot-product attention as one fused op: `Tensor::scaled_dot_product_attention`, with
//! PyTorch's `F.scaled_dot_product_attention` semantics and its own backward.
//!
//! - `cpu.rs`: the CPU forward and backward (blocked, rayon-parallel); also the reference of the
//!   parity tests when run in f64.
//! - `cuda.rs`: the launches; the kernels are `attention_common.cuh` (ABI, shared helpers),
//!   `attention_tc.cu` (FlashAttention-2 style, tensor cores, bf16 / f16), `attention_simt.cu`
//!   (exact f32) and `attention.cu` (backward helpers, entry points), one NVRTC module per head dim.
//! - `cudnn/`: cuDNN's fused SDPA forward and backward through its backend graph API, where a
//!   libcudnn 9.x loads at run time.
//! - `select.rs`: which of them runs on CUDA (`FERROGRAD_ATTENTION=flash|cudnn|math`, default
//!   cuDNN where it can run the case, our kernels otherwise), and counters of what ran.
//! - `math.rs`: the composed definition (`FERROGRAD_ATTENTION=math`).
//! - `packed.rs`: the same op over one packed `[B, T, 3, H, D]` QKV buffer
//!   ([`Tensor::attention_packed`]), whose backward writes one packed gradient.
//! - `bench.rs`: the workload of `ferrograd bench attention` (twin: `bench/torch_attention.py`).
//!
//! The forward keeps only the output and the per-row log-sum-exp (`[B, H, Tq]`, f32, f64 for f64
//! inputs on the CPU), never the `Tq x Tk` matrix; the backward recomputes the probabilities from
//! them. Dropout draws its mask from the project's Philox generator at indices of
//! `(b, h, i, j)` (see [`Dropout`]), so the CPU and the GPU drop the same elements and the backward
//! regenerates the mask instead of storing it.

pub mod bench;
mod cpu;
mod cuda;
pub mod cudnn;
mod math;
mod packed;
pub mod select;

use super::{apply, apply_all, FusedCtx, FusedOp, FusedOutputs};
use crate::cpu::CpuStorage;
use crate::cuda::modules::headers::COMMON;
use crate::cuda::modules::{CompileOptions, Define, Header, Module};
use crate::cuda::CudaStorage;
use crate::rng::Rng;
use crate::{shape_err, DType, Error, Layout, Result, Tensor};
use select::{count, Backend};
use std::sync::Arc;

/// Options of [`Tensor::scaled_dot_product_attention`], PyTorch's keyword arguments.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AttentionOpts {
    /// Mask out keys after the query (`j > i`), top-left aligned as PyTorch's `is_causal`.
    pub causal: bool,
    /// Softmax scale; `None` is `1 / sqrt(D)`.
    pub scale: Option<f64>,
    /// Dropout probability on the attention weights, in `[0, 1)`; 0 disables dropout. Like
    /// PyTorch's argument it applies whenever it is non-zero: pass 0 in evaluation.
    pub dropout_p: f64,
}

impl Default for AttentionOpts {
    fn default() -> Self {
        AttentionOpts { causal: false, scale: None, dropout_p: 0.0 }
    }
}

impl AttentionOpts {
    /// Causal attention with the default scale and no dropout.
    pub fn causal() -> Self {
        AttentionOpts { causal: true, ..Default::default() }
    }
}

/// Head dims the CUDA kernels are built for (every head dim works on the CPU).
pub const CUDA_HEAD_DIMS: [usize; 5] = [32, 64, 80, 96, 128];

/// The module's own headers (`attention.cu` includes them after the shared `common.cuh`): the
/// ABI and helpers, the tensor-core kernels, the f32 kernels.
const ATTN_COMMON: Header = Header::new("attention_common.cuh", include_str!("attention_common.cuh"));
const ATTN_TC: Header = Header::new("attention_tc.cu", include_str!("attention_tc.cu"));
const ATTN_SIMT: Header = Header::new("attention_simt.cu", include_str!("attention_simt.cu"));
/// The Hopper kernels (`wgmma`; the backward in `_bwd.cu`), built into the head dim 64 and 128
/// bf16 / f16 modules for sm_90a; `gen_wgmma.py` writes the `_ops.cuh` wrappers.
const ATTN_WG: Header = Header::new("attention_wgmma.cu", include_str!("attention_wgmma.cu"));
const ATTN_WG_OPS: Header = Header::new("attention_wgmma_ops.cuh", include_str!("attention_wgmma_ops.cuh"));
const ATTN_WG_BWD: Header = Header::new("attention_wgmma_bwd.cu", include_str!("attention_wgmma_bwd.cu"));

/// One module per head dim and dtype (`-D FG_ATTN_D=<d> -D FG_ATTN_DTYPE=<0 bf16, 1 f16, 2 f32>`):
/// a head dim's twelve kernels in one module took 3-7 s of NVRTC, the longest poles of a cold
/// precompile; apart they compile in parallel in under 2 s each, and a run compiles only the head
/// dim and dtype it launches. `cuda.rs` `module` picks one.
macro_rules! attention_module {
    ($id:ident, $name:literal, $d:literal, $dtype:literal, $ms:literal) => {
        /// The attention kernels compiled for one head dim and dtype (the Hopper headers are
        /// declared because `attention.cu` names them, under a condition these modules never meet).
        pub const $id: Module = Module::new($name, include_str!("attention.cu"))
            .with_headers(&[COMMON, ATTN_COMMON, ATTN_TC, ATTN_SIMT, ATTN_WG, ATTN_WG_OPS, ATTN_WG_BWD])
            .with_defines(&[Define::int("FG_ATTN_D", $d), Define::int("FG_ATTN_DTYPE", $dtype)])
            .with_cost_ms($ms);
    };
}

/// The Hopper kernels of one head dim and dtype (`-D FG_ATTN_WG_PART`), without dropout or with it
/// (`-D FG_ATTN_WG_DROP`): modules of their own, built for sm_90a and only for sm_90
/// (`CompileOptions::SM90A`), so they compile beside the mma.sync module instead of after it (in
/// one module the d128 part was a cold precompile's longest pole, 6.6 s) and a run compiles only
/// the kind it launches (the dropout kernels spill where the others do not, so they are separate
/// kernels, and would double the module's NVRTC time for runs that never drop).
macro_rules! attention_wg_module {
    ($id:ident, $name:literal, $d:literal, $dtype:literal, $drop:literal, $ms:literal) => {
        /// The Hopper (wgmma) attention kernels of one head dim and dtype, without or with dropout.
        pub const $id: Module = Module::new($name, include_str!("attention.cu"))
            .with_headers(&[COMMON, ATTN_COMMON, ATTN_TC, ATTN_SIMT, ATTN_WG, ATTN_WG_OPS, ATTN_WG_BWD])
            .with_defines(&[
                Define::int("FG_ATTN_D", $d),
                Define::int("FG_ATTN_DTYPE", $dtype),
                Define::int("FG_ATTN_WG_PART", 1),
                Define::int("FG_ATTN_WG_DROP", $drop),
            ])
            .with_options(CompileOptions::SM90A)
            .with_cost_ms($ms);
    };
}

attention_module!(ATTENTION_D32_BF16, "attention_d32_bf16", 32, 0, 850);
attention_module!(ATTENTION_D32_F16, "attention_d32_f16", 32, 1, 850);
attention_module!(ATTENTION_D32_F32, "attention_d32_f32", 32, 2, 630);
attention_module!(ATTENTION_D64_BF16, "attention_d64_bf16", 64, 0, 1000);
attention_module!(ATTENTION_D64_F16, "attention_d64_f16", 64, 1, 1000);
attention_module!(ATTENTION_D64_F32, "attention_d64_f32", 64, 2, 700);
attention_module!(ATTENTION_D80_BF16, "attention_d80_bf16", 80, 0, 1200);
attention_module!(ATTENTION_D80_F16, "attention_d80_f16", 80, 1, 1200);
attention_module!(ATTENTION_D80_F32, "attention_d80_f32", 80, 2, 750);
attention_module!(ATTENTION_D96_BF16, "attention_d96_bf16", 96, 0, 1300);
attention_module!(ATTENTION_D96_F16, "attention_d96_f16", 96, 1, 1300);
attention_module!(ATTENTION_D96_F32, "attention_d96_f32", 96, 2, 800);
attention_module!(ATTENTION_D128_BF16, "attention_d128_bf16", 128, 0, 1500);
attention_module!(ATTENTION_D128_F16, "attention_d128_f16", 128, 1, 1500);
attention_wg_module!(ATTENTION_D64_BF16_WG, "attention_d64_bf16_wg", 64, 0, 0, 1300);
attention_wg_module!(ATTENTION_D64_F16_WG, "attention_d64_f16_wg", 64, 1, 0, 1300);
attention_wg_module!(ATTENTION_D128_BF16_WG, "attention_d128_bf16_wg", 128, 0, 0, 1300);
attention_wg_module!(ATTENTION_D128_F16_WG, "attention_d128_f16_wg", 128, 1, 0, 1300);
attention_wg_module!(ATTENTION_D64_BF16_WGDROP, "attention_d64_bf16_wgdrop", 64, 0, 1, 1300);
attention_wg_module!(ATTENTION_D64_F16_WGDROP, "attention_d64_f16_wgdrop", 64, 1, 1, 1300);
attention_wg_module!(ATTENTION_D128_BF16_WGDROP, "attention_d128_bf16_wgdrop", 128, 0, 1, 1300);
attention_wg_module!(ATTENTION_D128_F16_WGDROP, "attention_d128_f16_wgdrop", 128, 1, 1, 1300);

/// The Hopper parts, as d64 bf16, d64 f16, d128 bf16, d128 f16 without dropout, then the same with
/// it (`cuda.rs` `wg_module`).
pub const WG_MODULES: [&Module; 8] = [
    &ATTENTION_D64_BF16_WG,
    &ATTENTION_D64_F16_WG,
    &ATTENTION_D128_BF16_WG,
    &ATTENTION_D128_F16_WG,
    &ATTENTION_D64_BF16_WGDROP,
    &ATTENTION_D64_F16_WGDROP,
    &ATTENTION_D128_BF16_WGDROP,
    &ATTENTION_D128_F16_WGDROP,
];
attention_module!(ATTENTION_D128_F32, "attention_d128_f32", 128, 2, 850);

/// Whether a cold precompile for `arch` can leave `module` out because nothing runs it there: on
/// sm_90 the Hopper kernels, with and without dropout, take every bf16 / f16 call at head dims 64
/// and 128 that the mma.sync modules of those head dims would (`cuda.rs` `wgmma`), unless
/// `FERROGRAD_ATTENTION_WGMMA=0` turns them off (or a grid past 2^31 blocks needs the mma.sync
/// kernels' two-dimensional one). Such a call still compiles the module on first use.
pub fn superseded_on(module: &Module, arch: crate::cuda::nvrtc::Arch) -> bool {
    arch == crate::cuda::nvrtc::Arch::SM90
        && select::wgmma_allowed()
        && [&ATTENTION_D64_BF16, &ATTENTION_D64_F16, &ATTENTION_D128_BF16, &ATTENTION_D128_F16]
            .iter()
            .any(|m| m.name == module.name)
}

/// The kernel modules (for `cuda::modules::ALL`), head dim by head dim as in [`CUDA_HEAD_DIMS`],
/// each as bf16, f16, f32.
pub const MODULES: [&Module; 15] = [
    &ATTENTION_D32_BF16,
    &ATTENTION_D32_F16,
    &ATTENTION_D32_F32,
    &ATTENTION_D64_BF16,
    &ATTENTION_D64_F16,
    &ATTENTION_D64_F32,
    &ATTENTION_D80_BF16,
    &ATTENTION_D80_F16,
    &ATTENTION_D80_F32,
    &ATTENTION_D96_BF16,
    &ATTENTION_D96_F16,
    &ATTENTION_D96_F32,
    &ATTENTION_D128_BF16,
    &ATTENTION_D128_F16,
    &ATTENTION_D128_F32,
];

/// Dropout of one call: which Philox numbers it reads and how it decides.
///
/// Element `(b, h, i, j)` (query `i`, key `j`) takes 16-bit half `j % 2` (0: the low half) of word
/// `(j % 8) / 2` of Philox block `offset + ((b * H + h) * Tq + i) * ceil(Tk / 8) + j / 8` of `seed`
/// (`rng::philox4x32_10`, counter `[index lo, index hi, 0, 0]`, key `[seed lo, seed hi]`), and is
/// kept when `half >= thr`, `thr = ceil(p * 2^16)`: exactly when the uniform `half * 2^-16` is
/// `>= p` (so `p` counts in steps of 2^-16: 0.1 drops with probability 0.100006). Kept weights are
/// scaled by `1 / (1 - p)`. Half a word an element rather than a word: the GPU kernels spend most of
/// a dropout step drawing these blocks, and a block now serves 8 keys instead of 4 (BENCHMARKS.md,
/// thirteenth session).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Dropout {
    /// Dropout probability.
    pub p: f64,
    /// Philox key.
    pub seed: u64,
    /// First Philox block of this call.
    pub offset: u64,
    /// Keep threshold on a 16-bit half of a word: `ceil(p * 2^16)`.
    pub thr: u32,
}

impl Dropout {
    fn new(p: f64, seed: u64, offset: u64) -> Dropout {
        Dropout { p, seed, offset, thr: (p * 65_536.0).ceil() as u32 }
    }

    /// The 4 words of the block that holds keys `8 * jb8 .. 8 * jb8 + 7` of query row `i` of head `bh`.
    pub fn words(&self, bh: usize, tq: usize, tk: usize, i: usize, jb8: usize) -> [u32; 4] {
        let index = self.offset + ((bh * tq + i) * tk.div_ceil(8) + jb8) as u64;
        crate::rng::philox4x32_10(
            [index as u32, (index >> 32) as u32, 0, 0],
            [self.seed as u32, (self.seed >> 32) as u32],
        )
    }

    /// Whether key `j` is kept, given the words of its block (`words(.., j / 8)`).
    pub fn keeps(&self, words: &[u32; 4], j: usize) -> bool {
        let w = words[(j % 8) / 2];
        ((w >> (16 * (j % 2))) & 0xffff) >= self.thr
    }
}

/// One call's resolved problem, shared by the forward and backward of both backends.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Problem {
    /// Batch.
    pub b: usize,
    /// Heads.
    pub h: usize,
    /// Query length.
    pub tq: usize,
    /// Key length.
    pub tk: usize,
    /// Head dim.
    pub d: usize,
    /// Causal mask.
    pub causal: bool,
    /// Softmax scale.
    pub scale: f64,
    /// Dropout, when `p > 0`.
    pub dropout: Option<Dropout>,
}

impl Problem {
    /// Philox blocks one call's mask covers (the stream advance that reserves them).
    fn mask_blocks(&self) -> usize {
        self.b * self.h * self.tq * self.tk.div_ceil(8)
    }
}

const OP: &str = "scaled_dot_product_attention";

/// Shapes, dtypes, devices and options checked; the problem they describe.
fn resolve(q: &Tensor, k: &Tensor, v: &Tensor, opts: &AttentionOpts) -> Result<Problem> {
    for t in [q, k, v] {
        if t.rank() != 4 {
            return Err(shape_err!(
                OP,
                "q, k and v must be [B, H, T, D], got {:?}, {:?}, {:?}",
                q.dims(),
                k.dims(),
                v.dims()
            ));
        }
    }
    if !q.dtype().is_float() {
        return Err(Error::UnsupportedDType { op: OP, dtype: q.dtype() });
    }
    for t in [k, v] {
        if t.dtype() != q.dtype() {
            return Err(Error::DTypeMismatch { op: OP, lhs: q.dtype(), rhs: t.dtype() });
        }
        if t.device() != q.device() {
            return Err(Error::DeviceMismatch { op: OP, lhs: q.device(), rhs: t.device() });
        }
    }
    let (qd, kd, vd) = (q.dims(), k.dims(), v.dims());
    if qd[0] != kd[0] || qd[1] != kd[1] || qd[3] != kd[3] {
        return Err(Error::ShapeMismatch { op: OP, lhs: qd.to_vec(), rhs: kd.to_vec() });
    }
    if kd[..3] != vd[..3] || vd[3] != qd[3] {
        return Err(Error::ShapeMismatch { op: OP, lhs: kd.to_vec(), rhs: vd.to_vec() });
    }
    let (b, h, tq, tk, d) = (qd[0], qd[1], qd[2], kd[2], qd[3]);
    if tk == 0 && tq > 0 {
        return Err(shape_err!(OP, "no keys (k has shape {kd:?}): every query's softmax would be empty"));
    }
    if d == 0 {
        return Err(shape_err!(OP, "head dim 0 (q has shape {qd:?})"));
    }
    if !(opts.dropout_p.is_finite() && (0.0..1.0).contains(&opts.dropout_p)) {
        return Err(Error::InvalidArgument(format!("{OP}: dropout_p {} is not in [0, 1)", opts.dropout_p)));
    }
    let scale = opts.scale.unwrap_or(1.0 / (d as f64).sqrt());
    if !scale.is_finite() {
        return Err(Error::InvalidArgument(format!("{OP}: scale {scale} is not finite")));
    }
    if q.device().is_cuda() {
        cuda::check(q.dtype(), b, h, tq, tk, d)?;
    }
    Ok(Problem { b, h, tq, tk, d, causal: opts.causal, scale, dropout: None })
}

impl Tensor {
    /// Scaled dot-product attention, PyTorch's `F.scaled_dot_product_attention(q, k, v,
    /// dropout_p=opts.dropout_p, is_causal=opts.causal, scale=opts.scale)`:
    /// `softmax(scale * q k^T [+ causal mask]) v`, with dropout on the softmax weights. Recorded as
    /// one op with its own backward (gradients for q, k and v).
    ///
    /// - Shapes: `q` is `[B, H, Tq, D]`, `k` and `v` are `[B, H, Tk, D]` (B, H and D must agree;
    ///   a value head dim different from D is not supported); the result is `[B, H, Tq, D]`, a
    ///   permuted view of a `[B, Tq, H, D]` buffer as FlashAttention returns it, so
    ///   `.transpose(1, 2)` of it is contiguous. Any T (1, odd, not a multiple of a tile).
    /// - Strides: any; the CUDA kernels read views in place (the `[B, H, T, D]` permutations of
    ///   one `[B, T, 3, H, D]` QKV buffer, say) as long as the head dim is contiguous and rows are
    ///   16-byte aligned, and copy other views first.
    /// - Causal: `j > i` masked, top-left aligned as PyTorch's `is_causal` (also for Tq != Tk).
    /// - Dtypes: f32, f16, bf16 everywhere (f16 / bf16 accumulate in f32, on tensor cores on
    ///   CUDA; f32 is exact f32 arithmetic on CUDA, SIMT kernels, no TF32); f64 on the CPU.
    /// - Devices: CPU (any head dim) and CUDA (head dims [`CUDA_HEAD_DIMS`]: 32, 64, 80, 96, 128).
    /// - Memory: the output and a `[B, H, Tq]` log-sum-exp; the `Tq x Tk` matrix is never stored.
    /// - Dropout: drawn from the default generator (see
    ///   [`scaled_dot_product_attention_with`](Self::scaled_dot_product_attention_with)); the
    ///   same elements are dropped on every backend.
    /// - Errors: `Error::Shape` for a rank other than 4, no keys or head dim 0,
    ///   `Error::ShapeMismatch` when B, H or D differ or k and v disagree,
    ///   `Error::DTypeMismatch` / `Error::DeviceMismatch` across q, k, v,
    ///   `Error::UnsupportedDType` for integers (and f64 on CUDA), `Error::Shape` naming the
    ///   supported head dims for another head dim on CUDA, `Error::InvalidArgument` for
    ///   `dropout_p` outside `[0, 1)` or a non-finite scale.
    pub fn scaled_dot_product_attention(q: &Tensor, k: &Tensor, v: &Tensor, opts: AttentionOpts) -> Result<Tensor> {
        sdpa(q, k, v, &opts, |n| crate::rng::with_global_rng(|r| r.advance(n)))
    }

    /// [`scaled_dot_product_attention`](Self::scaled_dot_product_attention) with dropout drawn
    /// from `rng` (which advances only when `dropout_p > 0`).
    pub fn scaled_dot_product_attention_with(
        rng: &mut Rng,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        opts: AttentionOpts,
    ) -> Result<Tensor> {
        sdpa(q, k, v, &opts, |n| rng.advance(n))
    }
}

fn sdpa(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    opts: &AttentionOpts,
    draw: impl FnOnce(usize) -> (u64, u64),
) -> Result<Tensor> {
    let mut pb = resolve(q, k, v, opts)?;
    if q.device().is_cuda() && select::backend()? == Backend::Math {
        select::announce(Backend::Math);
        count(|c| c.math += 1);
        return math::composed(q, k, v, &pb, opts.dropout_p);
    }
    if opts.dropout_p > 0.0 {
        let (seed, offset) = draw(pb.mask_blocks() * 4);
        pb.dropout = Some(Dropout::new(opts.dropout_p, seed, offset));
    }
    apply(Arc::new(Sdpa(pb)), &[q, k, v])?.permute(&[0, 2, 1, 3])
}

/// The forward: inputs q, k, v; outputs O `[B, Tq, H, D]` (the op's value) and the saved
/// log-sum-exp `[B, H, Tq]`.
struct Sdpa(Problem);

/// The backward: inputs q, k, v, O, dO (both `[B, Tq, H, D]`), lse; outputs dq, dk, dv, each
/// `[B, T, H, D]`.
struct SdpaBackward(Problem);

fn three<'a, S>(inputs: &'a [(&'a S, &'a Layout)], n: usize, op: &str) -> Result<&'a [(&'a S, &'a Layout)]> {
    if inputs.len() == n {
        Ok(inputs)
    } else {
        Err(Error::InvalidArgument(format!("{op}: {} inputs, expected {n}", inputs.len())))
    }
}

impl FusedOp for Sdpa {
    fn name(&self) -> &'static str {
        OP
    }

    fn cpu_fwd(&self, inputs: &[(&CpuStorage, &Layout)]) -> Result<FusedOutputs<CpuStorage>> {
        let x = three(inputs, 3, OP)?;
        cpu::forward(&self.0, x[0], x[1], x[2])
    }

    fn cuda_fwd(&self, inputs: &[(&CudaStorage, &Layout)]) -> Result<FusedOutputs<CudaStorage>> {
        let x = three(inputs, 3, OP)?;
        if wants_cudnn(&self.0, x[0].0.dtype())? {
            if let Some(out) = cudnn::forward(&self.0, x[0], x[1], x[2])? {
                count(|c| c.cudnn_fwd += 1);
                return Ok(out);
            }
            count(|c| c.cudnn_fallbacks += 1);
        }
        count(|c| c.flash_fwd += 1);
        cuda::forward(&self.0, x[0], x[1], x[2])
    }

    fn backward(&self, ctx: &FusedCtx<'_>, grad: &Tensor) -> Result<Vec<Option<Tensor>>> {
        let lse = ctx.saved.first().ok_or_else(|| Error::Backward(format!("{OP}: the log-sum-exp was not saved")))?;
        let [q, k, v] = ctx.inputs else {
            return Err(Error::Backward(format!("{OP}: {} inputs recorded, expected 3", ctx.inputs.len())));
        };
        let grad = if grad.dtype() == q.dtype() { grad.clone() } else { grad.to_dtype(q.dtype())? };
        let grads = apply_all(&SdpaBackward(self.0), &[q, k, v, ctx.output, &grad, lse])?;
        grads.iter().map(|g| g.permute(&[0, 2, 1, 3]).map(Some)).collect()
    }
}

impl FusedOp for SdpaBackward {
    fn name(&self) -> &'static str {
        "scaled_dot_product_attention_backward"
    }

    fn cpu_fwd(&self, inputs: &[(&CpuStorage, &Layout)]) -> Result<FusedOutputs<CpuStorage>> {
        let x = three(inputs, 6, self.name())?;
        cpu::backward(&self.0, x[0], x[1], x[2], x[3], x[4], x[5])
    }

    fn cuda_fwd(&self, inputs: &[(&CudaStorage, &Layout)]) -> Result<FusedOutputs<CudaStorage>> {
        let x = three(inputs, 6, self.name())?;
        if wants_cudnn(&self.0, x[0].0.dtype())? {
            if let Some(out) = cudnn::backward(&self.0, x[0], x[1], x[2], x[3], x[4], x[5], false)? {
                count(|c| c.cudnn_bwd += 1);
                return Ok(out);
            }
            count(|c| c.cudnn_fallbacks += 1);
        }
        count(|c| c.flash_bwd += 1);
        cuda::backward(&self.0, x[0], x[1], x[2], x[3], x[4], x[5], false)
    }
}

/// The kernel modules a causal call of `tq` queries (no dropout) of head dim `d` in `dtype` loads
/// on `dev` under the backend in force: none where cuDNN takes it or where CUDA has no kernel for
/// `d` (the composed fallback), else our kernels' module, the Hopper build where it applies.
/// Training and a prompt's forward are calls of more than one query, a decode step one. What a
/// run's warm start compiles ahead (`CudaDevice::warm`).
pub fn call_modules(dev: &crate::cuda::CudaDevice, tq: usize, d: usize, dtype: DType) -> Result<Vec<&'static Module>> {
    let pb = Problem { b: 1, h: 1, tq: tq.max(1), tk: tq.max(1), d, causal: true, scale: 1.0, dropout: None };
    if wants_cudnn(&pb, dtype)? {
        return Ok(vec![]);
    }
    Ok(cuda::modules_for(dev, &pb, dtype))
}

/// Whether this CUDA forward or backward should try cuDNN (the backend in force and the case).
/// Either direction may run on either implementation: both save and read the same statistics.
fn wants_cudnn(pb: &Problem, dtype: DType) -> Result<bool> {
    let backend = select::backend()?;
    select::announce(backend);
    match backend {
        // Not for a single query (a KV-cache decode step): cuDNN builds a plan per problem, and a
        // decode step's key length is new at every token, so each step paid a plan build (GPT-2
        // bf16 decode: 37.7 ms per token against 1.25 ms in f32, whose attention is ours; H200).
        // One query row is memory-bound work our kernel does without any per-shape cost.
        Backend::Auto => Ok(pb.tq > 1 && cudnn::supports(pb, dtype)),
        Backend::Cudnn => {
            let ok = cudnn::supports(pb, dtype);
            if !ok {
                select::log_once("cudnn-unsupported", || {
                    let why = match cudnn::library() {
                        Err(e) => e.to_string(),
                        Ok(_) => format!(
                            "it takes bf16/f16 without dropout and head dims that are multiples of 8 up to 128, \
                             not {dtype} D={} dropout={}",
                            pb.d,
                            pb.dropout.is_some()
                        ),
                    };
                    format!("cuDNN was asked for but cannot run this call ({why}); our kernels run it")
                });
            }
            Ok(ok)
        }
        Backend::Flash | Backend::Math => Ok(false),
    }
}

/// The accumulation dtype of the saved log-sum-exp for inputs of `dtype`.
pub(crate) fn lse_dtype(dtype: DType) -> DType {
    if dtype == DType::F64 {
        DType::F64
    } else {
        DType::F32
    }
}
