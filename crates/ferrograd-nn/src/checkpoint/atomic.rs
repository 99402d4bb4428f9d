//! Atomic file replacement: write a temporary file in the same directory, fsync it, rename it over
//! the target, fsync the directory. A crash at any point leaves either the old file or the new one,
//! never a torn mix (rename within one filesystem is atomic; the directory fsync makes the rename
//! itself durable).

use std::fs::{self, File, OpenOptions};
use std::io::{self, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

fn temp_path(path: &Path) -> io::Result<PathBuf> {
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let name = path
        .file_name()
        .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidInput, "checkpoint path has no file name"))?;
    let tmp =
        format!(".{}.tmp-{}-{}", name.to_string_lossy(), std::process::id(), COUNTER.fetch_add(1, Ordering::Relaxed));
    Ok(path.with_file_name(tmp))
}

fn parent_dir(path: &Path) -> &Path {
    match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p,
        _ => Path::new("."),
    }
}

/// Make a completed rename in `dir` durable. Only Unix lets a directory be opened and synced.
fn sync_dir(dir: &Path) -> io::Result<()> {
    #[cfg(unix)]
    {
        File::open(dir)?.sync_all()
    }
    #[cfg(not(unix))]
    {
        let _ = dir;
        Ok(())
    }
}

/// Replace `path` with `bytes` atomically.
pub fn write_atomic(path: &Path, bytes: &[u8]) -> io::Result<()> {
    let tmp = temp_path(path)?;
    let result = (|| {
        let mut f = OpenOptions::new().write(true).create_new(true).open(&tmp)?;
        f.write_all(bytes)?;
        f.sync_all()?;
        drop(f);
        fs::rename(&tmp, path)?;
        sync_dir(parent_dir(path))
    })();
    if result.is_err() {
        // Best effort: after a successful rename the temporary name no longer exists.
        let _ = fs::remove_file(&tmp);
    }
    result
}
