//! ferrograd's CUDA kernel modules, prebuilt: every module a GPU of sm_80 or sm_90 runs, compiled
//! by NVRTC ahead of time and shipped in the program, so that its first GPU run loads CUBINs
//! instead of spending 80-100 s of CPU in NVRTC (6-9 s of wall time on a 16-core machine, minutes
//! on a laptop-class one).
//!
//! ```no_run
//! // First thing in `main`, before the first kernel loads:
//! ferrograd_kernels::install().expect("the shipped kernels parse");
//! ```
//!
//! A prebuilt module is used only when its cache key (module name, source, shared headers,
//! options and architecture, computed with the NVRTC version that built it) is the key of what
//! this program would compile: an edited kernel, extra NVRTC flags or another architecture is
//! compiled as before (`ferrograd_core::cuda::nvrtc`'s `prebuilt` module says why, and how a
//! driver that refuses a CUBIN falls back). `FERROGRAD_PREBUILT=0` turns them off.
//!
//! Files, one pair per architecture in `prebuilt/`, written by `ferrograd kernels
//! --write-prebuilt` (`scripts/prebuild-kernels.sh` for every shipped architecture):
//! - `<arch>.bin`: the CUBINs, each one deflate stream, one after another.
//! - `<arch>.manifest`: text; `nvrtc <major.minor>`, `arch <sm_XY>`, then one line per module:
//!   `<name> <target> <key> <offset> <deflated bytes> <cubin bytes> <sha-256 of the cubin> <NVRTC ms>`.
//!
//! ferrograd-cli's `tests/cli_suite/prebuilt.rs` fails when a module changed and these were not
//! rebuilt.

mod fresh;
mod set;
mod write;

pub use fresh::{freshness, Freshness};
pub use set::{Entry, Prebuilt};
pub use write::{write, WriteError};

use ferrograd_core::cuda::nvrtc::Arch;
use std::sync::OnceLock;

/// The shipped architectures, each with its manifest and CUBINs. A `static`, not a `const`: a
/// const's bytes are copied into every function that names it (the binary carried them twice).
static SHIPPED: &[(Arch, &str, &[u8])] = &[
    (Arch::SM80, include_str!("../prebuilt/sm_80.manifest"), include_bytes!("../prebuilt/sm_80.bin")),
    (Arch::SM90, include_str!("../prebuilt/sm_90.manifest"), include_bytes!("../prebuilt/sm_90.bin")),
];

/// The architectures shipped.
pub fn archs() -> impl Iterator<Item = Arch> {
    SHIPPED.iter().map(|(a, _, _)| *a)
}

/// The shipped kernels, parsed once (a parse error names the manifest and the line).
pub fn prebuilt() -> Result<&'static Prebuilt, String> {
    static SET: OnceLock<Result<Prebuilt, String>> = OnceLock::new();
    SET.get_or_init(|| Prebuilt::parse(SHIPPED)).as_ref().map_err(Clone::clone)
}

/// Makes the shipped kernels the process's prebuilt set (`ferrograd_core::cuda::nvrtc::
/// install_prebuilt`): `Ok(false)` when another set was installed first.
pub fn install() -> Result<bool, String> {
    Ok(ferrograd_core::cuda::nvrtc::install_prebuilt(prebuilt()?))
}
