//! Helpers shared by this module's tests.

use std::ffi::OsString;
use std::fs;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

/// A unique scratch directory removed on drop; tests must not touch the user's cache.
pub(crate) struct TempDir(PathBuf);

impl TempDir {
    pub(crate) fn new(tag: &str) -> TempDir {
        static N: AtomicU64 = AtomicU64::new(0);
        let dir = std::env::temp_dir().join(format!(
            "ferrograd-kernels-{tag}-{}-{}",
            std::process::id(),
            N.fetch_add(1, Ordering::Relaxed)
        ));
        let _ = fs::remove_dir_all(&dir);
        fs::create_dir_all(&dir).expect("create temp dir");
        TempDir(dir)
    }

    pub(crate) fn path(&self) -> &Path {
        &self.0
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = fs::remove_dir_all(&self.0);
    }
}

/// An environment made of these variables only.
pub(crate) fn env_of(vars: Vec<(&'static str, OsString)>) -> impl Fn(&str) -> Option<OsString> {
    move |k| vars.iter().find(|(n, _)| *n == k).map(|(_, v)| v.clone())
}

/// A cache key for tests, differing by `src`.
pub(crate) fn key(src: &str) -> super::key::CacheKey {
    use super::{Arch, KernelSource, NvrtcVersion};
    let opts = super::source::nvrtc_options(Arch::SM90, &KernelSource::new("k", src));
    super::key::CacheKey::new("k", src, &[], &opts, NvrtcVersion { major: 13, minor: 0 }, Arch::SM90)
}
