//! Pipeline parallelism on the CPU over the in-process thread communicator: a pipelined run trains
//! the same parameters as the unsplit model on one device for the same micro-batches (GPipe and
//! 1F1B, 2 to 4 stages, unequal micro-batches), the two schedules agree, and a stage that fails
//! stops every rank at once with an error naming it. The ranks' point-to-point messages behave as
//! NCCL's (`testing::P2p::Rendezvous`: a send waits for its receive, a pair's first message for
//! the peer's connection), so an ordering that hangs on GPUs fails here within the timeout.

use ferrograd_core::{DType, Device, Result, Rng, Tensor};
use ferrograd_dist::pipeline::{LocalPipeline, Measure, Pipeline, PipelineConfig, ScheduleKind, Stage};
use ferrograd_dist::testing::{run_group, run_ranks, ThreadComm};
use ferrograd_dist::DistResult;
use ferrograd_nn::optim::{Adam, AdamConfig, Optimizer};
use ferrograd_nn::{Linear, Module};
use std::sync::Arc;
use std::time::{Duration, Instant};

const CPU: Device = Device::Cpu;
/// Layer widths: six Linear layers, ReLU between them.
const WIDTHS: [usize; 7] = [6, 9, 5, 8, 4, 7, 3];
const ROWS: usize = 13;
const STEPS: usize = 3;

fn layers(seed: u64) -> Result<Vec<Linear>> {
    let mut rng = Rng::new(seed);
    WIDTHS.windows(2).map(|w| Linear::new(w[0], w[1], true, &mut rng, CPU)).collect()
}

/// The same layers on `dev` (drawn on the CPU, then moved).
fn layers_on(seed: u64, dev: Device) -> Result<Vec<Linear>> {
    layers(seed)?
        .into_iter()
        .map(|l| {
            let b = l.bias.as_ref().map(|b| b.to_device(dev)).transpose()?;
            Ok(Linear::from_tensors(l.weight.to_device(dev)?, b))
        })
        .collect()
}

/// The step's batch: inputs [ROWS, 6] and targets [ROWS, 3], different every step.
fn batch(step: usize) -> Result<(Tensor, Tensor)> {
    let mut rng = Rng::new(100 + step as u64);
    let x = Tensor::randn_with(&mut rng, 0.0, 1.0, (ROWS, WIDTHS[0]), DType::F32, CPU)?;
    let y = Tensor::randn_with(&mut rng, 0.0, 1.0, (ROWS, WIDTHS[6]), DType::F32, CPU)?;
    Ok((x, y))
}

/// Rows of micro-batch `i` of `m` (unequal when `m` does not divide ROWS).
fn rows(i: usize, m: usize) -> std::ops::Range<usize> {
    (i * ROWS / m)..((i + 1) * ROWS / m)
}

fn apply(ls: &[Linear], first: usize, x: &Tensor) -> Result<Tensor> {
    let mut h = x.clone();
    for (k, l) in ls.iter().enumerate() {
        h = l.forward(&h)?;
        if first + k + 1 < WIDTHS.len() - 1 {
            h = h.relu()?;
        }
    }
    Ok(h)
}

/// The micro-batch's loss weighted as its share of the batch's mean squared error.
fn weighted_loss(out: &Tensor, y: &Tensor, r: &std::ops::Range<usize>) -> Result<Tensor> {
    out.mse_loss(&y.narrow(0, r.start, r.len())?)?.mul_scalar(r.len() as f64 / ROWS as f64)
}

fn adam(params: Vec<(String, Tensor)>) -> Result<Adam> {
    Adam::new(params, AdamConfig { lr: 1e-2, ..Default::default() })
}

fn values(ls: &[Linear]) -> Result<Vec<Vec<f32>>> {
    ls.iter().flat_map(|l| l.parameters()).map(|p| p.to_vec::<f32>()).collect()
}

/// One device, the whole model, the same micro-batches accumulated, Adam.
fn reference(m: usize) -> Result<Vec<Vec<f32>>> {
    reference_on(m, CPU)
}

fn reference_on(m: usize, dev: Device) -> Result<Vec<Vec<f32>>> {
    let ls = layers_on(7, dev)?;
    let params: Vec<(String, Tensor)> = ls
        .iter()
        .enumerate()
        .flat_map(|(i, l)| l.named_parameters().into_iter().map(move |(n, p)| (format!("{i}.{n}"), p)))
        .collect();
    let mut opt = adam(params)?;
    for step in 0..STEPS {
        let (x, y) = batch(step)?;
        let mut grads = ferrograd_core::GradStore::default();
        for i in 0..m {
            let r = rows(i, m);
            let out = apply(&ls, 0, &x.narrow(0, r.start, r.len())?.to_device(dev)?)?;
            weighted_loss(&out, &y.to_device(dev)?, &r)?.backward_into(&mut grads)?;
        }
        opt.step(&grads)?;
    }
    values(&ls)
}

/// Which layers stage `s` of `p` holds (as even as 6 layers split).
fn split(s: usize, p: usize) -> std::ops::Range<usize> {
    (s * 6 / p)..((s + 1) * 6 / p)
}

/// A rank's trained parameter values and (the last rank) its step losses.
type RankResult = (Vec<Vec<f32>>, Vec<f64>);

/// Every rank builds the model from the same seed and keeps its layers; returns each rank's
/// trained layers and step losses (the last rank's).
fn pipelined(p: usize, m: usize, kind: ScheduleKind, fail: Option<(usize, usize)>) -> Vec<DistResult<RankResult>> {
    pipelined_with(p, m, kind, fail, true, Duration::from_secs(30))
}

/// `pipelined` under NCCL's point-to-point semantics with `timeout`; `connect`: whether the
/// pipeline makes its connections before the first step (as `Pipeline::new` does).
fn pipelined_with(
    p: usize,
    m: usize,
    kind: ScheduleKind,
    fail: Option<(usize, usize)>,
    connect: bool,
    timeout: Duration,
) -> Vec<DistResult<RankResult>> {
    run_group(ThreadComm::rendezvous_group(p, timeout), |comm| {
        let s = comm.rank();
        let range = split(s, p);
        let first = range.start;
        let mine: Vec<Linear> = layers(7)?[range.clone()].to_vec();
        let params: Vec<(String, Tensor)> = mine
            .iter()
            .enumerate()
            .flat_map(|(i, l)| l.named_parameters().into_iter().map(move |(n, t)| (format!("{}.{n}", first + i), t)))
            .collect();
        let mut opt = adam(params.clone())?;
        let step_no = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let sn = step_no.clone();
        let last = s + 1 == p;
        let fwd_layers = mine.clone();
        let stage = Stage::new(params, move |input, micro| {
            let step = sn.load(std::sync::atomic::Ordering::Relaxed);
            if fail == Some((s, micro)) && step == 1 {
                return Err(ferrograd_core::Error::InvalidArgument(format!("stage {s} refuses micro-batch {micro}")));
            }
            let (x, y) = batch(step)?;
            let r = rows(micro, m);
            let h = match input {
                Some(h) => h.clone(),
                None => x.narrow(0, r.start, r.len())?,
            };
            let out = apply(&fwd_layers, first, &h)?;
            if last {
                weighted_loss(&out, &y, &r)
            } else {
                Ok(out)
            }
        });
        let cfg = PipelineConfig {
            schedule: kind,
            micro_batches: m,
            boundary: Arc::new(move |b, i| vec![rows(i, m).len(), WIDTHS[split(b, p).end]]),
            dtype: DType::F32,
        };
        let mut pipe = match connect {
            true => Pipeline::new(comm.clone(), stage, cfg)?,
            false => Pipeline::unconnected(comm.clone(), stage, cfg)?,
        };
        let mut losses = vec![];
        let start = Instant::now();
        for step in 0..STEPS {
            step_no.store(step, std::sync::atomic::Ordering::Relaxed);
            let st = pipe.step(&mut opt)?;
            assert!(st.peak_held <= m);
            if let Some(l) = st.loss {
                losses.push(l.item_f64()?);
            }
        }
        let compute = pipe.take_compute_ms()?;
        let measure = Measure::gather(comm.as_ref(), m, compute, start.elapsed().as_secs_f64() * 1e3)?;
        assert!((0.0..=1.0).contains(&measure.bubble()), "{measure:?}");
        Ok((values(&mine)?, losses))
    })
}

fn close(a: &[f32], b: &[f32], what: &str) {
    let scale = b.iter().fold(1e-3f32, |m, v| m.max(v.abs()));
    for (x, y) in a.iter().zip(b) {
        assert!((x - y).abs() <= 1e-5 * scale, "{what}: {x} vs {y}");
    }
}

#[test]
fn pipelined_training_equals_the_unsplit_model() {
    for m in [1, 4, 5] {
        let want = reference(m).unwrap();
        for p in [2, 3, 4] {
            let mut by_kind = vec![];
            for kind in [ScheduleKind::GPipe, ScheduleKind::OneFOneB] {
                let got: Vec<Vec<f32>> = pipelined(p, m, kind, None)
                    .into_iter()
                    .flat_map(|r| r.unwrap_or_else(|e| panic!("{kind} p={p} m={m}: {e}")).0)
                    .collect();
                assert_eq!(got.len(), want.len());
                for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                    close(g, w, &format!("{kind} p={p} m={m} tensor {i}"));
                }
                by_kind.push(got);
            }
            for (i, (a, b)) in by_kind[0].iter().zip(&by_kind[1]).enumerate() {
                close(a, b, &format!("gpipe vs 1f1b p={p} m={m} tensor {i}"));
            }
        }
    }
}

/// The first 2 x H200 run hung here: GPipe's stage 0 posts its last activation grouped with its
/// first gradient receive, whose new connection waits for stage 1's first gradient send, while
/// stage 1 waits for that activation. Under NCCL's semantics without the connections made first
/// the thread group reports the hang (a timeout naming the connection) instead of passing, and
/// with them (every other test here) it trains.
#[test]
fn gpipe_without_its_connections_made_first_hangs_under_nccl_semantics() {
    let start = Instant::now();
    let res = pipelined_with(2, 4, ScheduleKind::GPipe, None, false, Duration::from_secs(2));
    assert!(start.elapsed() < Duration::from_secs(20), "took {:?}", start.elapsed());
    let errs: Vec<String> = res.iter().filter_map(|r| r.as_ref().err().map(|e| e.to_string())).collect();
    assert_eq!(errs.len(), 2, "both ranks must fail: {errs:?}");
    // Which wait times out first (rank 0's connection or rank 1's receive) depends on the
    // scheduler: a 2-core CI machine saw the receive first. Either names the hang.
    assert!(errs.iter().all(|e| e.contains("a point-to-point hang")), "{errs:?}");
    // The same run with the connections made first.
    for r in pipelined_with(2, 4, ScheduleKind::GPipe, None, true, Duration::from_secs(30)) {
        r.unwrap();
    }
}

#[test]
fn the_last_stage_reports_the_step_loss() {
    let res = pipelined(2, 4, ScheduleKind::OneFOneB, None);
    let (_, losses) = res.into_iter().last().unwrap().unwrap();
    assert_eq!(losses.len(), STEPS);
    // The step-0 loss is the unsplit model's mean squared error on the first batch.
    let ls = layers(7).unwrap();
    let (x, y) = batch(0).unwrap();
    let want = apply(&ls, 0, &x).unwrap().mse_loss(&y).unwrap().item_f64().unwrap();
    assert!((losses[0] - want).abs() <= 1e-5 * want.abs(), "{} vs {want}", losses[0]);
}

#[test]
fn a_failing_stage_stops_every_rank_with_its_reason() {
    for kind in [ScheduleKind::GPipe, ScheduleKind::OneFOneB] {
        let start = Instant::now();
        let res = pipelined(3, 4, kind, Some((1, 2)));
        // The thread group's timeout is 30 s: an abort ends the step long before.
        assert!(start.elapsed() < Duration::from_secs(20), "{kind}: took {:?}", start.elapsed());
        for (rank, r) in res.iter().enumerate() {
            let e = r.as_ref().err().unwrap_or_else(|| panic!("{kind}: rank {rank} did not fail")).to_string();
            assert!(e.contains("stage 1 refuses micro-batch 2"), "{kind} rank {rank}: {e}");
        }
    }
}

#[test]
fn a_stage_whose_output_differs_from_the_declared_dims_is_named() {
    let res = run_ranks(2, |comm| {
        let stage = Stage::new(vec![], |input, _| match input {
            None => Tensor::ones((3, 4), DType::F32, CPU),
            Some(x) => x.sum_all(),
        });
        let cfg = PipelineConfig {
            schedule: ScheduleKind::GPipe,
            micro_batches: 2,
            boundary: Arc::new(|_, _| vec![3, 5]),
            dtype: DType::F32,
        };
        Pipeline::new(comm, stage, cfg)?.run_micro_batches().map(|_| ())
    });
    let e = res[0].as_ref().unwrap_err().to_string();
    assert!(e.contains("[3, 4]") && e.contains("[3, 5]"), "{e}");
    assert!(res[1].as_ref().unwrap_err().to_string().contains("rank 0 failed"));
}

/// The single-process pipeline with stage `s` on `devs[s]`: trained values of every stage.
fn local(devs: &[Device], m: usize, kind: ScheduleKind) -> Result<Vec<Vec<f32>>> {
    let p = devs.len();
    let mut stage_layers = vec![];
    let mut stages = vec![];
    for (s, &dev) in devs.iter().enumerate() {
        let range = split(s, p);
        let first = range.start;
        let mine: Vec<Linear> = layers_on(7, dev)?[range].to_vec();
        let params: Vec<(String, Tensor)> = mine
            .iter()
            .enumerate()
            .flat_map(|(i, l)| l.named_parameters().into_iter().map(move |(n, t)| (format!("{}.{n}", first + i), t)))
            .collect();
        let fwd = mine.clone();
        let step = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        stage_layers.push((mine, params.clone(), step.clone()));
        let last = s + 1 == p;
        stages.push((
            dev,
            Stage::new(params, move |input, micro| {
                let (x, y) = batch(step.load(std::sync::atomic::Ordering::Relaxed))?;
                let r = rows(micro, m);
                let h = match input {
                    Some(h) => h.clone(),
                    None => x.narrow(0, r.start, r.len())?.to_device(dev)?,
                };
                let out = apply(&fwd, first, &h)?;
                if last {
                    weighted_loss(&out, &y.to_device(dev)?, &r)
                } else {
                    Ok(out)
                }
            }),
        ));
    }
    let mut pipe = LocalPipeline::new(stages, kind, m).map_err(ferrograd_core::Error::from)?;
    let mut opts: Vec<Adam> = stage_layers.iter().map(|(_, p, _)| adam(p.clone())).collect::<Result<_>>()?;
    for step in 0..STEPS {
        for (_, _, c) in &stage_layers {
            c.store(step, std::sync::atomic::Ordering::Relaxed);
        }
        let mut refs: Vec<&mut dyn Optimizer> = opts.iter_mut().map(|o| o as &mut dyn Optimizer).collect();
        pipe.step(&mut refs).map_err(ferrograd_core::Error::from)?;
    }
    let mut out = vec![];
    for (ls, _, _) in &stage_layers {
        out.extend(values(ls)?);
    }
    Ok(out)
}

#[test]
fn the_single_process_pipeline_equals_the_unsplit_model() {
    for m in [1, 4] {
        let want = reference(m).unwrap();
        for p in [2, 3] {
            for kind in [ScheduleKind::GPipe, ScheduleKind::OneFOneB] {
                let got = local(&vec![CPU; p], m, kind).unwrap();
                for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                    close(g, w, &format!("local {kind} p={p} m={m} tensor {i}"));
                }
            }
        }
    }
}

/// Two GPUs of this process, activations over peer copies (skips without two GPUs).
#[test]
fn the_single_process_pipeline_on_two_gpus_equals_one_gpu() {
    let n = ferrograd_core::cuda::device_count().unwrap_or(0);
    if n < 2 {
        println!("skipped the_single_process_pipeline_on_two_gpus_equals_one_gpu: {n} CUDA device(s), 2 needed");
        return;
    }
    let want = reference_on(4, Device::Cuda(0)).unwrap();
    for kind in [ScheduleKind::GPipe, ScheduleKind::OneFOneB] {
        let got = local(&[Device::Cuda(0), Device::Cuda(1)], 4, kind).unwrap();
        for (i, (g, w)) in got.iter().zip(&want).enumerate() {
            close(g, w, &format!("2 GPUs {kind} tensor {i}"));
        }
    }
}

#[test]
fn a_stage_whose_parameters_are_elsewhere_is_refused() {
    let w = Tensor::ones((2, 2), DType::F32, CPU).unwrap().requires_grad();
    let st = Stage::new(vec![("w".into(), w)], |x, _| Ok(x.cloned().unwrap()));
    let e = LocalPipeline::new(vec![(Device::Cuda(0), st)], ScheduleKind::GPipe, 2).err().unwrap().to_string();
    assert!(e.contains("parameter w is on cpu"), "{e}");
}

/// The measured bubble of stages whose forward sleeps 4 ms (backward nearly free: the bubble of
/// both schedules is still (p - 1) / (m + p - 1)) beside the theory, on the thread communicator:
/// prints the numbers, asserts nothing about time (run with --ignored).
#[test]
#[ignore]
fn measured_bubble_of_sleeping_stages() {
    for kind in [ScheduleKind::GPipe, ScheduleKind::OneFOneB] {
        for (p, m) in [(2, 4), (2, 8), (4, 8), (4, 16)] {
            let res = run_ranks(p, |comm| {
                let last = comm.rank() + 1 == p;
                let w = Tensor::ones((1, 1), DType::F32, CPU)?.requires_grad();
                let wf = w.clone();
                let stage = Stage::new(vec![("w".into(), w)], move |x, _| {
                    std::thread::sleep(Duration::from_millis(4));
                    let x = match x {
                        Some(x) => x.clone(),
                        None => Tensor::ones((2, 1), DType::F32, CPU)?,
                    };
                    let y = x.matmul(&wf)?;
                    if last {
                        y.sum_all()
                    } else {
                        Ok(y)
                    }
                });
                let cfg = PipelineConfig {
                    schedule: kind,
                    micro_batches: m,
                    boundary: Arc::new(|_, _| vec![2, 1]),
                    dtype: DType::F32,
                };
                let mut pipe = Pipeline::new(comm.clone(), stage, cfg)?;
                let start = Instant::now();
                for _ in 0..3 {
                    pipe.run_micro_batches()?;
                    pipe.zero_grad();
                }
                let c = pipe.take_compute_ms()?;
                Measure::gather(comm.as_ref(), m, c, start.elapsed().as_secs_f64() * 1e3)
            });
            let ms = res[0].as_ref().unwrap();
            println!(
                "{kind} p={p} m={m}: bubble {:.1}% measured, {:.1}% theory",
                100.0 * ms.bubble(),
                100.0 * ms.theory()
            );
        }
    }
}
