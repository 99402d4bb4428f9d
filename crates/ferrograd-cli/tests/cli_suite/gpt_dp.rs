//! `gpt train` data parallel without GPUs: the hooks `ferrograd launch` gives a run
//! (`ferrograd_cli::gpt_dp_hooks`), driven by ferrograd-dist's in-process thread communicator.
//! Two ranks take exactly the steps one process takes on the same global batch, communicate only
//! on the last micro-step of accumulation, read disjoint micro-batches, let rank 0 alone write
//! files, and leave a checkpoint that resumes on another number of ranks.

use crate::common;

use common::gpt_run::{cfg, dp, max_rel, params, shards, B, T};
use ferrograd_core::{DType, Device, Result, Tensor};
use ferrograd_dist::bucket::BucketPlan;
use ferrograd_dist::testing::run_ranks;
use ferrograd_dist::{CommStats, Communicator, ReduceOp, Work};
use ferrograd_models::gpt::loader::TokenLoader;
use ferrograd_models::gpt::train::{Run, TrainConfig};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

/// A communicator that counts the all-reduces of more than one element (gradient buckets; the
/// logged loss is one element) and passes everything on.
struct Counting {
    inner: Arc<dyn Communicator>,
    bucket_all_reduces: AtomicUsize,
}

impl Communicator for Counting {
    fn rank(&self) -> usize {
        self.inner.rank()
    }
    fn world_size(&self) -> usize {
        self.inner.world_size()
    }
    fn device(&self) -> Device {
        self.inner.device()
    }
    fn backend(&self) -> &'static str {
        self.inner.backend()
    }
    fn all_reduce(&self, buf: &Tensor, op: ReduceOp) -> ferrograd_dist::DistResult<Work> {
        if buf.elem_count() > 1 {
            self.bucket_all_reduces.fetch_add(1, Ordering::SeqCst);
        }
        self.inner.all_reduce(buf, op)
    }
    fn reduce_scatter(&self, buf: &Tensor, op: ReduceOp) -> ferrograd_dist::DistResult<Work> {
        self.inner.reduce_scatter(buf, op)
    }
    fn all_gather(&self, buf: &Tensor) -> ferrograd_dist::DistResult<Work> {
        self.inner.all_gather(buf)
    }
    fn broadcast(&self, buf: &Tensor, root: usize) -> ferrograd_dist::DistResult<Work> {
        self.inner.broadcast(buf, root)
    }
    fn send(&self, buf: &Tensor, peer: usize) -> ferrograd_dist::DistResult<Work> {
        self.inner.send(buf, peer)
    }
    fn recv(&self, buf: &Tensor, peer: usize) -> ferrograd_dist::DistResult<Work> {
        self.inner.recv(buf, peer)
    }
    fn barrier(&self) -> ferrograd_dist::DistResult<()> {
        self.inner.barrier()
    }
    fn stats(&self) -> ferrograd_dist::DistResult<CommStats> {
        self.inner.stats()
    }
}

#[test]
fn two_ranks_take_the_steps_of_one_on_the_same_global_batch() -> Result<()> {
    let dir = tempfile::tempdir()?;
    shards(dir.path());
    // 4 micro-batches a step: 4 on one process, 2 on each of two ranks.
    let steps = 4;
    let mut one = Run::new(cfg(dir.path(), "one", steps, 4))?;
    let mut one_losses = vec![];
    for _ in 0..steps {
        one_losses.push(one.train_step()?.0.item_f64()?);
    }
    let reference = params(&one);
    let n_buckets = {
        let numels: Vec<usize> = one.model.params().iter().map(|(_, t)| t.elem_count()).collect();
        BucketPlan::new(&numels, 4, dp(DType::F32).bucket_bytes, 2).buckets.len()
    };
    assert!(n_buckets > 2, "the test wants several buckets, got {n_buckets}");
    let ranks = run_ranks(2, |comm| {
        let counting = Arc::new(Counting { inner: comm, bucket_all_reduces: AtomicUsize::new(0) });
        let hooks = ferrograd_cli::gpt_dp_hooks(counting.clone(), dp(DType::F32));
        let mut run = Run::new(TrainConfig { dist: Some(hooks), ..cfg(dir.path(), "two", steps, 4) }).unwrap();
        assert_eq!((run.grad_accum, run.info.world, run.info.tokens_per_step), (2, 2, 4 * B * T));
        let mut per_step = vec![];
        let mut losses = vec![];
        for _ in 0..steps {
            let before = counting.bucket_all_reduces.load(Ordering::SeqCst);
            let (loss, _) = run.train_step().unwrap();
            losses.push(loss.item_f64().unwrap());
            per_step.push(counting.bucket_all_reduces.load(Ordering::SeqCst) - before);
        }
        (params(&run), per_step, losses)
    });
    for (rank, (p, per_step, losses)) in ranks.iter().enumerate() {
        let rel = max_rel(p, &reference);
        println!("rank {rank}: parameters vs one process after {steps} steps: max rel {rel:.2e}");
        assert!(rel < 1e-5, "rank {rank}: {rel}");
        // Two micro-batches per rank per step, but one all-reduce per bucket: only the last
        // micro-step communicates.
        assert_eq!(per_step, &vec![n_buckets; steps as usize], "rank {rank}");
        // Each rank's loss is its own half of the batch; their mean is the one process's loss.
        if rank == 0 {
            let other = &ranks[1].2;
            for (s, l) in one_losses.iter().enumerate() {
                let mean = (losses[s] + other[s]) / 2.0;
                assert!((mean - l).abs() < 1e-5 * l.abs(), "step {s}: {mean} vs {l}");
                assert!(losses[s] != other[s], "the ranks must read different batches");
            }
        }
    }
    assert_eq!(ranks[0].0, ranks[1].0, "both ranks hold the same parameters");
    Ok(())
}

/// Data parallel rides the one-process step body: through the hooks over a world of one (`Solo`:
/// every collective the identity) a run takes bit-identical steps to a run without a group, with
/// accumulation (gradients copied into buckets and averaged views handed to the same clipping and
/// AdamW change no bit).
#[test]
fn a_world_of_one_through_the_hooks_takes_the_steps_of_no_group_bit_for_bit() -> Result<()> {
    let dir = tempfile::tempdir()?;
    shards(dir.path());
    let steps = 3;
    let mut plain = Run::new(TrainConfig { grad_clip: 0.05, ..cfg(dir.path(), "plain", steps, 2) })?;
    let solo: Arc<dyn Communicator> = Arc::new(ferrograd_dist::Solo::new(Device::Cpu));
    let hooks = ferrograd_cli::gpt_dp_hooks(solo, dp(DType::F32));
    let mut grouped =
        Run::new(TrainConfig { dist: Some(hooks), grad_clip: 0.05, ..cfg(dir.path(), "solo", steps, 2) })?;
    assert_eq!((grouped.grad_accum, grouped.info.world), (2, 1));
    for s in 0..steps {
        let (a, na) = plain.train_step()?;
        let (b, nb) = grouped.train_step()?;
        assert_eq!((a.item_f64()?, na.item_f64()?), (b.item_f64()?, nb.item_f64()?), "step {s}: loss, norm");
        assert!(na.item_f64()? > 0.05, "clipping must act for the test to mean something");
    }
    assert_eq!(params(&plain), params(&grouped));
    Ok(())
}

#[test]
fn bf16_gradients_train_like_f32() -> Result<()> {
    let dir = tempfile::tempdir()?;
    shards(dir.path());
    let steps = 6;
    let mut one = Run::new(cfg(dir.path(), "one", steps, 2))?;
    let mut one_losses = vec![];
    for _ in 0..steps {
        one_losses.push(one.train_step()?.0.item_f64()?);
    }
    let reference = params(&one);
    let ranks = run_ranks(2, |comm| {
        let hooks = ferrograd_cli::gpt_dp_hooks(comm, dp(DType::BF16));
        let mut run = Run::new(TrainConfig { dist: Some(hooks), ..cfg(dir.path(), "two", steps, 2) }).unwrap();
        let mut losses = vec![];
        for _ in 0..steps {
            losses.push(run.train_step().unwrap().0.item_f64().unwrap());
        }
        (params(&run), losses)
    });
    assert_eq!(ranks[0].0, ranks[1].0, "both ranks average the same bf16 buckets");
    let rel = max_rel(&ranks[0].0, &reference);
    println!("bf16 gradients: parameters vs f32 on one process after {steps} steps: max rel {rel:.2e}");
    // Not the same steps (8 bits of mantissa on the wire, and Adam turns the sign of nearly
    // cancelling gradient entries into whole steps), but the same training: parameters within a
    // few steps' worth of lr of each other and the same losses to 1%.
    assert!(rel > 0.0 && rel < 0.1, "{rel}");
    for (s, l) in one_losses.iter().enumerate() {
        let mean = (ranks[0].1[s] + ranks[1].1[s]) / 2.0;
        assert!((mean - l).abs() < 1e-2 * l, "step {s}: {mean} vs {l}");
    }
    assert!(one_losses[steps as usize - 1] < one_losses[0]);
    Ok(())
}

#[test]
fn ranks_read_interleaved_micro_batches_of_the_single_order() -> Result<()> {
    let dir = tempfile::tempdir()?;
    shards(dir.path());
    let data = dir.path().join("data");
    let mut single = TokenLoader::new(&data, "train", B, T)?;
    let order: Vec<_> = (0..12).map(|_| single.next_batch().unwrap().0).collect();
    for world in [2, 3] {
        for rank in 0..world {
            let mut l = TokenLoader::new(&data, "train", B, T)?;
            l.set_stride(rank, world)?;
            for i in 0..12 / world {
                assert_eq!(l.next_batch()?.0, order[i * world + rank], "rank {rank} of {world}, batch {i}");
            }
            // Every rank's position is the group's: the single loader's after the same batches.
            assert_eq!(l.position(), single.position());
        }
    }
    let mut l = TokenLoader::new(&data, "train", B, T)?;
    assert!(l.set_stride(2, 2).is_err() && l.set_stride(0, 0).is_err());
    Ok(())
}

#[test]
fn rank_zero_writes_and_the_checkpoint_resumes_on_one_process() -> Result<()> {
    let dir = tempfile::tempdir()?;
    shards(dir.path());
    let (steps, half) = (6, 3);
    // The reference: 6 steps on one process.
    let mut straight = Run::new(cfg(dir.path(), "straight", steps, 2))?;
    for _ in 0..steps {
        straight.train_step()?;
    }
    // Two ranks train 3 of the 6 steps through the training loop, into one shared directory.
    let summaries = run_ranks(2, |comm| {
        let hooks = ferrograd_cli::gpt_dp_hooks(comm, dp(DType::F32));
        let c = TrainConfig { dist: Some(hooks), ..cfg(dir.path(), "two", steps, 2) };
        // Stop after `half` steps: a run planned for 6 steps, interrupted (as a checkpoint at
        // --save-every would leave it).
        let mut run = Run::new(c).unwrap();
        for _ in 0..half {
            run.train_step().unwrap();
        }
        run.save_checkpoint().unwrap()
    });
    let out = dir.path().join("two");
    assert!(summaries.iter().all(|p| p == &Run::checkpoint_path(&out)));
    assert!(Run::checkpoint_path(&out).is_file());
    // One process resumes the 2-rank checkpoint and finishes the run.
    let mut resumed = Run::new(TrainConfig { resume: true, ..cfg(dir.path(), "two", steps, 2) })?;
    assert_eq!(resumed.step, half);
    for _ in half..steps {
        resumed.train_step()?;
    }
    let rel = max_rel(&params(&resumed), &params(&straight));
    println!("2 ranks for {half} steps, resumed on 1 for {}: vs 1 throughout: max rel {rel:.2e}", steps - half);
    assert!(rel < 1e-5, "{rel}");
    Ok(())
}

#[test]
fn the_training_loop_writes_files_on_rank_zero_only() -> Result<()> {
    let dir = tempfile::tempdir()?;
    shards(dir.path());
    let results = run_ranks(2, |comm| {
        let rank = comm.rank();
        let hooks = ferrograd_cli::gpt_dp_hooks(comm, dp(DType::F32));
        // Each rank its own directory, to see who writes what.
        let c = TrainConfig { dist: Some(hooks), ..cfg(dir.path(), &format!("rank{rank}"), 4, 2) };
        let mut losses = vec![];
        let s = ferrograd_models::gpt::train::train(c, std::time::Instant::now(), |e| {
            if let ferrograd_models::gpt::train::Event::Logged(st) = e {
                losses.push(st.loss);
            }
        })
        .unwrap();
        (s.tokens_per_s > 0.0, losses)
    });
    assert!(results.iter().all(|r| r.0));
    // The logged loss is the mean over the ranks: the same on both.
    assert_eq!(results[0].1, results[1].1);
    let (r0, r1) = (dir.path().join("rank0"), dir.path().join("rank1"));
    assert!(r0.join("log.jsonl").is_file() && Run::checkpoint_path(&r0).is_file() && r0.join("model").is_dir());
    let written: Vec<_> = std::fs::read_dir(&r1).map(|d| d.flatten().map(|e| e.path()).collect()).unwrap_or_default();
    assert!(written.is_empty(), "rank 1 wrote {written:?}");
    Ok(())
}

#[test]
fn a_total_batch_that_does_not_split_over_the_ranks_is_refused() -> Result<()> {
    let dir = tempfile::tempdir()?;
    shards(dir.path());
    let errs = run_ranks(2, |comm| {
        let hooks = ferrograd_cli::gpt_dp_hooks(comm, dp(DType::F32));
        // 3 micro-batches a step cannot split over 2 ranks.
        Run::new(TrainConfig { dist: Some(hooks), ..cfg(dir.path(), "odd", 2, 3) }).err().map(|e| e.to_string())
    });
    for e in errs {
        let e = e.expect("refused");
        assert!(e.contains("--total-batch") && e.contains("2 ranks"), "{e}");
    }
    Ok(())
}
