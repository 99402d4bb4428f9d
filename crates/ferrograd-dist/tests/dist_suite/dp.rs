//! Data parallel on the CPU over the in-process thread communicator: the same steps as one process
//! on the global batch (replicated and ZeRO-1, with accumulation and clipping), communication
//! launched during backward in bucket order, only on the last micro-step, and checkpoints that
//! resume on another world size.

use ferrograd_core::{DType, Device, GradStore, Tensor, TensorId};
use ferrograd_dist::comm::{CommStats, Communicator, ReduceOp, Work};
use ferrograd_dist::testing::{run_ranks, ThreadComm};
use ferrograd_dist::workload::{self, MlpRun};
use ferrograd_dist::{DataParallel, DistResult, DpConfig};
use ferrograd_nn::optim::{Adam, GradAccumulator, Optimizer};
use ferrograd_nn::Module;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

const CPU: Device = Device::Cpu;

/// One process, no DataParallel at all: AdamW over the global batch, micro-batches accumulated,
/// clipped like the Trainer does. The reference every data-parallel run must match.
fn reference(run: &MlpRun) -> Vec<Vec<f64>> {
    let (x, y) = workload::dataset(run, CPU).unwrap();
    let net = workload::model(run, run.seed, CPU).unwrap();
    let mut opt = Adam::new(net.named_parameters(), workload::adam_config(run.lr)).unwrap();
    let mut acc = GradAccumulator::new();
    for step in 0..run.steps {
        acc.zero_grad();
        for micro in 0..run.micro_steps {
            let r = workload::rows(run, step, micro, 0, 1).unwrap();
            let n = r.len();
            let loss = net.forward(&x.narrow(0, r.start, n).unwrap()).unwrap().sub(&y.narrow(0, r.start, n).unwrap());
            let loss = loss.unwrap().sqr().unwrap().mean_all().unwrap();
            acc.backward_scaled(&loss, 1.0 / run.micro_steps as f64).unwrap();
        }
        if let Some(max) = run.clip {
            let params: Vec<Tensor> = net.parameters();
            ferrograd_nn::optim::clip_grad_norm(acc.grads_mut(), &params, max).unwrap();
        }
        opt.step(acc.grads()).unwrap();
    }
    values(&net)
}

fn values(net: &dyn Module) -> Vec<Vec<f64>> {
    net.parameters().iter().map(|p| p.to_f64_vec().unwrap()).collect()
}

fn train(world: usize, run: &MlpRun) -> Vec<Vec<Vec<f64>>> {
    run_ranks(world, |comm| {
        let (net, losses) = workload::train(comm, run, &mut |_| Ok(())).unwrap();
        assert!(losses.iter().all(|l| l.is_finite() && *l > 0.0), "{losses:?}");
        values(&net)
    })
}

/// Largest over parameter tensors of max|a - b| / max|b|: the difference relative to the tensor's
/// scale (elementwise ratios blow up on weights that happen to sit near zero).
fn max_rel(a: &[Vec<f64>], b: &[Vec<f64>]) -> f64 {
    a.iter()
        .zip(b)
        .map(|(x, y)| {
            let diff = x.iter().zip(y).map(|(p, q)| (p - q).abs()).fold(0.0, f64::max);
            diff / y.iter().map(|q| q.abs()).fold(1e-30, f64::max)
        })
        .fold(0.0, f64::max)
}

fn assert_matches(world: usize, run: &MlpRun, want: &[Vec<f64>], tol: f64) {
    let got = train(world, run);
    for (rank, g) in got.iter().enumerate() {
        let e = max_rel(g, want);
        assert!(e <= tol, "world {world}, rank {rank}, {:?}: max relative difference {e:e} > {tol:e}", run.dp);
    }
}

#[test]
fn replicated_and_zero1_take_the_single_process_steps() {
    let run = MlpRun { steps: 10, ..Default::default() };
    let want = reference(&run);
    for world in [1, 2, 3, 4] {
        for zero in [0, 1] {
            let run = MlpRun { dp: DpConfig { zero, bucket_bytes: 4096, ..Default::default() }, ..run.clone() };
            assert_matches(world, &run, &want, 1e-5);
        }
    }
}

#[test]
fn accumulation_and_clipping_match_too() {
    let run = MlpRun { steps: 6, micro_steps: 3, clip: Some(0.05), global_batch: 24, ..Default::default() };
    let want = reference(&run);
    for zero in [0, 1] {
        let run = MlpRun { dp: DpConfig { zero, bucket_bytes: 8192, ..Default::default() }, ..run.clone() };
        assert_matches(2, &run, &want, 1e-5);
    }
}

#[test]
fn bf16_gradients_average_to_the_global_gradient_within_bf16_precision() {
    let run = MlpRun::default();
    let (x, y) = workload::dataset(&run, CPU).unwrap();
    let grad_of = |net: &dyn Module, r: std::ops::Range<usize>| {
        let n = r.len();
        let loss = net.forward(&x.narrow(0, r.start, n).unwrap()).unwrap().sub(&y.narrow(0, r.start, n).unwrap());
        loss.unwrap().sqr().unwrap().mean_all().unwrap()
    };
    let net = workload::model(&run, 0, CPU).unwrap();
    let full = grad_of(&net, 0..run.global_batch).backward().unwrap();
    let want: Vec<Vec<f64>> = net.parameters().iter().map(|p| full.get(p).unwrap().to_f64_vec().unwrap()).collect();
    for zero in [0, 1] {
        let got = run_ranks(2, |comm| {
            let rank = comm.rank();
            let net = workload::model(&run, 0, CPU).unwrap();
            let dp = DpConfig { comm_dtype: DType::BF16, zero, ..Default::default() };
            let mut opt =
                DataParallel::with_adam(comm, net.named_parameters(), workload::adam_config(1e-2), dp).unwrap();
            let mut grads = GradStore::default();
            let r = ferrograd_dist::shard_range(run.global_batch, rank, 2).unwrap();
            opt.backward(&grad_of(&net, r), &mut grads, true).unwrap();
            opt.reduce_grads(&mut grads).unwrap();
            let g: Vec<Vec<f64>> = net
                .parameters()
                .iter()
                .map(|p| grads.get(p).map(|g| g.to_f64_vec().unwrap()))
                .collect::<Option<_>>()
                .unwrap_or_default();
            opt.step(&grads).unwrap();
            (g, values(&net))
        });
        assert_eq!(got[0].1, got[1].1, "zero {zero}: every rank must hold the same parameters");
        if zero == 0 {
            // bf16 keeps 8 significant bits: each rank's half rounds to 2^-8 of its scale.
            let e = max_rel(&got[0].0, &want);
            assert!(e < 1e-2 && e > 0.0, "bf16 averaged gradients: {e}");
            assert_eq!(got[0].0, got[1].0);
        }
    }
    // And training with them follows the f32 run closely.
    let f32_run = MlpRun { steps: 20, ..Default::default() };
    let bf16_run = MlpRun { dp: DpConfig { comm_dtype: DType::BF16, ..Default::default() }, ..f32_run.clone() };
    let loss = |r: &MlpRun| run_ranks(2, |comm| workload::train(comm, r, &mut |_| Ok(())).unwrap().1)[0].clone();
    let (a, b) = (loss(&f32_run), loss(&bf16_run));
    let (la, lb) = (a[a.len() - 1], b[b.len() - 1]);
    assert!(la < a[0] * 0.8, "f32 run did not learn: {a:?}");
    assert!((la - lb).abs() < 0.05 * la, "final loss f32 {la} vs bf16 {lb}");
}

#[test]
fn checkpoints_resume_on_another_world_size() {
    let dir = tempfile::tempdir().unwrap();
    let full = MlpRun { steps: 8, ..Default::default() };
    let want = reference(&full);
    for (zero, saved_on, resumed_on) in [(0, 2, 1), (1, 2, 3), (1, 4, 1), (0, 3, 2)] {
        let path = dir.path().join(format!("ckpt-{zero}-{saved_on}-{resumed_on}.safetensors"));
        let dp = DpConfig { zero, bucket_bytes: 4096, ..Default::default() };
        let first = MlpRun { steps: 4, save: Some((4, path.clone())), dp: dp.clone(), ..full.clone() };
        train(saved_on, &first);
        let rest = MlpRun { resume: Some(path.clone()), dp, ..full.clone() };
        let got = train(resumed_on, &rest);
        let e = max_rel(&got[0], &want);
        assert!(e <= 1e-5, "zero {zero}, saved on {saved_on}, resumed on {resumed_on}: {e:e}");
    }
    // The file is a plain AdamW checkpoint: a single process without DataParallel reads it.
    let path = dir.path().join("ckpt-1-2-3.safetensors");
    let net = workload::model(&full, 99, CPU).unwrap();
    let mut adam = Adam::new(net.named_parameters(), workload::adam_config(full.lr)).unwrap();
    let state = ferrograd_nn::checkpoint::load(&path, &net, Some(&mut adam)).unwrap();
    assert_eq!((state.step, adam.step_count()), (4, 4));
}

/// Counts what reaches the wrapped communicator and stamps each reduction with a fresh tensor id
/// (ids count tensor creations: they date the launch against the gradients the walk made).
struct Counting {
    inner: ThreadComm,
    calls: AtomicUsize,
    stamps: Mutex<Vec<TensorId>>,
}

impl Counting {
    fn stamp(&self) {
        self.calls.fetch_add(1, Ordering::SeqCst);
        let id = Tensor::zeros(1, DType::F32, CPU).unwrap().id();
        self.stamps.lock().unwrap().push(id);
    }
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
        "counting"
    }
    fn all_reduce(&self, buf: &Tensor, op: ReduceOp) -> DistResult<Work> {
        self.stamp();
        self.inner.all_reduce(buf, op)
    }
    fn reduce_scatter(&self, buf: &Tensor, op: ReduceOp) -> DistResult<Work> {
        self.stamp();
        self.inner.reduce_scatter(buf, op)
    }
    fn all_gather(&self, buf: &Tensor) -> DistResult<Work> {
        self.stamp();
        self.inner.all_gather(buf)
    }
    fn broadcast(&self, buf: &Tensor, root: usize) -> DistResult<Work> {
        self.inner.broadcast(buf, root)
    }
    fn send(&self, buf: &Tensor, peer: usize) -> DistResult<Work> {
        self.inner.send(buf, peer)
    }
    fn recv(&self, buf: &Tensor, peer: usize) -> DistResult<Work> {
        self.inner.recv(buf, peer)
    }
    fn barrier(&self) -> DistResult<()> {
        self.inner.barrier()
    }
    fn stats(&self) -> DistResult<CommStats> {
        Ok(CommStats { calls: self.calls.load(Ordering::SeqCst) as u64, ..Default::default() })
    }
}

#[test]
fn buckets_launch_during_backward_in_order_and_only_on_the_last_micro_step() {
    // Equal widths: each Linear layer (1024 weights + 32 biases) fills one 4400-byte bucket.
    let run = MlpRun { sizes: vec![32; 5], ..Default::default() };
    let comms = ThreadComm::group(2);
    std::thread::scope(|s| {
        for c in comms {
            let run = run.clone();
            s.spawn(move || {
                let counting = Arc::new(Counting { inner: c, calls: AtomicUsize::new(0), stamps: Mutex::new(vec![]) });
                let comm: Arc<dyn Communicator> = counting.clone();
                let rank = comm.rank();
                let (x, y) = workload::dataset(&run, CPU).unwrap();
                let net = workload::model(&run, 0, CPU).unwrap();
                let params = net.named_parameters();
                let dp = DpConfig { bucket_bytes: 4400, ..Default::default() };
                let mut opt = DataParallel::with_adam(comm, params.clone(), workload::adam_config(1e-2), dp).unwrap();
                let nb = opt.plan().buckets.len();
                assert_eq!(nb, 4, "{:?}", opt.plan());
                let mut grads = GradStore::default();
                let loss = |m: usize| {
                    let r = workload::rows(&run, 0, m, rank, 2).unwrap();
                    let (xb, yb) = (x.narrow(0, r.start, r.len()).unwrap(), y.narrow(0, r.start, r.len()).unwrap());
                    net.forward(&xb).unwrap().sub(&yb).unwrap().sqr().unwrap().mean_all().unwrap()
                };
                let before = counting.calls.load(Ordering::SeqCst);
                opt.backward(&loss(0), &mut grads, false).unwrap();
                opt.backward(&loss(1), &mut grads, false).unwrap();
                assert_eq!(
                    counting.calls.load(Ordering::SeqCst),
                    before,
                    "no communication before the last micro-step"
                );
                opt.backward(&loss(2), &mut grads, true).unwrap();
                assert_eq!(counting.calls.load(Ordering::SeqCst), before + nb, "one collective per bucket");
                let log = opt.launch_log().to_vec();
                assert_eq!(log.iter().map(|l| l.bucket).collect::<Vec<_>>(), (0..nb).collect::<Vec<_>>());
                assert_eq!(log.iter().map(|l| l.grads_final).collect::<Vec<_>>(), vec![2, 4, 6, 8], "{log:?}");
                assert!(log.iter().all(|l| l.during_backward), "{log:?}");
                // Overlap: the last layer's bucket left before the walk had made the first layer's
                // gradient (its tensor was created after the launch).
                let stamps = counting.stamps.lock().unwrap().clone();
                let first_layer_grad = grads.get(&params[0].1).unwrap().id();
                assert!(stamps[0] < first_layer_grad, "bucket 0 launched only after backward finished");
                assert!(opt.backward(&loss(0), &mut grads, true).is_err(), "a second last micro-step is refused");
                opt.step(&grads).unwrap();
                // The next step starts clean.
                let mut g2 = GradStore::default();
                opt.backward(&loss(0), &mut g2, true).unwrap();
                opt.step(&g2).unwrap();
            });
        }
    });
}

#[test]
fn zero1_keeps_a_shard_of_the_moments() {
    let run = MlpRun::default();
    let n: usize = workload::model(&run, 0, CPU).unwrap().parameters().iter().map(|p| p.elem_count()).sum();
    for world in [1, 2, 4] {
        let got = run_ranks(world, |comm| {
            let net = workload::model(&run, 0, CPU).unwrap();
            let dp = DpConfig { zero: 1, bucket_bytes: 8192, ..Default::default() };
            let opt = DataParallel::with_adam(comm, net.named_parameters(), workload::adam_config(1e-2), dp).unwrap();
            let state: usize = opt.state_tensors().iter().map(|(_, t)| t.elem_count()).sum();
            (state, opt.plan().total_len(), opt.plan().buckets.len())
        });
        for (state, total, buckets) in got {
            // m and v of one shard of every bucket: 2 x total / world, padding at most
            // world x 64 elements per bucket.
            assert_eq!(state * world, 2 * total, "world {world}");
            assert!(total <= n + buckets * (world * 64 + 64), "world {world}: {total} for {n} parameters");
        }
    }
}

#[test]
fn parameters_on_another_device_or_dtype_are_refused() {
    let errs = run_ranks(2, |comm| {
        let t = Tensor::zeros(4, DType::F64, CPU).unwrap().requires_grad();
        let e1 = DataParallel::with_adam(
            comm.clone(),
            vec![("w".into(), t)],
            workload::adam_config(1e-3),
            DpConfig::default(),
        )
        .err()
        .map(|e| e.to_string());
        let cfg = DpConfig { comm_dtype: DType::I32, ..Default::default() };
        let t = Tensor::zeros(4, DType::F32, CPU).unwrap().requires_grad();
        let e2 = DataParallel::with_adam(comm, vec![("w".into(), t)], workload::adam_config(1e-3), cfg)
            .err()
            .map(|e| e.to_string());
        (e1, e2)
    });
    for (e1, e2) in errs {
        assert!(e1.unwrap().contains("f32"));
        assert!(e2.unwrap().contains("bf16"));
    }
}

/// What a training step with a fused loss does (GPT's classifier): backward from the
/// predictions, seeded with the loss's gradient formed beforehand, through `backward_seeded`.
/// The averages equal those of the loss-based backward; accumulation communicates only on the
/// last micro-step; the buckets launch during the walk, in order.
#[test]
fn seeded_backward_averages_like_the_loss_backward_and_launches_during_the_walk() {
    let run = MlpRun { sizes: vec![32; 5], ..Default::default() };
    let comms = ThreadComm::group(2);
    std::thread::scope(|s| {
        for c in comms {
            let run = run.clone();
            s.spawn(move || {
                let counting = Arc::new(Counting { inner: c, calls: AtomicUsize::new(0), stamps: Mutex::new(vec![]) });
                let comm: Arc<dyn Communicator> = counting.clone();
                let rank = comm.rank();
                let (x, y) = workload::dataset(&run, CPU).unwrap();
                let net = workload::model(&run, 0, CPU).unwrap();
                let params = net.named_parameters();
                let dp = DpConfig { bucket_bytes: 4400, ..Default::default() };
                let mut seeded = DataParallel::grad_sync(comm.clone(), params.clone(), dp.clone()).unwrap();
                let mut plain = DataParallel::grad_sync(comm, params.clone(), dp).unwrap();
                let nb = seeded.plan().buckets.len();
                assert_eq!(nb, 4, "{:?}", seeded.plan());
                // Micro-batch m of this rank: predictions, and d(loss / 3)/d(pred) for the mean
                // squared error (three micro-batches a step).
                let batch = |m: usize| {
                    let r = workload::rows(&run, 0, m, rank, 2).unwrap();
                    let (xb, yb) = (x.narrow(0, r.start, r.len()).unwrap(), y.narrow(0, r.start, r.len()).unwrap());
                    let pred = net.forward(&xb).unwrap();
                    let diff = pred.sub(&yb).unwrap();
                    let loss = diff.sqr().unwrap().mean_all().unwrap().mul_scalar(1.0 / 3.0).unwrap();
                    let seed = diff.detach().mul_scalar(2.0 / (3.0 * diff.elem_count() as f64)).unwrap();
                    (pred, seed, loss)
                };
                let (mut g_seeded, mut g_plain) = (GradStore::default(), GradStore::default());
                let before = counting.calls.load(Ordering::SeqCst);
                for m in 0..3 {
                    let (pred, seed, _) = batch(m);
                    seeded.backward_seeded(pred.clone(), &seed, &mut g_seeded, m == 2).unwrap();
                    if m < 2 {
                        assert_eq!(
                            counting.calls.load(Ordering::SeqCst),
                            before,
                            "communication before the last micro-step"
                        );
                    }
                }
                assert_eq!(counting.calls.load(Ordering::SeqCst), before + nb, "one all-reduce per bucket");
                let log = seeded.launch_log().to_vec();
                assert_eq!(log.iter().map(|l| l.bucket).collect::<Vec<_>>(), (0..nb).collect::<Vec<_>>());
                assert!(log.iter().all(|l| l.during_backward), "{log:?}");
                let stamps = counting.stamps.lock().unwrap().clone();
                let first_layer_grad = g_seeded.get(&params[0].1).unwrap().id();
                assert!(stamps[0] < first_layer_grad, "bucket 0 launched only after the walk finished");
                for m in 0..3 {
                    plain.backward(&batch(m).2, &mut g_plain, m == 2).unwrap();
                }
                seeded.reduce_grads(&mut g_seeded).unwrap();
                plain.reduce_grads(&mut g_plain).unwrap();
                for (name, p) in &params {
                    let (a, b) =
                        (g_seeded.get(p).unwrap().to_f64_vec().unwrap(), g_plain.get(p).unwrap().to_f64_vec().unwrap());
                    let scale = b.iter().fold(1e-30f64, |s, v| s.max(v.abs()));
                    let diff = a.iter().zip(&b).fold(0.0f64, |s, (u, v)| s.max((u - v).abs()));
                    assert!(
                        diff <= 1e-5 * scale,
                        "rank {rank}, {name}: seeded vs loss backward differ by {diff:e} (scale {scale:e})"
                    );
                }
                // The grad-sync mode updates nothing and ends the step: the next may communicate.
                let before: Vec<Vec<f64>> = params.iter().map(|(_, p)| p.to_f64_vec().unwrap()).collect();
                seeded.step(&g_seeded).unwrap();
                let after: Vec<Vec<f64>> = params.iter().map(|(_, p)| p.to_f64_vec().unwrap()).collect();
                assert_eq!(before, after);
                let (pred, seed, _) = batch(0);
                seeded.backward_seeded(pred.clone(), &seed, &mut GradStore::default(), true).unwrap();
                // A seed of the wrong shape is an error, not a panic.
                let bad = Tensor::zeros(3, DType::F32, CPU).unwrap();
                seeded.step(&GradStore::default()).unwrap();
                assert!(seeded.backward_seeded(pred.clone(), &bad, &mut GradStore::default(), true).is_err());
            });
        }
    });
}
