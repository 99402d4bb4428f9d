//! The kernel modules a Monster Walk run loads on a GPU are the ones `monster_walk::kernels`
//! lists (what a run warms at its start and loads before its timed loop): a module outside the
//! list would compile inside the timed loop on a cold kernel cache. Its own test binary, so that
//! the device's loaded modules are this test's alone. Prints one line and passes without a GPU.

mod common;

use common::gpu;
use ferrograd_core::cuda::CudaDevice;
use ferrograd_core::{Device, Result};
use ferrograd_models::monster_walk::plan::PlanRequest;
use ferrograd_models::monster_walk::{kernels, run, TrainConfig};
use std::collections::BTreeSet;

#[test]
fn cuda_runs_load_only_the_modules_they_list() -> Result<()> {
    let Some(dev) = gpu() else { return Ok(()) };
    let Device::Cuda(o) = dev else { return Ok(()) };
    let cuda = CudaDevice::get(o)?;
    let small = TrainConfig { plan: PlanRequest::Copies(2), epochs: 2, ..TrainConfig::spec_defaults(dev) };
    let steps = [
        ("persistent", small.clone()),
        ("fused", TrainConfig { persistent: false, ..small.clone() }),
        ("fused, skipping non-finite steps", TrainConfig { skip_nonfinite: true, ..small.clone() }),
        ("autograd, graph", TrainConfig { fused: false, ..small.clone() }),
        ("autograd, eager", TrainConfig { fused: false, graph: false, ..small.clone() }),
    ];
    // Loaded modules accumulate over the runs, so each run is checked against every list so far.
    let mut listed = BTreeSet::new();
    for (what, cfg) in steps {
        let list = kernels::modules(&cfg, &cuda)?;
        listed.extend(list.iter().map(|m| m.name));
        let (report, _) = run(&cfg, |_| {})?;
        let loaded: BTreeSet<&str> = cuda.loaded_modules().into_iter().collect();
        let extra: Vec<&&str> = loaded.difference(&listed).collect();
        println!("{what} ({}): listed {:?}", report.step_kind, list.iter().map(|m| m.name).collect::<Vec<_>>());
        assert!(extra.is_empty(), "{what}: loaded {extra:?}, which monster_walk::kernels does not list");
    }
    Ok(())
}
