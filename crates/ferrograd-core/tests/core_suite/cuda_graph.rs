//! A training step as the runtime must run it: no host wait after warm-up, captured into a CUDA
//! graph and replayed bit for bit like eager steps, and a capture with a forbidden call failing
//! cleanly. Without a usable GPU the CUDA tests print one line and pass; the CPU test of
//! `adam_step_counted` runs everywhere.

use crate::common;

use common::cuda_device as gpu;
use ferrograd_core::cuda::{is_capturing, Capture, Graph, SyncCounter};
use ferrograd_core::optim::{adam_step, adam_step_counted, AdamConfig};
use ferrograd_core::{DType, Device, Error, Result, Rng, Tensor};

const IN: usize = 24;
const HIDDEN: usize = 40;
const CLASSES: usize = 10;
const VOCAB: usize = 50;
const BATCH: usize = 64;

/// An MLP with an optional embedding in front, trained by AdamW with gradient clipping; every
/// piece of state (parameters, moments, step count) lives on the device.
struct Mlp {
    embed: Option<Tensor>,
    params: Vec<Tensor>,
    m: Vec<Tensor>,
    v: Vec<Tensor>,
    step: Tensor,
    adam: AdamConfig,
}

impl Mlp {
    fn new(seed: u64, embedding: bool, device: Device) -> Result<Mlp> {
        let mut rng = Rng::new(seed);
        let mut params = Vec::new();
        let embed = if embedding {
            let e = Tensor::randn_with(&mut rng, 0.0, 1.0, (VOCAB, IN), DType::F32, device)?.requires_grad();
            params.push(e.clone());
            Some(e)
        } else {
            None
        };
        let out = if embedding { CLASSES } else { IN };
        for (fan_in, fan_out) in [(IN, HIDDEN), (HIDDEN, HIDDEN), (HIDDEN, out)] {
            let b = 1.0 / (fan_in as f64).sqrt();
            params.push(Tensor::rand_with(&mut rng, -b, b, (fan_out, fan_in), DType::F32, device)?.requires_grad());
            params.push(Tensor::rand_with(&mut rng, -b, b, fan_out, DType::F32, device)?.requires_grad());
        }
        let m = params.iter().map(|p| p.zeros_like()).collect::<Result<_>>()?;
        let v = params.iter().map(|p| p.zeros_like()).collect::<Result<_>>()?;
        let step = Tensor::zeros(1, DType::F64, device)?;
        let adam = AdamConfig { lr: 3e-3, weight_decay: 0.01, decoupled: true, ..AdamConfig::default() };
        Ok(Mlp { embed, params, m, v, step, adam })
    }

    fn linears(&self) -> &[Tensor] {
        &self.params[self.embed.is_some() as usize..]
    }

    /// Forward, backward, clipping to global norm 1 (nn's `clip_grad_norm`, on the device) and
    /// AdamW. Without an embedding `x` is `[BATCH, IN]` f32 and the loss is the reconstruction
    /// MSE; with one, `x` holds `[BATCH]` token ids and `y` class ids (cross entropy).
    fn step(&self, x: &Tensor, y: &Tensor) -> Result<Tensor> {
        let mut h = match &self.embed {
            Some(e) => e.embedding(x)?,
            None => x.clone(),
        };
        let layers = self.linears();
        for (i, wb) in layers.chunks(2).enumerate() {
            h = h.matmul(&wb[0].t()?)?.add(&wb[1])?;
            if i + 1 < layers.len() / 2 {
                h = h.relu()?;
            }
        }
        let loss = if self.embed.is_some() { h.cross_entropy(y, None)? } else { h.mse_loss(y)? };
        let grads = loss.backward()?;
        let g = self
            .params
            .iter()
            .map(|p| grads.get(p).cloned().ok_or_else(|| Error::Backward("no gradient".into())))
            .collect::<Result<Vec<_>>>()?;
        let sums = g.iter().map(|g| g.sqr()?.sum_all()).collect::<Result<Vec<_>>>()?;
        let norm = Tensor::stack(&sums, 0)?.sum_all()?.sqrt()?;
        let scale = norm.add_scalar(1e-6)?.recip()?.mul_scalar(1.0)?.clamp(f64::NEG_INFINITY, 1.0)?;
        let g = g.iter().map(|g| g.mul(&scale)).collect::<Result<Vec<_>>>()?;
        adam_step_counted(&self.params, &g, &self.m, &self.v, &self.adam, &self.step)?;
        Ok(loss.detach())
    }

    fn state(&self) -> Result<Vec<Vec<f32>>> {
        let mut out = Vec::new();
        for t in self.params.iter().chain(&self.m).chain(&self.v) {
            out.push(t.to_vec::<f32>()?);
        }
        out.push(vec![self.step.to_vec::<f64>()?[0] as f32]);
        Ok(out)
    }
}

/// `n` batches: (inputs, targets) for the MSE model, (token ids, class ids) for the other.
fn batches(n: usize, embedding: bool, device: Device) -> Result<Vec<(Tensor, Tensor)>> {
    let mut rng = Rng::new(99);
    (0..n)
        .map(|_| {
            if embedding {
                let ids = |k: usize, rng: &mut Rng| {
                    Tensor::rand_with(rng, 0.0, k as f64, BATCH, DType::F32, Device::Cpu)?
                        .to_dtype(DType::U32)?
                        .to_device(device)
                };
                Ok((ids(VOCAB, &mut rng)?, ids(CLASSES, &mut rng)?))
            } else {
                let x = Tensor::randn_with(&mut rng, 0.0, 1.0, (BATCH, IN), DType::F32, device)?;
                Ok((x.clone(), x))
            }
        })
        .collect()
}

/// Steps after warm-up must not make the host wait: counts the waits of one step.
fn host_waits_of_a_step(embedding: bool) -> Result<()> {
    let Some(dev) = gpu() else { return Ok(()) };
    let device = Device::Cuda(dev.ordinal);
    let model = Mlp::new(1, embedding, device)?;
    let data = batches(3, embedding, device)?;
    for (x, y) in &data[..2] {
        model.step(x, y)?;
    }
    dev.synchronize()?;
    let counter = SyncCounter::start();
    let loss = model.step(&data[2].0, &data[2].1)?;
    let calls = counter.calls();
    assert!(calls.is_empty(), "a warmed-up training step made host-waiting driver calls: {calls:?}");
    assert!(loss.item_f64()?.is_finite());
    assert_eq!(counter.calls(), vec![("cuMemcpyDtoH", 1)], "reading the loss is one counted wait");
    Ok(())
}

#[test]
fn mlp_training_step_makes_no_host_wait() -> Result<()> {
    host_waits_of_a_step(false)
}

#[test]
fn embedding_and_cross_entropy_step_makes_no_host_wait() -> Result<()> {
    host_waits_of_a_step(true)
}

/// Warm-up steps and replays of a captured step end exactly where as many eager steps do (within
/// rounding where atomics make the eager steps themselves vary).
fn graph_matches_eager(embedding: bool) -> Result<()> {
    let Some(dev) = gpu() else { return Ok(()) };
    let device = Device::Cuda(dev.ordinal);
    const STEPS: usize = 7;
    const WARMUP: usize = 2;
    let data = batches(STEPS, embedding, device)?;

    let eager = Mlp::new(5, embedding, device)?;
    let mut eager_losses = Vec::new();
    for (x, y) in &data {
        eager_losses.push(eager.step(x, y)?.item_f64()?);
    }

    let model = Mlp::new(5, embedding, device)?;
    // Fixed input buffers, refilled before every warm-up step and replay.
    let (sx, sy) = (data[0].0.zeros_like()?, data[0].1.zeros_like()?);
    let mut capture = Capture::new(&dev)?;
    let mut losses = Vec::new();
    for (x, y) in &data[..WARMUP] {
        sx.set(x)?;
        sy.set(y)?;
        losses.push(capture.warmup(|| model.step(&sx, &sy))?.item_f64()?);
    }
    let before = dev.memory_stats().device_allocs;
    let (graph, loss) = capture.capture(|| model.step(&sx, &sy))?;
    assert_eq!(dev.memory_stats().device_allocs, before, "the capture allocated from the driver");
    assert!(!is_capturing());
    for (x, y) in &data[WARMUP..] {
        sx.set(x)?;
        sy.set(y)?;
        graph.replay()?;
        losses.push(loss.item_f64()?);
    }
    let (a, b) = (eager.state()?, model.state()?);
    if embedding {
        // The embedding's backward adds rows with atomics, whose order varies from run to run.
        let close = |x: f64, y: f64| (x - y).abs() <= 1e-4 * y.abs().max(1e-3);
        for (l, e) in losses.iter().zip(&eager_losses) {
            assert!(close(*l, *e), "losses {losses:?} vs eager {eager_losses:?}");
        }
        for (i, (a, b)) in a.iter().zip(&b).enumerate() {
            assert!(a.iter().zip(b).all(|(x, y)| close(*x as f64, *y as f64)), "state tensor {i}");
        }
    } else {
        assert_eq!(losses, eager_losses, "losses step by step");
        for (i, (a, b)) in a.iter().zip(&b).enumerate() {
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(a), bits(b), "state tensor {i} differs after {STEPS} steps");
        }
    }
    assert_eq!(b.last(), Some(&vec![STEPS as f32]), "the device step count");
    drop(graph);
    drop(capture);
    // The pool went back with the graph; the device works on.
    let x = Tensor::ones(1000, DType::F32, device)?;
    assert_eq!(x.sum_all()?.item_f64()?, 1000.0);
    Ok(())
}

#[test]
fn replayed_mlp_step_matches_eager_steps_bit_for_bit() -> Result<()> {
    graph_matches_eager(false)
}

#[test]
fn replayed_embedding_cross_entropy_step_matches_eager_steps() -> Result<()> {
    graph_matches_eager(true)
}

/// The call a failed capture names.
fn refused<T>(r: Result<(Graph, T)>) -> &'static str {
    match r {
        Err(Error::GraphCapture { call }) => call,
        Err(e) => panic!("expected a GraphCapture error, got {e}"),
        Ok(_) => panic!("expected a GraphCapture error, the capture succeeded"),
    }
}

#[test]
fn forbidden_calls_fail_the_capture_and_the_device_recovers() -> Result<()> {
    let Some(dev) = gpu() else { return Ok(()) };
    let device = Device::Cuda(dev.ordinal);
    let x = Tensor::randn_with(&mut Rng::new(3), 0.0, 1.0, 1000, DType::F32, device)?;
    let want: Vec<f32> = x.to_vec::<f32>()?.iter().map(|v| 2.0 * v).collect();
    let mut capture = Capture::new(&dev)?;
    capture.warmup(|| x.mul_scalar(2.0))?;
    // A host read, returned as the error ...
    let r = capture.capture(|| x.mul_scalar(2.0)?.to_vec::<f32>());
    assert_eq!(refused(r), "cuMemcpyDtoH");
    // ... or swallowed by the closure: the capture still fails.
    let r = capture.capture(|| {
        let y = x.mul_scalar(2.0)?;
        let _ignored = y.to_vec::<f32>();
        Ok(y)
    });
    assert_eq!(refused(r), "cuMemcpyDtoH");
    // An allocation the pool cannot serve.
    let r = capture.capture(|| Tensor::zeros(64 << 20, DType::F32, device));
    assert_eq!(refused(r), "cuMemAlloc");
    // A synchronize and an upload from host memory.
    assert_eq!(refused(capture.capture(|| device.synchronize())), "cuCtxSynchronize");
    let r = capture.capture(|| Tensor::from_vec(vec![1f32; 10], 10, device));
    assert_eq!(refused(r), "cuMemcpyHtoDAsync(pageable)");
    assert!(!is_capturing());
    // The device and the same capture work on.
    assert_eq!(x.mul_scalar(2.0)?.to_vec::<f32>()?, want);
    let (graph, y) = capture.capture(|| x.mul_scalar(2.0))?;
    graph.replay()?;
    assert_eq!(y.to_vec::<f32>()?, want);
    Ok(())
}

#[test]
fn graph_outputs_follow_refilled_inputs() -> Result<()> {
    let Some(dev) = gpu() else { return Ok(()) };
    let device = Device::Cuda(dev.ordinal);
    let mut rng = Rng::new(4);
    let input = Tensor::zeros((32, 16), DType::F32, device)?;
    let w = Tensor::randn_with(&mut rng, 0.0, 1.0, (16, 8), DType::F32, device)?;
    let f = || input.matmul(&w)?.relu()?.sum(1, true);
    let (graph, out) = Graph::capture(&dev, 1, f)?;
    for _ in 0..3 {
        let x = Tensor::randn_with(&mut rng, 0.0, 1.0, (32, 16), DType::F32, device)?;
        input.set(&x)?;
        graph.replay()?;
        let want = x.matmul(&w)?.relu()?.sum(1, true)?;
        assert_eq!(out.to_vec::<f32>()?, want.to_vec::<f32>()?);
    }
    Ok(())
}

/// The device-counted Adam is `adam_step` bit for bit, on every device present.
#[test]
fn counted_adam_equals_adam_step() -> Result<()> {
    let mut devices = vec![Device::Cpu];
    if let Some(d) = gpu() {
        devices.push(Device::Cuda(d.ordinal));
    }
    for device in devices {
        let mut rng = Rng::new(8);
        let shapes = [(7usize, 5usize), (1, 33), (64, 3)];
        let init = |rng: &mut Rng| -> Result<Vec<Tensor>> {
            shapes.iter().map(|&s| Tensor::randn_with(rng, 0.0, 1.0, s, DType::F32, device)).collect()
        };
        let (p0, m0, v0) = (init(&mut rng)?, init(&mut rng)?, init(&mut rng)?);
        let v0: Vec<Tensor> = v0.iter().map(|v| v.abs()).collect::<Result<_>>()?;
        let copy = |ts: &[Tensor]| -> Result<Vec<Tensor>> {
            ts.iter()
                .map(|t| {
                    let c = t.zeros_like()?;
                    c.set(t)?;
                    Ok(c)
                })
                .collect()
        };
        let (pa, ma, va) = (copy(&p0)?, copy(&m0)?, copy(&v0)?);
        let (pb, mb, vb) = (copy(&p0)?, copy(&m0)?, copy(&v0)?);
        let c = AdamConfig { lr: 1e-2, weight_decay: 0.1, decoupled: true, ..AdamConfig::default() };
        let step = Tensor::full(40.0, 1, DType::F64, device)?;
        for k in 41..=44u64 {
            let g = init(&mut rng)?;
            adam_step(&pa, &g, &ma, &va, &c, k)?;
            adam_step_counted(&pb, &g, &mb, &vb, &c, &step)?;
        }
        assert_eq!(step.to_vec::<f64>()?, vec![44.0]);
        for (a, b) in pa.iter().chain(&ma).chain(&va).zip(pb.iter().chain(&mb).chain(&vb)) {
            let bits =
                |t: &Tensor| -> Result<Vec<u32>> { Ok(t.to_vec::<f32>()?.iter().map(|x| x.to_bits()).collect()) };
            assert_eq!(bits(a)?, bits(b)?, "on {device}");
        }
        let bad = Tensor::zeros(1, DType::F32, device)?;
        assert!(matches!(adam_step_counted(&pa, &pa, &ma, &va, &c, &bad), Err(Error::InvalidArgument(_))));
    }
    Ok(())
}

/// The test model itself, on the CPU (runs everywhere): both variants train.
#[test]
fn test_models_train_on_the_cpu() -> Result<()> {
    for embedding in [false, true] {
        let model = Mlp::new(2, embedding, Device::Cpu)?;
        let data = batches(1, embedding, Device::Cpu)?;
        let first = model.step(&data[0].0, &data[0].1)?.item_f64()?;
        let mut last = first;
        for _ in 0..30 {
            last = model.step(&data[0].0, &data[0].1)?.item_f64()?;
        }
        assert!(last.is_finite() && last < first, "embedding {embedding}: loss {first} -> {last}");
        assert_eq!(model.step.to_vec::<f64>()?, vec![31.0]);
    }
    Ok(())
}
