//! What `bench selective-scan` and `bench conv1d` share for each sequence length: the forward and
//! forward + backward of a fused op timed with CUDA events (median per call,
//! `timing::measure_device`), the allocator's peak over one forward + backward (inputs included),
//! the table row and the three report rows (`fwd …`, `fwd+bwd …`, `peak fwd+bwd …`).

use super::{Report, Row};
use crate::timing::{measure_device, Clock, DevicePlan, DeviceTiming};
use crate::CliResult;
use ferrograd_core::cuda::CudaDevice;
use std::io::Write;

/// One length's measurements.
pub struct Measured {
    pub fwd: DeviceTiming,
    pub fwd_bwd: DeviceTiming,
    pub peak_mib: f64,
}

/// Time `fwd` and `fwd_bwd`, then the peak memory of one more `fwd_bwd`.
pub fn measure<A, B>(
    clock: &Clock,
    dev: &CudaDevice,
    fwd: impl FnMut() -> ferrograd_core::Result<A>,
    mut fwd_bwd: impl FnMut() -> ferrograd_core::Result<B>,
) -> CliResult<Measured> {
    let tf = measure_device(clock, DevicePlan::GPU, fwd)?;
    let tb = measure_device(clock, DevicePlan::GPU, &mut fwd_bwd)?;
    clock.synchronize()?;
    dev.reset_peak_stats();
    drop(fwd_bwd()?);
    clock.synchronize()?;
    let peak_mib = dev.memory_stats().allocated_bytes.peak as f64 / (1 << 20) as f64;
    Ok(Measured { fwd: tf, fwd_bwd: tb, peak_mib })
}

/// Print the table row (`label`, ms and GB/s of both, peak, the worse error) and push the report
/// rows named by `name(mode)`. `bytes` = the least bytes the forward and the forward + backward
/// move; `errs` = the small problem's forward and backward errors.
pub fn record(
    out: &mut dyn Write,
    report: &mut Report,
    name: impl Fn(&str) -> String,
    m: &Measured,
    bytes: (f64, f64),
    errs: (f64, f64),
) -> CliResult<()> {
    let (tf, tb) = (m.fwd.median_s(), m.fwd_bwd.median_s());
    let (gf, gb) = (bytes.0 / tf / 1e9, bytes.1 / tb / 1e9);
    writeln!(
        out,
        "{:34} | {:>9.4} | {:>7.1} | {:>9.4} | {:>7.1} | {:>9.1} | {:>9.2e}",
        name("").trim(),
        tf * 1e3,
        gf,
        tb * 1e3,
        gb,
        m.peak_mib,
        errs.0.max(errs.1)
    )?;
    out.flush()?;
    report.rows.push(
        Row::new(name("fwd"), tf * 1e3, "ms", false)
            .with("reps", m.fwd.reps())
            .with("gb_per_s", gf)
            .with("rel_err_small", errs.0),
    );
    report.rows.push(
        Row::new(name("fwd+bwd"), tb * 1e3, "ms", false)
            .with("reps", m.fwd_bwd.reps())
            .with("gb_per_s", gb)
            .with("rel_err_small", errs.1),
    );
    report.rows.push(Row::new(name("peak fwd+bwd"), m.peak_mib, "MiB", false));
    Ok(())
}

/// The table's head, as both benches print it.
pub fn head() -> String {
    format!(
        "{:34} | {:>9} | {:>7} | {:>9} | {:>7} | {:>9} | {:>9}",
        "what", "fwd ms", "GB/s", "f+b ms", "GB/s", "peak MiB", "rel err"
    )
}
