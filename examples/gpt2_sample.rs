//! Loading a Hugging Face GPT-2 checkpoint and sampling from it with a KV cache.
//!
//! ```sh
//! # a directory written by `GPT2LMHeadModel.save_pretrained(DIR)` (config.json, model.safetensors),
//! # or by `ferrograd gpt train` (its `model/` folder):
//! cargo run --release --example gpt2_sample -- --model DIR --prompt "ROMEO:" --tokens 50
//! # without one: a tiny random GPT-2 is written in the same format, read back and sampled
//! # (the text is gibberish; the loading and decoding path is the real one)
//! cargo run --example gpt2_sample -- --tiny
//! ```
//!
//! To get the real 124M weights with Python: `python -c "from transformers import GPT2LMHeadModel;
//! GPT2LMHeadModel.from_pretrained('gpt2').save_pretrained('gpt2')"`, then `--model gpt2`.

use ferrograd_core::{DType, Error, Result};
use ferrograd_examples::{arg, arg_or, flag};
use ferrograd_models::gpt::hf::{from_pretrained, save_pretrained};
use ferrograd_models::gpt::sample::{generate, SampleConfig};
use ferrograd_models::gpt::{Gpt, GptConfig, Tokenizer};
use ferrograd_nn::amp::autocast;
use std::io::Write;
use std::path::PathBuf;

fn main() -> Result<()> {
    let dev = ferrograd_examples::device()?;
    let dir = match (arg("model"), flag("tiny")) {
        (Some(d), _) => PathBuf::from(d),
        (None, true) => {
            // GPT-2's vocabulary and tokenizer, 2 layers of width 32: what `save_pretrained` writes.
            let dir = std::env::temp_dir().join(format!("ferrograd-tiny-gpt2-{}", std::process::id()));
            save_pretrained(&Gpt::new(GptConfig::tiny(), 0, dev)?, &dir)?;
            println!("wrote a tiny random GPT-2 to {}", dir.display());
            dir
        }
        (None, false) => {
            return Err(Error::InvalidArgument("pass --model DIR (a save_pretrained directory) or --tiny".into()))
        }
    };

    // config.json gives the shape; model.safetensors the weights (Hugging Face names and layouts).
    let (model, note) = from_pretrained(&dir, dev)?;
    println!("{}: {:.1}M parameters on {dev} ({note})", dir.display(), model.config.num_parameters() as f64 / 1e6);

    // GPT-2's byte-level BPE (tiktoken's r50k_base, embedded: no download).
    let tok = Tokenizer::gpt2()?;
    let prompt_text = arg("prompt").unwrap_or_else(|| "The meaning of life is".into());
    let prompt = tok.encode(&prompt_text);
    let cfg = SampleConfig {
        max_new_tokens: arg_or("tokens", 40)?,
        temperature: arg_or("temperature", 0.8)?,
        top_k: Some(arg_or("top-k", 50)?),
        seed: arg_or("seed", 0)?,
        stop_at_eot: true,
        // On CUDA each decode step is one CUDA-graph replay.
        graph: true,
    };

    // On a GPU the matmuls run in bf16 (the weights stay f32); on the CPU in f32.
    let _autocast = if dev.is_cuda() { Some(autocast(DType::BF16)?) } else { None };
    print!("{prompt_text}");
    // `generate` calls back with each new token as it is chosen; print it at once. (A token can
    // end inside a UTF-8 character; the `ferrograd gpt sample` command buffers such bytes.)
    let stats = generate(&model, &prompt, &cfg, |id| {
        if id != tok.eot() {
            print!("{}", tok.decode(&[id])?);
            let _ = std::io::stdout().flush();
        }
        Ok(())
    })?;
    println!();
    let per = stats.ms_per_token().map_or("-".into(), |ms| format!("{ms:.2} ms/token"));
    println!("{} prompt tokens, {} new tokens, {per}", prompt.len(), stats.tokens.len());
    if flag("tiny") && arg("model").is_none() {
        let _ = std::fs::remove_dir_all(&dir);
    }
    Ok(())
}
