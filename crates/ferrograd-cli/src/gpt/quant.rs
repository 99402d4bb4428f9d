//! `gpt quantize` (a checkpoint's projections to an int8 weights file, with the sizes) and
//! `gpt eval` (validation loss and perplexity of a checkpoint in float, bf16, W8A16 and W8A8).

use super::human_bytes;
use crate::CliResult;
use clap::Args;
use ferrograd_core::{no_grad, DType, Device, Tensor};
use ferrograd_models::gpt::hf::from_pretrained;
use ferrograd_models::gpt::loader::{StepInputs, TokenLoader};
use ferrograd_models::gpt::quant::{self, is_int8_file, load_int8, Linears, QuantMode};
use ferrograd_models::gpt::Gpt;
use ferrograd_nn::amp::autocast;
use std::io::Write;
use std::path::{Path, PathBuf};

#[derive(Args, Debug)]
pub struct QuantizeArgs {
    /// The float model: a checkpoint (.safetensors, ours or Hugging Face's) or a save_pretrained directory.
    pub checkpoint: PathBuf,
    /// The int8 weights file to write (safetensors).
    #[arg(long)]
    pub out: PathBuf,
    /// The mode recorded in the file, which `gpt sample --int8` and `gpt eval` use by default
    /// (the int8 weights serve both).
    #[arg(long, default_value = "w8a16", value_parser = parse_mode)]
    pub mode: QuantMode,
}

pub(crate) fn parse_mode(s: &str) -> Result<QuantMode, String> {
    s.parse().map_err(|e: ferrograd_core::Error| e.to_string())
}

/// f32 bytes of `model`'s projection weights (what int8 replaces) and of everything else.
fn float_sizes(model: &Gpt) -> CliResult<(usize, usize)> {
    let proj: usize = model
        .blocks
        .iter()
        .map(|b| [&b.c_attn_w, &b.attn_proj_w, &b.c_fc_w, &b.mlp_proj_w].iter().map(|w| w.elem_count()).sum::<usize>())
        .sum();
    let all: usize = model.hf_params()?.iter().map(|(_, t)| t.elem_count()).sum();
    Ok((4 * proj, 4 * (all - proj)))
}

pub fn quantize(a: QuantizeArgs, out: &mut dyn Write) -> CliResult<()> {
    ferrograd_core::io::check_output("--out", &a.out)?;
    if is_int8_file(&a.checkpoint) {
        return Err(format!("{} is already an int8 file", a.checkpoint.display()).into());
    }
    let (mut model, note) = from_pretrained(&a.checkpoint, Device::Cpu)?;
    let (proj_f32, rest_f32) = float_sizes(&model)?;
    quant::quantize(&mut model, a.mode)?;
    let sizes = quant::save_int8(&model, &a.out)?;
    let file = std::fs::metadata(&a.out).map(|m| m.len() as usize).unwrap_or(0);
    writeln!(out, "{} ({note}) -> {} ({} int8 default)", a.checkpoint.display(), a.out.display(), a.mode)?;
    writeln!(
        out,
        "projection weights: f32 {} -> int8 + scales {} ({:.2}x smaller)",
        human_bytes(proj_f32),
        human_bytes(sizes.int8_bytes),
        proj_f32 as f64 / sizes.int8_bytes.max(1) as f64
    )?;
    writeln!(
        out,
        "all weights: f32 {} -> {} (embeddings, norms and biases stay f32: {}); file {} bytes",
        human_bytes(proj_f32 + rest_f32),
        human_bytes(sizes.int8_bytes + sizes.float_bytes),
        human_bytes(rest_f32),
        file
    )?;
    Ok(())
}

#[derive(Args, Debug)]
pub struct EvalArgs {
    /// A float checkpoint (.safetensors or save_pretrained directory) or an int8 file from `gpt quantize`.
    #[arg(long)]
    pub checkpoint: PathBuf,
    /// Directory of token shards; the val_*.bin split is read.
    #[arg(long, default_value = "data/shakespeare")]
    pub data: PathBuf,
    /// What to evaluate, comma-separated: f32, bf16, w8a16, w8a8 (int8 projections, bf16
    /// activations). Default: all four for a float checkpoint, both int8 modes for an int8 file.
    #[arg(long, value_delimiter = ',')]
    pub modes: Vec<String>,
    /// Sequences per batch.
    #[arg(long, default_value_t = 8)]
    pub batch: usize,
    /// Tokens per sequence (default: the model's context).
    #[arg(long)]
    pub context: Option<usize>,
    /// Batches to average (0: the whole split, each token once).
    #[arg(long, default_value_t = 0)]
    pub batches: usize,
    /// cpu, cuda or cuda:N (default: the best device).
    #[arg(long)]
    pub device: Option<Device>,
}

/// One row of `gpt eval`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum EvalMode {
    F32,
    Bf16,
    Int8(QuantMode),
}

impl std::str::FromStr for EvalMode {
    type Err = String;
    fn from_str(s: &str) -> Result<EvalMode, String> {
        match s.to_ascii_lowercase().as_str() {
            "f32" | "float" => Ok(EvalMode::F32),
            "bf16" => Ok(EvalMode::Bf16),
            other => parse_mode(other)
                .map(EvalMode::Int8)
                .map_err(|_| format!("--modes: `{s}` is not f32, bf16, w8a16 or w8a8")),
        }
    }
}

impl std::fmt::Display for EvalMode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            EvalMode::F32 => f.write_str("f32"),
            EvalMode::Bf16 => f.write_str("bf16"),
            EvalMode::Int8(m) => write!(f, "int8 {m}"),
        }
    }
}

/// Mean loss of `model` over `n` batches of `loader` from its start.
fn mean_loss(model: &Gpt, loader: &mut TokenLoader, n: usize, b: usize, t: usize) -> CliResult<f64> {
    loader.set_position(Default::default())?;
    let bufs = StepInputs::new(1, b, t, model.device())?;
    let mut sum: Option<Tensor> = None;
    for _ in 0..n {
        bufs.fill_from(loader)?;
        let l = model.loss(&bufs.x[0], &bufs.y[0])?;
        sum = Some(match sum {
            Some(s) => s.add(&l)?,
            None => l,
        });
    }
    let s = sum.ok_or("no batches")?.item_f64()?;
    Ok(s / n as f64)
}

pub fn eval(a: EvalArgs, out: &mut dyn Write) -> CliResult<()> {
    let int8_file = is_int8_file(&a.checkpoint);
    let modes: Vec<EvalMode> = if a.modes.is_empty() {
        let int8 = [EvalMode::Int8(QuantMode::W8A16), EvalMode::Int8(QuantMode::W8A8)];
        if int8_file {
            int8.to_vec()
        } else {
            [EvalMode::F32, EvalMode::Bf16].into_iter().chain(int8).collect()
        }
    } else {
        a.modes.iter().map(|m| m.parse()).collect::<Result<_, _>>()?
    };
    if int8_file {
        if let Some(m) = modes.iter().find(|m| !matches!(m, EvalMode::Int8(_))) {
            return Err(format!(
                "--modes {m}: {} is an int8 file (its float weights are gone)",
                a.checkpoint.display()
            )
            .into());
        }
    }
    if a.batch == 0 {
        return Err("--batch must be positive".into());
    }
    let device = match a.device {
        Some(d) => d,
        None => Device::best()?,
    };
    let (mut model, note) = if int8_file {
        (load_int8(&a.checkpoint, device, None)?, "int8 file".to_string())
    } else {
        from_pretrained(&a.checkpoint, device)?
    };
    let t = a.context.unwrap_or(model.config.n_positions);
    if t == 0 || t > model.config.n_positions {
        return Err(format!("--context {t} must be between 1 and the model's {}", model.config.n_positions).into());
    }
    let mut loader = TokenLoader::new(&a.data, "val", a.batch, t)?;
    let per = a.batch * t;
    let whole = loader.total_tokens().saturating_sub(1) / per;
    let n = if a.batches == 0 { whole } else { a.batches };
    if n == 0 {
        return Err(format!(
            "the val split of {} has {} tokens, fewer than one batch of {} x {t} + 1: lower --batch or --context",
            a.data.display(),
            loader.total_tokens(),
            a.batch
        )
        .into());
    }
    writeln!(
        out,
        "{} ({note}) on {device}: {n} batches of {} x {t} from {}",
        a.checkpoint.display(),
        a.batch,
        a.data.display()
    )?;
    let _g = no_grad();
    let mut bf16_loss = None;
    for m in modes {
        match m {
            EvalMode::Int8(q) if int8_file => quant::set_mode(&mut model, q)?,
            EvalMode::Int8(q) => quant::quantize(&mut model, q)?,
            _ => model.linears = Linears::Float,
        }
        let _ac = if m == EvalMode::F32 { None } else { Some(autocast(DType::BF16)?) };
        let loss = mean_loss(&model, &mut loader, n, a.batch, t)?;
        if m == EvalMode::Bf16 {
            bf16_loss = Some(loss);
        }
        let vs = bf16_loss
            .filter(|_| m != EvalMode::Bf16)
            .map(|b| format!("  ({:+.2}% perplexity vs bf16)", 100.0 * ((loss - b).exp() - 1.0)))
            .unwrap_or_default();
        writeln!(out, "{:<11} val loss {loss:.4}  perplexity {:.3}{vs}", m.to_string(), loss.exp())?;
    }
    Ok(())
}

/// The model `gpt sample` runs: an int8 file as it is (in `mode`, default the file's), or a float
/// checkpoint, quantized on load when `mode` is given.
pub(crate) fn load_for_sampling(path: &Path, device: Device, mode: Option<QuantMode>) -> CliResult<(Gpt, String)> {
    let int8_file = is_int8_file(path);
    if let (Device::Cuda(o), true) = (device, int8_file || mode.is_some()) {
        // Quantizing on load (or the int8 file's scales) launches the quant kernels: their module
        // compiles while the checkpoint is read.
        drop(ferrograd_core::cuda::CudaDevice::get(o)?.warm(&[&ferrograd_core::quant::MODULE]));
    }
    if int8_file {
        let m = load_int8(path, device, mode)?;
        let note = match &m.linears {
            Linears::Int8 { mode, .. } => format!("int8 file, {mode}"),
            _ => "int8 file".into(),
        };
        return Ok((m, note));
    }
    let (mut m, note) = from_pretrained(path, device)?;
    if let Some(q) = mode {
        quant::quantize(&mut m, q)?;
        quant::drop_float_projections(&mut m)?;
        return Ok((m, format!("{note}; quantized on load to int8 {q}")));
    }
    Ok((m, note))
}
