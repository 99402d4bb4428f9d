//! GPT-2 with int8 linears (issue 18): how the four projections of each block run ([`Linears`]),
//! post-training quantization of a trained model, the int8 weights file `gpt quantize` writes, and
//! quantization-aware training.
//!
//! - **Float** (the default): `ops::linear` / `ops::mlp`, the training step's fused path.
//! - **Int8** (inference): each projection's weight quantized per output channel (symmetric int8
//!   on `[-127, 127]`, `ferrograd_core::quant::Int8Weight`), run as W8A16 (the weight dequantized
//!   into the float GEMM) or W8A8 (the input quantized per token, int8 GEMM with int32 sums,
//!   rescaled). The embeddings, layer norms, biases and the tied classifier stay float: `wte` is
//!   also the LM head, whose logits the loss is most sensitive to.
//! - **QAT**: each projection's weight fake-quantized per output channel and its input per token
//!   (symmetric int8, straight-through gradients), both with scales taken from the values
//!   themselves in every forward: exactly the integers W8A8 inference computes, so what QAT learns
//!   is what int8 inference runs. (`ferrograd_nn::quant::QatLinear` keeps per-tensor observers
//!   for the input instead; per-token dynamic scales match this model's W8A8 path and keep no
//!   state, so a QAT step can still be captured as a CUDA graph.)
//!
//! Under autocast the int8 paths take their float input in the low dtype (bf16), as the float path
//! does, and give their output in it.

use super::config::GptConfig;
use super::hf::{f32_blob, read_onto, Blob, CONFIG_KEY};
use super::model::{Block, Gpt, PREFIX};
use super::ops::{self, to_matmul_dtype};
use ferrograd_core::quant::{linear_w8a16, linear_w8a8, Int8Weight};
use ferrograd_core::{DType, Device, Error, FakeQuant, Result, Tensor};
use ferrograd_nn::checkpoint;
use safetensors::Dtype as StDtype;
use std::collections::HashMap;
use std::path::Path;

/// How the input of an int8 linear is handled.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum QuantMode {
    /// Weight-only: the int8 weight dequantized into a float GEMM.
    W8A16,
    /// The input quantized per token too, int8 GEMM with int32 accumulation.
    W8A8,
}

impl QuantMode {
    pub fn name(self) -> &'static str {
        match self {
            QuantMode::W8A16 => "w8a16",
            QuantMode::W8A8 => "w8a8",
        }
    }
}

impl std::fmt::Display for QuantMode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl std::str::FromStr for QuantMode {
    type Err = Error;
    fn from_str(s: &str) -> Result<QuantMode> {
        match s.to_ascii_lowercase().as_str() {
            "w8a16" => Ok(QuantMode::W8A16),
            "w8a8" => Ok(QuantMode::W8A8),
            _ => Err(Error::InvalidArgument(format!("int8 mode `{s}`: expected w8a16 or w8a8"))),
        }
    }
}

/// One block's four projections as int8 `[out, in]` weights (PyTorch's layout: one row per
/// output channel) with their per-row scales.
#[derive(Clone, Debug)]
pub struct BlockInt8 {
    pub c_attn: Int8Weight,
    pub attn_proj: Int8Weight,
    pub c_fc: Int8Weight,
    pub mlp_proj: Int8Weight,
}

/// How a GPT's block projections run (module documentation).
#[derive(Clone, Debug, Default)]
pub enum Linears {
    #[default]
    Float,
    Qat,
    Int8 {
        mode: QuantMode,
        blocks: Vec<BlockInt8>,
    },
}

/// Which of a block's two plain projections (the MLP's two are [`Linears::mlp`]).
#[derive(Clone, Copy, Debug)]
pub enum Proj {
    /// `attn.c_attn`: x to q|k|v.
    Qkv,
    /// `attn.c_proj`
    AttnOut,
}

/// The HF names (under `h.{i}.`) of the four projection weights, in [`BlockInt8`]'s order.
pub const PROJ_WEIGHTS: [&str; 4] =
    ["attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight"];

impl BlockInt8 {
    /// Quantize a block's float weights (`[in, out]`, Conv1D layout) per output channel.
    pub fn quantize(b: &Block) -> Result<BlockInt8> {
        Ok(BlockInt8 {
            c_attn: quantize_conv1d(&b.c_attn_w)?,
            attn_proj: quantize_conv1d(&b.attn_proj_w)?,
            c_fc: quantize_conv1d(&b.c_fc_w)?,
            mlp_proj: quantize_conv1d(&b.mlp_proj_w)?,
        })
    }

    fn weights(&self) -> [&Int8Weight; 4] {
        [&self.c_attn, &self.attn_proj, &self.c_fc, &self.mlp_proj]
    }
}

/// A Conv1D weight `[in, out]` as int8 `[out, in]`, one scale per output channel.
pub fn quantize_conv1d(w: &Tensor) -> Result<Int8Weight> {
    Int8Weight::quantize(&w.detach().to_dtype(DType::F32)?.t()?.contiguous()?)
}

impl Linears {
    fn int8(&self, layer: usize) -> Result<Option<(QuantMode, &BlockInt8)>> {
        match self {
            Linears::Int8 { mode, blocks } => blocks
                .get(layer)
                .map(|b| Some((*mode, b)))
                .ok_or_else(|| Error::InvalidArgument(format!("int8 GPT: no int8 weights for block {layer}"))),
            _ => Ok(None),
        }
    }

    /// `x W + b` for block `layer`'s projection `which` (`w` `[in, out]`, the float weight).
    pub fn linear(&self, layer: usize, which: Proj, x: &Tensor, w: &Tensor, b: &Tensor) -> Result<Tensor> {
        if let Some((mode, q)) = self.int8(layer)? {
            let q = match which {
                Proj::Qkv => &q.c_attn,
                Proj::AttnOut => &q.attn_proj,
            };
            return int8_linear(x, q, b, mode);
        }
        match self {
            Linears::Qat => ops::linear(&fq_per_token(x)?, &fq_per_column(w)?, Some(b)),
            _ => ops::linear(x, w, Some(b)),
        }
    }

    /// Block `layer`'s MLP, `gelu_tanh(x W1 + b1) W2 + b2`; `recompute`: the float path's backward
    /// recomputes the hidden activation (`ops::mlp`).
    pub fn mlp(&self, layer: usize, x: &Tensor, blk: &Block, recompute: bool) -> Result<Tensor> {
        if let Some((mode, q)) = self.int8(layer)? {
            let h = int8_linear(x, &q.c_fc, &blk.c_fc_b, mode)?.gelu_tanh()?;
            return int8_linear(&h, &q.mlp_proj, &blk.mlp_proj_b, mode);
        }
        match self {
            Linears::Qat => {
                let h = ops::linear(&fq_per_token(x)?, &fq_per_column(&blk.c_fc_w)?, Some(&blk.c_fc_b))?.gelu_tanh()?;
                ops::linear(&fq_per_token(&h)?, &fq_per_column(&blk.mlp_proj_w)?, Some(&blk.mlp_proj_b))
            }
            _ => ops::mlp(x, &blk.c_fc_w, &blk.c_fc_b, &blk.mlp_proj_w, &blk.mlp_proj_b, recompute),
        }
    }
}

/// An int8 projection: the input in the matmul dtype (bf16 under autocast), the bias cast to it.
fn int8_linear(x: &Tensor, w: &Int8Weight, b: &Tensor, mode: QuantMode) -> Result<Tensor> {
    let x = to_matmul_dtype(x)?;
    let b = b.to_dtype(x.dtype())?;
    match mode {
        QuantMode::W8A16 => linear_w8a16(&x, w, Some(&b)),
        QuantMode::W8A8 => linear_w8a8(&x, w, Some(&b)),
    }
}

/// Symmetric int8 fake quantization of a 2-d `x` per index of `axis`, the scale `max |x| / 127`
/// over the other dim (detached: the straight-through estimator passes the gradient to `x` only).
fn fq_sym_2d(x: &Tensor, axis: usize) -> Result<Tensor> {
    let s = x.detach().abs()?.max(1 - axis, false)?.to_dtype(DType::F32)?;
    // A row of zeros quantizes to zeros whatever its scale; the floor keeps the division finite.
    let s = s.mul_scalar(1.0 / 127.0)?.clamp(f32::MIN_POSITIVE as f64, f64::from(f32::MAX))?;
    let z = Tensor::zeros(s.shape().clone(), DType::F32, x.device())?;
    x.fake_quantize(&s, &z, FakeQuant { qmin: -127, qmax: 127, axis: Some(axis), grad_factor: None })
}

/// `x` `[.., C]` fake-quantized per row (per token), as W8A8 quantizes its input.
pub fn fq_per_token(x: &Tensor) -> Result<Tensor> {
    let c = x.dims().last().copied().unwrap_or(1).max(1);
    let rows = x.elem_count() / c;
    fq_sym_2d(&x.reshape((rows, c))?, 0)?.reshape(x.dims())
}

/// A Conv1D weight `[in, out]` fake-quantized per output channel (column), as
/// [`quantize_conv1d`] quantizes it.
pub fn fq_per_column(w: &Tensor) -> Result<Tensor> {
    fq_sym_2d(w, 1)
}

/// Quantize `model`'s projections for int8 inference in `mode` (the float weights are kept: see
/// [`drop_float_projections`]).
pub fn quantize(model: &mut Gpt, mode: QuantMode) -> Result<()> {
    let blocks = model.blocks.iter().map(BlockInt8::quantize).collect::<Result<Vec<_>>>()?;
    model.linears = Linears::Int8 { mode, blocks };
    Ok(())
}

/// Free the float projection weights of an int8 model (each becomes an empty tensor), so that only
/// the int8 copies take memory. An error unless the model is int8.
pub fn drop_float_projections(model: &mut Gpt) -> Result<()> {
    if !matches!(model.linears, Linears::Int8 { .. }) {
        return Err(Error::InvalidArgument("drop_float_projections: the model is not int8".into()));
    }
    let device = model.device();
    for b in &mut model.blocks {
        for (w, _) in b.projections_mut() {
            *w = Tensor::zeros((0, 0), DType::F32, device)?;
        }
    }
    Ok(())
}

/// Metadata of an int8 weights file: `format` is [`INT8_FORMAT`], [`MODE_KEY`] the mode it was
/// written for (the weights serve both), and the config under `hf::CONFIG_KEY`.
pub const FORMAT_KEY: &str = "format";
pub const INT8_FORMAT: &str = "ferrograd-gpt-int8";
pub const MODE_KEY: &str = "int8_mode";

/// Names of a projection's int8 values (`[out, in]` i8) and scales (`[out]` f32) in the file.
fn q_names(weight: &str) -> (String, String) {
    (format!("{weight}_int8"), format!("{weight}_scale"))
}

/// Bytes in an int8 file, by kind: `(projection weights as int8 + scales, the float rest)`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Int8Sizes {
    pub int8_bytes: usize,
    pub float_bytes: usize,
}

/// An int8 model's weights file: the projections as `{name}_int8` (i8 `[out, in]`) and
/// `{name}_scale` (f32 `[out]`), everything else f32 under its Hugging Face name (`wte` with the
/// real vocabulary), the config and mode in the metadata. With the sizes of each part.
pub fn int8_bytes(model: &Gpt) -> Result<(Vec<u8>, Int8Sizes)> {
    let Linears::Int8 { mode, blocks } = &model.linears else {
        return Err(Error::InvalidArgument("int8_bytes: the model is not quantized (gpt::quant::quantize)".into()));
    };
    if blocks.len() != model.blocks.len() {
        return Err(Error::InvalidArgument(format!(
            "int8_bytes: {} int8 blocks for {} blocks",
            blocks.len(),
            model.blocks.len()
        )));
    }
    let mut sizes = Int8Sizes::default();
    let mut blobs: Vec<(String, Blob)> = vec![];
    for (name, t) in model.hf_params()? {
        let Some((layer, w)) = projection(&name) else {
            let b = f32_blob(&t)?;
            sizes.float_bytes += b.2.len();
            blobs.push((name, b));
            continue;
        };
        let q = blocks[layer].weights()[w];
        let (qn, sn) = q_names(&name);
        let qv: Vec<u8> = q.q.to_vec::<i8>()?.into_iter().map(|v| v as u8).collect();
        let s = f32_blob(&q.scale)?;
        sizes.int8_bytes += qv.len() + s.2.len();
        blobs.push((qn, Blob(StDtype::I8, q.q.dims().to_vec(), qv)));
        blobs.push((sn, s));
    }
    let mut meta = HashMap::new();
    meta.insert(FORMAT_KEY.to_string(), INT8_FORMAT.to_string());
    meta.insert(MODE_KEY.to_string(), mode.name().to_string());
    meta.insert(
        CONFIG_KEY.to_string(),
        serde_json::to_string(&model.config).map_err(|e| Error::InvalidArgument(e.to_string()))?,
    );
    let bytes = ferrograd_nn::checkpoint::serialize_safetensors(blobs.iter().map(|(n, b)| (n.as_str(), b)), Some(meta))
        .map_err(|e| Error::InvalidArgument(format!("serialising int8 weights: {e}")))?;
    Ok((bytes, sizes))
}

/// Write [`int8_bytes`] atomically; returns the sizes.
pub fn save_int8(model: &Gpt, path: &Path) -> Result<Int8Sizes> {
    let (bytes, sizes) = int8_bytes(model)?;
    ferrograd_core::io::write_atomic(path, &bytes)?;
    Ok(sizes)
}

/// `(block, index in PROJ_WEIGHTS)` of a projection weight's full name.
fn projection(name: &str) -> Option<(usize, usize)> {
    let rest = name.strip_prefix(PREFIX)?.strip_prefix(".h.")?;
    let (layer, tail) = rest.split_once('.')?;
    let w = PROJ_WEIGHTS.iter().position(|p| *p == tail)?;
    Some((layer.parse().ok()?, w))
}

fn file_err(path: &Path, msg: impl Into<String>) -> Error {
    Error::File { path: path.display().to_string(), msg: msg.into() }
}

/// Whether `path` is a file [`save_int8`] wrote (reads its header only).
pub fn is_int8_file(path: &Path) -> bool {
    checkpoint::read_safetensors_header(path)
        .is_ok_and(|h| h.metadata.get(FORMAT_KEY).map(String::as_str) == Some(INT8_FORMAT))
}

/// An int8 model from a file [`save_int8`] wrote, on `device`, its projections in `mode` (default:
/// the file's) and their float weights dropped. Every tensor's dtype and shape is checked in the
/// header before the file is read, straight onto `device` (`hf::read_onto`: no host copy).
pub fn load_int8(path: &Path, device: Device, mode: Option<QuantMode>) -> Result<Gpt> {
    let header = checkpoint::read_safetensors_header(path)?;
    let meta = &header.metadata;
    if meta.get(FORMAT_KEY).map(String::as_str) != Some(INT8_FORMAT) {
        return Err(file_err(path, "not an int8 GPT file (`ferrograd gpt quantize` writes one)"));
    }
    let file_mode: QuantMode = meta.get(MODE_KEY).map(|s| s.parse()).transpose()?.unwrap_or(QuantMode::W8A16);
    let cfg: GptConfig = meta
        .get(CONFIG_KEY)
        .ok_or_else(|| file_err(path, format!("no {CONFIG_KEY} in the metadata")))
        .and_then(|s| serde_json::from_str(s).map_err(|e| file_err(path, format!("metadata {CONFIG_KEY}: {e}"))))?;
    cfg.validate()?;
    let mut model = Gpt::zeroed(cfg, device)?;
    // What each tensor of the file must be: the projections' int8 values and f32 scales, the other
    // parameters f32.
    let mut expected: Vec<(String, DType, Vec<usize>)> = vec![];
    for (name, t) in model.hf_params()? {
        match projection(&name) {
            Some(_) => {
                let (inp, out) = (t.dims()[0], t.dims()[1]);
                let (qn, sn) = q_names(&name);
                expected.push((qn, DType::I8, vec![out, inp]));
                expected.push((sn, DType::F32, vec![out]));
            }
            None => expected.push((name, DType::F32, t.dims().to_vec())),
        }
    }
    for (name, dtype, shape) in &expected {
        let e = header.tensors.get(name).ok_or_else(|| file_err(path, format!("tensor {name} is missing")))?;
        if e.dtype != Some(*dtype) || e.shape != *shape {
            return Err(file_err(
                path,
                format!("tensor {name} is {} {:?}, expected {dtype:?} {shape:?}", e.dtype_name, e.shape),
            ));
        }
    }
    let seen: std::collections::HashSet<&str> = expected.iter().map(|(n, _, _)| n.as_str()).collect();
    if let Some(extra) = header.tensors.keys().find(|n| !seen.contains(n.as_str())) {
        return Err(file_err(path, format!("tensor {extra} is not part of an int8 GPT-2 of this config")));
    }
    let mut loaded = read_onto(path, device, None)?;
    let mut take =
        |name: &str| loaded.tensors.remove(name).ok_or_else(|| file_err(path, format!("tensor {name} was not read")));
    let mut blocks: Vec<[Option<Int8Weight>; 4]> = (0..cfg.n_layer).map(|_| [None, None, None, None]).collect();
    for (name, t) in model.hf_params()? {
        match projection(&name) {
            Some((layer, w)) => {
                let (qn, sn) = q_names(&name);
                blocks[layer][w] = Some(Int8Weight::from_parts(take(&qn)?, take(&sn)?)?);
            }
            None => t.set(&take(&name)?)?,
        }
    }
    let blocks = blocks
        .into_iter()
        .map(|[a, b, c, d]| match (a, b, c, d) {
            (Some(c_attn), Some(attn_proj), Some(c_fc), Some(mlp_proj)) => {
                Ok(BlockInt8 { c_attn, attn_proj, c_fc, mlp_proj })
            }
            _ => Err(file_err(path, "a block's int8 projections are incomplete")),
        })
        .collect::<Result<Vec<_>>>()?;
    model.linears = Linears::Int8 { mode: mode.unwrap_or(file_mode), blocks };
    drop_float_projections(&mut model)?;
    Ok(model)
}

/// Set the mode of an int8 model's projections (the same int8 weights serve both).
pub fn set_mode(model: &mut Gpt, mode: QuantMode) -> Result<()> {
    match &mut model.linears {
        Linears::Int8 { mode: m, .. } => {
            *m = mode;
            Ok(())
        }
        _ => Err(Error::InvalidArgument("set_mode: the model is not int8".into())),
    }
}
