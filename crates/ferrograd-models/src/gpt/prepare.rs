//! `gpt prepare`: UTF-8 text files to train/val token shards.
//!
//! Each file is one document: `<|endoftext|>` then its GPT-2 tokens (llm.c's convention), the
//! files in the order given. The stream's first `1 - val_fraction` goes to `train_*.bin`, the
//! rest to `val_*.bin` (nanoGPT's split), each cut into shards of at most `shard_tokens`. Every
//! input is checked before anything is written: a binary, empty, non-UTF-8 or unreadable file is
//! an error naming the file and what is wrong with it.

use super::shards::{list_shards, shard_name, write_shard};
use super::tokenizer::Tokenizer;
use ferrograd_core::{Error, Result};
use std::path::{Path, PathBuf};

#[derive(Debug, Clone, PartialEq)]
pub struct PrepareConfig {
    /// Fraction of the token stream (its end) kept for validation.
    pub val_fraction: f64,
    /// Tokens per shard file at most (llm.c uses 100M).
    pub shard_tokens: usize,
}

impl Default for PrepareConfig {
    fn default() -> Self {
        PrepareConfig { val_fraction: 0.1, shard_tokens: 100_000_000 }
    }
}

#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct PrepareReport {
    pub files: usize,
    pub bytes: u64,
    pub tokens: usize,
    pub train_tokens: usize,
    pub val_tokens: usize,
    pub train_shards: Vec<PathBuf>,
    pub val_shards: Vec<PathBuf>,
}

fn file_err(path: &Path, msg: impl Into<String>) -> Error {
    Error::File { path: path.display().to_string(), msg: msg.into() }
}

/// The file's text, or an error saying why it is not usable text.
pub fn read_text(path: &Path) -> Result<String> {
    if path.is_dir() {
        return Err(file_err(path, "is a directory (prepare takes text files; pass DIR/*.txt)"));
    }
    // On the host on purpose: text is checked and tokenized by the CPU.
    let bytes = std::fs::read(path).map_err(|e| file_err(path, format!("cannot read: {e}")))?;
    check_text(&bytes, path)
}

/// Bytes to text: no NUL byte (a binary file), valid UTF-8, not empty or only whitespace.
pub fn check_text(bytes: &[u8], path: &Path) -> Result<String> {
    if let Some(i) = bytes.iter().position(|&b| b == 0) {
        return Err(file_err(path, format!("looks binary (a NUL byte at offset {i}); prepare reads UTF-8 text files")));
    }
    let bytes = bytes.strip_prefix(b"\xEF\xBB\xBF").unwrap_or(bytes);
    let text = std::str::from_utf8(bytes).map_err(|e| {
        file_err(
            path,
            format!(
                "is not UTF-8 text (invalid byte at offset {}); convert it first, e.g. iconv -t UTF-8",
                e.valid_up_to()
            ),
        )
    })?;
    if text.trim().is_empty() {
        return Err(file_err(path, if text.is_empty() { "is empty" } else { "holds only whitespace" }));
    }
    Ok(text.to_string())
}

/// Delete our shards of `split` numbered `keep` and above (left from an earlier, larger run).
fn remove_stale(out: &Path, split: &str, keep: usize) -> Result<()> {
    for p in list_shards(out, split)? {
        let name = p.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
        let index = name.strip_prefix(&format!("{split}_")).and_then(|s| s.strip_suffix(".bin"));
        if let Some(i) = index.filter(|s| s.len() == 6).and_then(|s| s.parse::<usize>().ok()) {
            if i >= keep {
                std::fs::remove_file(&p).map_err(|e| file_err(&p, format!("removing a stale shard: {e}")))?;
            }
        }
    }
    Ok(())
}

fn write_split(out: &Path, split: &str, tokens: &[u16], per_shard: usize) -> Result<Vec<PathBuf>> {
    let mut paths = Vec::new();
    for (i, chunk) in tokens.chunks(per_shard.max(1)).enumerate() {
        let p = out.join(shard_name(split, i));
        write_shard(&p, chunk)?;
        paths.push(p);
    }
    remove_stale(out, split, paths.len())?;
    Ok(paths)
}

/// Tokenize `files` into shards under `out`. `progress(bytes)` is called as each file's bytes
/// have been tokenized (from worker threads).
pub fn prepare(
    files: &[PathBuf],
    out: &Path,
    cfg: &PrepareConfig,
    progress: &(dyn Fn(u64) + Sync),
) -> Result<PrepareReport> {
    use rayon::prelude::*;
    if files.is_empty() {
        return Err(Error::InvalidArgument("prepare: no input files".into()));
    }
    if !(0.0..1.0).contains(&cfg.val_fraction) {
        return Err(Error::InvalidArgument(format!("--val-fraction {} must be in [0, 1)", cfg.val_fraction)));
    }
    if cfg.shard_tokens == 0 {
        return Err(Error::InvalidArgument("--shard-tokens must be positive".into()));
    }
    // Check every file before writing anything.
    let mut bytes = 0u64;
    for f in files {
        let text = read_text(f)?;
        bytes += text.len() as u64;
    }
    let tok = Tokenizer::gpt2()?;
    let docs: Vec<Vec<u32>> = files
        .par_iter()
        .map(|f| {
            let text = read_text(f)?;
            let ids = tok.encode(&text);
            progress(text.len() as u64);
            Ok(ids)
        })
        .collect::<Result<_>>()?;
    let mut stream: Vec<u16> = Vec::with_capacity(docs.iter().map(|d| d.len() + 1).sum());
    for d in &docs {
        stream.push(tok.eot() as u16);
        // GPT-2 ids are below 50257, so they fit in u16 (the shard format's token type).
        stream.extend(d.iter().map(|&t| t as u16));
    }
    let n = stream.len();
    let n_val = (n as f64 * cfg.val_fraction).round() as usize;
    let n_train = n - n_val;
    if n_train == 0 {
        return Err(Error::InvalidArgument(format!("prepare: {n} tokens leave none for training")));
    }
    std::fs::create_dir_all(out).map_err(|e| file_err(out, format!("creating the output directory: {e}")))?;
    let train_shards = write_split(out, "train", &stream[..n_train], cfg.shard_tokens)?;
    let val_shards = write_split(out, "val", &stream[n_train..], cfg.shard_tokens)?;
    let report = PrepareReport {
        files: files.len(),
        bytes,
        tokens: n,
        train_tokens: n_train,
        val_tokens: n_val,
        train_shards,
        val_shards,
    };
    let summary = serde_json::json!({
        "tokenizer": "gpt2 (tiktoken r50k_base)",
        "format": "llm.c .bin: 256 x i32 header (20240520, 1, count), u16 tokens",
        "documents": files.iter().map(|f| f.display().to_string()).collect::<Vec<_>>(),
        "val_fraction": cfg.val_fraction,
        "report": report,
    });
    let p = out.join("prepare.json");
    let text = serde_json::to_string_pretty(&summary).map_err(|e| Error::InvalidArgument(e.to_string()))?;
    ferrograd_nn::checkpoint::write_atomic(&p, text.as_bytes()).map_err(|e| file_err(&p, e.to_string()))?;
    Ok(report)
}
