//! A first look at the header before `safetensors` parses the file: it turns a truncated file into
//! an error naming the first tensor whose bytes are missing, and rejects offsets that would make
//! the library's own size arithmetic overflow.

use super::CheckpointError;

/// Check the 8-byte length, the header JSON, and that each tensor's byte range fits in the file.
pub fn precheck(bytes: &[u8], path: &str) -> Result<(), CheckpointError> {
    let corrupt = |msg: String| CheckpointError::Corrupt { path: path.to_string(), msg };
    let Some(len_bytes) = bytes.get(..8) else {
        return Err(corrupt(format!("{} bytes, shorter than the 8-byte header length", bytes.len())));
    };
    let mut le = [0u8; 8];
    le.copy_from_slice(len_bytes);
    let n = u64::from_le_bytes(le);
    let rest = (bytes.len() - 8) as u64;
    if n > rest {
        return Err(corrupt(format!("header claims {n} bytes but only {rest} follow (truncated header?)")));
    }
    // n <= rest, which is a slice length, so these conversions and the slice are in range.
    let header = &bytes[8..8 + n as usize];
    let text = std::str::from_utf8(header).map_err(|e| corrupt(format!("header is not UTF-8: {e}")))?;
    let json: serde_json::Value =
        serde_json::from_str(text).map_err(|e| corrupt(format!("header is not valid JSON: {e}")))?;
    let obj = json.as_object().ok_or_else(|| corrupt("header is not a JSON object".into()))?;
    let available = rest - n;
    // Report the tensor whose range starts first among those that run past the end.
    let mut worst: Option<(u64, u64, &str)> = None;
    for (name, info) in obj {
        if name == "__metadata__" {
            continue;
        }
        let offs = info.get("data_offsets").and_then(|v| v.as_array());
        let (Some(s), Some(e)) = (
            offs.and_then(|a| a.first()).and_then(|v| v.as_u64()),
            offs.and_then(|a| a.get(1)).and_then(|v| v.as_u64()),
        ) else {
            return Err(corrupt(format!("tensor {name} has no valid data_offsets")));
        };
        if e > available && worst.is_none_or(|(ws, _, _)| s < ws) {
            worst = Some((s, e, name));
        }
    }
    if let Some((start, end, name)) = worst {
        return Err(CheckpointError::Truncated {
            path: path.to_string(),
            name: name.to_string(),
            start,
            end,
            available,
        });
    }
    Ok(())
}
