//! Generation: the prompt goes through the model once (prefill), filling a KV cache; each new
//! token is then one decode step over the cache. Temperature and top-k are applied on the host to
//! the last position's logits; the draw is Philox (`uniform_at(seed, 0, i)` for the i-th new
//! token), so a seed gives the same text on every device.
//!
//! The decode step takes its token and its position from one small device buffer and writes
//! into caches allocated once at full length, attending to the whole cache through a mask built
//! on the device (`Gpt::forward_at`): nothing in it depends on a host value, so on CUDA the step
//! is captured once as a CUDA graph and replayed for every token (PyTorch's "static cache +
//! CUDA graph" decode), one launch instead of a dozen kernels per layer. `SampleConfig::graph`
//! (`gpt sample --no-graph`) runs the same step eagerly; a step that cannot be captured falls
//! back to eager and says why (`Decoder::graph_note`).

use super::model::Gpt;
use ferrograd_core::cuda::{CudaDevice, Graph};
use ferrograd_core::rng::uniform_at;
use ferrograd_core::{no_grad, DType, Device, Error, Result, Tensor};
use ferrograd_nn::amp::autocast_dtype;
use std::time::Instant;

#[derive(Debug, Clone, PartialEq)]
pub struct SampleConfig {
    pub max_new_tokens: usize,
    /// Logits are divided by this; 0 means greedy.
    pub temperature: f64,
    /// Sample among the `k` most likely tokens (1 = greedy); `None`: the whole vocabulary.
    pub top_k: Option<usize>,
    pub seed: u64,
    /// Stop after generating `<|endoftext|>`.
    pub stop_at_eot: bool,
    /// On CUDA, replay the decode step as a CUDA graph (else run it op by op).
    pub graph: bool,
}

impl Default for SampleConfig {
    fn default() -> Self {
        SampleConfig { max_new_tokens: 100, temperature: 1.0, top_k: Some(50), seed: 0, stop_at_eot: true, graph: true }
    }
}

/// Per-layer key and value buffers `[capacity, H, D]`.
pub struct KvCache {
    pub k: Vec<Tensor>,
    pub v: Vec<Tensor>,
    pub len: usize,
}

impl KvCache {
    /// Caches in `dtype` (the dtype the projections write: f32, or the autocast dtype).
    pub fn new(model: &Gpt, capacity: usize, dtype: DType) -> Result<KvCache> {
        let c = &model.config;
        let z = || Tensor::zeros((capacity, c.n_head, c.head_dim()), dtype, model.device());
        Ok(KvCache {
            k: (0..c.n_layer).map(|_| z()).collect::<Result<_>>()?,
            v: (0..c.n_layer).map(|_| z()).collect::<Result<_>>()?,
            len: 0,
        })
    }

    pub fn capacity(&self) -> usize {
        self.k.first().map_or(0, |k| k.dims()[0])
    }
}

/// The decode step's fixed inputs: `io` `[2]` u32 holds the token and its position (one copy per
/// step), `positions` `[capacity]` u32 is `0..capacity` (the attention mask is `positions > pos`).
struct StepInputs {
    io: Tensor,
    positions: Tensor,
}

impl StepInputs {
    /// The step as `Gpt::forward_at` runs it, reading everything from device memory.
    fn forward(&self, model: &Gpt, cache: &KvCache) -> Result<Tensor> {
        let id = self.io.narrow(0, 0, 1)?.reshape((1, 1))?;
        let pos = self.io.narrow(0, 1, 1)?;
        let mask = self.positions.gt(&pos)?.reshape((1, cache.capacity()))?;
        model.forward_at(&id, &pos, &mask, &cache.k, &cache.v)
    }
}

/// How decode steps run.
enum Mode {
    Eager,
    /// Captured at the first step.
    Graph,
    /// The captured step and the logits tensor each replay overwrites.
    Replay(Graph, Tensor),
}

/// A model with its cache and its fixed one-token inputs.
pub struct Decoder<'a> {
    pub model: &'a Gpt,
    pub cache: KvCache,
    inputs: StepInputs,
    mode: Mode,
    graph_note: Option<String>,
}

impl<'a> Decoder<'a> {
    /// A decoder for sequences of up to `capacity` tokens (at most the model's context), whose
    /// decode steps replay a CUDA graph on CUDA.
    pub fn new(model: &'a Gpt, capacity: usize) -> Result<Decoder<'a>> {
        Self::with_graph(model, capacity, true)
    }

    /// As [`Decoder::new`]; `graph: false` runs every decode step op by op.
    pub fn with_graph(model: &'a Gpt, capacity: usize, graph: bool) -> Result<Decoder<'a>> {
        if capacity == 0 || capacity > model.config.n_positions {
            return Err(Error::InvalidArgument(format!(
                "a sequence of {capacity} tokens does not fit the model's context of {}",
                model.config.n_positions
            )));
        }
        let dev = model.device();
        let positions = (0..capacity as u32).collect::<Vec<_>>();
        Ok(Decoder {
            model,
            cache: KvCache::new(model, capacity, autocast_dtype().unwrap_or(DType::F32))?,
            inputs: StepInputs {
                io: Tensor::zeros(2, DType::U32, dev)?,
                positions: Tensor::from_vec(positions, capacity, dev)?,
            },
            mode: if graph && dev.is_cuda() { Mode::Graph } else { Mode::Eager },
            graph_note: None,
        })
    }

    /// Whether decode steps replay a CUDA graph (after the first), and if a capture failed, why not.
    pub fn graph_state(&self) -> (bool, Option<&str>) {
        (!matches!(self.mode, Mode::Eager), self.graph_note.as_deref())
    }

    fn check_ids(&self, ids: &[u32]) -> Result<()> {
        let v = self.model.config.vocab_size;
        if let Some(&bad) = ids.iter().find(|&&t| t as usize >= v) {
            return Err(Error::IndexOutOfRange { op: "gpt sample", index: bad as i64, size: v });
        }
        if self.cache.len + ids.len() > self.cache.capacity() {
            return Err(Error::InvalidArgument(format!(
                "{} tokens do not fit the cache of {} (the model's context)",
                self.cache.len + ids.len(),
                self.cache.capacity()
            )));
        }
        Ok(())
    }

    /// Run `ids` from the current position; the logits `[vocab_size]` (f32) after the last of them.
    pub fn prefill(&mut self, ids: &[u32]) -> Result<Tensor> {
        if ids.is_empty() {
            return Err(Error::InvalidArgument("prefill needs at least one token".into()));
        }
        self.check_ids(ids)?;
        let _g = no_grad();
        let x = Tensor::from_vec(ids.to_vec(), (1, ids.len()), self.model.device())?;
        let l = self.model.forward_cached(&x, self.cache.len, &self.cache.k, &self.cache.v)?;
        self.cache.len += ids.len();
        Ok(l)
    }

    /// One decode step: `id` at the next position; the logits after it. Replaying a graph, the
    /// returned tensor is the graph's output, overwritten by the next step: read it (or copy
    /// it) before stepping again.
    pub fn step(&mut self, id: u32) -> Result<Tensor> {
        self.check_ids(&[id])?;
        let _g = no_grad();
        let dev = self.model.device();
        self.inputs.io.set(&Tensor::from_vec(vec![id, self.cache.len as u32], 2, dev)?)?;
        let l = match (&self.mode, dev) {
            (Mode::Replay(g, out), _) => {
                g.replay()?;
                out.clone()
            }
            (Mode::Graph, Device::Cuda(o)) => {
                let (inputs, model, cache) = (&self.inputs, self.model, &self.cache);
                // One warm-up runs the step (idempotent: the same row gets the same keys and
                // values), then the capture records it and a replay computes this step.
                match Graph::capture(&CudaDevice::get(o)?, 1, || inputs.forward(model, cache)) {
                    Ok((g, out)) => {
                        g.replay()?;
                        self.mode = Mode::Replay(g, out.clone());
                        out
                    }
                    Err(e @ Error::GraphCapture { .. }) => {
                        self.graph_note = Some(format!("decode step not captured ({e}); running it eagerly"));
                        self.mode = Mode::Eager;
                        self.inputs.forward(self.model, &self.cache)?
                    }
                    Err(e) => return Err(e),
                }
            }
            _ => self.inputs.forward(self.model, &self.cache)?,
        };
        self.cache.len += 1;
        Ok(l)
    }
}

/// The token to emit given the logits: the arg-max for `temperature == 0` or `top_k == 1` (the
/// lowest index among ties), else a draw from `softmax(logits / temperature)` restricted to the
/// `top_k` largest, by inverse CDF at `u` in `[0, 1)`.
pub fn choose(logits: &[f32], temperature: f64, top_k: Option<usize>, u: f64) -> Result<u32> {
    if logits.is_empty() {
        return Err(Error::InvalidArgument("no logits to sample from".into()));
    }
    if !(temperature.is_finite() && temperature >= 0.0) {
        return Err(Error::InvalidArgument(format!("--temperature {temperature} must be >= 0")));
    }
    if top_k == Some(0) {
        return Err(Error::InvalidArgument("--top-k must be at least 1".into()));
    }
    if let Some(i) = logits.iter().position(|v| v.is_nan()) {
        return Err(Error::InvalidArgument(format!("the model produced NaN logits (token {i})")));
    }
    // Descending by value, ascending index among equals: a stable, total order.
    let before = |a: &usize, b: &usize| logits[*b].total_cmp(&logits[*a]).then(a.cmp(b));
    if temperature == 0.0 || top_k == Some(1) {
        // The first of that order, in one pass (a decode step of GPT-2 has 50,257 logits).
        let best = (1..logits.len()).fold(0, |m, i| if before(&i, &m).is_lt() { i } else { m });
        return Ok(best as u32);
    }
    let mut order: Vec<usize> = (0..logits.len()).collect();
    let k = top_k.unwrap_or(order.len()).min(order.len());
    if k < order.len() {
        // The k first of the order, then only those sorted.
        order.select_nth_unstable_by(k - 1, before);
        order.truncate(k);
    }
    order.sort_unstable_by(before);
    let top = &order[..k];
    let max = logits[top[0]] as f64;
    let w: Vec<f64> = top.iter().map(|&i| ((logits[i] as f64 - max) / temperature).exp()).collect();
    let total: f64 = w.iter().sum();
    let target = u * total;
    let mut acc = 0.0;
    for (&i, wi) in top.iter().zip(&w) {
        acc += wi;
        if target < acc {
            return Ok(i as u32);
        }
    }
    Ok(top[k - 1] as u32)
}

#[derive(Debug, Clone, Default)]
pub struct GenStats {
    /// The new tokens (the prompt not included).
    pub tokens: Vec<u32>,
    pub prefill_s: f64,
    /// Each decode step's time (its logits read back to the host included), in order: a first
    /// step that compiles or allocates shows here.
    pub step_s: Vec<f64>,
    /// Whether the decode steps replayed a CUDA graph, and why not where a capture failed.
    pub graph: bool,
    pub graph_note: Option<String>,
}

impl GenStats {
    /// Decode steps taken (the first new token comes from the prefill).
    pub fn decode_steps(&self) -> usize {
        self.step_s.len()
    }

    /// Mean decode time per token.
    pub fn ms_per_token(&self) -> Option<f64> {
        (!self.step_s.is_empty()).then(|| 1e3 * self.step_s.iter().sum::<f64>() / self.step_s.len() as f64)
    }

    /// Median decode time per token: the steady state, whatever one-time costs the mean carries.
    pub fn p50_ms(&self) -> Option<f64> {
        let mut s = self.step_s.clone();
        s.sort_by(f64::total_cmp);
        s.get(s.len() / 2).map(|m| 1e3 * m)
    }
}

/// Continue `prompt` (at least one token) by up to `cfg.max_new_tokens`, calling `on_token` with
/// each new token as it is chosen.
pub fn generate(
    model: &Gpt,
    prompt: &[u32],
    cfg: &SampleConfig,
    mut on_token: impl FnMut(u32) -> Result<()>,
) -> Result<GenStats> {
    let capacity = prompt.len() + cfg.max_new_tokens;
    if capacity > model.config.n_positions {
        return Err(Error::InvalidArgument(format!(
            "prompt ({} tokens) + --tokens {} exceed the model's context of {}",
            prompt.len(),
            cfg.max_new_tokens,
            model.config.n_positions
        )));
    }
    let mut dec = Decoder::with_graph(model, capacity.max(1), cfg.graph)?;
    let mut stats = GenStats::default();
    if cfg.max_new_tokens == 0 {
        return Ok(stats);
    }
    let t = Instant::now();
    let mut logits = dec.prefill(prompt)?.to_vec::<f32>()?;
    stats.prefill_s = t.elapsed().as_secs_f64();
    for i in 0..cfg.max_new_tokens {
        let id = choose(&logits, cfg.temperature, cfg.top_k, uniform_at(cfg.seed, 0, i as u64))?;
        stats.tokens.push(id);
        on_token(id)?;
        if (cfg.stop_at_eot && id == super::EOT) || i + 1 == cfg.max_new_tokens {
            break;
        }
        let t = Instant::now();
        logits = dec.step(id)?.to_vec::<f32>()?;
        stats.step_s.push(t.elapsed().as_secs_f64());
    }
    let (graph, note) = dec.graph_state();
    (stats.graph, stats.graph_note) = (graph && !stats.step_s.is_empty(), note.map(str::to_string));
    Ok(stats)
}
