//! `--batch auto`: the largest micro-batch that fits, found by measuring.

use super::model::Gpt;
use super::train::{precision_guard, TrainConfig};
use ferrograd_core::cuda::CudaDevice;
use ferrograd_core::{Device, Error, Result, Tensor};
use ferrograd_nn::optim::clip_grad_norm;

/// Deterministic stand-in tokens for measuring memory (the values do not matter there, but they
/// are not all equal).
fn probe_ids(b: usize, t: usize, vocab: usize, device: Device) -> Result<Tensor> {
    let v: Vec<u32> = (0..b * t).map(|i| ((i * 7919 + 13) % vocab) as u32).collect();
    Tensor::from_vec(v, (b, t), device)
}

/// The largest power-of-two micro-batch whose forward, backward and clipping fit in the device's
/// memory next to the model and optimizer state, found by trying 1, 2, 4, ... until the allocator
/// reports out of memory. `limit` caps it (and every candidate must divide it).
pub(crate) fn find_micro_batch(model: &Gpt, cfg: &TrainConfig, limit: usize) -> Result<(usize, String)> {
    let Device::Cuda(o) = cfg.device else {
        return Err(Error::InvalidArgument(
            "--batch auto measures GPU memory; on the CPU give the micro-batch (--batch N)".into(),
        ));
    };
    let dev = CudaDevice::get(o)?;
    let params: Vec<Tensor> = model.params().into_iter().map(|(_, t)| t).collect();
    let mut best = 0;
    let mut b = 1;
    let mut tried = vec![];
    while b <= limit {
        let trial = (|| -> Result<()> {
            let x = probe_ids(b, cfg.context, model.config.vocab_size, cfg.device)?;
            let _ac = precision_guard(cfg.precision)?;
            let loss = model.loss(&x, &x)?;
            drop(_ac);
            let mut grads = loss.backward()?;
            drop(loss);
            clip_grad_norm(&mut grads, &params, 1.0)?;
            dev.synchronize()
        })();
        match trial {
            Ok(()) => {
                tried.push(format!("{b} fits"));
                best = b;
            }
            Err(Error::OutOfMemory { .. }) => {
                tried.push(format!("{b} is out of memory"));
                break;
            }
            Err(e) => return Err(e),
        }
        b *= 2;
        while b <= limit && !limit.is_multiple_of(b) {
            b *= 2;
        }
    }
    dev.empty_cache()?;
    if best == 0 {
        return Err(Error::InvalidArgument(format!(
            "--batch auto: not even one sequence of {} tokens fits; use a smaller --context or model",
            cfg.context
        )));
    }
    Ok((best, format!("--batch auto: {} -> {best}", tried.join(", "))))
}
