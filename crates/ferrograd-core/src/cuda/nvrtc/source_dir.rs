//! `FERROGRAD_KERNEL_DIR`: a kernel developer's way to run an edited `.cu` without rebuilding.
//!
//! Every module's source is compiled into the binary (`include_str!`), which is what a user wants
//! and what makes a GPU run reproducible. A kernel developer iterating on a GPU machine without a
//! Rust toolchain wants the opposite: edit `mlp_persistent.cu`, run the same binary again. With
//! `FERROGRAD_KERNEL_DIR=DIR`, a module named `NAME` is compiled from `DIR/NAME.cu` when that file
//! exists (headers, defines and options stay the module's own). The cache key hashes the source
//! text, so an edited file never meets a CUBIN of the built-in one. Each replaced module is named
//! once on stderr; a file that exists but cannot be read is an error, never a silent fallback.

use super::error::KernelError;
use super::source::KernelSource;
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Mutex, OnceLock, PoisonError};

/// The environment variable naming the directory.
pub const KERNEL_DIR_ENV: &str = "FERROGRAD_KERNEL_DIR";

/// `kernel` with its source replaced from `FERROGRAD_KERNEL_DIR`, or as given when the variable is
/// unset or holds no file for it.
pub(crate) fn with_override<'a>(kernel: &KernelSource<'a>) -> Result<KernelSource<'a>, KernelError> {
    static DIR: OnceLock<Option<PathBuf>> = OnceLock::new();
    let dir = DIR.get_or_init(|| std::env::var_os(KERNEL_DIR_ENV).filter(|v| !v.is_empty()).map(PathBuf::from));
    match dir {
        Some(dir) => from_dir(kernel, dir),
        None => Ok(*kernel),
    }
}

/// [`with_override`] for an explicit directory. A file's text is read once per process and kept
/// (leaked: a handful of kernel files in a development run), as built-in sources are `'static`.
pub(crate) fn from_dir<'a>(kernel: &KernelSource<'a>, dir: &Path) -> Result<KernelSource<'a>, KernelError> {
    static READ: OnceLock<Mutex<HashMap<PathBuf, &'static str>>> = OnceLock::new();
    let path = dir.join(format!("{}.cu", kernel.name));
    let mut read = READ.get_or_init(Default::default).lock().unwrap_or_else(PoisonError::into_inner);
    if let Some(src) = read.get(&path) {
        return Ok(KernelSource { src, ..*kernel });
    }
    if !path.is_file() {
        return Ok(*kernel);
    }
    let text = std::fs::read_to_string(&path).map_err(|e| KernelError::InvalidInput {
        name: kernel.name.to_string(),
        what: format!("the override {} ({e})", path.display()),
    })?;
    eprintln!("ferrograd: kernel module `{}` compiled from {} ({KERNEL_DIR_ENV})", kernel.name, path.display());
    let src: &'static str = Box::leak(text.into_boxed_str());
    read.insert(path, src);
    Ok(KernelSource { src, ..*kernel })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_file_named_for_the_module_replaces_its_source_and_nothing_else() {
        let dir = tempfile::tempdir().expect("temp dir");
        std::fs::write(dir.path().join("mine.cu"), "// edited").expect("write");
        let k = KernelSource::new("mine", "// built in");
        let got = from_dir(&k, dir.path()).expect("override");
        assert_eq!((got.name, got.src), ("mine", "// edited"));
        // Read once: a later edit in the same process does not change a module mid-run.
        std::fs::write(dir.path().join("mine.cu"), "// edited again").expect("write");
        assert_eq!(from_dir(&k, dir.path()).expect("override").src, "// edited");
        let other = KernelSource::new("other", "// built in");
        assert_eq!(from_dir(&other, dir.path()).expect("no file").src, "// built in");
    }

    #[test]
    fn an_unreadable_override_is_an_error_that_names_it() {
        let dir = tempfile::tempdir().expect("temp dir");
        std::fs::write(dir.path().join("bad.cu"), [0xff, 0xfe, 0x00]).expect("write");
        let err = from_dir(&KernelSource::new("bad", "x"), dir.path()).expect_err("not UTF-8");
        assert!(err.to_string().contains("bad.cu"), "{err}");
    }
}
