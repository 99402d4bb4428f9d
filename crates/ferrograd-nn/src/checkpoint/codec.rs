//! Tensors to and from safetensors bytes (little-endian, row-major), and the dtype names of both
//! libraries.

use ferrograd_core::{bf16, f16, DType, Device, Result, Tensor};
use safetensors::Dtype as StDtype;

pub fn to_st(d: DType) -> StDtype {
    match d {
        DType::F32 => StDtype::F32,
        DType::F64 => StDtype::F64,
        DType::F16 => StDtype::F16,
        DType::BF16 => StDtype::BF16,
        DType::I32 => StDtype::I32,
        DType::U32 => StDtype::U32,
        DType::U8 => StDtype::U8,
        DType::I8 => StDtype::I8,
    }
}

pub fn from_st(d: StDtype) -> Option<DType> {
    Some(match d {
        StDtype::F32 => DType::F32,
        StDtype::F64 => DType::F64,
        StDtype::F16 => DType::F16,
        StDtype::BF16 => DType::BF16,
        StDtype::I32 => DType::I32,
        StDtype::U32 => DType::U32,
        StDtype::U8 => DType::U8,
        StDtype::I8 => DType::I8,
        _ => return None,
    })
}

/// The tensor's elements as bytes (read to the host for device tensors).
pub fn tensor_bytes(t: &Tensor) -> Result<Vec<u8>> {
    fn raw<T: ferrograd_core::WithDType>(t: &Tensor) -> Result<Vec<u8>> {
        Ok(bytemuck::cast_slice(&t.to_vec::<T>()?).to_vec())
    }
    match t.dtype() {
        DType::F32 => raw::<f32>(t),
        DType::F64 => raw::<f64>(t),
        DType::F16 => raw::<f16>(t),
        DType::BF16 => raw::<bf16>(t),
        DType::I32 => raw::<i32>(t),
        DType::U32 => raw::<u32>(t),
        DType::U8 => raw::<u8>(t),
        DType::I8 => raw::<i8>(t),
    }
}

/// A tensor of `dtype` and `shape` on `device` from its bytes (any alignment: the bytes are
/// copied into a typed buffer). The caller has checked that the length matches.
pub fn tensor_from_bytes(bytes: &[u8], dtype: DType, shape: &[usize], device: Device) -> Result<Tensor> {
    fn typed<T: ferrograd_core::WithDType>(b: &[u8], shape: &[usize], device: Device) -> Result<Tensor> {
        let size = std::mem::size_of::<T>();
        if !b.len().is_multiple_of(size) {
            return Err(ferrograd_core::Error::ElementCount {
                op: "checkpoint tensor",
                expected: b.len() / size,
                got: 0,
            });
        }
        let mut v = vec![T::zeroed(); b.len() / size];
        // Copy rather than cast in place: the file's bytes need not be aligned for `T`.
        bytemuck::cast_slice_mut::<T, u8>(&mut v).copy_from_slice(b);
        Tensor::from_vec(v, shape, device)
    }
    match dtype {
        DType::F32 => typed::<f32>(bytes, shape, device),
        DType::F64 => typed::<f64>(bytes, shape, device),
        DType::F16 => typed::<f16>(bytes, shape, device),
        DType::BF16 => typed::<bf16>(bytes, shape, device),
        DType::I32 => typed::<i32>(bytes, shape, device),
        DType::U32 => typed::<u32>(bytes, shape, device),
        DType::U8 => typed::<u8>(bytes, shape, device),
        DType::I8 => typed::<i8>(bytes, shape, device),
    }
}

/// The first element of little-endian `bytes` of `dtype` that is NaN or infinite, with its value
/// (integer dtypes have none).
pub fn first_nonfinite(bytes: &[u8], dtype: DType) -> Option<(usize, f64)> {
    fn scan<const N: usize>(bytes: &[u8], f: impl Fn([u8; N]) -> f64) -> Option<(usize, f64)> {
        bytes.chunks_exact(N).enumerate().find_map(|(i, c)| {
            let mut a = [0u8; N];
            a.copy_from_slice(c);
            let v = f(a);
            (!v.is_finite()).then_some((i, v))
        })
    }
    match dtype {
        DType::F32 => scan(bytes, |a| f32::from_le_bytes(a) as f64),
        DType::F64 => scan(bytes, f64::from_le_bytes),
        DType::F16 => scan(bytes, |a| f16::from_le_bytes(a).to_f64()),
        DType::BF16 => scan(bytes, |a| bf16::from_le_bytes(a).to_f64()),
        _ => None,
    }
}

/// An owned tensor ready for `safetensors::serialize`.
pub struct Blob {
    pub dtype: StDtype,
    pub shape: Vec<usize>,
    pub data: Vec<u8>,
}

impl Blob {
    pub fn of(t: &Tensor) -> Result<Blob> {
        Ok(Blob { dtype: to_st(t.dtype()), shape: t.dims().to_vec(), data: tensor_bytes(t)? })
    }
}

impl safetensors::View for &Blob {
    fn dtype(&self) -> StDtype {
        self.dtype
    }
    fn shape(&self) -> &[usize] {
        &self.shape
    }
    fn data(&self) -> std::borrow::Cow<'_, [u8]> {
        std::borrow::Cow::Borrowed(&self.data)
    }
    fn data_len(&self) -> usize {
        self.data.len()
    }
}

/// `safetensors::serialize` with a deterministic header: the crate writes the metadata map in
/// `HashMap` order, which differs between two maps with the same entries, so two saves of the same
/// weights gave different bytes (and tests comparing files failed at random). The header is
/// rewritten with its keys sorted (serde_json's map is ordered) and padded with spaces to a
/// multiple of 8 bytes as the format asks; the tensors' offsets are relative to the data, which
/// does not move.
pub fn serialize<S, V, I>(
    tensors: I,
    metadata: Option<std::collections::HashMap<String, String>>,
) -> std::result::Result<Vec<u8>, String>
where
    S: AsRef<str> + Ord + std::fmt::Display,
    V: safetensors::View,
    I: IntoIterator<Item = (S, V)>,
{
    let bytes = safetensors::serialize(tensors, metadata).map_err(|e| e.to_string())?;
    let n = bytes.get(..8).map(|b| u64::from_le_bytes([b[0], b[1], b[2], b[3], b[4], b[5], b[6], b[7]]));
    let n = n.and_then(|n| usize::try_from(n).ok()).filter(|&n| 8 + n <= bytes.len()).ok_or("header length")?;
    let header: serde_json::Value = serde_json::from_slice(&bytes[8..8 + n]).map_err(|e| e.to_string())?;
    let mut json = serde_json::to_vec(&header).map_err(|e| e.to_string())?;
    json.resize(json.len().next_multiple_of(8), b' ');
    let mut out = Vec::with_capacity(8 + json.len() + bytes.len() - 8 - n);
    out.extend_from_slice(&(json.len() as u64).to_le_bytes());
    out.extend_from_slice(&json);
    out.extend_from_slice(&bytes[8 + n..]);
    Ok(out)
}

#[cfg(test)]
mod serialize_tests {
    use super::*;
    use std::collections::HashMap;

    /// Two maps with the same entries iterate in different orders; the files must not differ.
    #[test]
    fn same_content_same_bytes_and_readable() {
        let blob = Blob {
            dtype: StDtype::F32,
            shape: vec![3],
            data: [1f32, 2.0, 3.0].iter().flat_map(|x| x.to_le_bytes()).collect(),
        };
        let keys: Vec<String> = (0..40).map(|i| format!("key{i}")).collect();
        let forward: HashMap<String, String> = keys.iter().map(|k| (k.clone(), format!("v{k}"))).collect();
        let backward: HashMap<String, String> = keys.iter().rev().map(|k| (k.clone(), format!("v{k}"))).collect();
        let a = serialize([("w", &blob), ("b", &blob)], Some(forward.clone())).unwrap();
        let b = serialize([("b", &blob), ("w", &blob)], Some(backward)).unwrap();
        assert_eq!(a, b);
        assert_eq!(u64::from_le_bytes(a[..8].try_into().unwrap()) % 8, 0, "header padded to 8 bytes");
        let (_, meta) = safetensors::SafeTensors::read_metadata(&a).unwrap();
        assert_eq!(meta.metadata().as_ref(), Some(&forward));
        let t = safetensors::SafeTensors::deserialize(&a).unwrap();
        assert_eq!(t.tensor("w").unwrap().data(), blob.data.as_slice());
        assert_eq!(t.tensor("b").unwrap().data(), blob.data.as_slice());
    }
}
