//! Checkpoints as safetensors files: the model's tensors under their `state_dict` names (so the
//! file doubles as a plain weights file), the optimizer's state under `optim.state.<param>.<slot>`,
//! and the step, generator states, optimizer scalars and user entries in the header metadata.
//!
//! Writes are atomic (`ferrograd_core::io::write_atomic`) and stream each tensor into the file
//! (device tensors through pinned chunks: `files.rs`). Loading reads the header first and only
//! the tensors it needs, by their declared sizes (`reader.rs`); into a CUDA model they come in one
//! pass through the GPU file reader (`files.rs`, one log line naming the path), into a CPU model
//! tensor by tensor. It checks every tensor's presence,
//! dtype, shape and values (no NaN or infinity unless `LoadOptions::allow_nonfinite`) and all
//! metadata before it changes anything, and restores values bit for bit into the existing
//! parameter and state buffers (their identity is kept), so a resumed run continues exactly as
//! the original would have on the same device. A file already read onto a device
//! ([`load_safetensors_with`]) restores through [`from_loaded`], with the same checks and writes.

mod codec;
pub use codec::serialize as serialize_safetensors;
mod error;
mod files;
pub mod reader;

pub use error::CheckpointError;
/// The project's one atomic write (`ferrograd_core::io`), re-exported where it used to live.
pub use ferrograd_core::io::write_atomic;
pub use files::{
    load_safetensors, load_safetensors_with, read_safetensors_header, save_safetensors, Loaded, ReadOptions, ReadPath,
};

use crate::optim::Optimizer;
use crate::Module;
use ferrograd_core::{DType, Device, Rng, Tensor};
use std::collections::{BTreeMap, HashMap, HashSet};
use std::io::{Read, Seek};
use std::path::Path;

/// The `format` metadata value of files this module writes.
pub const FORMAT: &str = "ferrograd-checkpoint-v1";
/// Name prefix of optimizer state tensors.
pub const OPTIM_PREFIX: &str = "optim.state.";

/// Everything besides tensors that a run needs to resume.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct TrainState {
    /// Optimizer steps taken (or whatever step counter the caller keeps).
    pub step: u64,
    /// Named generator states (dropout, data order, ...): seed and offset are a Philox stream's
    /// entire state.
    pub rngs: BTreeMap<String, Rng>,
    /// Free-form entries (epoch, batch index, scaler state as JSON, ...).
    pub extra: BTreeMap<String, String>,
}

type CResult<T> = std::result::Result<T, CheckpointError>;

/// How loading treats what it finds.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct LoadOptions {
    /// Accept NaN and infinite values. Off by default: such a file is an error naming the tensor
    /// and the element (a model loaded with them trains to NaN and hides it until the end).
    pub allow_nonfinite: bool,
}

/// A core file error (from `ferrograd_core::io`) as this module's I/O error.
fn io_err(label: &str, e: ferrograd_core::Error) -> CheckpointError {
    let msg = match e {
        ferrograd_core::Error::File { msg, .. } => msg,
        e => e.to_string(),
    };
    CheckpointError::Io { path: label.to_string(), source: std::io::Error::other(msg) }
}

/// Write model, optimizer and training state to `path`, atomically (`ferrograd_core::io`), each
/// tensor streamed into the file (the bytes of [`to_bytes`]).
pub fn save(
    path: impl AsRef<Path>,
    model: &dyn Module,
    optim: Option<&dyn Optimizer>,
    state: &TrainState,
) -> CResult<()> {
    let path = path.as_ref();
    let (tensors, meta) = contents(model, optim, state, &path.display().to_string())?;
    let named: Vec<(&str, &Tensor)> = tensors.iter().map(|(n, t)| (n.as_str(), t)).collect();
    save_safetensors(path, &named, meta)
}

/// Restore model, optimizer and training state from `path`. With `optim: None` the optimizer
/// entries of the file are ignored (loading weights only). Non-finite values are refused.
pub fn load(path: impl AsRef<Path>, model: &dyn Module, optim: Option<&mut dyn Optimizer>) -> CResult<TrainState> {
    load_with(path, model, optim, LoadOptions::default())
}

/// [`load`] with options. The file must be a regular file (a FIFO would block forever); its
/// header is read and checked first, then only the tensors being loaded, each by its declared
/// size (`reader.rs`).
pub fn load_with(
    path: impl AsRef<Path>,
    model: &dyn Module,
    optim: Option<&mut dyn Optimizer>,
    opts: LoadOptions,
) -> CResult<TrainState> {
    let path = path.as_ref();
    let label = path.display().to_string();
    let (file, len) = ferrograd_core::io::open_input(path).map_err(|e| io_err(&label, e))?;
    restore(&mut std::io::BufReader::new(file), len, &label, Some(path), model, optim, opts)
}

fn metadata_err(path: &str, key: &str, msg: impl std::fmt::Display) -> CheckpointError {
    CheckpointError::Metadata { path: path.to_string(), key: key.to_string(), msg: msg.to_string() }
}

/// The checkpoint's tensors by file name and its metadata (`label` names it in errors).
fn contents(
    model: &dyn Module,
    optim: Option<&dyn Optimizer>,
    state: &TrainState,
    label: &str,
) -> CResult<(BTreeMap<String, Tensor>, HashMap<String, String>)> {
    let mut tensors: BTreeMap<String, Tensor> = BTreeMap::new();
    let mut add = |name: String, t: Tensor| -> CResult<()> {
        if tensors.contains_key(&name) {
            return Err(metadata_err(label, &name, "two tensors share this name"));
        }
        tensors.insert(name, t);
        Ok(())
    };
    for (name, t) in model.named_parameters() {
        add(name, t)?;
    }
    let mut meta = HashMap::new();
    meta.insert("format".to_string(), FORMAT.to_string());
    meta.insert("step".to_string(), state.step.to_string());
    let rngs: BTreeMap<&str, serde_json::Value> = state
        .rngs
        .iter()
        .map(|(k, r)| (k.as_str(), serde_json::json!({ "seed": r.seed, "offset": r.offset })))
        .collect();
    meta.insert("rngs".to_string(), serde_json::json!(rngs).to_string());
    if let Some(o) = optim {
        for (name, t) in o.state_tensors() {
            add(format!("{OPTIM_PREFIX}{name}"), t)?;
        }
        let names: Vec<&str> = o.params().iter().map(|(n, _)| n.as_str()).collect();
        let v = serde_json::json!({ "kind": o.kind(), "params": names, "state": o.state_meta() });
        meta.insert("optim".to_string(), v.to_string());
    }
    for (k, v) in &state.extra {
        meta.insert(format!("extra.{k}"), v.clone());
    }
    Ok((tensors, meta))
}

/// The checkpoint as bytes (`label` names it in errors): what [`save`] writes.
pub fn to_bytes(
    model: &dyn Module,
    optim: Option<&dyn Optimizer>,
    state: &TrainState,
    label: &str,
) -> CResult<Vec<u8>> {
    let (tensors, meta) = contents(model, optim, state, label)?;
    let blobs = tensors.iter().map(|(n, t)| Ok((n.as_str(), codec::Blob::of(t)?))).collect::<CResult<Vec<_>>>()?;
    codec::serialize(blobs.iter().map(|(n, b)| (*n, b)), Some(meta))
        .map_err(|e| CheckpointError::Corrupt { path: label.to_string(), msg: format!("serialising: {e}") })
}

/// Parse and validate the file's metadata into a `TrainState` and the optimizer entry (if any).
fn read_meta(meta: &HashMap<String, String>, path: &str) -> CResult<(TrainState, Option<serde_json::Value>)> {
    let mut state = TrainState::default();
    if let Some(f) = meta.get("format") {
        if f != FORMAT {
            return Err(metadata_err(path, "format", format!("{f:?} is not {FORMAT:?}")));
        }
    }
    if let Some(s) = meta.get("step") {
        state.step = s.parse().map_err(|e| metadata_err(path, "step", format!("{s:?}: {e}")))?;
    }
    if let Some(s) = meta.get("rngs") {
        let v: BTreeMap<String, serde_json::Value> =
            serde_json::from_str(s).map_err(|e| metadata_err(path, "rngs", e))?;
        for (name, r) in v {
            let field = |k: &str| r.get(k).and_then(|x| x.as_u64());
            let (Some(seed), Some(offset)) = (field("seed"), field("offset")) else {
                return Err(metadata_err(path, &format!("rngs.{name}"), "needs integer seed and offset"));
            };
            state.rngs.insert(name, Rng { seed, offset });
        }
    }
    for (k, v) in meta {
        if let Some(k) = k.strip_prefix("extra.") {
            state.extra.insert(k.to_string(), v.clone());
        }
    }
    let optim = match meta.get("optim") {
        Some(s) => Some(serde_json::from_str(s).map_err(|e| metadata_err(path, "optim", e))?),
        None => None,
    };
    Ok((state, optim))
}

/// Restore from bytes already in memory (`label` names the source in errors).
pub fn from_bytes(
    bytes: &[u8],
    label: &str,
    model: &dyn Module,
    optim: Option<&mut dyn Optimizer>,
) -> CResult<TrainState> {
    from_bytes_with(bytes, label, model, optim, LoadOptions::default())
}

/// [`from_bytes`] with options.
pub fn from_bytes_with(
    bytes: &[u8],
    label: &str,
    model: &dyn Module,
    optim: Option<&mut dyn Optimizer>,
    opts: LoadOptions,
) -> CResult<TrainState> {
    from_reader(&mut std::io::Cursor::new(bytes), bytes.len() as u64, label, model, optim, opts)
}

/// Restore from any `total_len`-byte source: header first, everything checked, then the tensors.
pub fn from_reader<R: Read + Seek>(
    r: &mut R,
    total_len: u64,
    label: &str,
    model: &dyn Module,
    optim: Option<&mut dyn Optimizer>,
    opts: LoadOptions,
) -> CResult<TrainState> {
    restore(r, total_len, label, None, model, optim, opts)
}

/// The tensors read from the file, before they are written into the model.
enum ReadData {
    /// Host bytes, one vector per target (CPU models, sources without a path).
    Host(Vec<Vec<u8>>),
    /// Tensors, one per target: a CUDA model's, read through the GPU file reader, or those of a
    /// file already read ([`from_loaded`]).
    Tensors(Vec<Tensor>),
}

/// Restore model, optimizer and training state from a file already read
/// ([`load_safetensors_with`], onto the model's device): the checks and in-place writes of
/// [`load_with`], from the tensors as they were read (no second read, no host copy of the file).
/// `loaded` must hold every tensor of the file (several reads of one file, each with
/// `ReadOptions::only`, may be merged), so that a tensor the model lacks is still refused. A
/// tensor read onto another device than its destination's is copied there before anything is
/// written (read each where it goes to save that copy).
pub fn from_loaded(
    loaded: &Loaded,
    model: &dyn Module,
    optim: Option<&mut dyn Optimizer>,
    opts: LoadOptions,
) -> CResult<TrainState> {
    let label = loaded.path.as_str();
    let plan = plan(&loaded.metadata, label, model, optim.as_deref())?;
    let spec = |t: &Tensor| Spec {
        dtype: Some(t.dtype()),
        dtype_name: format!("{:?}", codec::to_st(t.dtype())),
        shape: t.dims().to_vec(),
    };
    let sources = match_targets(label, &plan.targets, &loaded.tensors, spec, optim.is_some())?;
    let ts = plan
        .targets
        .iter()
        .zip(sources)
        .map(|((_, t), src)| src.to_device(t.device()))
        .collect::<ferrograd_core::Result<Vec<_>>>()?;
    check_finite(label, &plan.targets, &ts, opts)?;
    apply(label, plan, &ReadData::Tensors(ts), optim)
}

/// What a load restores: the file's training state and optimizer entry, and every destination by
/// its name in the file (the model's parameters, then the optimizer's state).
struct Plan {
    state: TrainState,
    optim_meta: Option<serde_json::Value>,
    targets: Vec<(String, Tensor)>,
}

/// The [`Plan`] for a file with `metadata`, its optimizer entry checked against `optim`.
fn plan(
    metadata: &HashMap<String, String>,
    label: &str,
    model: &dyn Module,
    optim: Option<&dyn Optimizer>,
) -> CResult<Plan> {
    let (state, optim_meta) = read_meta(metadata, label)?;
    let mut targets: Vec<(String, Tensor)> = model.named_parameters();
    if let Some(o) = optim {
        let Some(om) = &optim_meta else {
            return Err(metadata_err(label, "optim", "the file holds no optimizer state"));
        };
        let kind = om.get("kind").and_then(|k| k.as_str()).unwrap_or("?");
        if kind != o.kind() {
            return Err(metadata_err(label, "optim", format!("saved by {kind}, loading into {}", o.kind())));
        }
        let names: Vec<&str> = o.params().iter().map(|(n, _)| n.as_str()).collect();
        let saved: Option<Vec<&str>> =
            om.get("params").and_then(|p| p.as_array()).map(|a| a.iter().filter_map(|v| v.as_str()).collect());
        if saved.as_deref() != Some(&names[..]) {
            return Err(metadata_err(label, "optim", "parameter list differs from the optimizer's"));
        }
        targets.extend(o.state_tensors().into_iter().map(|(n, t)| (format!("{OPTIM_PREFIX}{n}"), t)));
    }
    Ok(Plan { state, optim_meta, targets })
}

/// How a file describes one tensor (its header entry, or the tensor read), for the checks against
/// the destination.
struct Spec {
    /// Ours, when we have it.
    dtype: Option<DType>,
    /// As the file spells it.
    dtype_name: String,
    shape: Vec<usize>,
}

/// Each target's entry of `file`, in target order, after checking that every target is there with
/// its dtype and shape and that the file holds nothing else (optimizer entries aside when no
/// optimizer is loaded): all before anything is read or written.
fn match_targets<'a, T>(
    label: &str,
    targets: &[(String, Tensor)],
    file: &'a BTreeMap<String, T>,
    spec: impl Fn(&T) -> Spec,
    loading_optim: bool,
) -> CResult<Vec<&'a T>> {
    let mut sources = Vec::with_capacity(targets.len());
    for (name, t) in targets {
        let entry =
            file.get(name).ok_or_else(|| CheckpointError::Missing { path: label.to_string(), name: name.clone() })?;
        let s = spec(entry);
        if s.dtype != Some(t.dtype()) {
            return Err(CheckpointError::DType {
                path: label.to_string(),
                name: name.clone(),
                expected: t.dtype(),
                got: s.dtype_name,
            });
        }
        if s.shape != t.dims() {
            return Err(CheckpointError::Shape {
                path: label.to_string(),
                name: name.clone(),
                expected: t.dims().to_vec(),
                got: s.shape,
            });
        }
        sources.push(entry);
    }
    let known: HashSet<&str> = targets.iter().map(|(n, _)| n.as_str()).collect();
    for name in file.keys() {
        let ignorable = !loading_optim && name.starts_with(OPTIM_PREFIX);
        if !known.contains(name.as_str()) && !ignorable {
            return Err(CheckpointError::Unexpected { path: label.to_string(), name: name.to_string() });
        }
    }
    Ok(sources)
}

/// Refuse NaN and infinity in `ts` (one per target) unless `opts` allows them.
fn check_finite(label: &str, targets: &[(String, Tensor)], ts: &[Tensor], opts: LoadOptions) -> CResult<()> {
    if !opts.allow_nonfinite {
        if let Some((i, index, value)) = files::first_nonfinite(ts)? {
            let name = targets[i].0.clone();
            return Err(CheckpointError::NonFinite { path: label.to_string(), name, index, value });
        }
    }
    Ok(())
}

/// [`from_reader`]; `file`, the path `r` reads, lets a CUDA model's tensors come through the GPU
/// file reader.
fn restore<R: Read + Seek>(
    r: &mut R,
    total_len: u64,
    label: &str,
    file: Option<&Path>,
    model: &dyn Module,
    optim: Option<&mut dyn Optimizer>,
    opts: LoadOptions,
) -> CResult<TrainState> {
    let header = reader::read_header(r, total_len, label)?;
    let plan = plan(&header.metadata, label, model, optim.as_deref())?;
    let targets = &plan.targets;
    let spec = |e: &reader::Entry| Spec { dtype: e.dtype, dtype_name: e.dtype_name.clone(), shape: e.shape.clone() };
    let sources = match_targets(label, targets, &header.tensors, spec, optim.is_some())?;
    // Read every tensor and check its values before writing any: into a CUDA model (all targets
    // on one GPU) through the GPU file reader, else each by its declared size into host memory.
    let device = targets.first().map(|(_, t)| t.device());
    let data = match (file, device) {
        (Some(path), Some(dev @ Device::Cuda(_))) if targets.iter().all(|(_, t)| t.device() == dev) => {
            let start = std::time::Instant::now();
            let named: Vec<(&str, &reader::Entry)> =
                targets.iter().zip(&sources).map(|((n, _), e)| (n.as_str(), *e)).collect();
            let (ts, how) = files::read_entries(r, path, label, &header, &named, dev, true)?;
            let bytes = sources.iter().map(|e| e.end - e.start).sum();
            let line = files::read_line(label, ts.len(), bytes, dev, how, start.elapsed().as_secs_f64());
            eprintln!("ferrograd: read {line}");
            check_finite(label, targets, &ts, opts)?;
            ReadData::Tensors(ts)
        }
        _ => {
            let mut data = Vec::with_capacity(sources.len());
            for ((name, t), entry) in targets.iter().zip(&sources) {
                let bytes = reader::read_tensor(r, &header, entry, label)?;
                if !opts.allow_nonfinite {
                    if let Some((index, value)) = codec::first_nonfinite(&bytes, t.dtype()) {
                        let name = name.clone();
                        return Err(CheckpointError::NonFinite { path: label.to_string(), name, index, value });
                    }
                }
                data.push(bytes);
            }
            ReadData::Host(data)
        }
    };
    apply(label, plan, &data, optim)
}

/// Write what was read into the plan's targets: the optimizer's scalars first (they validate; on
/// a later failure the old ones are put back), then the tensors, each in place.
fn apply(label: &str, plan: Plan, data: &ReadData, mut optim: Option<&mut dyn Optimizer>) -> CResult<TrainState> {
    let mut previous = None;
    if let (Some(o), Some(om)) = (optim.as_deref_mut(), &plan.optim_meta) {
        let saved = om.get("state").cloned().unwrap_or(serde_json::Value::Null);
        let old = o.state_meta();
        o.load_state_meta(&saved).map_err(|e| metadata_err(label, "optim.state", e))?;
        previous = Some(old);
    }
    let targets = &plan.targets;
    let written = (|| -> CResult<()> {
        match data {
            ReadData::Host(bytes) => {
                for ((_, t), b) in targets.iter().zip(bytes) {
                    t.set(&codec::tensor_from_bytes(b, t.dtype(), t.dims(), t.device())?)?;
                }
            }
            ReadData::Tensors(ts) => {
                for ((_, t), src) in targets.iter().zip(ts) {
                    t.set(src)?;
                }
            }
        }
        Ok(())
    })();
    if let Err(e) = written {
        if let (Some(o), Some(old)) = (optim, previous) {
            // Restoring what was just read back from the optimizer cannot fail meaningfully.
            let _ = o.load_state_meta(&old);
        }
        return Err(e);
    }
    Ok(plan.state)
}
