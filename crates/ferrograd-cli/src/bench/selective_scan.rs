//! `ferrograd bench selective-scan`: the fused selective scan (`ferrograd_core::fused::selective_scan`)
//! forward and forward + backward time, effective GB/s and peak memory, Mamba's shapes (batch 4,
//! d_inner 1536, state 16, one group, D, z, delta_bias, softplus) at lengths 256 .. 4096. The
//! workload is the op's own (`ferrograd_core::fused::selective_scan::bench`); this file times it and
//! reports. Twin: `bench/torch_selective_scan.py` (mamba_ssm's `selective_scan_ref`, the sequential
//! recurrence in plain PyTorch, eager and with a compiled step; same shapes, same row names).
//!
//! Before timing, once per length the forward (computed into poisoned memory) and all eight
//! gradients of a small problem (batch 1, 8 channels, the same length) are checked against the
//! float64 CPU op. Timing: CUDA events, warm-up, batches, median per call
//! (`timing::measure_device`). Peak memory: the allocator's peak over one forward + backward,
//! inputs included.

use super::seq_op::{self, check_sizes, product, Sizes, Spec};
use crate::CliResult;
use ferrograd_core::fused::selective_scan::bench::Workload;
use ferrograd_core::fused::selective_scan::MAX_CUDA_STATE;
use ferrograd_core::DType;
use std::io::Write;

#[derive(Debug, Clone)]
pub struct Config {
    pub sizes: Sizes,
    pub state: usize,
}

/// `fwd bf16 B=4 D=1536 N=16 L=1024`: the row name both sides use.
pub fn row_name(mode: &str, dtype: DType, (b, d, n, l): (usize, usize, usize, usize)) -> String {
    format!("{mode} {} B={b} D={d} N={n} L={l}", dtype.as_str())
}

/// The flags, and the largest problem's byte count checked for overflow (issue 11): the
/// `[batch, dim, len]` tensors (u, delta, z, out, dout and the gradients: a dozen copies counted
/// as sixteen) and the `[batch, state, len]` ones (B, C and theirs, counted as eight).
pub fn check(cfg: &Config) -> CliResult<()> {
    if cfg.state == 0 || cfg.state > MAX_CUDA_STATE {
        return Err(format!("--state {} out of range (1..={MAX_CUDA_STATE})", cfg.state).into());
    }
    let (sz, e) = (&cfg.sizes, cfg.sizes.dtype.size_in_bytes());
    let bytes = |l| {
        let x = product(sz.batch, &[sz.dim, l, e, 16])?;
        x.checked_add(product(sz.batch, &[cfg.state, l, e, 8])?)
    };
    check_sizes("selective-scan", &cfg.sizes, 1 << 20, bytes)
}

pub fn run(cfg: &Config, out: &mut dyn Write) -> CliResult<()> {
    check(cfg)?;
    let (b, d, n, dtype) = (cfg.sizes.batch, cfg.sizes.dim, cfg.state, cfg.sizes.dtype);
    let name = |mode: &str, l: usize| row_name(mode, dtype, (b, d, n, l));
    let spec = Spec {
        command: "selective-scan",
        report: "selective_scan",
        what: "selective scan",
        sizes: &cfg.sizes,
        extra: n,
        title: [
            format!("selective scan (mamba selective_scan_fn), {dtype}, B={b} D={d} N={n}"),
            "D, z, delta_bias, softplus; one group of B/C; GB/s = minimal bytes moved / time; CUDA events, median"
                .into(),
        ],
        notes: [
            format!(
                "B={b} D={d} N={n}, one group; u, delta/2, z, B, C, dout N(0,1) from Philox (seed {}); \
                 A[d,n] = -(n+1); D = 1; delta_bias = -3; softplus; fwd+bwd = recorded forward + the op's \
                 backward with dout",
                cfg.sizes.seed
            ),
            "one block per (batch, channel), chunks of up to 2048 steps, warp-shuffle scan; f32 state".into(),
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
        assert_eq!(row_name("fwd", DType::BF16, (4, 1536, 16, 1024)), "fwd bf16 B=4 D=1536 N=16 L=1024");
        let cfg = |sizes| Config { sizes, state: 16 };
        refuses_bad_sizes(|s| check(&cfg(s)), |s| run(&cfg(s), &mut Vec::new()));
        assert!(check(&Config { state: 0, ..cfg(sizes()) }).is_err());
        assert!(check(&Config { state: MAX_CUDA_STATE + 1, ..cfg(sizes()) }).is_err());
    }
}
