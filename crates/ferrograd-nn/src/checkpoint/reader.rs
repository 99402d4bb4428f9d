//! Reading a safetensors file without trusting it: the 8-byte length and the header first (the
//! header capped at [`MAX_HEADER_BYTES`]), every tensor's dtype, shape and byte range checked with
//! checked arithmetic, then only the tensors the caller needs read, each by its declared size. A
//! 4 GiB file whose header lists one 38 KB tensor never costs more than the header and that
//! tensor; a truncated file names the first tensor whose bytes are missing; sizes that would
//! overflow are errors, never panics; tensors must tile the data section in offset order (no
//! overlaps, no gaps), as the format requires.
//!
//! Works over any `Read + Seek`: a file (`checkpoint::load`) or bytes in memory (`from_bytes`).
//! Files are read (`read_exact` after a seek), not memory-mapped: a file truncated by another
//! process while mapped would kill this one with SIGBUS, where a read returns an error.

use super::codec;
use super::CheckpointError;
use ferrograd_core::DType;
use std::collections::{BTreeMap, HashMap};
use std::io::{Read, Seek, SeekFrom};

/// The largest header accepted (the `safetensors` crate's own limit).
pub const MAX_HEADER_BYTES: u64 = 100_000_000;

/// One tensor's entry in the header.
#[derive(Debug, Clone)]
pub struct Entry {
    /// The dtype as the file spells it (`F32`, `I64`, ...).
    pub dtype_name: String,
    /// Ours, when we have it.
    pub dtype: Option<DType>,
    /// The tensor's shape.
    pub shape: Vec<usize>,
    /// Byte range within the data section.
    pub start: u64,
    /// One past the last byte, within the data section.
    pub end: u64,
}

/// The parsed and checked header.
#[derive(Debug)]
pub struct Header {
    /// Every tensor's entry, by name.
    pub tensors: BTreeMap<String, Entry>,
    /// The `__metadata__` entries.
    pub metadata: HashMap<String, String>,
    /// Where the data section starts in the file.
    pub data_start: u64,
}

fn dtype_size_of_name(name: &str) -> Option<u64> {
    Some(match name {
        "BOOL" | "U8" | "I8" | "F8_E5M2" | "F8_E4M3" => 1,
        "I16" | "U16" | "F16" | "BF16" => 2,
        "I32" | "U32" | "F32" => 4,
        "I64" | "U64" | "F64" => 8,
        _ => return None,
    })
}

fn our_dtype(name: &str) -> Option<DType> {
    let st: safetensors::Dtype = serde_json::from_value(serde_json::Value::String(name.to_string())).ok()?;
    codec::from_st(st)
}

/// Read and check the header of a `total_len`-byte source.
pub fn read_header<R: Read + Seek>(r: &mut R, total_len: u64, path: &str) -> Result<Header, CheckpointError> {
    let corrupt = |msg: String| CheckpointError::Corrupt { path: path.to_string(), msg };
    let io = |source: std::io::Error| CheckpointError::Io { path: path.to_string(), source };
    if total_len < 8 {
        return Err(corrupt(format!("{total_len} bytes, shorter than the 8-byte header length")));
    }
    let mut le = [0u8; 8];
    r.seek(SeekFrom::Start(0)).map_err(io)?;
    r.read_exact(&mut le).map_err(io)?;
    let n = u64::from_le_bytes(le);
    let rest = total_len - 8;
    if n > MAX_HEADER_BYTES {
        return Err(corrupt(format!("header claims {n} bytes, more than the {MAX_HEADER_BYTES} allowed")));
    }
    if n > rest {
        return Err(corrupt(format!("header claims {n} bytes but only {rest} follow (truncated header?)")));
    }
    // n <= MAX_HEADER_BYTES, so this fits in memory and in usize.
    let mut header = vec![0u8; n as usize];
    r.read_exact(&mut header).map_err(io)?;
    let text = std::str::from_utf8(&header).map_err(|e| corrupt(format!("header is not UTF-8: {e}")))?;
    let json: serde_json::Value =
        serde_json::from_str(text).map_err(|e| corrupt(format!("header is not valid JSON: {e}")))?;
    let obj = json.as_object().ok_or_else(|| corrupt("header is not a JSON object".into()))?;
    let available = rest - n;

    let mut metadata = HashMap::new();
    let mut tensors = BTreeMap::new();
    for (name, info) in obj {
        if name == "__metadata__" {
            let m = info.as_object().ok_or_else(|| corrupt("__metadata__ is not a JSON object".into()))?;
            for (k, v) in m {
                let v = v.as_str().ok_or_else(|| corrupt(format!("metadata {k} is not a string")))?;
                metadata.insert(k.clone(), v.to_string());
            }
            continue;
        }
        let bad = |what: &str| corrupt(format!("tensor {name} has {what}"));
        let dtype_name = info.get("dtype").and_then(|d| d.as_str()).ok_or_else(|| bad("no dtype"))?.to_string();
        let shape = info
            .get("shape")
            .and_then(|s| s.as_array())
            .ok_or_else(|| bad("no shape"))?
            .iter()
            .map(|d| d.as_u64().and_then(|d| usize::try_from(d).ok()))
            .collect::<Option<Vec<usize>>>()
            .ok_or_else(|| bad("a shape that is not a list of sizes"))?;
        let offs = info.get("data_offsets").and_then(|v| v.as_array());
        let (Some(start), Some(end)) = (
            offs.and_then(|a| a.first()).and_then(|v| v.as_u64()),
            offs.and_then(|a| a.get(1)).and_then(|v| v.as_u64()),
        ) else {
            return Err(bad("no valid data_offsets"));
        };
        if offs.map_or(0, |a| a.len()) != 2 || start > end {
            return Err(bad(&format!("invalid data offsets [{start}, {end}]")));
        }
        let size = dtype_size_of_name(&dtype_name).ok_or_else(|| bad(&format!("unknown dtype {dtype_name}")))?;
        let bytes = shape
            .iter()
            .try_fold(size, |acc, &d| acc.checked_mul(d as u64))
            .ok_or_else(|| bad(&format!("shape {shape:?} whose byte count overflows")))?;
        if bytes != end - start {
            return Err(bad(&format!(
                "shape {shape:?} of {dtype_name} ({bytes} bytes) but data offsets [{start}, {end}] ({} bytes)",
                end - start
            )));
        }
        let dtype = our_dtype(&dtype_name);
        tensors.insert(name.clone(), Entry { dtype_name, dtype, shape, start, end });
    }
    // A tensor whose bytes run past the end: report the one that starts first.
    if let Some((name, e)) = tensors.iter().filter(|(_, e)| e.end > available).min_by_key(|(_, e)| e.start) {
        return Err(CheckpointError::Truncated {
            path: path.to_string(),
            name: name.clone(),
            start: e.start,
            end: e.end,
            available,
        });
    }
    // The format's rule (and the `safetensors` crate's check): in offset order each tensor starts
    // where the one before it ends, so no two share bytes and no bytes are unaccounted for.
    let mut by_offset: Vec<(&String, &Entry)> = tensors.iter().collect();
    by_offset.sort_by_key(|(_, e)| (e.start, e.end));
    let mut next = 0u64;
    for (name, e) in by_offset {
        if e.start != next {
            return Err(corrupt(format!(
                "tensor {name} starts at byte {} of the data section, but the tensors before it end at byte \
                 {next} ({} tensors)",
                e.start,
                if e.start < next { "overlapping" } else { "a gap between" }
            )));
        }
        next = e.end;
    }
    let used = tensors.values().map(|e| e.end).max().unwrap_or(0);
    if used != available {
        return Err(corrupt(format!(
            "the data section holds {available} bytes but the header's tensors use {used} (bytes missing or \
             extra: the file is not what its header describes)"
        )));
    }
    Ok(Header { tensors, metadata, data_start: 8 + n })
}

/// The bytes of one tensor, read by its declared size.
pub fn read_tensor<R: Read + Seek>(r: &mut R, h: &Header, e: &Entry, path: &str) -> Result<Vec<u8>, CheckpointError> {
    let io = |source: std::io::Error| CheckpointError::Io { path: path.to_string(), source };
    let len = e.end - e.start;
    let mut buf = Vec::new();
    // The size was checked against the file's length, so this is at most the file's size.
    buf.try_reserve_exact(len as usize).map_err(|_| {
        CheckpointError::Tensor(ferrograd_core::host::alloc_failed(|| format!("reading {path}"), len as usize))
    })?;
    r.seek(SeekFrom::Start(h.data_start + e.start)).map_err(io)?;
    r.by_ref().take(len).read_to_end(&mut buf).map_err(io)?;
    if buf.len() as u64 != len {
        return Err(CheckpointError::Corrupt {
            path: path.to_string(),
            msg: format!("the file ended inside a tensor ({} of {len} bytes read)", buf.len()),
        });
    }
    Ok(buf)
}
