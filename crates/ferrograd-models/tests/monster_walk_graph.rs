//! Monster Walk's autograd step replayed as a CUDA graph trains exactly like the eager step: same
//! losses and the same weights, bit for bit, including a batch size that leaves a shorter last
//! batch (two graphs). Prints one line and passes where no GPU is usable.

use ferrograd_core::cuda::CudaDevice;
use ferrograd_core::{Device, Result};
use ferrograd_models::monster_walk::{run, PlanRequest, TrainConfig};

#[test]
fn graph_replay_trains_exactly_like_eager_steps() -> Result<()> {
    if let Err(e) = CudaDevice::get(0) {
        println!("skipping CUDA test: {e}");
        return Ok(());
    }
    let dir = std::env::temp_dir().join(format!("fg-mw-graph-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    for batch in [5041, 2000] {
        let train = |graph: bool| -> Result<(f64, f64, bool, Vec<u8>)> {
            let path = dir.join(format!("w-{batch}-{graph}.safetensors"));
            let cfg = TrainConfig {
                plan: PlanRequest::Copies(2),
                epochs: 4,
                batch,
                fused: false,
                graph,
                seed: 3,
                save: Some(path.clone()),
                ..TrainConfig::spec_defaults(Device::Cuda(0))
            };
            let r = run(&cfg, |_| {})?.0;
            Ok((r.first_loss, r.final_loss, r.cuda_graph, std::fs::read(&path)?))
        };
        let (eager, graph) = (train(false)?, train(true)?);
        assert!(!eager.2 && graph.2, "the report says which ran");
        println!("batch {batch}: eager loss {} -> {}, graph {} -> {}", eager.0, eager.1, graph.0, graph.1);
        assert_eq!((eager.0, eager.1), (graph.0, graph.1), "batch {batch}: losses");
        assert!(eager.3 == graph.3, "batch {batch}: trained weights differ");
    }
    std::fs::remove_dir_all(&dir)?;
    Ok(())
}
