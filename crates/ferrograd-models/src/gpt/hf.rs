//! GPT-2 weights in Hugging Face's formats: reading any `GPT2LMHeadModel`/`GPT2Model` safetensors
//! file (names with or without the `transformer.` prefix, `lm_head.weight` present or tied away,
//! the `attn.bias`/`attn.masked_bias` mask buffers skipped, f32/f16/bf16 values), our training
//! checkpoints (their optimizer entries ignored), and writing what `from_pretrained` reads: a
//! directory with `config.json` and `model.safetensors` (metadata `format: pt`).

use super::config::GptConfig;
use super::model::{Gpt, PREFIX};
use ferrograd_core::{DType, Device, Error, Result, Tensor};
use ferrograd_nn::checkpoint::{self, Loaded, ReadOptions};
use safetensors::Dtype as StDtype;
use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};

/// Metadata key holding the model's `GptConfig` (JSON) in files we write.
pub const CONFIG_KEY: &str = "gpt_config";
/// The same under a training checkpoint's `extra.` namespace (`ferrograd_nn::checkpoint`).
pub const CHECKPOINT_CONFIG_KEY: &str = "extra.gpt_config";

fn file_err(path: &Path, msg: impl Into<String>) -> Error {
    Error::File { path: path.display().to_string(), msg: msg.into() }
}

/// A weights file and, for a `save_pretrained` directory, its `config.json`.
#[derive(Debug, Clone)]
pub struct Source {
    pub weights: PathBuf,
    pub config_json: Option<PathBuf>,
}

impl Source {
    /// `path` is a `.safetensors` file or a directory holding `model.safetensors` (and usually
    /// `config.json`).
    pub fn locate(path: &Path) -> Result<Source> {
        if path.is_dir() {
            let weights = path.join("model.safetensors");
            if !weights.is_file() {
                let sharded = path.join("model.safetensors.index.json").is_file();
                return Err(file_err(
                    path,
                    if sharded {
                        "holds a sharded checkpoint (model.safetensors.index.json); save it unsharded \
                         (save_pretrained(..., max_shard_size=\"100GB\"))"
                            .to_string()
                    } else {
                        "no model.safetensors in this directory (pytorch_model.bin is not read: save with \
                         safe_serialization=True)"
                            .to_string()
                    },
                ));
            }
            let cj = path.join("config.json");
            return Ok(Source { weights, config_json: cj.is_file().then_some(cj) });
        }
        if !path.exists() {
            return Err(file_err(path, "no such file or directory"));
        }
        Ok(Source { weights: path.to_path_buf(), config_json: None })
    }
}

/// A name as this model knows it (without the `transformer.` prefix), or `None` for entries a
/// GPT-2 file may hold that are not parameters here.
fn canonical(name: &str) -> Option<&str> {
    if name.starts_with(checkpoint::OPTIM_PREFIX) || name == "lm_head.weight" {
        return None;
    }
    let n = name.strip_prefix("transformer.").unwrap_or(name);
    if n.ends_with(".attn.bias") || n.ends_with(".attn.masked_bias") {
        return None;
    }
    Some(n)
}

/// The config of a weights source: `config.json`, else the metadata we write, else inferred from
/// the tensor shapes with GPT-2's head size of 64 (the returned note says so).
pub fn read_config(src: &Source) -> Result<(GptConfig, String)> {
    if let Some(cj) = &src.config_json {
        let text = std::fs::read_to_string(cj).map_err(|e| file_err(cj, format!("cannot read: {e}")))?;
        let v: serde_json::Value = serde_json::from_str(&text).map_err(|e| file_err(cj, format!("not JSON: {e}")))?;
        let cfg = GptConfig::from_hf_json(&v).map_err(|e| file_err(cj, e.to_string()))?;
        return Ok((cfg, format!("config from {}", cj.display())));
    }
    // The header only: the metadata and the tensors' shapes say all there is to say.
    let header = checkpoint::read_safetensors_header(&src.weights)?;
    let meta = &header.metadata;
    if let Some(s) = meta.get(CONFIG_KEY).or_else(|| meta.get(CHECKPOINT_CONFIG_KEY)) {
        let cfg: GptConfig =
            serde_json::from_str(s).map_err(|e| file_err(&src.weights, format!("metadata {CONFIG_KEY}: {e}")))?;
        cfg.validate()?;
        return Ok((cfg, "config from the file's metadata".into()));
    }
    let shape = |n: &str| -> Option<Vec<usize>> {
        let t = &header.tensors;
        t.get(n).or_else(|| t.get(&format!("transformer.{n}"))).map(|e| e.shape.clone())
    };
    let (Some(wte), Some(wpe)) = (shape("wte.weight"), shape("wpe.weight")) else {
        return Err(file_err(&src.weights, "no wte.weight / wpe.weight: not a GPT-2 checkpoint"));
    };
    let n_layer = (0..).take_while(|i| shape(&format!("h.{i}.ln_1.weight")).is_some()).count();
    let n_embd = wte.get(1).copied().unwrap_or(0);
    let cfg = GptConfig {
        vocab_size: wte[0],
        n_positions: wpe[0],
        n_layer,
        n_head: (n_embd / 64).max(1),
        n_embd,
        layer_norm_epsilon: 1e-5,
    };
    cfg.validate()?;
    Ok((cfg, format!("no config.json: inferred {n_layer} layers, {} heads of 64", cfg.n_head)))
}

/// The tensors of `path` that `only` accepts (all, with `None`) read onto `device` in one pass
/// (`load_safetensors_with`: no host copy of the file). The line naming the read path is printed
/// for GPU reads, where it tells cuFile from the pinned reads; a CPU read has one path and stays
/// quiet, as `checkpoint::load` does (a command that fails later keeps its one `error:` line).
pub(crate) fn read_onto(path: &Path, device: Device, only: Option<&dyn Fn(&str) -> bool>) -> Result<Loaded> {
    let opts = ReadOptions { only, log: device.is_cuda(), ..ReadOptions::default() };
    Ok(checkpoint::load_safetensors_with(path, device, opts)?)
}

/// Load every parameter of `model` from `path` in place. Names, shapes and dtypes are checked in
/// the header before anything is read; then only the parameters' tensors are read, straight onto
/// the model's device (`read_onto`), and cast to the parameters' dtype there (f16, bf16 and f64
/// files). The padded rows of `wte` are left as they are (zero).
pub fn load_weights(model: &Gpt, path: &Path) -> Result<()> {
    let header = checkpoint::read_safetensors_header(path)?;
    let want: BTreeMap<String, Tensor> = model
        .hf_params()?
        .into_iter()
        .map(|(n, t)| (n.strip_prefix(&format!("{PREFIX}.")).unwrap_or(&n).to_string(), t))
        .collect();
    // Each parameter's name in the file.
    let mut found: BTreeMap<&str, &str> = BTreeMap::new();
    for (name, e) in &header.tensors {
        if name == "lm_head.weight" {
            let expect = [model.config.vocab_size, model.config.n_embd];
            if e.shape != expect {
                return Err(file_err(path, format!("lm_head.weight has shape {:?}, expected {expect:?}", e.shape)));
            }
            continue; // tied to wte
        }
        let Some(key) = canonical(name) else { continue };
        let Some(t) = want.get(key) else {
            return Err(file_err(path, format!("tensor {name} is not a parameter of this GPT-2 model")));
        };
        if e.shape != t.dims() {
            return Err(file_err(path, format!("tensor {name} has shape {:?}, expected {:?}", e.shape, t.dims())));
        }
        if !e.dtype.is_some_and(|d| d.is_float()) {
            let d = &e.dtype_name;
            return Err(file_err(path, format!("tensor {name} has dtype {d}; GPT-2 weights are float")));
        }
        if found.insert(key, name).is_some() {
            return Err(file_err(path, format!("tensor {key} appears both with and without the transformer. prefix")));
        }
    }
    if let Some(missing) = want.keys().find(|k| !found.contains_key(k.as_str())) {
        return Err(file_err(path, format!("tensor {missing} is missing (with or without the transformer. prefix)")));
    }
    let params = |n: &str| canonical(n).is_some();
    let loaded = read_onto(path, model.wte.device(), Some(&params))?;
    for (key, name) in found {
        let (Some(t), Some(src)) = (want.get(key), loaded.tensors.get(name)) else {
            return Err(file_err(path, format!("tensor {name} was not read")));
        };
        t.set(&src.to_dtype(t.dtype())?)?;
    }
    Ok(())
}

/// A model with the weights of `path` (a file or a `save_pretrained` directory) on `device`, and a
/// line saying where its config came from.
pub fn from_pretrained(path: &Path, device: Device) -> Result<(Gpt, String)> {
    let src = Source::locate(path)?;
    let (cfg, note) = read_config(&src)?;
    let model = Gpt::zeroed(cfg, device)?;
    load_weights(&model, &src.weights)?;
    Ok((model, note))
}

/// One tensor's dtype, shape and little-endian bytes, for `safetensors::serialize` (this file's
/// f32 weights; the int8 file's i8 values and f32 scales, `quant.rs`).
pub(crate) struct Blob(pub StDtype, pub Vec<usize>, pub Vec<u8>);

impl safetensors::View for &Blob {
    fn dtype(&self) -> StDtype {
        self.0
    }
    fn shape(&self) -> &[usize] {
        &self.1
    }
    fn data(&self) -> std::borrow::Cow<'_, [u8]> {
        std::borrow::Cow::Borrowed(&self.2)
    }
    fn data_len(&self) -> usize {
        self.2.len()
    }
}

/// `t`'s values as an f32 [`Blob`].
pub(crate) fn f32_blob(t: &Tensor) -> Result<Blob> {
    let v = t.to_dtype(DType::F32)?.to_vec::<f32>()?;
    Ok(Blob(StDtype::F32, t.dims().to_vec(), v.iter().flat_map(|x| x.to_le_bytes()).collect()))
}

/// Bytes of a weights-only safetensors file: Hugging Face names with the prefix, no `lm_head`
/// (tied), `wte` with the real vocabulary, metadata `format: pt` and our config.
pub fn weights_bytes(model: &Gpt) -> Result<Vec<u8>> {
    let mut blobs = Vec::new();
    for (n, t) in model.hf_params()? {
        blobs.push((n, f32_blob(&t)?));
    }
    let mut meta = HashMap::new();
    meta.insert("format".to_string(), "pt".to_string());
    meta.insert(
        CONFIG_KEY.to_string(),
        serde_json::to_string(&model.config).map_err(|e| Error::InvalidArgument(e.to_string()))?,
    );
    checkpoint::serialize_safetensors(blobs.iter().map(|(n, b)| (n.as_str(), b)), Some(meta))
        .map_err(|e| Error::InvalidArgument(format!("serialising weights: {e}")))
}

/// Write the weights-only file atomically.
pub fn save_weights(model: &Gpt, path: &Path) -> Result<()> {
    let bytes = weights_bytes(model)?;
    checkpoint::write_atomic(path, &bytes).map_err(|e| file_err(path, format!("writing: {e}")))
}

/// What `GPT2LMHeadModel.from_pretrained(dir)` reads: `dir/config.json` and `dir/model.safetensors`.
pub fn save_pretrained(model: &Gpt, dir: &Path) -> Result<()> {
    std::fs::create_dir_all(dir).map_err(|e| file_err(dir, format!("creating: {e}")))?;
    save_weights(model, &dir.join("model.safetensors"))?;
    let cfg =
        serde_json::to_string_pretty(&model.config.to_hf_json()).map_err(|e| Error::InvalidArgument(e.to_string()))?;
    let p = dir.join("config.json");
    checkpoint::write_atomic(&p, cfg.as_bytes()).map_err(|e| file_err(&p, format!("writing: {e}")))
}
