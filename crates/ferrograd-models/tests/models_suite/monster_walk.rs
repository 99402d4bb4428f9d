//! Monster Walk end to end: device-built data against the integer reference, training on the CPU,
//! CPU/CUDA agreement, the memory plan under a 12 GB cap, and the report. CUDA tests print one
//! line and pass where no GPU is usable.

use crate::common;

use common::gpu;
use ferrograd_core::cuda::CudaDevice;
use ferrograd_core::{Device, Result};
use ferrograd_models::monster_walk::plan::{measure_copy, plan, PlanRequest};
use ferrograd_models::monster_walk::walk::residues_reference;
use ferrograd_models::monster_walk::{run, Autoencoder, CopyData, Report, TrainConfig};

fn small(device: Device, copies: usize, epochs: usize) -> TrainConfig {
    TrainConfig { plan: PlanRequest::Copies(copies), epochs, ..TrainConfig::spec_defaults(device) }
}

#[test]
fn short_cpu_training_lowers_the_loss_and_reports_every_field() -> Result<()> {
    let mut epochs_seen = 0;
    let (r, p) = run(&small(Device::Cpu, 3, 8), |s| {
        epochs_seen += 1;
        assert!(s.loss.is_finite() && s.samples_per_s > 0.0);
    })?;
    assert_eq!(epochs_seen, 8);
    assert_eq!((r.copies, r.steps, p.copies), (3, 24, 3));
    assert!(r.final_loss < 0.8 * r.first_loss, "{} -> {}", r.first_loss, r.final_loss);
    assert_eq!(r.total_entries, 3 * 357_911);
    assert_eq!(r.memory_measured_bytes, r.memory_planned_bytes);
    assert_eq!(r.parameters, 9_690);
    let json = serde_json::to_value(&r).map_err(|e| ferrograd_core::Error::InvalidArgument(e.to_string()))?;
    for key in [
        "name",
        "tensor_shape",
        "copies",
        "total_entries",
        "memory_planned_bytes",
        "memory_measured_bytes",
        "device",
        "training_time_s",
        "samples_per_s",
        "entries_per_s",
        "first_loss",
        "final_loss",
        "seed",
        "ferrograd_version",
    ] {
        assert!(json.get(key).is_some(), "report lacks {key}");
    }
    let back: Report =
        serde_json::from_value(json).map_err(|e| ferrograd_core::Error::InvalidArgument(e.to_string()))?;
    assert_eq!(back, r);
    Ok(())
}

#[test]
fn cuda_data_is_identical_to_cpu() -> Result<()> {
    let Some(dev) = gpu() else { return Ok(()) };
    for copy in [0, 94, 112] {
        let (c, g) = (CopyData::build(copy, Device::Cpu)?, CopyData::build(copy, dev)?);
        assert_eq!(g.residues.to_vec::<u8>()?, residues_reference(copy));
        assert_eq!(g.values.to_vec::<f32>()?, c.values.to_vec::<f32>()?);
        assert_eq!(g.ring_onehot.to_vec::<f32>()?, c.ring_onehot.to_vec::<f32>()?);
        let (a, b) = (g.complex.to_vec::<f32>()?, c.complex.to_vec::<f32>()?);
        assert!(a.iter().zip(&b).all(|(x, y)| (x - y).abs() < 1e-6));
    }
    Ok(())
}

#[test]
fn cpu_and_cuda_losses_agree_after_20_steps() -> Result<()> {
    let Some(dev) = gpu() else { return Ok(()) };
    let dir = std::env::temp_dir().join(format!("fg-mw-parity-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    let init = dir.join("init.safetensors");
    Autoencoder::init(11, Device::Cpu)?.save(&init)?;
    let cfg = |d| TrainConfig { init: Some(init.clone()), ..small(d, 2, 10) };
    let (c, _) = run(&cfg(Device::Cpu), |_| {})?;
    let (g, _) = run(&cfg(dev), |_| {})?;
    assert_eq!(c.steps, 20);
    let rel = (c.final_loss - g.final_loss).abs() / c.final_loss.abs();
    println!("cpu {} cuda {} rel {rel:e}", c.final_loss, g.final_loss);
    assert!(rel < 1e-4, "cpu {} vs cuda {}", c.final_loss, g.final_loss);
    assert!((c.first_loss - g.first_loss).abs() / c.first_loss < 1e-5);
    std::fs::remove_dir_all(&dir)?;
    Ok(())
}

#[test]
fn fused_step_matches_the_autograd_path_on_cuda() -> Result<()> {
    let Some(dev) = gpu() else { return Ok(()) };
    let run_kind = |fused| -> Result<Report> {
        let cfg = TrainConfig { fused, persistent: false, seed: 5, ..small(dev, 3, 7) };
        Ok(run(&cfg, |_| {})?.0)
    };
    let (f, a) = (run_kind(true)?, run_kind(false)?);
    assert_eq!((f.step_kind.as_str(), a.step_kind.as_str()), ("fused", "autograd"));
    assert_eq!(f.steps, 21);
    assert!((f.first_loss - a.first_loss).abs() / a.first_loss < 1e-5, "{} vs {}", f.first_loss, a.first_loss);
    let rel = (f.final_loss - a.final_loss).abs() / a.final_loss;
    println!("fused {} autograd {} rel {rel:e}", f.final_loss, a.final_loss);
    assert!(rel < 1e-4, "fused {} vs autograd {}", f.final_loss, a.final_loss);
    Ok(())
}

/// The default CUDA run is the persistent kernel; it reports every epoch while it runs, writes the
/// trained weights back (--save) and lands where the autograd path lands.
#[test]
fn persistent_run_is_the_default_and_matches_the_autograd_path() -> Result<()> {
    let Some(dev) = gpu() else { return Ok(()) };
    let dir = std::env::temp_dir().join(format!("fg-mw-persist-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    let save = dir.join("trained.safetensors");
    let mut epochs = vec![];
    let cfg = TrainConfig { seed: 5, save: Some(save.clone()), ..small(dev, 3, 7) };
    let (p, _) = run(&cfg, |s| epochs.push((s.epoch, s.steps, s.loss)))?;
    let (a, _) = run(&TrainConfig { fused: false, seed: 5, ..small(dev, 3, 7) }, |_| {})?;
    assert_eq!((p.step_kind.as_str(), p.steps, p.step_fallback.as_deref()), ("persistent", 21, None));
    assert!(p.precision.as_deref().is_some_and(|s| s.contains("3xTF32")), "{:?}", p.precision);
    assert_eq!(epochs.iter().map(|e| (e.0, e.1)).collect::<Vec<_>>(), (1..=7).map(|e| (e, 3 * e)).collect::<Vec<_>>());
    assert_eq!(epochs[6].2, p.final_loss);
    let phases = p.phases.clone().map(|ph| ph.phases.len());
    assert_eq!(phases, Some(6));
    assert!((p.first_loss - a.first_loss).abs() / a.first_loss < 1e-5, "{} vs {}", p.first_loss, a.first_loss);
    let rel = (p.final_loss - a.final_loss).abs() / a.final_loss;
    println!("persistent {} autograd {} rel {rel:e}", p.final_loss, a.final_loss);
    assert!(rel < 1e-4, "persistent {} vs autograd {}", p.final_loss, a.final_loss);
    // The saved weights are the trained ones: their loss on copy 0 is below the first loss.
    let trained = Autoencoder::load(&save, dev)?;
    let x = CopyData::build(0, dev)?.samples()?;
    assert!(trained.loss(&x)?.item_f64()? < 0.9 * p.first_loss);
    std::fs::remove_dir_all(&dir)?;
    Ok(())
}

#[test]
fn memory_fits_12gb() -> Result<()> {
    let budget = 12_000_000_000usize;
    let Some(dev) = gpu() else {
        // On the CPU: the planner's arithmetic against the bytes the tensors really hold.
        let (c, measured) = measure_copy(Device::Cpu)?;
        let p = plan(PlanRequest::Budget(budget), measured, None)?;
        assert_eq!(measured, c.bytes());
        assert!(p.copies >= 1 && p.planned_bytes == p.copies * c.bytes());
        assert!(p.planned_bytes + p.reserve_bytes <= budget);
        return Ok(());
    };
    let cd = CudaDevice::get(0)?;
    cd.synchronize()?;
    cd.empty_cache()?;
    let stats = cd.memory_stats();
    let base = stats.allocated_bytes.current;
    // The cap is on reserved bytes: what other tests of this binary still hold (workspaces,
    // cached plans, their live tensors) stays outside the 12 GB this run is given.
    cd.set_memory_limit(Some(stats.reserved_bytes.current + budget));
    let result = (|| -> Result<(usize, usize, usize)> {
        let (first, measured) = measure_copy(dev)?;
        let p = plan(PlanRequest::Budget(budget), measured, None)?;
        let mut held = vec![first];
        for c in 1..p.copies {
            held.push(CopyData::build(c, dev)?);
        }
        cd.synchronize()?;
        let now = cd.memory_stats().allocated_bytes.current - base;
        Ok((p.copies, p.planned_bytes, now))
    })();
    cd.set_memory_limit(None);
    let (copies, planned, measured) = result?;
    println!("12 GB plan: {copies} copies, planned {planned} B, measured {measured} B");
    assert!(copies >= 100, "{copies}");
    let err = (measured as f64 - planned as f64).abs() / planned as f64;
    assert!(err < 0.01, "measured {measured} vs planned {planned}");
    Ok(())
}

/// Data-parallel hooks over `comm` (what `ferrograd monster-walk` under `launch` builds).
fn hooks(comm: std::sync::Arc<dyn ferrograd_dist::Communicator>) -> ferrograd_models::monster_walk::train::DistHooks {
    use ferrograd_core::{DType, Tensor};
    use ferrograd_dist::ReduceOp;
    let (c1, c2, c3) = (comm.clone(), comm.clone(), comm.clone());
    ferrograd_models::monster_walk::train::DistHooks {
        rank: comm.rank(),
        world: comm.world_size(),
        all_reduce_mean: std::sync::Arc::new(move |t| Ok(c1.all_reduce(t, ReduceOp::Avg)?.wait()?)),
        broadcast: std::sync::Arc::new(move |t| Ok(c2.broadcast(t, 0)?.wait()?)),
        min: std::sync::Arc::new(move |v| {
            let t = Tensor::full(v as f64, 1, DType::F64, c3.device())?;
            c3.all_reduce(&t, ReduceOp::Min)?.wait()?;
            Ok(t.item_f64()? as usize)
        }),
    }
}

#[test]
fn data_parallel_on_one_rank_is_the_plain_run() -> Result<()> {
    let mut devices = vec![(Device::Cpu, false)];
    devices.extend(gpu().map(|d| (d, true)));
    for (dev, fused) in devices {
        // The plain run on the same step (fused, not persistent: data parallel never takes the
        // single-GPU persistent kernel).
        let plain = run(&TrainConfig { fused, persistent: false, seed: 2, ..small(dev, 2, 3) }, |_| {})?.0;
        let solo = std::sync::Arc::new(ferrograd_dist::Solo::new(dev));
        let dp = TrainConfig { fused, seed: 2, dist: Some(hooks(solo)), ..small(dev, 2, 3) };
        let d = run(&dp, |_| {})?.0;
        assert_eq!((d.world_size, d.copies, d.steps), (1, 2, 6));
        let rel = (d.final_loss - plain.final_loss).abs() / plain.final_loss;
        println!("{dev} fused={fused}: data-parallel step on one rank vs plain: {rel:e}");
        assert!(rel < 1e-5, "{dev}: {} vs {}", d.final_loss, plain.final_loss);
    }
    Ok(())
}

/// What differs between two safetensors files: tensors by name, then the header.
fn file_differences(a: &[u8], b: &[u8]) -> Vec<String> {
    let (sa, sb) =
        (safetensors::SafeTensors::deserialize(a).unwrap(), safetensors::SafeTensors::deserialize(b).unwrap());
    let mut out = vec![];
    for (name, ta) in sa.tensors() {
        match sb.tensor(&name) {
            Ok(tb) if tb.data() == ta.data() => {}
            Ok(_) => out.push(format!("tensor {name} differs")),
            Err(_) => out.push(format!("tensor {name} missing from the second file")),
        }
    }
    let header = |x: &[u8]| {
        let n = u64::from_le_bytes(x[..8].try_into().unwrap()) as usize;
        String::from_utf8_lossy(&x[8..8 + n]).into_owned()
    };
    if out.is_empty() && a != b {
        out.push(format!("same tensors, different headers:\n{}\n{}", header(a), header(b)));
    }
    out
}

#[test]
fn two_ranks_train_their_own_copies_in_lockstep() {
    // This failed intermittently with identical weights: the checkpoint header's metadata came
    // out in HashMap order (ferrograd-nn's checkpoint now sorts it); `file_differences` says
    // which part differs should it fail again.
    let reports = ferrograd_dist::testing::run_ranks(2, |comm| {
        let dir = std::env::temp_dir().join(format!("mw-dp-{}-{}", std::process::id(), comm.rank()));
        std::fs::create_dir_all(&dir).unwrap();
        let save = dir.join("w.safetensors");
        let cfg =
            TrainConfig { fused: false, save: Some(save.clone()), dist: Some(hooks(comm)), ..small(Device::Cpu, 2, 4) };
        let r = run(&cfg, |_| {}).unwrap().0;
        (r, std::fs::read(&save).unwrap())
    });
    let (a, b) = (&reports[0], &reports[1]);
    let diff = file_differences(&a.1, &b.1);
    assert!(diff.is_empty() && a.1 == b.1, "both ranks must end with the same file: {diff:?}");
    assert_eq!((a.0.world_size, a.0.copies, a.0.total_entries, a.0.steps), (2, 4, 4 * 357_911, 8));
    assert!(a.0.final_loss < a.0.first_loss, "{} -> {}", a.0.first_loss, a.0.final_loss);
}
