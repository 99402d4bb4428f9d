//! Devices and data movement: which device ferrograd picks and why, copies between the host and a
//! GPU, pinned (page-locked) memory, prefetching a copy while compute runs, a loader that does it
//! for you, and the caching allocator's memory figures.
//!
//! ```sh
//! cargo run --release --example devices            # on a GPU if there is one
//! cargo run --example devices -- --device cpu      # the same code on the CPU
//! FERROGRAD_DEVICE=cpu cargo run --example devices # the environment variable every command reads
//! ```

use ferrograd_core::cuda::{self, CudaDevice};
use ferrograd_core::{DType, Device, Result, Rng, Tensor};
use ferrograd_nn::data::{DataLoader, LoaderConfig, TensorDataset};
use std::sync::Arc;
use std::time::Instant;

fn main() -> Result<()> {
    // ---- which device ----------------------------------------------------------------------------
    // `best_with_reason`: FERROGRAD_DEVICE if set, else cuda:0 if usable, else the CPU, and why.
    let (best, why) = Device::best_with_reason()?;
    println!("Device::best() = {best}: {why}");
    match cuda::devices() {
        Ok(list) => {
            for d in list {
                let (major, minor) = d.compute_capability;
                println!(
                    "  cuda:{} {} sm_{major}{minor}, {} SMs, {:.1} GiB",
                    d.ordinal,
                    d.name,
                    d.multiprocessors,
                    d.total_memory as f64 / (1u64 << 30) as f64
                );
            }
        }
        Err(e) => println!("  no CUDA: {e}"),
    }
    let dev = ferrograd_examples::device()?;
    let mb: usize = ferrograd_examples::arg_or("mib", 64)?;
    let n = (mb << 20) / 4; // f32 elements

    // ---- plain copies ------------------------------------------------------------------------------
    let mut rng = Rng::new(0);
    let host = Tensor::randn_with(&mut rng, 0.0, 1.0, n, DType::F32, Device::Cpu)?;
    let t = Instant::now();
    let on_dev = host.to_device(dev)?; // a no-op (the same tensor) when dev is the CPU
    dev.synchronize()?; // copies from pageable memory are staged; wait to time them
    println!("to_device({dev}) of {mb} MiB: {:.1} ms", 1e3 * t.elapsed().as_secs_f64());
    // Ops run where their operands are; mixing devices is an error naming both.
    if dev.is_cuda() {
        let err = on_dev.add(&host).err().map(|e| e.to_string()).unwrap_or_default();
        println!("cuda + cpu operands: {err}");
    }

    if dev.is_cuda() {
        // ---- pinned memory and prefetch -------------------------------------------------------------
        // A page-locked copy of the host tensor: the GPU reads it by DMA, asynchronously.
        let pinned = host.pin_memory()?;
        println!("pinned: {}", pinned.is_pinned());
        // Queue some compute, then start the copy: it runs on the copy stream beside the compute.
        let a = Tensor::randn_with(&mut rng, 0.0, 1.0, (2048, 2048), DType::F32, dev)?;
        let t = Instant::now();
        let busy = a.matmul(&a)?;
        let in_flight = pinned.to_device_async(dev)?; // returns at once
        let arrived = in_flight.wait()?; // later ops on this thread's stream wait for the copy
        let sum = arrived.sum_all()?.item_f64()? + busy.mean_all()?.item_f64()?; // reads wait for both
        println!("matmul + overlapped {mb} MiB copy: {:.1} ms (checksum {sum:.3})", 1e3 * t.elapsed().as_secs_f64());
        // Several small tensors: one coalesced copy instead of one per tensor.
        let parts: Vec<Tensor> =
            (0..8).map(|i| Tensor::full(i as f64, 1000, DType::F32, Device::Cpu)).collect::<Result<_>>()?;
        let moved = Tensor::to_device_many(&parts, dev)?;
        println!("to_device_many: {} tensors on {}", moved.len(), moved[0].device());
    }

    // ---- a loader that pins and prefetches for you ------------------------------------------------
    // The producer thread gathers batch k+1 (pinning it for a GPU) and starts its copy while the
    // training step consumes batch k. The same code delivers CPU batches on the CPU.
    let x = Tensor::randn_with(&mut rng, 0.0, 1.0, (4096, 256), DType::F32, Device::Cpu)?;
    let y = x.sum(1, false)?;
    let cfg = LoaderConfig { batch_size: 512, device: dev, prefetch: 2, ..Default::default() };
    let loader = DataLoader::new(Arc::new(TensorDataset::new(vec![x, y])?), cfg)?;
    let w = Tensor::randn_with(&mut rng, 0.0, 1.0, (256, 256), DType::F32, dev)?;
    let mut acc = Tensor::zeros((), DType::F32, dev)?;
    for batch in loader.epoch(0) {
        let batch = batch?;
        // Stand-in for a training step: stays on the device, no host read per batch.
        acc = acc.add(&batch.tensors[0].matmul(&w)?.sqr()?.mean_all()?)?;
    }
    println!("{} batches of 512 on {dev}; accumulated {:.3}", loader.len(), acc.item_f64()?);

    // ---- memory ------------------------------------------------------------------------------------
    if let Device::Cuda(o) = dev {
        let gpu = CudaDevice::get(o)?;
        let s = gpu.memory_stats();
        let mib = |b: usize| b as f64 / (1u64 << 20) as f64;
        println!(
            "allocator on {dev}: {:.0} MiB allocated (peak {:.0}), {:.0} MiB reserved in {} segments, {} driver allocations",
            mib(s.allocated_bytes.current),
            mib(s.allocated_bytes.peak),
            mib(s.reserved_bytes.current),
            s.segments.current,
            s.device_allocs
        );
        let (free, total) = gpu.mem_info()?;
        println!("driver: {:.0} of {:.0} MiB free", mib(free), mib(total));
    }
    Ok(())
}
