//! Token shards in llm.c's `.bin` format: a header of 256 little-endian i32 (magic 20240520,
//! version 1, token count, the rest 0) followed by the tokens as little-endian u16. Files written
//! by llm.c's `dev/data/*.py` scripts load here and ours load there.

use ferrograd_core::{Error, Result};
use std::path::{Path, PathBuf};

pub const MAGIC: i32 = 20240520;
pub const VERSION: i32 = 1;
pub const HEADER_INTS: usize = 256;
const HEADER_BYTES: usize = HEADER_INTS * 4;

fn file_err(path: &Path, msg: impl Into<String>) -> Error {
    Error::File { path: path.display().to_string(), msg: msg.into() }
}

/// The bytes of a shard holding `tokens`.
pub fn encode_shard(tokens: &[u16]) -> Result<Vec<u8>> {
    let n = i32::try_from(tokens.len()).map_err(|_| {
        Error::InvalidArgument(format!("a shard holds at most {} tokens, got {}", i32::MAX, tokens.len()))
    })?;
    let mut out = Vec::with_capacity(HEADER_BYTES + 2 * tokens.len());
    let mut header = [0i32; HEADER_INTS];
    header[0] = MAGIC;
    header[1] = VERSION;
    header[2] = n;
    for h in header {
        out.extend_from_slice(&h.to_le_bytes());
    }
    for t in tokens {
        out.extend_from_slice(&t.to_le_bytes());
    }
    Ok(out)
}

/// Write a shard atomically (a crash leaves the old file or the new one).
pub fn write_shard(path: &Path, tokens: &[u16]) -> Result<()> {
    let bytes = encode_shard(tokens)?;
    ferrograd_nn::checkpoint::write_atomic(path, &bytes).map_err(|e| file_err(path, format!("writing: {e}")))
}

/// Tokens of a shard's bytes, checking the header against the length (`path` names it in errors).
pub fn decode_shard(bytes: &[u8], path: &Path) -> Result<Vec<u16>> {
    if bytes.len() < HEADER_BYTES {
        return Err(file_err(
            path,
            format!("{} bytes: too short for the {HEADER_BYTES}-byte llm.c header", bytes.len()),
        ));
    }
    let int = |i: usize| i32::from_le_bytes([bytes[4 * i], bytes[4 * i + 1], bytes[4 * i + 2], bytes[4 * i + 3]]);
    if int(0) != MAGIC {
        return Err(file_err(path, format!("magic {} is not {MAGIC}: not an llm.c token shard", int(0))));
    }
    if int(1) != VERSION {
        return Err(file_err(path, format!("version {} (only version {VERSION}, u16 GPT-2 tokens, is read)", int(1))));
    }
    let n = usize::try_from(int(2)).map_err(|_| file_err(path, format!("negative token count {}", int(2))))?;
    let body = &bytes[HEADER_BYTES..];
    if body.len() != 2 * n {
        return Err(file_err(
            path,
            format!("header says {n} tokens ({} bytes) but {} bytes follow (truncated?)", 2 * n, body.len()),
        ));
    }
    Ok(body.chunks_exact(2).map(|c| u16::from_le_bytes([c[0], c[1]])).collect())
}

pub fn read_shard(path: &Path) -> Result<Vec<u16>> {
    // On the host on purpose: the loader cuts each batch out of the tokens on the host.
    let bytes = std::fs::read(path).map_err(|e| file_err(path, format!("reading: {e}")))?;
    decode_shard(&bytes, path)
}

/// Only the token count from a shard's header (reads 1 KiB).
pub fn shard_len(path: &Path) -> Result<usize> {
    use std::io::Read;
    let mut f = std::fs::File::open(path).map_err(|e| file_err(path, format!("opening: {e}")))?;
    let mut header = vec![0u8; HEADER_BYTES];
    f.read_exact(&mut header).map_err(|e| file_err(path, format!("reading the header: {e}")))?;
    let len = f.metadata().map_err(|e| file_err(path, e.to_string()))?.len() as usize;
    let int = |i: usize| i32::from_le_bytes([header[4 * i], header[4 * i + 1], header[4 * i + 2], header[4 * i + 3]]);
    if int(0) != MAGIC || int(1) != VERSION {
        return Err(file_err(path, "not an llm.c token shard (bad magic or version)"));
    }
    let n = usize::try_from(int(2)).map_err(|_| file_err(path, "negative token count"))?;
    if len != HEADER_BYTES + 2 * n {
        return Err(file_err(path, format!("header says {n} tokens but the file has {len} bytes")));
    }
    Ok(n)
}

/// The name of shard `index` of `split` that `prepare` writes: `train_000000.bin`.
pub fn shard_name(split: &str, index: usize) -> String {
    format!("{split}_{index:06}.bin")
}

/// The `split` ("train" or "val") shards in `dir`, sorted by name: ours (`train_000000.bin`) and
/// llm.c's (`tiny_shakespeare_train.bin`, `fineweb_train_000001.bin`).
pub fn list_shards(dir: &Path, split: &str) -> Result<Vec<PathBuf>> {
    let rd = std::fs::read_dir(dir).map_err(|e| file_err(dir, format!("listing token shards: {e}")))?;
    let mut out = Vec::new();
    for entry in rd {
        let entry = entry.map_err(|e| file_err(dir, e.to_string()))?;
        let name = entry.file_name().to_string_lossy().into_owned();
        let Some(stem) = name.strip_suffix(".bin") else { continue };
        let ours = stem.starts_with(&format!("{split}_"));
        let llmc = stem.contains(&format!("_{split}_")) || stem.ends_with(&format!("_{split}"));
        if (ours || llmc) && entry.path().is_file() {
            out.push(entry.path());
        }
    }
    out.sort();
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn encode_decode_and_header_errors() {
        let toks: Vec<u16> = vec![0, 1, 50256, 65535, 7];
        let b = encode_shard(&toks).unwrap();
        assert_eq!(b.len(), 1024 + 10);
        let p = Path::new("x.bin");
        assert_eq!(decode_shard(&b, p).unwrap(), toks);
        let e = decode_shard(&b[..b.len() - 1], p).unwrap_err().to_string();
        assert!(e.contains("truncated"), "{e}");
        let mut bad = b.clone();
        bad[0] = 0;
        assert!(decode_shard(&bad, p).unwrap_err().to_string().contains("magic"));
        assert!(decode_shard(&b[..100], p).unwrap_err().to_string().contains("too short"));
    }
}
