//! Whether the shipped CUBINs are those of today's sources: what `ferrograd kernels` prints and
//! what ferrograd-cli's `tests/cli_suite/prebuilt.rs` requires.

use crate::set::Prebuilt;
use ferrograd_core::cuda::nvrtc::{Arch, Module, PrebuiltKernels};

/// The modules of one architecture against what is shipped for it.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Freshness {
    /// Modules whose CUBIN is shipped (by its key: today's source, headers, options).
    pub current: Vec<&'static str>,
    /// Modules a GPU of the architecture may run with no CUBIN of theirs shipped: a kernel or
    /// shared header changed since `scripts/prebuild-kernels.sh` ran (NVRTC compiles them).
    pub stale: Vec<&'static str>,
    /// Shipped CUBINs no module has the key of any more (dead weight in the binary).
    pub orphans: Vec<String>,
}

impl Freshness {
    /// Every module current and nothing else shipped.
    pub fn is_exact(&self) -> bool {
        self.stale.is_empty() && self.orphans.is_empty()
    }
}

/// `modules` (those a GPU of `arch` may run: `Module::source().needed_for(arch)`) against
/// what `prebuilt` ships for `arch`, keys computed with the NVRTC version that built them.
pub fn freshness(prebuilt: &Prebuilt, arch: Arch, modules: &[&'static Module]) -> Freshness {
    let mut f = Freshness::default();
    let mut keys = Vec::new();
    for m in modules.iter().filter(|m| m.source().needed_for(arch)) {
        let key = m.source().cache_key(arch, prebuilt.nvrtc());
        keys.push(key);
        if prebuilt.entry(&key).is_some() {
            f.current.push(m.name);
        } else {
            f.stale.push(m.name);
        }
    }
    f.orphans = prebuilt.modules(arch).into_iter().filter(|e| !keys.contains(&e.key)).map(|e| e.name.clone()).collect();
    f
}
