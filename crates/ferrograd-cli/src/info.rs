//! `ferrograd info`: what this build is and what it would run on. Works on any machine: without a
//! CUDA driver it says in one line that it runs on the CPU, and why.

use crate::CliResult;
use ferrograd_core::cuda::{self, CudaDeviceInfo};
use ferrograd_core::Device;
use std::io::Write;

const GIB: f64 = (1u64 << 30) as f64;

pub fn run(out: &mut dyn Write) -> CliResult<()> {
    writeln!(out, "ferrograd {}", env!("CARGO_PKG_VERSION"))?;

    // A bad FERROGRAD_DEVICE is reported after the rest, so the listing still helps to fix it.
    let best = Device::best_with_reason();
    match &best {
        Ok((dev, why)) => writeln!(out, "device: {dev} ({why})")?,
        Err(e) => writeln!(out, "device: none usable ({e})")?,
    }

    writeln!(out, "cpu: {} ({} rayon threads)", cpu_model(), rayon::current_num_threads())?;

    match cuda::devices() {
        Ok(devs) if devs.is_empty() => writeln!(out, "cuda: no devices; ferrograd runs on the CPU")?,
        Ok(devs) => {
            writeln!(out, "cuda: {} device(s)", devs.len())?;
            for d in &devs {
                writeln!(out, "  {}", describe(d))?;
            }
        }
        Err(e) => writeln!(out, "cuda: none; ferrograd runs on the CPU ({e})")?,
    }

    // The error names FERROGRAD_DEVICE itself (Device::best_with_reason).
    best.map(|_| ()).map_err(Into::into)
}

/// One line per CUDA device: ordinal, name, memory, compute capability, SM count.
fn describe(d: &CudaDeviceInfo) -> String {
    let (major, minor) = d.compute_capability;
    format!(
        "cuda:{}  {}  {:.1} GiB  compute capability {major}.{minor} (sm_{major}{minor})  {} SMs",
        d.ordinal,
        d.name,
        d.total_memory as f64 / GIB,
        d.multiprocessors
    )
}

/// The CPU's model name where the OS tells it (Linux), else the architecture.
pub fn cpu_model() -> String {
    std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("model name"))
                .and_then(|l| l.split_once(':'))
                .map(|(_, v)| v.trim().to_string())
        })
        .unwrap_or_else(|| std::env::consts::ARCH.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn describes_a_device_on_one_line() {
        let d = CudaDeviceInfo {
            ordinal: 0,
            name: "NVIDIA H200".into(),
            total_memory: 150_011_707_392,
            compute_capability: (9, 0),
            multiprocessors: 132,
        };
        let s = describe(&d);
        assert_eq!(s, "cuda:0  NVIDIA H200  139.7 GiB  compute capability 9.0 (sm_90)  132 SMs");
    }
}
