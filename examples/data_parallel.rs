//! Data-parallel training with `ferrograd_dist::DataParallel`: one process (or thread) per rank,
//! each computing the loss of its slice of every global batch; gradients are averaged across the
//! ranks while backward runs, so every rank takes the same optimizer step and the weights stay
//! identical everywhere.
//!
//! ```sh
//! # On GPUs, one process per GPU over NCCL (torchrun's variables; build first, then launch):
//! cargo build --release --example data_parallel
//! cargo run --release -- launch --nproc-per-node 2 -- target/release/examples/data_parallel
//! # Anywhere: a single process (a world of one), with or without the launcher.
//! cargo run --example data_parallel -- --device cpu
//! # On the CPU with 2 ranks as threads of one process (the in-process communicator the tests use);
//! # it also checks the result against one rank training on the whole batch.
//! cargo run --example data_parallel -- --threads 2
//! ```

use ferrograd_core::{DType, Device, GradStore, Result, Rng, Tensor};
use ferrograd_dist::testing::run_ranks;
use ferrograd_dist::{shard_range, DataParallel, DpConfig, ProcessGroup};
use ferrograd_examples::{arg, arg_or};
use ferrograd_nn::optim::{AdamConfig, Optimizer};
use ferrograd_nn::{mlp_on, Activation, Module};

const GLOBAL_BATCH: usize = 64;

fn main() -> Result<()> {
    let steps: usize = arg_or("steps", 50)?;
    let threads: usize = arg_or("threads", 0)?;
    if threads > 0 {
        // Every rank runs `train` on its own thread; `run_ranks` hands each a communicator.
        let results = run_ranks(threads, |comm| train(&ProcessGroup::with_comm(comm), steps));
        let weights = results.into_iter().collect::<Result<Vec<_>>>()?;
        let same = weights.windows(2).all(|w| w[0] == w[1]);
        println!("{threads} ranks hold identical weights: {same}");
        // One rank seeing the whole batch takes the same steps, up to float rounding (the ranks
        // sum their halves in a different order).
        let single = train(&ProcessGroup::single(Device::Cpu), steps)?;
        let diff = weights[0].iter().zip(&single).map(|(a, b)| (a - b).abs()).fold(0.0, f64::max);
        println!("max |difference| from a single process on the full batch: {diff:.2e}");
        if !same || diff > 1e-4 {
            return Err(ferrograd_core::Error::InvalidArgument("data parallel diverged from one process".into()));
        }
        return Ok(());
    }
    // Without launcher variables this is a world of one on `--device` (or the best device); under
    // `ferrograd launch`, torchrun or srun, rank RANK of WORLD_SIZE on cuda:LOCAL_RANK over NCCL.
    let pg = match arg("device") {
        Some(d) if std::env::var_os("WORLD_SIZE").is_none() => ProcessGroup::single(d.parse()?),
        _ => ProcessGroup::init()?,
    };
    train(&pg, steps)?;
    Ok(())
}

/// Train a small regression MLP for `steps` steps on this rank's slices; returns the final
/// weights (flattened, f64) so callers can compare ranks.
fn train(pg: &ProcessGroup, steps: usize) -> Result<Vec<f64>> {
    let (rank, world, dev) = (pg.rank(), pg.world_size(), pg.device());
    if pg.is_main() {
        println!("{world} rank(s), rank 0 on {dev}");
    }
    // The same seed everywhere; DataParallel also broadcasts rank 0's weights when it is built.
    let model = mlp_on(&[8, 32, 1], Activation::Tanh, &mut Rng::new(0), dev)?;
    let adam = AdamConfig { lr: 3e-3, ..Default::default() };
    // Gradients travel in 25 MiB buckets (PyTorch DDP's default), averaged in f32.
    let mut opt = DataParallel::with_adam(pg.comm(), model.named_parameters(), adam, DpConfig::default())?;

    // Every rank draws the same global batches and keeps rows [rank * B / N, (rank + 1) * B / N).
    let mine = shard_range(GLOBAL_BATCH, rank, world)?;
    let mut data_rng = Rng::new(1);
    for step in 0..steps {
        let x = Tensor::randn_with(&mut data_rng, 0.0, 1.0, (GLOBAL_BATCH, 8), DType::F32, Device::Cpu)?;
        let y = x.sin()?.sum(1, true)?; // a smooth target of shape [B, 1]
        let (x, y) = (
            x.narrow(0, mine.start, mine.len())?.to_device(dev)?,
            y.narrow(0, mine.start, mine.len())?.to_device(dev)?,
        );

        let loss = model.forward(&x)?.mse_loss(&y)?;
        let mut grads = GradStore::default();
        // `true`: the last micro-step before `step`, so the buckets are all-reduced during this
        // backward (with gradient accumulation, pass false for the earlier micro-batches).
        opt.backward(&loss, &mut grads, true)?;
        opt.step(&grads)?;
        if pg.is_main() && (step + 1).is_multiple_of(10) {
            println!("step {:3}  loss (rank 0's slice) {:.5}", step + 1, loss.item_f64()?);
        }
    }
    let mut weights = vec![];
    for p in model.parameters() {
        weights.extend(p.to_f64_vec()?);
    }
    Ok(weights)
}
