//! `gpt prepare FILES... --out DIR`

use crate::CliResult;
use clap::Args;
use ferrograd_models::gpt::prepare::{prepare, PrepareConfig};
use indicatif::{ProgressBar, ProgressStyle};
use std::io::{IsTerminal, Write};
use std::path::PathBuf;

#[derive(Args, Debug)]
pub struct PrepareArgs {
    /// UTF-8 text files; each is one document (they are concatenated in this order).
    #[arg(required = true, value_name = "FILES")]
    pub files: Vec<PathBuf>,
    /// Directory for train_*.bin, val_*.bin and prepare.json.
    #[arg(long)]
    pub out: PathBuf,
    /// Fraction of the tokens (the end of the stream) kept for validation.
    #[arg(long, default_value_t = 0.1)]
    pub val_fraction: f64,
    /// Tokens per shard file at most.
    #[arg(long, default_value_t = 100_000_000)]
    pub shard_tokens: usize,
}

pub fn run(a: PrepareArgs, out: &mut dyn Write) -> CliResult<()> {
    let total: u64 = a.files.iter().filter_map(|f| std::fs::metadata(f).ok()).map(|m| m.len()).sum();
    let bar = if std::io::stderr().is_terminal() { ProgressBar::new(total) } else { ProgressBar::hidden() };
    if let Ok(style) = ProgressStyle::with_template(
        "tokenizing {bar:30} {binary_bytes}/{binary_total_bytes} [{elapsed_precise}<{eta_precise}]",
    ) {
        bar.set_style(style);
    }
    let cfg = PrepareConfig { val_fraction: a.val_fraction, shard_tokens: a.shard_tokens };
    let t = std::time::Instant::now();
    let report = prepare(&a.files, &a.out, &cfg, &|b| bar.inc(b));
    bar.finish_and_clear();
    let r = report?;
    let secs = t.elapsed().as_secs_f64();
    writeln!(
        out,
        "{} files, {:.1} MB -> {} tokens ({:.2} MB/s)",
        r.files,
        r.bytes as f64 / 1e6,
        r.tokens,
        r.bytes as f64 / 1e6 / secs.max(1e-9)
    )?;
    writeln!(out, "train: {} tokens in {} shard(s)", r.train_tokens, r.train_shards.len())?;
    writeln!(out, "val:   {} tokens in {} shard(s)", r.val_tokens, r.val_shards.len())?;
    writeln!(out, "wrote {}", a.out.display())?;
    Ok(())
}
