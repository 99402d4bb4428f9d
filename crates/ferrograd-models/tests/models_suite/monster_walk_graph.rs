//! Monster Walk's autograd step replayed as a CUDA graph trains exactly like the eager step: same
//! losses and the same weights, bit for bit, including a batch size that leaves a shorter last
//! batch (two graphs). Prints one line and passes where no GPU is usable.
//!
//! cuBLASLt autotuning is off here (`blaslt::without_tuning`): the graph path times its plans'
//! candidates during warm-up and keeps the fastest, which can differ from run to run and from the
//! eager path's choice; different algorithms round differently (1-ulp weight differences in 2 of 4
//! runs on an H100, 2026-11-24). What this test checks is the capture, not the tuner.

use ferrograd_core::cuda::CudaDevice;
use ferrograd_core::{Device, Result};
use ferrograd_models::monster_walk::{run, PlanRequest, TrainConfig};

#[test]
fn graph_replay_trains_exactly_like_eager_steps() -> Result<()> {
    if let Err(e) = CudaDevice::get(0) {
        println!("skipping CUDA test: {e}");
        return Ok(());
    }
    let _same_algorithms = ferrograd_core::cuda::blaslt::without_tuning();
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
        assert!(eager.3 == graph.3, "batch {batch}: trained weights differ: {}", differences(&eager.3, &graph.3));
    }
    std::fs::remove_dir_all(&dir)?;
    Ok(())
}

/// What differs between two safetensors files: each tensor's largest absolute difference, and the
/// headers (names, dtypes, shapes, metadata) when they are not equal.
fn differences(a: &[u8], b: &[u8]) -> String {
    let (ta, tb) = match (safetensors::SafeTensors::deserialize(a), safetensors::SafeTensors::deserialize(b)) {
        (Ok(ta), Ok(tb)) => (ta, tb),
        (ea, eb) => return format!("unreadable: {:?} / {:?}", ea.err(), eb.err()),
    };
    let mut out = vec![];
    let (ha, hb) = (safetensors::SafeTensors::read_metadata(a), safetensors::SafeTensors::read_metadata(b));
    if let (Ok((_, ma)), Ok((_, mb))) = (ha, hb) {
        if ma.metadata() != mb.metadata() {
            out.push(format!("metadata {:?} vs {:?}", ma.metadata(), mb.metadata()));
        }
    }
    let mut names = ta.names();
    names.sort();
    for name in names {
        let (Ok(x), Ok(y)) = (ta.tensor(name), tb.tensor(name)) else {
            out.push(format!("{name}: only in one file"));
            continue;
        };
        let f = |d: &[u8]| {
            d.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]) as f64).collect::<Vec<_>>()
        };
        let (vx, vy) = (f(x.data()), f(y.data()));
        let diff = vx.iter().zip(&vy).map(|(p, q)| (p - q).abs()).fold(0.0, f64::max);
        let count = vx.iter().zip(&vy).filter(|(p, q)| p.to_bits() != q.to_bits()).count();
        if count > 0 || x.shape() != y.shape() {
            out.push(format!("{name}: {count} of {} elements differ, max |diff| {diff:e}", vx.len()));
        }
    }
    out.join("; ")
}
