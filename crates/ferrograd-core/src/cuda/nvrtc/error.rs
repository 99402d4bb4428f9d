//! What can go wrong between a kernel source and a CUBIN, as one typed error.

use super::arch::Arch;
use super::compiler::NvrtcVersion;
use super::include::{CUDA_INCLUDE_ENV, REQUIRED_HEADERS};
use std::path::PathBuf;

/// Everything that can go wrong while turning a kernel source into a CUBIN.
///
/// Clone because `nvrtc_info` remembers its outcome for the whole process and hands out copies.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum KernelError {
    #[error(
        "libnvrtc not found: none of [{}] could be loaded from the loader path; install the CUDA \
         toolkit, or `pip install nvidia-cuda-nvrtc` and put its nvidia/cu13/lib on \
         LD_LIBRARY_PATH before the process starts",
        .candidates.join(", ")
    )]
    /// No libnvrtc could be loaded.
    NvrtcMissing {
        /// The library names tried.
        candidates: Vec<String>,
    },

    #[error("libnvrtc at {library} lacks `{symbol}`; it is too old (CUDA 12 or newer is needed)")]
    /// The libnvrtc found lacks a function ferrograd needs.
    NvrtcTooOld {
        /// The library loaded.
        library: String,
        /// The missing symbol.
        symbol: String,
    },

    #[error(
        "CUDA headers ({}) not found; searched: {}. Set {CUDA_INCLUDE_ENV} or CUDA_HOME, or \
         `pip install nvidia-cuda-runtime` (headers in nvidia/cu13/include)",
        REQUIRED_HEADERS.join(", "),
        display_paths(.searched)
    )]
    /// The CUDA headers kernels include are not found.
    HeadersNotFound {
        /// The directories searched.
        searched: Vec<PathBuf>,
    },

    #[error("`{0}` is not a GPU architecture (expected sm_80, sm_90a, 90, 9.0, ...)")]
    /// A string that names no GPU architecture.
    InvalidArch(String),

    #[error("NVRTC {nvrtc} cannot compile for {arch}; it supports {}", display_archs(.supported))]
    /// This NVRTC cannot compile for the GPU's architecture.
    UnsupportedArch {
        /// The architecture asked for.
        arch: Arch,
        /// The NVRTC version loaded.
        nvrtc: NvrtcVersion,
        /// The architectures it supports.
        supported: Vec<u32>,
    },

    #[error("kernel `{name}`: {what} contains a NUL byte")]
    /// A kernel's source, name or option holds a NUL byte.
    InvalidInput {
        /// The kernel.
        name: String,
        /// Which input.
        what: String,
    },

    #[error("kernel `{name}` failed to compile for {arch} ({code}); options {options:?}:\n{log}")]
    /// NVRTC rejected the source.
    Compile {
        /// The kernel module.
        name: String,
        /// The target architecture.
        arch: Arch,
        /// NVRTC's result code.
        code: String,
        /// The compile options.
        options: Vec<String>,
        /// NVRTC's log.
        log: String,
    },

    #[error("kernel `{name}`: NVRTC call {call} failed: {code}")]
    /// Another NVRTC call failed.
    Nvrtc {
        /// The kernel module.
        name: String,
        /// The NVRTC function.
        call: &'static str,
        /// Its result code.
        code: String,
    },
}

impl KernelError {
    /// The kernel the error is about, for callers that file it under a per-kernel error.
    pub fn kernel_name(&self) -> Option<&str> {
        match self {
            KernelError::InvalidInput { name, .. }
            | KernelError::Compile { name, .. }
            | KernelError::Nvrtc { name, .. } => Some(name),
            _ => None,
        }
    }
}

fn display_paths(paths: &[PathBuf]) -> String {
    if paths.is_empty() {
        return "nothing (no candidate directory)".to_string();
    }
    paths.iter().map(|p| p.display().to_string()).collect::<Vec<_>>().join(", ")
}

fn display_archs(archs: &[u32]) -> String {
    archs.iter().map(|a| format!("sm_{a}")).collect::<Vec<_>>().join(", ")
}
