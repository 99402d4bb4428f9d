//! What every example shares: `--device cpu|cuda|cuda:N` (default: the best device, as the
//! `ferrograd` binary picks it) and `--name value` flags, parsed without a dependency so that each
//! example reads as plain ferrograd code.

use ferrograd_core::{Device, Error, Result};

/// The value after `--name` on the command line, if given (`--name=value` works too).
pub fn arg(name: &str) -> Option<String> {
    let flag = format!("--{name}");
    let args: Vec<String> = std::env::args().collect();
    args.iter().enumerate().find_map(|(i, a)| {
        if *a == flag {
            args.get(i + 1).cloned()
        } else {
            a.strip_prefix(&format!("{flag}=")).map(str::to_string)
        }
    })
}

/// Whether the bare flag `--name` was given.
pub fn flag(name: &str) -> bool {
    let flag = format!("--{name}");
    std::env::args().any(|a| a == flag)
}

/// `--name N` as a number, or `default`; a value that does not parse is an error naming the flag.
pub fn arg_or<T: std::str::FromStr>(name: &str, default: T) -> Result<T> {
    match arg(name) {
        None => Ok(default),
        Some(v) => v.parse().map_err(|_| Error::InvalidArgument(format!("--{name} {v:?} is not a valid value"))),
    }
}

/// `--device` if given, else [`Device::best`] (`FERROGRAD_DEVICE`, else `cuda:0`, else the CPU).
/// Prints the choice, so the reader sees where the example ran. Installs the kernels prebuilt for
/// sm_80 and sm_90 first, as the `ferrograd` binary does, so a first GPU run does not wait for NVRTC.
pub fn device() -> Result<Device> {
    if let Err(e) = ferrograd_kernels::install() {
        eprintln!("prebuilt kernels unusable ({e}); NVRTC compiles the kernels");
    }
    let device = match arg("device") {
        Some(d) => d.parse()?,
        None => Device::best()?,
    };
    println!("device: {device}");
    Ok(device)
}

/// The user guide's chapters (`docs/guide/src/`) as doctests: `cargo test --doc -p
/// ferrograd-examples` compiles and runs every Rust sample in them, so the guide cannot drift from
/// the API. (This crate links every ferrograd crate, which `mdbook test` cannot.)
#[cfg(doctest)]
pub mod guide {
    #[doc = include_str!("../docs/guide/src/install.md")]
    pub struct Install;
    #[doc = include_str!("../docs/guide/src/tensors.md")]
    pub struct Tensors;
    #[doc = include_str!("../docs/guide/src/autograd.md")]
    pub struct Autograd;
    #[doc = include_str!("../docs/guide/src/training.md")]
    pub struct Training;
    #[doc = include_str!("../docs/guide/src/mixed-precision.md")]
    pub struct MixedPrecision;
    #[doc = include_str!("../docs/guide/src/checkpoints.md")]
    pub struct Checkpoints;
    #[doc = include_str!("../docs/guide/src/gpu-memory.md")]
    pub struct GpuMemory;
    #[doc = include_str!("../docs/guide/src/multi-gpu.md")]
    pub struct MultiGpu;
    #[doc = include_str!("../docs/guide/src/performance.md")]
    pub struct Performance;
    #[doc = include_str!("../docs/guide/src/troubleshooting.md")]
    pub struct Troubleshooting;
}
