//! Plain safetensors files of named tensors, to and from any device: [`load_safetensors`] and
//! [`save_safetensors`], and the device reads under checkpoint loading.
//!
//! **Loading.** The header is read and checked first (`reader.rs`: its length against the file's,
//! every dtype, shape and byte range, the data section exactly covered), then the tensors. For a
//! CUDA device the tensors come in one pass over the file through ferrograd-core's file reader
//! (`cuda::file_read::read_tensors`: cuFile where it registers the file, else two pinned buffers,
//! double-buffered), each into its own device allocation: no host copy of the file and no second
//! device copy of it. For the CPU they are read one by one into host memory. One line on stderr
//! names the path the bytes took and the rate ([`Loaded::summary`]).
//!
//! **Saving.** The header is made by `safetensors::serialize` itself (with empty payloads, so its
//! order and offsets are the crate's, and `codec::serialize` makes it deterministic); then each
//! tensor is written in the header's offset order, a CUDA tensor through two pinned chunks
//! (`cuda::file_write::write_tensor`), all inside the project's atomic write. The bytes equal
//! `safetensors::serialize` of the same tensors (tested), without ever holding the file in memory.

use super::{codec, io_err, reader, CheckpointError};
use ferrograd_core::cuda::file_read::FileTensor;
pub use ferrograd_core::cuda::file_read::ReadPath;
use ferrograd_core::{DType, Device, Tensor};
use std::collections::{BTreeMap, HashMap};
use std::io::{Read, Seek};
use std::path::Path;
use std::time::Instant;

type CResult<T> = std::result::Result<T, CheckpointError>;

/// How [`load_safetensors_with`] reads.
#[derive(Clone, Copy)]
pub struct ReadOptions<'a> {
    /// Read only the tensors whose names this accepts (the others are checked in the header but
    /// not read). All by default.
    pub only: Option<&'a dyn Fn(&str) -> bool>,
    /// Try cuFile before the pinned reads (CUDA devices). On by default; tests turn it off to
    /// compare the paths.
    pub allow_cufile: bool,
    /// Print [`Loaded::summary`] on stderr. On by default.
    pub log: bool,
}

impl Default for ReadOptions<'_> {
    fn default() -> Self {
        ReadOptions { only: None, allow_cufile: true, log: true }
    }
}

/// A safetensors file read onto a device.
#[derive(Debug)]
pub struct Loaded {
    /// The tensors by name, on the requested device.
    pub tensors: BTreeMap<String, Tensor>,
    /// The header's `__metadata__`.
    pub metadata: HashMap<String, String>,
    /// How the bytes went.
    pub read: ReadPath,
    /// Tensor bytes read.
    pub bytes: u64,
    /// Seconds from opening the file until the tensors were on the device.
    pub seconds: f64,
    /// The file, as errors and the log line name it.
    pub path: String,
    /// Where the tensors are.
    pub device: Device,
}

impl Loaded {
    /// Tensor bytes per second, in GB/s.
    pub fn gbps(&self) -> f64 {
        self.bytes as f64 / self.seconds.max(1e-9) / 1e9
    }

    /// The log line: file, count, size, device, path, time and rate.
    pub fn summary(&self) -> String {
        read_line(&self.path, self.tensors.len(), self.bytes, self.device, self.read, self.seconds)
    }
}

/// `{path}: N tensors, X MB to DEVICE through PATH in T ms (R GB/s)`, with why cuFile was not used
/// where a CUDA read went through the pinned buffers.
pub(super) fn read_line(path: &str, n: usize, bytes: u64, device: Device, how: ReadPath, seconds: f64) -> String {
    let mut s = format!(
        "{path}: {n} tensor{}, {:.1} MB to {device} through {how} in {:.1} ms ({:.1} GB/s)",
        if n == 1 { "" } else { "s" },
        bytes as f64 / 1e6,
        seconds * 1e3,
        bytes as f64 / seconds.max(1e-9) / 1e9
    );
    if how == ReadPath::Pinned {
        if let Err(why) = ferrograd_core::cuda::file_read::cufile_status() {
            s += &format!(" (cuFile not used: {why})");
        }
    }
    s
}

/// Every tensor of the safetensors file at `path` on `device`, and how the bytes went (one log
/// line on stderr). Malformed files are typed errors naming the tensor where one is to blame.
pub fn load_safetensors(path: impl AsRef<Path>, device: Device) -> CResult<Loaded> {
    load_safetensors_with(path, device, ReadOptions::default())
}

/// [`load_safetensors`] with options (a subset of the tensors, no cuFile, no log line).
pub fn load_safetensors_with(path: impl AsRef<Path>, device: Device, opts: ReadOptions<'_>) -> CResult<Loaded> {
    let start = Instant::now();
    let path = path.as_ref();
    let (mut r, header, label) = open_with_header(path)?;
    let chosen: Vec<(&String, &reader::Entry)> =
        header.tensors.iter().filter(|(n, _)| opts.only.is_none_or(|keep| keep(n))).collect();
    let entries: Vec<(&str, &reader::Entry)> = chosen.iter().map(|(n, e)| (n.as_str(), *e)).collect();
    let (tensors, read) = read_entries(&mut r, path, &label, &header, &entries, device, opts.allow_cufile)?;
    let loaded = Loaded {
        bytes: entries.iter().map(|(_, e)| e.end - e.start).sum(),
        tensors: chosen.iter().map(|(n, _)| (*n).clone()).zip(tensors).collect(),
        metadata: header.metadata,
        read,
        seconds: start.elapsed().as_secs_f64(),
        path: label,
        device,
    };
    if opts.log {
        eprintln!("ferrograd: read {}", loaded.summary());
    }
    Ok(loaded)
}

/// The header of the safetensors file at `path`, checked (`reader.rs`): every tensor's dtype,
/// shape and byte range, and the metadata. No tensor is read, so this costs a header read however
/// large the file.
pub fn read_safetensors_header(path: impl AsRef<Path>) -> CResult<reader::Header> {
    Ok(open_with_header(path.as_ref())?.1)
}

/// The file at `path` open for reading, its checked header, and its name for errors.
fn open_with_header(path: &Path) -> CResult<(std::io::BufReader<std::fs::File>, reader::Header, String)> {
    let label = path.display().to_string();
    let (file, len) = ferrograd_core::io::open_input(path).map_err(|e| io_err(&label, e))?;
    let mut r = std::io::BufReader::new(file);
    let header = reader::read_header(&mut r, len, &label)?;
    Ok((r, header, label))
}

/// Our dtype of an entry, or an error naming the tensor.
fn entry_dtype(label: &str, name: &str, e: &reader::Entry) -> CResult<DType> {
    e.dtype.ok_or_else(|| CheckpointError::Unsupported {
        path: label.to_string(),
        name: name.to_string(),
        dtype: e.dtype_name.clone(),
    })
}

/// The tensors of `entries` (of `header`, the header of `path`, which `r` reads) on `device`: one
/// pass through the GPU file reader for a CUDA device, host reads for the CPU.
pub(super) fn read_entries<R: Read + Seek>(
    r: &mut R,
    path: &Path,
    label: &str,
    header: &reader::Header,
    entries: &[(&str, &reader::Entry)],
    device: Device,
    allow_cufile: bool,
) -> CResult<(Vec<Tensor>, ReadPath)> {
    let dtypes = entries.iter().map(|(n, e)| entry_dtype(label, n, e)).collect::<CResult<Vec<_>>>()?;
    match device {
        Device::Cuda(ordinal) => {
            let spans: Vec<FileTensor> = entries
                .iter()
                .zip(&dtypes)
                .map(|((_, e), &dtype)| FileTensor {
                    offset: header.data_start + e.start,
                    shape: e.shape.clone().into(),
                    dtype,
                })
                .collect();
            ferrograd_core::cuda::file_read::read_tensors(path, &spans, ordinal, allow_cufile).map_err(|e| match e {
                e @ ferrograd_core::Error::File { .. } => io_err(label, e),
                e => CheckpointError::Tensor(e),
            })
        }
        Device::Cpu => {
            let mut out = Vec::with_capacity(entries.len());
            for ((_, e), &dtype) in entries.iter().zip(&dtypes) {
                let bytes = reader::read_tensor(r, header, e, label)?;
                out.push(codec::tensor_from_bytes(&bytes, dtype, &e.shape, Device::Cpu)?);
            }
            Ok((out, ReadPath::Host))
        }
    }
}

/// For each tensor of `ts`, the first element that is NaN or infinite, with its value: `(tensor,
/// element, value)`. Device tensors are probed on the device (`sum(t * 0)` is NaN exactly when `t`
/// holds a non-finite value, one read of all the probes), and only a tensor that fails is read
/// back to find the element.
pub(super) fn first_nonfinite(ts: &[Tensor]) -> CResult<Option<(usize, usize, f64)>> {
    let floats: Vec<usize> = (0..ts.len()).filter(|&i| ts[i].dtype().is_float()).collect();
    if floats.is_empty() {
        return Ok(None);
    }
    let probes = floats
        .iter()
        .map(|&i| ts[i].mul_scalar(0.0)?.to_dtype(DType::F32)?.sum_all())
        .collect::<ferrograd_core::Result<Vec<_>>>()?;
    // One read per device: the tensors may live on several (a ZeRO-1 resume stages the optimizer's
    // moments on the host beside the model on its GPU), and probes of different devices do not stack.
    let mut sums = vec![0f32; probes.len()];
    let mut devices = Vec::new();
    for p in &probes {
        if !devices.contains(&p.device()) {
            devices.push(p.device());
        }
    }
    for dev in devices {
        let on: Vec<usize> = (0..probes.len()).filter(|&k| probes[k].device() == dev).collect();
        let these: Vec<Tensor> = on.iter().map(|&k| probes[k].clone()).collect();
        for (&k, s) in on.iter().zip(Tensor::stack(&these, 0)?.to_vec::<f32>()?) {
            sums[k] = s;
        }
    }
    for (&i, s) in floats.iter().zip(sums) {
        if !s.is_finite() {
            let bytes = codec::tensor_bytes(&ts[i])?;
            if let Some((index, value)) = codec::first_nonfinite(&bytes, ts[i].dtype()) {
                return Ok(Some((i, index, value)));
            }
        }
    }
    Ok(None)
}

/// A tensor's header entry without its payload: what `safetensors::serialize` needs to lay out
/// the header.
struct HeaderOnly {
    dtype: safetensors::Dtype,
    shape: Vec<usize>,
    len: usize,
}

impl safetensors::View for &HeaderOnly {
    fn dtype(&self) -> safetensors::Dtype {
        self.dtype
    }
    fn shape(&self) -> &[usize] {
        &self.shape
    }
    fn data(&self) -> std::borrow::Cow<'_, [u8]> {
        std::borrow::Cow::Borrowed(&[])
    }
    fn data_len(&self) -> usize {
        self.len
    }
}

/// Write named tensors (any dtype, any device) as a safetensors file with `metadata`, atomically
/// (see the module documentation).
pub fn save_safetensors(
    path: impl AsRef<Path>,
    tensors: &[(&str, &Tensor)],
    metadata: HashMap<String, String>,
) -> CResult<()> {
    let path = path.as_ref();
    let label = path.display().to_string();
    let corrupt = |msg: String| CheckpointError::Corrupt { path: label.clone(), msg: format!("serialising: {msg}") };
    let mut seen = std::collections::HashSet::new();
    if let Some((n, _)) = tensors.iter().find(|(n, _)| !seen.insert(*n)) {
        return Err(CheckpointError::Metadata {
            path: label.clone(),
            key: n.to_string(),
            msg: "two tensors share this name".into(),
        });
    }
    let views: Vec<(&str, HeaderOnly)> = tensors
        .iter()
        .map(|(n, t)| {
            let len = t.elem_count() * t.dtype().size_in_bytes();
            (*n, HeaderOnly { dtype: codec::to_st(t.dtype()), shape: t.dims().to_vec(), len })
        })
        .collect();
    let meta = (!metadata.is_empty()).then_some(metadata);
    let header = codec::serialize(views.iter().map(|(n, v)| (*n, v)), meta).map_err(corrupt)?;
    // The data section's order is the header's: by start offset.
    let json: serde_json::Value = header
        .get(8..)
        .and_then(|h| serde_json::from_slice(h).ok())
        .ok_or_else(|| corrupt("the header just made does not parse".into()))?;
    let start = |name: &str| json.get(name).and_then(|e| e.get("data_offsets")).and_then(|o| o.get(0)?.as_u64());
    let mut order: Vec<(u64, usize)> = Vec::with_capacity(tensors.len());
    for (i, (n, _)) in tensors.iter().enumerate() {
        order.push((start(n).ok_or_else(|| corrupt(format!("tensor {n} is not in the header")))?, i));
    }
    order.sort_unstable();
    let mut failed: Option<ferrograd_core::Error> = None;
    let written = ferrograd_core::io::write_atomic_with(path, |w| {
        use std::io::Write;
        w.write_all(&header)?;
        for &(_, i) in &order {
            let t = tensors[i].1;
            let r = match t.device() {
                Device::Cuda(_) => ferrograd_core::cuda::file_write::write_tensor(t, w),
                Device::Cpu => codec::tensor_bytes(t).and_then(|b| w.write_all(&b).map_err(ferrograd_core::Error::Io)),
            };
            if let Err(e) = r {
                // An I/O error stays one; anything else is reported as itself below.
                let msg = e.to_string();
                match e {
                    ferrograd_core::Error::Io(io) => return Err(io),
                    e => failed = Some(e),
                }
                return Err(std::io::Error::other(msg));
            }
        }
        Ok(())
    });
    match (written, failed) {
        (Ok(()), _) => Ok(()),
        (Err(_), Some(e)) => Err(CheckpointError::Tensor(e)),
        (Err(e), None) => Err(io_err(&label, e)),
    }
}
