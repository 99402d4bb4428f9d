//! What the `gpt train` data-parallel tests over the thread communicator share (gpt_dp.rs,
//! gpt_zero.rs): a tiny model, token shards, run settings and parameter comparisons.

use ferrograd_core::DType;
use ferrograd_core::Device;
use ferrograd_dist::DpConfig;
use ferrograd_models::gpt::shards::write_shard;
use ferrograd_models::gpt::train::{BatchSize, Precision, Run, TrainConfig};
use ferrograd_models::gpt::GptConfig;
use std::path::Path;

pub const B: usize = 2;
pub const T: usize = 16;

pub fn model() -> GptConfig {
    GptConfig { vocab_size: 300, n_positions: T, n_layer: 2, n_head: 2, n_embd: 16, layer_norm_epsilon: 1e-5 }
}

/// Train and val shards of LCG tokens (below the vocabulary) in `dir/data`.
pub fn shards(dir: &Path) {
    lcg_shards(&dir.join("data"), 12345, 40_000, 2_000);
}

/// `train_000000.bin` and `val_000000.bin` of `train` and `val` LCG tokens from `seed` in `dir`:
/// a skewed distribution below 300, so that a model has something to learn.
pub fn lcg_shards(dir: &Path, seed: u64, train: usize, val: usize) {
    std::fs::create_dir_all(dir).unwrap();
    let mut s = seed;
    let mut toks = |n: usize| -> Vec<u16> {
        (0..n)
            .map(|_| {
                s = s.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                let r = (s >> 33) as usize % 1000;
                (if r < 600 { r % 20 } else { r % 300 }) as u16
            })
            .collect()
    };
    write_shard(&dir.join("train_000000.bin"), &toks(train)).unwrap();
    write_shard(&dir.join("val_000000.bin"), &toks(val)).unwrap();
}

/// `micro_total` micro-batches of B x T per optimizer step over all ranks.
pub fn cfg(dir: &Path, out: &str, steps: u64, micro_total: usize) -> TrainConfig {
    TrainConfig {
        model: model(),
        steps,
        batch: BatchSize::Fixed(B),
        context: T,
        total_batch: Some(micro_total * B * T),
        precision: Precision::F32,
        lr: 3e-3,
        warmup: Some(2),
        log_every: 2,
        val_every: 0,
        val_batches: 2,
        ..TrainConfig::gpu_defaults(dir.join("data"), dir.join(out), Device::Cpu)
    }
}

/// Small buckets, so that a step has several.
pub fn dp(dtype: DType) -> DpConfig {
    DpConfig { bucket_bytes: 16 << 10, comm_dtype: dtype, zero: 0 }
}

pub fn params(run: &Run) -> Vec<(String, Vec<f32>)> {
    run.model.params().into_iter().map(|(n, t)| (n, t.to_vec::<f32>().unwrap())).collect()
}

/// The largest difference of any tensor relative to that tensor's largest magnitude, leaving out
/// the key third of each attention's `c_attn.bias`: its gradient is exactly zero in exact
/// arithmetic (adding `b` to every key adds `q.b` to all of a query's scores, which softmax
/// ignores), so it is pure rounding noise, which Adam scales to steps of about `lr`; any other
/// summation order (here: two ranks' halves summed, then averaged) moves it arbitrarily. It must
/// stay noise-sized, though.
pub fn max_rel(a: &[(String, Vec<f32>)], b: &[(String, Vec<f32>)]) -> f64 {
    assert_eq!(a.len(), b.len());
    let c = model().n_embd;
    let mut worst = 0.0f64;
    for ((n, x), (m, y)) in a.iter().zip(b) {
        assert_eq!(n, m);
        let keep = |i: usize| !(n.ends_with("attn.c_attn.bias") && (c..2 * c).contains(&i));
        for (i, v) in x.iter().chain(y).enumerate() {
            assert!(keep(i % x.len()) || v.abs() < 1e-4, "{n}[{i}] = {v}: the key bias should stay at noise level");
        }
        let scale = y.iter().fold(0.0f64, |s, v| s.max(v.abs() as f64)).max(1e-30);
        let diff = x
            .iter()
            .zip(y)
            .enumerate()
            .filter(|(i, _)| keep(*i))
            .fold(0.0f64, |s, (_, (p, q))| s.max((p - q).abs() as f64));
        worst = worst.max(diff / scale);
    }
    worst
}
