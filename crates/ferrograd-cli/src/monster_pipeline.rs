//! `ferrograd monster-walk --pipeline N`: the autoencoder cut into N stage groups of its eight
//! Linear layers (N = 4 is the design document's encoder 71→47→23, bottleneck 23→11→5, decoder
//! 5→11→23, output 23→47→71), placed on the ranks of `ferrograd launch` (N / ranks consecutive
//! groups per GPU, one stage of the pipeline each), trained with micro-batches under GPipe or 1F1B
//! (`ferrograd_dist::pipeline`). Without a launcher all groups are one stage on one device: the
//! single-GPU baseline of the same step.
//!
//! Rank 0 builds the copies it feeds in, the last rank the same copies as targets; every rank
//! initialises the whole model from the seed (or `--init`) and keeps its layers. Each step takes one
//! batch of one copy, in the order the single-process run takes them, and every micro-batch's loss is
//! weighted by its share of the batch, so the step's gradient is the batch's. The report gives the
//! measured bubble (1 - compute / wall, per rank) beside `(p - 1) / (m + p - 1)`, samples/s, and
//! the memory a step takes above the weights on each stage (on a GPU).

use crate::CliResult;
use ferrograd_core::cuda::CudaDevice;
use ferrograd_core::{DType, Device, Result, Tensor};
use ferrograd_dist::pipeline::{Measure, Pipeline, PipelineConfig, ScheduleKind, Stage};
use ferrograd_dist::{Communicator, ReduceOp};
use ferrograd_models::monster_walk::model::LAYERS;
use ferrograd_models::monster_walk::walk::{RINGS, SAMPLES};
use ferrograd_models::monster_walk::{Autoencoder, CopyData};
use ferrograd_nn::optim::{Adam, AdamConfig};
use ferrograd_nn::{Linear, Module};
use std::path::PathBuf;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Instant;

/// What a pipelined run does.
#[derive(Clone, Debug)]
pub struct PipeRun {
    /// Stage groups the eight layers are cut into (1, 2, 4 or 8).
    pub groups: usize,
    pub micro_batches: usize,
    pub schedule: ScheduleKind,
    pub copies: usize,
    pub epochs: usize,
    pub batch: usize,
    pub lr: f64,
    pub seed: u64,
    pub init: Option<PathBuf>,
}

/// What it measured; every rank returns the same numbers.
#[derive(Debug, Clone, serde::Serialize)]
pub struct PipeReport {
    pub name: String,
    pub groups: usize,
    pub ranks: usize,
    pub schedule: String,
    pub micro_batches: usize,
    /// Layers (in, out) of each rank's stage.
    pub stage_layers: Vec<Vec<(usize, usize)>>,
    pub copies: usize,
    pub epochs: usize,
    pub steps: usize,
    pub batch: usize,
    pub training_time_s: f64,
    pub samples_per_s: f64,
    pub first_loss: f64,
    pub final_loss: f64,
    pub bubble_measured: f64,
    pub bubble_theory: f64,
    /// Per rank: bytes allocated during one step above what was allocated before it (activations
    /// held between forward and backward, gradients, temporaries); `None` on the CPU.
    pub step_memory_bytes: Option<Vec<usize>>,
    /// Per rank: most micro-batches whose activations the stage held at once.
    pub peak_held: Vec<usize>,
    pub device: String,
    /// The trained weights in the model's order (filled on every rank).
    #[serde(skip)]
    pub weights: Vec<Tensor>,
}

/// The check that needs no device.
pub fn check(groups: usize, micro_batches: usize, batch: usize) -> std::result::Result<(), String> {
    if ![1, 2, 4, 8].contains(&groups) {
        return Err(format!(
            "--pipeline {groups}: the eight layers split evenly into 1, 2, 4 or 8 stage groups (4: the design \
             document's encoder, bottleneck, decoder, output)"
        ));
    }
    if micro_batches == 0 || micro_batches > batch {
        return Err(format!("--micro-batches {micro_batches} must be between 1 and the batch ({batch})"));
    }
    Ok(())
}

/// Rows of micro-batch `i` of `m` in a batch of `b` rows.
fn rows(i: usize, m: usize, b: usize) -> std::ops::Range<usize> {
    (i * b / m)..((i + 1) * b / m)
}

fn apply(layers: &[Linear], first: usize, x: &Tensor) -> Result<Tensor> {
    let mut h = x.clone();
    for (k, l) in layers.iter().enumerate() {
        h = l.forward(&h)?;
        if first + k + 1 < LAYERS.len() {
            h = h.relu()?;
        }
    }
    Ok(h)
}

/// Train on `comm`'s ranks (one stage each) with this rank's tensors on `device`.
pub fn train(comm: Arc<dyn Communicator>, device: Device, run: &PipeRun) -> CliResult<PipeReport> {
    let (rank, world) = (comm.rank(), comm.world_size());
    check(run.groups, run.micro_batches, run.batch)?;
    if !run.groups.is_multiple_of(world) {
        return Err(format!(
            "--pipeline {}: {} ranks cannot hold the stage groups evenly (use a rank count dividing it)",
            run.groups, world
        )
        .into());
    }
    // Every micro-batch needs a row, the short last batch of a copy included.
    let smallest = match SAMPLES % run.batch {
        0 => run.batch,
        r => r,
    };
    if run.micro_batches > smallest {
        return Err(format!(
            "--micro-batches {}: the last batch of each copy has {smallest} rows ({SAMPLES} = 5041 samples in \
             batches of {}); use at most {smallest} micro-batches or another --batch",
            run.micro_batches, run.batch
        )
        .into());
    }
    let per_rank = LAYERS.len() / world;
    let first = rank * per_rank;
    let model = match &run.init {
        Some(p) => Autoencoder::load(p, device)?,
        None => Autoencoder::init(run.seed, device)?,
    };
    let mine: Vec<Linear> = model.layers[first..first + per_rank].to_vec();
    let params: Vec<(String, Tensor)> = mine
        .iter()
        .enumerate()
        .flat_map(|(k, l)| l.named_parameters().into_iter().map(move |(n, t)| (format!("{}.{n}", 2 * (first + k)), t)))
        .collect();
    let mut opt = Adam::new(params.clone(), AdamConfig { lr: run.lr, ..AdamConfig::default() })?;

    // The copies' batches, in the single-process order, on the ranks that read them.
    let (is_first, is_last) = (rank == 0, rank + 1 == world);
    let mut batches: Vec<Tensor> = vec![];
    if is_first || is_last {
        for c in 0..run.copies {
            let x = CopyData::build(c, device)?.samples()?;
            for s in (0..SAMPLES).step_by(run.batch) {
                batches.push(x.narrow(0, s, run.batch.min(SAMPLES - s))?);
            }
        }
    }
    let steps_per_epoch = run.copies * SAMPLES.div_ceil(run.batch);
    let batch_rows = |k: usize| run.batch.min(SAMPLES - (k % SAMPLES.div_ceil(run.batch)) * run.batch);

    // A fault to inject, for the test that a failing stage stops every rank:
    // FERROGRAD_PIPELINE_FAIL=RANK makes that rank's forward fail at the third step.
    let fail_here = std::env::var("FERROGRAD_PIPELINE_FAIL").ok().and_then(|v| v.parse::<usize>().ok()) == Some(rank);
    let step_no = Arc::new(AtomicUsize::new(0));
    let cur_rows = Arc::new(AtomicUsize::new(batch_rows(0)));
    let m = run.micro_batches;
    let stage = {
        let (step_no, cur_rows, batches, layers) = (step_no.clone(), cur_rows.clone(), batches.clone(), mine.clone());
        Stage::new(params, move |input, micro| {
            let b = cur_rows.load(Ordering::Relaxed);
            let r = rows(micro, m, b);
            if fail_here && step_no.load(Ordering::Relaxed) == 2 {
                return Err(ferrograd_core::Error::InvalidArgument(format!(
                    "injected failure (FERROGRAD_PIPELINE_FAIL={rank}) at step 2, micro-batch {micro}"
                )));
            }
            let batch = || {
                batches.get(step_no.load(Ordering::Relaxed) % steps_per_epoch).ok_or_else(|| {
                    ferrograd_core::Error::InvalidArgument("this rank holds no Monster Walk data".into())
                })
            };
            let h = match input {
                Some(h) => h.clone(),
                None => batch()?.narrow(0, r.start, r.len())?,
            };
            let out = apply(&layers, first, &h)?;
            if is_last {
                out.mse_loss(&batch()?.narrow(0, r.start, r.len())?)?.mul_scalar(r.len() as f64 / b as f64)
            } else {
                Ok(out)
            }
        })
    };
    let boundary = {
        let cur_rows = cur_rows.clone();
        Arc::new(move |s: usize, micro: usize| {
            let b = cur_rows.load(Ordering::Relaxed);
            vec![rows(micro, m, b).len(), LAYERS[(s + 1) * per_rank - 1].1]
        })
    };
    let cfg = PipelineConfig { schedule: run.schedule, micro_batches: m, boundary, dtype: DType::F32 };
    let mut pipe = Pipeline::new(comm.clone(), stage, cfg)?;

    let dev = match device {
        Device::Cuda(o) => Some(CudaDevice::get(o)?),
        Device::Cpu => None,
    };
    let total_steps = run.epochs * steps_per_epoch;
    // The step measured for memory: after warm-up (kernels loaded, Adam's state made).
    let probe = 3.min(total_steps - 1);
    let mut step_mem = 0usize;
    let (mut peak_held, mut first_loss, mut last_loss) = (0usize, None, None);
    comm.barrier()?;
    let start = Instant::now();
    for k in 0..total_steps {
        step_no.store(k, Ordering::Relaxed);
        cur_rows.store(batch_rows(k), Ordering::Relaxed);
        let base = dev.as_ref().filter(|_| k == probe).map(|d| {
            d.reset_peak_stats();
            d.memory_stats().allocated_bytes.current
        });
        let st = pipe.step(&mut opt)?;
        if let (Some(b), Some(d)) = (base, &dev) {
            step_mem = d.memory_stats().allocated_bytes.peak.saturating_sub(b);
        }
        peak_held = peak_held.max(st.peak_held);
        if let Some(l) = st.loss {
            if k == 0 {
                first_loss = Some(l.clone());
            }
            last_loss = Some(l);
        }
    }
    device.synchronize()?;
    let wall_ms = start.elapsed().as_secs_f64() * 1e3;
    let compute_ms = pipe.take_compute_ms()?;
    let measure = Measure::gather(comm.as_ref(), m, compute_ms, wall_ms)?;

    // Everything every rank reports, gathered by sums of one-hot slots.
    let read = |t: Option<Tensor>| -> Result<f64> { t.map_or(Ok(0.0), |t| t.item_f64()) };
    let (fl, ll) = (read(first_loss)?, read(last_loss)?);
    let mut slots = vec![0.0f64; 2 + 2 * world];
    slots[0] = fl;
    slots[1] = ll;
    slots[2 + rank] = step_mem as f64;
    slots[2 + world + rank] = peak_held as f64;
    let t = Tensor::from_vec(slots, 2 + 2 * world, Device::Cpu)?.to_device(comm.device())?;
    comm.all_reduce(&t, ReduceOp::Sum)?.wait()?;
    let g = t.to_vec::<f64>()?;
    // The trained weights: each rank fills its layers' slots of the model's flat vector.
    let sizes: Vec<usize> = model.parameters().iter().map(|p| p.elem_count()).collect();
    let mut flat = vec![0.0f32; sizes.iter().sum()];
    let mut off = 0;
    for (i, p) in model.parameters().iter().enumerate() {
        if (2 * first..2 * (first + per_rank)).contains(&i) {
            flat[off..off + sizes[i]].copy_from_slice(&p.to_vec::<f32>()?);
        }
        off += sizes[i];
    }
    let ft = Tensor::from_vec(flat, off, Device::Cpu)?.to_device(comm.device())?;
    comm.all_reduce(&ft, ReduceOp::Sum)?.wait()?;
    let all = ft.to_vec::<f32>()?;
    let mut weights = vec![];
    let mut off = 0;
    for p in model.parameters() {
        weights.push(Tensor::from_vec(all[off..off + p.elem_count()].to_vec(), p.dims(), Device::Cpu)?);
        off += p.elem_count();
    }

    let training_time_s = wall_ms / 1e3;
    Ok(PipeReport {
        name: "monster-walk --pipeline".into(),
        groups: run.groups,
        ranks: world,
        schedule: run.schedule.to_string(),
        micro_batches: m,
        stage_layers: (0..world).map(|r| LAYERS[r * per_rank..(r + 1) * per_rank].to_vec()).collect(),
        copies: run.copies,
        epochs: run.epochs,
        steps: total_steps,
        batch: run.batch,
        training_time_s,
        samples_per_s: (run.epochs * run.copies * SAMPLES) as f64 / training_time_s.max(1e-9),
        first_loss: g[0],
        final_loss: g[1],
        bubble_measured: measure.bubble(),
        bubble_theory: measure.theory(),
        step_memory_bytes: dev.map(|_| (0..world).map(|r| g[2 + r] as usize).collect()),
        peak_held: (0..world).map(|r| g[2 + world + r] as usize).collect(),
        device: device.to_string(),
        weights,
    })
}

/// Print the report (rank 0).
pub fn table(r: &PipeReport, out: &mut dyn std::io::Write) -> CliResult<()> {
    // Each rank's stage groups, "71→47→23 + 23→11→5" (one GPU holds "+"-joined groups).
    let per_group = LAYERS.len() / r.groups;
    let stages: Vec<String> = r
        .stage_layers
        .iter()
        .map(|ls| {
            ls.chunks(per_group)
                .map(|g| {
                    let mut w = vec![g[0].0];
                    w.extend(g.iter().map(|l| l.1));
                    w.iter().map(|x| x.to_string()).collect::<Vec<_>>().join("→")
                })
                .collect::<Vec<_>>()
                .join(" + ")
        })
        .collect();
    let mem = match &r.step_memory_bytes {
        Some(v) => v.iter().map(|&b| ferrograd_models::monster_walk::plan::human(b)).collect::<Vec<_>>().join(", "),
        None => "not measured on the CPU".into(),
    };
    let rows = [
        ("pipeline", format!("{} stage groups on {} rank(s): {}", r.groups, r.ranks, stages.join(" | "))),
        ("schedule", format!("{}, {} micro-batches per step", r.schedule, r.micro_batches)),
        ("copies x epochs", format!("{} x {} = {} steps of {} samples", r.copies, r.epochs, r.steps, r.batch)),
        ("training time", format!("{:.3} s", r.training_time_s)),
        ("samples/s", format!("{:.0}", r.samples_per_s)),
        ("entries/s", format!("{:.3e}", r.samples_per_s * RINGS as f64)),
        ("loss", format!("{:.6} -> {:.6}", r.first_loss, r.final_loss)),
        (
            "bubble",
            format!("{:.1}% measured, {:.1}% theory (p-1)/(m+p-1)", 100.0 * r.bubble_measured, 100.0 * r.bubble_theory),
        ),
        ("step memory", format!("{mem} (per stage, above the weights)")),
        ("held micro-batches", r.peak_held.iter().map(|x| x.to_string()).collect::<Vec<_>>().join(", ")),
    ];
    for (k, v) in rows {
        writeln!(out, "  {k:<18} {v}")?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use ferrograd_dist::testing::run_ranks;
    use ferrograd_dist::Solo;

    fn small(groups: usize, schedule: ScheduleKind) -> PipeRun {
        PipeRun {
            groups,
            micro_batches: 3,
            schedule,
            copies: 1,
            epochs: 1,
            batch: 1200, // 5 steps a copy, the last of 241 rows
            lr: 1e-3,
            seed: 5,
            init: None,
        }
    }

    fn close(a: &[Tensor], b: &[Tensor]) {
        for (x, y) in a.iter().zip(b) {
            let (x, y) = (x.to_vec::<f32>().unwrap(), y.to_vec::<f32>().unwrap());
            let scale = y.iter().fold(1e-3f32, |m, v| m.max(v.abs()));
            for (p, q) in x.iter().zip(&y) {
                assert!((p - q).abs() <= 1e-5 * scale, "{p} vs {q}");
            }
        }
    }

    #[test]
    fn four_groups_on_two_and_four_ranks_train_as_one_device_does() {
        let one = train(Arc::new(Solo::new(Device::Cpu)), Device::Cpu, &small(4, ScheduleKind::GPipe)).unwrap();
        assert_eq!(one.steps, 5);
        for ranks in [2, 4] {
            for kind in [ScheduleKind::GPipe, ScheduleKind::OneFOneB] {
                let rs = run_ranks(ranks, |c| train(c, Device::Cpu, &small(4, kind)).map_err(|e| e.to_string()));
                for r in rs {
                    let r = r.unwrap();
                    assert_eq!(r.stage_layers.len(), ranks);
                    close(&r.weights, &one.weights);
                    assert!((r.final_loss - one.final_loss).abs() <= 1e-5 * one.final_loss);
                    assert!((0.0..=1.0).contains(&r.bubble_measured));
                }
            }
        }
        // The unsplit model's first loss: the batch's mean squared error at the seed's weights.
        let m = Autoencoder::init(5, Device::Cpu).unwrap();
        let x = CopyData::build(0, Device::Cpu).unwrap().samples().unwrap().narrow(0, 0, 1200).unwrap();
        let want = m.loss(&x).unwrap().item_f64().unwrap();
        assert!((one.first_loss - want).abs() <= 1e-6 * want, "{} vs {want}", one.first_loss);
    }

    #[test]
    fn uneven_placements_are_refused() {
        let rs = run_ranks(3, |c| {
            train(c, Device::Cpu, &small(4, ScheduleKind::GPipe)).map(|_| ()).map_err(|e| e.to_string())
        });
        assert!(rs[0].as_ref().unwrap_err().contains("3 ranks"), "{:?}", rs[0]);
        assert!(check(3, 4, 100).is_err() && check(4, 0, 100).is_err() && check(4, 200, 100).is_err());
        // 5041 in batches of 1000: the last has 41 rows, too few for 64 micro-batches.
        let run = PipeRun { micro_batches: 64, batch: 1000, ..small(4, ScheduleKind::GPipe) };
        let e = train(Arc::new(Solo::new(Device::Cpu)), Device::Cpu, &run).unwrap_err().to_string();
        assert!(e.contains("41 rows"), "{e}");
    }
}
