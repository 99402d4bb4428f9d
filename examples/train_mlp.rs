//! Training an MLP classifier the way a real run does: a prefetching data loader, AdamW with a
//! warm-up + cosine learning-rate schedule, gradient clipping, mixed precision (bf16 autocast, or
//! f16 with a dynamic loss scaler), and a checkpoint halfway that a fresh process resumes from,
//! reaching the very same weights as the run that never stopped.
//!
//! ```sh
//! cargo run --release --example train_mlp
//! cargo run --release --example train_mlp -- --device cpu --steps 40 --samples 1024
//! cargo run --release --example train_mlp -- --amp f16     # or bf16 (default on a GPU), off
//! ```
//!
//! The task: points in the square [-1, 1]^2, labelled by the ring their radius falls in (three
//! classes). The model: `Linear(2, H) GELU Linear(H, H) GELU Linear(H, 3)`.

use ferrograd_core::{DType, Device, Error, Result, Rng, Tensor};
use ferrograd_examples::{arg, arg_or};
use ferrograd_nn::amp::{autocast, GradScaler, GradScalerConfig};
use ferrograd_nn::checkpoint::{self, TrainState};
use ferrograd_nn::data::{DataLoader, LoaderConfig, TensorDataset};
use ferrograd_nn::optim::{adamw, clip_grad_norm, Adam, LrSchedule, Optimizer};
use ferrograd_nn::{mlp_on, Activation, Module, Sequential};
use std::sync::Arc;

/// Everything one run needs; what a checkpoint must restore.
struct Run {
    model: Sequential,
    opt: Adam,
    scaler: GradScaler,
    /// Optimizer steps taken.
    step: u64,
    /// Where the next batch comes from: epoch and batch index within it.
    epoch: u64,
    next_batch: usize,
}

struct Settings {
    hidden: usize,
    steps: u64,
    /// Low precision for the matmuls: `None` trains in f32.
    amp: Option<DType>,
    schedule: LrSchedule,
}

fn main() -> Result<()> {
    let dev = ferrograd_examples::device()?;
    let samples: usize = arg_or("samples", 8192)?;
    let batch: usize = arg_or("batch", 256)?;
    let steps: u64 = arg_or("steps", 400)?;
    let amp = match arg("amp").as_deref() {
        None if dev.is_cuda() => Some(DType::BF16),
        None | Some("off") => None,
        Some("bf16") => Some(DType::BF16),
        Some("f16") => Some(DType::F16),
        Some(other) => return Err(Error::InvalidArgument(format!("--amp {other}: expected bf16, f16 or off"))),
    };
    let s = Settings {
        hidden: arg_or("hidden", 64)?,
        steps,
        amp,
        // PyTorch's usual shape: a linear warm-up to the peak, half a cosine down to a tenth.
        schedule: LrSchedule::WarmupCosine { peak: 1e-2, warmup: steps / 10, total: steps, min: 1e-3 },
    };
    println!("{samples} samples, batch {batch}, {steps} steps, mixed precision: {amp:?}");

    // ---- data ------------------------------------------------------------------------------------
    // The dataset lives on the CPU; the loader's thread gathers batches, pins them when the target
    // is a GPU and copies the next batch while the current step runs.
    let (x, y) = rings(samples, &mut Rng::new(0))?;
    let dataset = Arc::new(TensorDataset::new(vec![x, y])?);
    let cfg =
        LoaderConfig { batch_size: batch, shuffle: true, seed: 1, drop_last: true, device: dev, ..Default::default() };
    let loader = DataLoader::new(dataset, cfg)?;

    // ---- one run from start to end ---------------------------------------------------------------
    println!("-- an uninterrupted run");
    let mut full = new_run(&s, dev)?;
    train(&mut full, &s, &loader, steps)?;

    // ---- the same run, stopped halfway and resumed from a checkpoint -----------------------------
    let path = std::env::temp_dir().join(format!("ferrograd-train-mlp-{}.safetensors", std::process::id()));
    println!("-- the same run, stopped halfway");
    let mut first = new_run(&s, dev)?;
    train(&mut first, &s, &loader, steps / 2)?;
    save(&first, &path)?;
    drop(first); // as if the process had ended

    // A fresh model and optimizer (their initial values do not matter: loading overwrites them).
    let mut resumed = new_run(&s, dev)?;
    load(&mut resumed, &path)?;
    println!("-- resumed in a fresh model and optimizer from {} at step {}", path.display(), resumed.step);
    train(&mut resumed, &s, &loader, steps)?;
    let _ = std::fs::remove_file(&path);

    // ---- the resumed run ends where the uninterrupted one did ------------------------------------
    let mut max_diff = 0f64;
    for ((name, a), (_, b)) in full.model.named_parameters().iter().zip(resumed.model.named_parameters()) {
        for (u, v) in a.to_f64_vec()?.iter().zip(b.to_f64_vec()?) {
            max_diff = max_diff.max((u - v).abs());
        }
        println!("  {name}: {:?}", a.dims());
    }
    let acc = accuracy(&full.model, &loader)?;
    println!("accuracy {:.1}%; resumed vs uninterrupted weights: max |difference| = {max_diff:e}", 100.0 * acc);
    if max_diff != 0.0 {
        return Err(Error::InvalidArgument(format!(
            "the resumed run differs from the uninterrupted one by {max_diff:e}"
        )));
    }
    Ok(())
}

/// `n` points uniform in [-1, 1]^2 and their class: 0 inside radius 0.5, 1 inside 0.8, else 2.
fn rings(n: usize, rng: &mut Rng) -> Result<(Tensor, Tensor)> {
    let x = Tensor::rand_with(rng, -1.0, 1.0, (n, 2), DType::F32, Device::Cpu)?;
    let r2 = x.sqr()?.sum(1, false)?; // [n]
    let beyond = |r: f64| r2.gt(&r2.scalar_like(r * r)?)?.to_dtype(DType::U32); // 0 or 1
    let y = beyond(0.5)?.add(&beyond(0.8)?)?;
    Ok((x, y))
}

fn new_run(s: &Settings, dev: Device) -> Result<Run> {
    // Parameters are f32 whatever the autocast dtype: they are the master weights.
    let model = mlp_on(&[2, s.hidden, s.hidden, 3], Activation::Gelu, &mut Rng::new(2), dev)?;
    let opt = adamw(model.named_parameters(), 1e-2, 0.01)?;
    // f16 gradients underflow without loss scaling; bf16 has f32's range and needs none.
    let enabled = s.amp == Some(DType::F16);
    let scaler = GradScaler::new(GradScalerConfig { enabled, ..Default::default() })?;
    Ok(Run { model, opt, scaler, step: 0, epoch: 0, next_batch: 0 })
}

/// Train `run` until it has taken `until` optimizer steps.
fn train(run: &mut Run, s: &Settings, loader: &DataLoader, until: u64) -> Result<()> {
    let params = run.model.parameters();
    let mut batches = loader.epoch_from(run.epoch, run.next_batch);
    while run.step < until {
        let batch = match batches.next() {
            Some(b) => b?,
            None => {
                // End of an epoch: the next one has its own shuffle (a function of seed and epoch).
                run.epoch += 1;
                run.next_batch = 0;
                batches = loader.epoch(run.epoch);
                continue;
            }
        };
        run.next_batch = batch.index + 1;
        let (x, y) = (&batch.tensors[0], &batch.tensors[1]);

        s.schedule.apply(&mut run.opt, run.step);
        let logits = {
            // Inside the scope the linears run their matmuls in bf16/f16 and return f32.
            let _autocast = s.amp.map(autocast).transpose()?;
            run.model.forward(x)?
        };
        let loss = logits.cross_entropy(y, None)?;
        let mut grads = run.scaler.scale_loss(&loss)?.backward()?;
        run.scaler.unscale(&mut grads, &params)?; // before clipping: clip the true gradients
        clip_grad_norm(&mut grads, &params, 1.0)?;
        run.scaler.step(&mut run.opt, &mut grads)?; // skips the step if a gradient overflowed
        run.step += 1;

        if run.step.is_multiple_of(50) || run.step == s.steps {
            // Reading the loss waits for the device: do it only when printing.
            println!("step {:4}  lr {:.5}  loss {:.4}", run.step, run.opt.lr(), loss.item_f64()?);
        }
    }
    Ok(())
}

/// Model, optimizer state, step, data position and loss-scaler state, in one safetensors file.
fn save(run: &Run, path: &std::path::Path) -> Result<()> {
    let mut state = TrainState { step: run.step, ..Default::default() };
    state.extra.insert("epoch".into(), run.epoch.to_string());
    state.extra.insert("next_batch".into(), run.next_batch.to_string());
    let sc = run.scaler.state();
    state.extra.insert("scaler".into(), format!("{} {} {}", sc.scale, sc.growth_tracker, sc.skipped));
    checkpoint::save(path, &run.model, Some(&run.opt), &state)?;
    Ok(())
}

fn load(run: &mut Run, path: &std::path::Path) -> Result<()> {
    let state = checkpoint::load(path, &run.model, Some(&mut run.opt))?;
    let get =
        |k: &str| state.extra.get(k).cloned().ok_or_else(|| Error::InvalidArgument(format!("checkpoint lacks {k}")));
    let bad = |k: &str| Error::InvalidArgument(format!("checkpoint entry {k} is malformed"));
    run.step = state.step;
    run.epoch = get("epoch")?.parse().map_err(|_| bad("epoch"))?;
    run.next_batch = get("next_batch")?.parse().map_err(|_| bad("next_batch"))?;
    let sc = get("scaler")?;
    let f: Vec<&str> = sc.split(' ').collect();
    let mut st = run.scaler.state();
    if let [scale, growth, skipped] = f[..] {
        st.scale = scale.parse().map_err(|_| bad("scaler"))?;
        st.growth_tracker = growth.parse().map_err(|_| bad("scaler"))?;
        st.skipped = skipped.parse().map_err(|_| bad("scaler"))?;
    } else {
        return Err(bad("scaler"));
    }
    run.scaler.load_state(st)
}

/// Fraction of one epoch's samples classified right (evaluation: no graph is recorded).
fn accuracy(model: &Sequential, loader: &DataLoader) -> Result<f64> {
    let _no_grad = ferrograd_core::no_grad();
    let (mut right, mut total) = (0.0, 0usize);
    for batch in loader.epoch(0) {
        let batch = batch?;
        let pred = model.forward(&batch.tensors[0])?.argmax(-1, false)?; // u32 class ids
        right += pred.eq(&batch.tensors[1])?.to_dtype(DType::F32)?.sum_all()?.item_f64()?;
        total += batch.len();
    }
    Ok(right / total.max(1) as f64)
}
