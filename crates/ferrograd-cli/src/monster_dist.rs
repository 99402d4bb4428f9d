//! `ferrograd monster-walk` under `ferrograd launch` (or torchrun): data parallel, one GPU per
//! process. Each GPU fills itself with copies of its own (rank r holds copies r*n .. (r+1)*n, n
//! agreed as the smallest any rank can hold), trains one copy per step with its fastest step
//! that can communicate (the fused two-kernel step, the 9,690 gradients all-reduced between its
//! two kernels), and reports the share of the run the all-reduces took.

use crate::CliResult;
use ferrograd_core::{DType, Device, Tensor};
use ferrograd_dist::{Communicator, DistEnv, ProcessGroup, ReduceOp};
use ferrograd_models::monster_walk::train::DistHooks;
use std::sync::Arc;

/// The process group when launched with more than one process, else `None`.
pub fn group() -> CliResult<Option<ProcessGroup>> {
    match DistEnv::from_env()? {
        Some(env) if env.world_size > 1 => Ok(Some(ProcessGroup::from_env(env)?)),
        _ => Ok(None),
    }
}

/// The device a training command runs on, and why: under a launch this rank's GPU (LOCAL_RANK;
/// a `--device` naming another is an error), else `--device`, else the best one present.
/// `gpt train` and `monster-walk` both choose this way.
pub fn device_for(pg: Option<&ProcessGroup>, requested: Option<Device>) -> CliResult<(Device, String)> {
    Ok(match (pg, requested) {
        (Some(pg), Some(d)) if d != pg.device() => {
            return Err(format!(
                "--device {d}: under launch, rank {} trains on {} (LOCAL_RANK)",
                pg.rank(),
                pg.device()
            )
            .into())
        }
        (Some(pg), _) => (pg.device(), format!("rank {} of {}, data parallel", pg.rank(), pg.world_size())),
        (None, Some(d)) => (d, "--device".to_string()),
        (None, None) => Device::best_with_reason()?,
    })
}

/// What the training run needs from the group; times every collective on the device.
pub fn hooks(pg: &ProcessGroup) -> DistHooks {
    let comm = pg.comm();
    comm.set_timing(true);
    let (c1, c2, c3) = (comm.clone(), comm.clone(), comm.clone());
    DistHooks {
        rank: pg.rank(),
        world: pg.world_size(),
        all_reduce_mean: Arc::new(move |t| Ok(c1.all_reduce(t, ReduceOp::Avg)?.wait()?)),
        broadcast: Arc::new(move |t| Ok(c2.broadcast(t, 0)?.wait()?)),
        min: Arc::new(move |v| {
            let t = Tensor::full(v as f64, 1, DType::F64, c3.device())?;
            c3.all_reduce(&t, ReduceOp::Min)?.wait()?;
            Ok(t.item_f64()? as usize)
        }),
    }
}

/// Device time of the collectives over the training's wall time.
pub fn allreduce_share(comm: &Arc<dyn Communicator>, training_time_s: f64) -> CliResult<f64> {
    let s = comm.stats()?;
    Ok(s.device_ms / 1e3 / training_time_s.max(1e-9))
}
