//! `gpt sample` (generation) and `gpt logits` (a model's logits for a prompt, as a safetensors
//! file, for comparing with Hugging Face's `GPT2LMHeadModel`).

use crate::CliResult;
use clap::Args;
use ferrograd_core::{no_grad, DType, Device, Tensor};
use ferrograd_models::gpt::hf::from_pretrained;
use ferrograd_models::gpt::sample::{generate, SampleConfig};
use ferrograd_models::gpt::{Gpt, Tokenizer};
use ferrograd_nn::amp::autocast;
use std::io::Write;
use std::path::PathBuf;

#[derive(Args, Debug)]
pub struct SampleArgs {
    /// A checkpoint (.safetensors: ours, or Hugging Face's) or a save_pretrained directory.
    #[arg(long)]
    pub checkpoint: PathBuf,
    /// Text to continue (empty: start a new document).
    #[arg(long, default_value = "")]
    pub prompt: String,
    /// New tokens to generate.
    #[arg(long, default_value_t = 100)]
    pub tokens: usize,
    /// Softmax temperature (0: greedy).
    #[arg(long, default_value_t = 1.0)]
    pub temperature: f64,
    /// Sample among the K most likely tokens (1: greedy; 0: all).
    #[arg(long, default_value_t = 50)]
    pub top_k: usize,
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// cpu, cuda or cuda:N (default: the best device).
    #[arg(long)]
    pub device: Option<Device>,
    /// Run the matmuls in bf16 (autocast) instead of f32.
    #[arg(long)]
    pub bf16: bool,
    /// Keep going after <|endoftext|>.
    #[arg(long)]
    pub ignore_eot: bool,
    /// On CUDA, run each decode step op by op instead of replaying it as a CUDA graph
    /// (FERROGRAD_PROFILE implies it: a replayed graph records no per-kernel timings).
    #[arg(long)]
    pub no_graph: bool,
    /// Run the block projections in int8: w8a16 (weight-only) or w8a8 (`--int8` alone); a float
    /// checkpoint is quantized on load, an int8 file from `gpt quantize` runs in its own mode
    /// unless this names one.
    #[arg(long, num_args = 0..=1, default_missing_value = "w8a8", value_parser = super::quant::parse_mode)]
    pub int8: Option<ferrograd_models::gpt::quant::QuantMode>,
}

fn load(path: &std::path::Path, device: Option<Device>) -> CliResult<(Gpt, String, Device)> {
    let device = match device {
        Some(d) => d,
        None => Device::best()?,
    };
    let (model, note) = from_pretrained(path, device)?;
    Ok((model, note, device))
}

/// Prints the longest valid UTF-8 prefix of what has been generated so far (a token can end in
/// the middle of a character).
struct Utf8Stream {
    pending: Vec<u8>,
}

impl Utf8Stream {
    fn push(&mut self, bytes: &[u8], out: &mut dyn Write) -> std::io::Result<()> {
        self.pending.extend_from_slice(bytes);
        let valid = match std::str::from_utf8(&self.pending) {
            Ok(s) => s.len(),
            // A sequence cut short at the end may still complete; anything else never will.
            Err(e) if e.error_len().is_none() => e.valid_up_to(),
            Err(_) => self.pending.len(),
        };
        let text = String::from_utf8_lossy(&self.pending[..valid]).into_owned();
        out.write_all(text.as_bytes())?;
        out.flush()?;
        self.pending.drain(..valid);
        Ok(())
    }

    fn finish(&mut self, out: &mut dyn Write) -> std::io::Result<()> {
        let rest = String::from_utf8_lossy(&self.pending).into_owned();
        self.pending.clear();
        out.write_all(rest.as_bytes())
    }
}

pub fn run(a: SampleArgs, out: &mut dyn Write) -> CliResult<()> {
    let device = match a.device {
        Some(d) => d,
        None => Device::best()?,
    };
    let (mut model, note) = super::quant::load_for_sampling(&a.checkpoint, device, a.int8)?;
    if let Device::Cuda(o) = device {
        // The prompt's and the decode's kernel modules start compiling now, all at once.
        let dev = ferrograd_core::cuda::CudaDevice::get(o)?;
        drop(dev.warm(&ferrograd_models::gpt::kernels::sample_modules(&model, &dev, a.bf16)?));
    }
    if a.bf16 {
        // Cast once here rather than by autocast at every decode step.
        model.cast_projections(DType::BF16)?;
    }
    let tok = Tokenizer::gpt2()?;
    let mut prompt = tok.encode(&a.prompt);
    if prompt.is_empty() {
        prompt.push(tok.eot());
    }
    // FERROGRAD_PROFILE=1: device time per kernel over the decode steps after the first few
    // (which may compile or allocate), printed with the timing line.
    let profile = crate::profiling_on(device);
    let cfg = SampleConfig {
        max_new_tokens: a.tokens,
        temperature: a.temperature,
        top_k: (a.top_k > 0).then_some(a.top_k),
        seed: a.seed,
        stop_at_eot: !a.ignore_eot,
        graph: !a.no_graph && !profile,
    };
    eprintln!(
        "{}: {:.1}M parameters on {device} ({note})",
        a.checkpoint.display(),
        model.config.num_parameters() as f64 / 1e6
    );
    let _ac = if a.bf16 { Some(autocast(DType::BF16)?) } else { None };
    write!(out, "{}", a.prompt)?;
    let mut stream = Utf8Stream { pending: vec![] };
    let mut io_err = None;
    let mut chosen = 0u64;
    let stats = generate(&model, &prompt, &cfg, |id| {
        chosen += 1;
        if profile && chosen == PROFILE_SKIP {
            ferrograd_core::cuda::profile::reset();
        }
        if id == tok.eot() && cfg.stop_at_eot {
            return Ok(());
        }
        let bytes = tok.decode_bytes(&[id])?;
        if let Err(e) = stream.push(&bytes, out) {
            io_err.get_or_insert(e);
        }
        Ok(())
    })?;
    if let Some(e) = io_err {
        return Err(e.into());
    }
    stream.finish(out)?;
    writeln!(out)?;
    out.flush()?;
    // The median first (what scripts read), then the mean with any one-time cost in it.
    let per = match (stats.p50_ms(), stats.ms_per_token()) {
        (Some(p), Some(m)) => format!("{p:.2} ms/token median, {m:.2} mean"),
        _ => "-".to_string(),
    };
    if let Some(note) = &stats.graph_note {
        eprintln!("note: {note}");
    }
    let how = if stats.graph { "a CUDA graph per token" } else { "op by op" };
    eprintln!(
        "{} prompt tokens in {:.1} ms, {} new tokens: {per} (decode with KV cache, {how}, {device})",
        prompt.len(),
        1e3 * stats.prefill_s,
        stats.tokens.len()
    );
    if profile {
        let steps = (stats.decode_steps() as u64).saturating_sub(PROFILE_SKIP - 1);
        eprint!("{}", ferrograd_core::cuda::profile::report_table(steps)?);
    }
    Ok(())
}

/// With FERROGRAD_PROFILE, the decode steps before this token are left out of the profile.
const PROFILE_SKIP: u64 = 5;

#[derive(Args, Debug)]
pub struct LogitsArgs {
    /// A checkpoint (.safetensors) or a save_pretrained directory.
    #[arg(long)]
    pub checkpoint: PathBuf,
    /// Token ids, comma-separated.
    #[arg(long, value_delimiter = ',', conflicts_with = "prompt", required_unless_present = "prompt")]
    pub ids: Option<Vec<u32>>,
    /// Text to tokenize instead of --ids.
    #[arg(long)]
    pub prompt: Option<String>,
    /// Write `logits` [T, vocab] (f32) and `ids` [T] (i32) here.
    #[arg(long)]
    pub out: PathBuf,
    #[arg(long)]
    pub device: Option<Device>,
    /// Also write the loaded model back out as a save_pretrained directory (our writer, for the
    /// reverse check: transformers loads it).
    #[arg(long, value_name = "DIR")]
    pub save_pretrained: Option<PathBuf>,
}

pub fn logits(a: LogitsArgs, out: &mut dyn Write) -> CliResult<()> {
    let (model, note, device) = load(&a.checkpoint, a.device)?;
    let ids = match (&a.ids, &a.prompt) {
        (Some(ids), _) => ids.clone(),
        (None, Some(p)) => Tokenizer::gpt2()?.encode(p),
        (None, None) => return Err("give --ids or --prompt".into()),
    };
    if ids.is_empty() {
        return Err("no tokens".into());
    }
    let t = ids.len();
    let _g = no_grad();
    let x = Tensor::from_vec(ids.clone(), (1, t), device)?;
    let l = model.logits(&x)?.reshape((t, model.config.vocab_size))?.to_vec::<f32>()?;
    let lb: Vec<u8> = l.iter().flat_map(|v| v.to_le_bytes()).collect();
    let ib: Vec<u8> = ids.iter().flat_map(|&v| (v as i32).to_le_bytes()).collect();
    let views = vec![
        (
            "logits",
            safetensors::tensor::TensorView::new(safetensors::Dtype::F32, vec![t, model.config.vocab_size], &lb)?,
        ),
        ("ids", safetensors::tensor::TensorView::new(safetensors::Dtype::I32, vec![t], &ib)?),
    ];
    let bytes = safetensors::serialize(views, None)?;
    ferrograd_nn::checkpoint::write_atomic(&a.out, &bytes).map_err(|e| format!("writing {}: {e}", a.out.display()))?;
    writeln!(
        out,
        "{} ({note}): logits [{t}, {}] -> {}",
        a.checkpoint.display(),
        model.config.vocab_size,
        a.out.display()
    )?;
    if let Some(dir) = &a.save_pretrained {
        ferrograd_models::gpt::hf::save_pretrained(&model, dir)?;
        writeln!(out, "wrote {}", dir.display())?;
    }
    Ok(())
}
