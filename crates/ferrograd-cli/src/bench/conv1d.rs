//! `ferrograd bench conv1d`: the causal depthwise conv1d (`ferrograd_core::fused::conv1d_causal`,
//! Mamba's `causal_conv1d_fn`) forward and forward + backward time, effective GB/s and peak memory,
//! at Mamba's shapes (batch 4, 1536 channels, width 4) and lengths 256 .. 4096. The workload is the
//! op's own (`ferrograd_core::fused::conv1d_causal::bench`); this file times it and reports. Twin:
//! `bench/torch_conv1d.py` (`F.conv1d(x, w[:, None], b, padding=k-1, groups=C)[..., :L]`, as
//! mamba_ssm's reference path computes it; same shapes, same row names).
//!
//! Before timing, once per length the forward (computed into poisoned memory) and the three
//! gradients of a small problem (batch 1, 8 channels, the same length) are checked against the
//! float64 CPU op. Timing: CUDA events, warm-up, batches, median per call
//! (`timing::measure_device`). Peak memory: the allocator's peak over one forward + backward,
//! inputs included.

use super::seq_op::{self, check_sizes, product, Sizes, Spec};
use crate::CliResult;
use ferrograd_core::fused::conv1d_causal::bench::Workload;
use ferrograd_core::fused::conv1d_causal::MAX_CUDA_K;
use ferrograd_core::DType;
use std::io::Write;

#[derive(Debug, Clone)]
pub struct Config {
    pub sizes: Sizes,
    pub k: usize,
}

/// `fwd bf16 B=4 D=1536 K=4 L=1024`: the row name both sides use.
pub fn row_name(mode: &str, dtype: DType, (b, d, k, l): (usize, usize, usize, usize)) -> String {
    format!("{mode} {} B={b} D={d} K={k} L={l}", dtype.as_str())
}

/// The flags, and the largest problem's byte count checked for overflow (issue 11): x, y, dy, dx
/// and the copies a step makes, counted as eight `[batch, dim, len]` tensors.
pub fn check(cfg: &Config) -> CliResult<()> {
    if cfg.k == 0 || cfg.k > MAX_CUDA_K {
        return Err(format!("--k {} out of range (1..={MAX_CUDA_K})", cfg.k).into());
    }
    let bytes = |l| product(cfg.sizes.batch, &[cfg.sizes.dim, l, cfg.sizes.dtype.size_in_bytes(), 8]);
    check_sizes("conv1d", &cfg.sizes, 1 << 24, bytes)
}

pub fn run(cfg: &Config, out: &mut dyn Write) -> CliResult<()> {
    check(cfg)?;
    let (b, d, k, dtype) = (cfg.sizes.batch, cfg.sizes.dim, cfg.k, cfg.sizes.dtype);
    let name = |mode: &str, l: usize| row_name(mode, dtype, (b, d, k, l));
    let spec = Spec {
        command: "conv1d",
        report: "conv1d",
        what: "conv1d",
        sizes: &cfg.sizes,
        extra: k,
        title: [
            format!("causal depthwise conv1d (mamba causal_conv1d_fn), {dtype}, B={b} D={d} K={k}, with bias"),
            "GB/s = minimal bytes moved / time; CUDA events, median".into(),
        ],
        notes: [
            format!(
                "B={b} D={d} K={k} with bias; x, dy N(0,1), w, b U(-1/sqrt(K), 1/sqrt(K)) from Philox (seed {}); \
                 fwd+bwd = recorded forward + the op's backward with dy (dx, dw, db)",
                cfg.sizes.seed
            ),
            "forward one elementwise kernel; backward a dx kernel and one block per channel for dw, db".into(),
        ],
        name: &name,
    };
    seq_op::run::<Workload>(spec, out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::bench::seq_op::testing::{refuses_bad_sizes, sizes};

    #[test]
    fn names_and_validation() {
        assert_eq!(row_name("fwd", DType::BF16, (4, 1536, 4, 1024)), "fwd bf16 B=4 D=1536 K=4 L=1024");
        let cfg = |sizes| Config { sizes, k: 4 };
        refuses_bad_sizes(|s| check(&cfg(s)), |s| run(&cfg(s), &mut Vec::new()));
        assert!(check(&Config { k: 0, ..cfg(sizes()) }).is_err());
        assert!(check(&Config { k: MAX_CUDA_K + 1, ..cfg(sizes()) }).is_err());
    }
}
