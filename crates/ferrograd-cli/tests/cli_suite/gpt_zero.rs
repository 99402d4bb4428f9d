//! `gpt train --zero 1` without GPUs: ZeRO-1 through the hooks `ferrograd launch` gives a run
//! (`ferrograd_cli::gpt_dp_hooks` with `zero: 1`), ranks as threads. On 2 and 3 ranks (3: shards
//! that cut parameters apart) it takes the steps one process takes on the same global batch, with
//! the same clipping norm and weight decay on the matrices only, each rank holding 1/N of AdamW's
//! moments; its checkpoints are the files one process writes, and resume bit for bit on the same
//! number of ranks and in a run without ZeRO.

use crate::common;

use common::gpt_run::{cfg, dp, max_rel, params, shards};
use ferrograd_core::{DType, Result};
use ferrograd_dist::testing::run_ranks;
use ferrograd_dist::DpConfig;
use ferrograd_models::gpt::train::{Run, TrainConfig};
use std::collections::BTreeMap;
use std::path::Path;

/// Small buckets (several per step, parameters cut at shard edges), ZeRO-1.
fn zero(dtype: DType) -> DpConfig {
    DpConfig { zero: 1, ..dp(dtype) }
}

/// Clipping that acts on every step and a weight decay large enough that decaying a vector (layer
/// norm gains sit at 1) would move it far beyond the tolerance.
fn settings(dir: &Path, out: &str, steps: u64, micro_total: usize) -> TrainConfig {
    TrainConfig { grad_clip: 0.05, weight_decay: 1.0, ..cfg(dir, out, steps, micro_total) }
}

/// `steps` steps of `settings(.., 6)` on `world` ranks averaging as `dp`, per rank: (parameters,
/// (loss, norm) per step, optimizer state bytes).
type RankRun = (Vec<(String, Vec<f32>)>, Vec<(f64, f64)>, usize);
fn ranks_run(dir: &Path, out: &str, world: usize, steps: u64, dp: DpConfig) -> Vec<RankRun> {
    run_ranks(world, |comm| {
        let hooks = ferrograd_cli::gpt_dp_hooks(comm, dp.clone());
        let mut run = Run::new(TrainConfig { dist: Some(hooks), ..settings(dir, out, steps, 6) }).unwrap();
        assert_eq!(run.opt.is_sharded(), dp.zero == 1);
        assert_eq!(run.info.notes.iter().any(|n| n.contains("ZeRO-1")), dp.zero == 1, "{:?}", run.info.notes);
        let mut seen = vec![];
        for _ in 0..steps {
            let (loss, norm) = run.train_step().unwrap();
            seen.push((loss.item_f64().unwrap(), norm.item_f64().unwrap()));
        }
        (params(&run), seen, run.opt.state_bytes())
    })
}

/// Parameters, losses and norms of ZeRO-1 on 2 and 3 ranks against one process. Against the
/// replicated (all-reduce) run on as many ranks, which averages in the same order, ZeRO-1 agrees
/// to 1e-6; against one process on 3 ranks the replicated run already differs by 3e-5 (an average
/// over 3 is not a sum over 6 micro-batches divided by 6, and Adam turns nearly cancelling entries
/// into whole steps), so that comparison allows 1e-4; on 2 ranks both are within 1e-5.
#[test]
fn zero1_on_two_and_three_ranks_takes_the_steps_of_one() -> Result<()> {
    let dir = tempfile::tempdir()?;
    shards(dir.path());
    // 6 micro-batches a step: 3 per rank on 2 ranks, 2 per rank on 3.
    let steps = 4;
    let mut one = Run::new(settings(dir.path(), "one", steps, 6))?;
    let whole_state = one.opt.state_bytes();
    let mut reference = vec![];
    for _ in 0..steps {
        let (loss, norm) = one.train_step()?;
        reference.push((loss.item_f64()?, norm.item_f64()?));
    }
    assert!(reference.iter().all(|&(_, n)| n > 0.05), "clipping must act: {reference:?}");
    let want = params(&one);
    for world in [2, 3] {
        let ranks = ranks_run(dir.path(), "zero", world, steps, zero(DType::F32));
        let replicated = ranks_run(dir.path(), "replicated", world, steps, dp(DType::F32));
        let vs_one = if world == 2 { 1e-5 } else { 1e-4 };
        for (rank, (p, seen, _)) in ranks.iter().enumerate() {
            let rel = max_rel(p, &want);
            let rel_rep = max_rel(p, &replicated[rank].0);
            println!(
                "ZeRO-1 on {world} ranks, rank {rank}, after {steps} steps: parameters vs one process {rel:.2e}, \
                 vs all-reduce on {world} ranks {rel_rep:.2e} (all-reduce vs one process {:.2e})",
                max_rel(&replicated[rank].0, &want)
            );
            assert!(rel < vs_one, "world {world}, rank {rank}: {rel}");
            assert!(rel_rep < 1e-6, "world {world}, rank {rank}: {rel_rep}");
            for (s, ((_, n), (_, m))) in seen.iter().zip(&reference).enumerate() {
                // The global norm of the whole averaged gradient, on every rank.
                assert!((n - m).abs() <= 1e-5 * m, "world {world}, rank {rank}, step {s}: norm {n} vs {m}");
            }
        }
        for (s, (l, _)) in reference.iter().enumerate() {
            let mean = ranks.iter().map(|r| r.1[s].0).sum::<f64>() / world as f64;
            assert!((mean - l).abs() < 1e-5 * l.abs(), "world {world}, step {s}: loss {mean} vs {l}");
        }
        assert!(ranks.iter().all(|r| r.0 == ranks[0].0), "every rank holds the same parameters");
        // Each element's moments live on exactly one rank: 1/N of the state per rank.
        let bytes: Vec<usize> = ranks.iter().map(|r| r.2).collect();
        assert_eq!(bytes.iter().sum::<usize>(), whole_state, "world {world}: {bytes:?}");
        assert!(bytes.iter().all(|&b| b <= whole_state / world + (64 << 10)), "world {world}: {bytes:?}");
        if world == 3 {
            assert!(bytes.iter().any(|&b| b != bytes[0]), "3 ranks: uneven parts of the parameters, {bytes:?}");
        }
    }
    Ok(())
}

/// bf16 on the wire: the shard is averaged in bf16 and widened, as the all-reduce path does.
#[test]
fn zero1_with_bf16_gradients_trains_like_f32() -> Result<()> {
    let dir = tempfile::tempdir()?;
    shards(dir.path());
    let steps = 4;
    let mut one = Run::new(cfg(dir.path(), "one", steps, 2))?;
    for _ in 0..steps {
        one.train_step()?;
    }
    let ranks = run_ranks(2, |comm| {
        let hooks = ferrograd_cli::gpt_dp_hooks(comm, zero(DType::BF16));
        let mut run = Run::new(TrainConfig { dist: Some(hooks), ..cfg(dir.path(), "two", steps, 2) }).unwrap();
        for _ in 0..steps {
            run.train_step().unwrap();
        }
        params(&run)
    });
    assert_eq!(ranks[0], ranks[1]);
    let rel = max_rel(&ranks[0], &params(&one));
    println!("ZeRO-1, bf16 gradients: parameters vs f32 on one process: {rel:.2e}");
    assert!(rel > 0.0 && rel < 0.1, "{rel}");
    Ok(())
}

/// The tensors of a checkpoint file, by name: (shape, values).
fn file_tensors(path: &Path) -> BTreeMap<String, (Vec<usize>, Vec<f32>)> {
    let bytes = std::fs::read(path).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    st.tensors()
        .into_iter()
        .map(|(n, v)| {
            let vals = v.data().chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect();
            (n, (v.shape().to_vec(), vals))
        })
        .collect()
}

/// `steps` ZeRO-1 steps on `world` ranks in `out` (resumed when asked), then a checkpoint; the
/// parameters of rank 0.
fn zero_run(dir: &Path, out: &str, world: usize, steps: u64, resume: bool) -> Vec<(String, Vec<f32>)> {
    let planned = 6;
    let ranks = run_ranks(world, |comm| {
        let hooks = ferrograd_cli::gpt_dp_hooks(comm, zero(DType::F32));
        let c = TrainConfig { dist: Some(hooks), resume, ..settings(dir, out, planned, 6) };
        let mut run = Run::new(c).unwrap();
        while run.step < steps {
            run.train_step().unwrap();
        }
        run.save_checkpoint().unwrap();
        params(&run)
    });
    ranks.into_iter().next().unwrap()
}

#[test]
fn a_zero1_checkpoint_is_the_plain_file_and_resumes_bit_for_bit_on_the_same_ranks() -> Result<()> {
    let dir = tempfile::tempdir()?;
    shards(dir.path());
    let straight = zero_run(dir.path(), "straight", 2, 6, false);
    zero_run(dir.path(), "halves", 2, 3, false);
    // The file one process writes after the same 3 steps: the same tensors, the same moments.
    let mut one = Run::new(settings(dir.path(), "one", 6, 6))?;
    for _ in 0..3 {
        one.train_step()?;
    }
    one.save_checkpoint()?;
    let (z, o) = (
        file_tensors(&Run::checkpoint_path(&dir.path().join("halves"))),
        file_tensors(&Run::checkpoint_path(&dir.path().join("one"))),
    );
    assert_eq!(z.keys().collect::<Vec<_>>(), o.keys().collect::<Vec<_>>());
    for (name, (shape, a)) in &z {
        let (oshape, b) = &o[name];
        assert_eq!(shape, oshape, "{name}");
        let scale = b.iter().fold(1e-30f32, |s, v| s.max(v.abs()));
        let diff = a.iter().zip(b).fold(0.0f32, |s, (x, y)| s.max((x - y).abs()));
        // The key third of c_attn.bias is rounding noise (see max_rel); its moments too.
        let noisy = name.contains("c_attn.bias");
        assert!(noisy || diff <= 1e-4 * scale, "{name}: {diff} of {scale}");
    }
    // Resumed on 2 ranks with ZeRO: the 6 straight steps, bit for bit.
    let resumed = zero_run(dir.path(), "halves", 2, 6, true);
    assert_eq!(resumed, straight, "a ZeRO-1 resume on the same ranks must continue bit for bit");
    Ok(())
}

#[test]
fn a_zero1_checkpoint_resumes_without_zero_and_on_other_ranks() -> Result<()> {
    let dir = tempfile::tempdir()?;
    shards(dir.path());
    let mut straight = Run::new(settings(dir.path(), "straight", 6, 6))?;
    for _ in 0..6 {
        straight.train_step()?;
    }
    let want = params(&straight);
    // ZeRO-1 on 2 ranks, then one process without ZeRO.
    zero_run(dir.path(), "to_one", 2, 3, false);
    let mut resumed = Run::new(TrainConfig { resume: true, ..settings(dir.path(), "to_one", 6, 6) })?;
    assert_eq!(resumed.step, 3);
    while resumed.step < 6 {
        resumed.train_step()?;
    }
    let rel = max_rel(&params(&resumed), &want);
    println!("ZeRO-1 on 2 ranks for 3 steps, resumed on one process: {rel:.2e}");
    assert!(rel < 1e-5, "{rel}");
    // One process, then ZeRO-1 on 3 ranks (its shards cut the moments another way).
    let mut first = Run::new(settings(dir.path(), "to_three", 6, 6))?;
    for _ in 0..3 {
        first.train_step()?;
    }
    first.save_checkpoint()?;
    let three = zero_run(dir.path(), "to_three", 3, 6, true);
    let rel = max_rel(&three, &want);
    println!("one process for 3 steps, resumed with ZeRO-1 on 3 ranks: {rel:.2e}");
    assert!(rel < 1e-5, "{rel}");
    Ok(())
}
