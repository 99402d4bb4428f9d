//! Files, safely: the one atomic write every file the project writes goes through (reports,
//! checkpoints, exports, bench JSON, plots, token shards), the check of output paths that runs
//! before any work, and the opening of input files (regular files only, sizes capped before
//! reading, permission errors named as such).
//!
//! **Atomic write.** The bytes go to a temporary file created exclusively (`O_CREAT|O_EXCL` with a
//! random suffix, through `tempfile`) in the target's directory, so a symlink planted under a
//! predictable name is never followed; the file is fsynced, renamed over the target (atomic within
//! a filesystem: readers see the old file or the new one, never a torn or empty one), and the
//! directory is fsynced so the rename itself survives a crash. A process killed mid-write leaves
//! its temporary file behind; the temporary names carry the host and process id, and the next
//! write of the same target removes those of processes that no longer exist on this host.

use crate::{Error, Result};
use std::ffi::OsString;
use std::fs::{self, File};
use std::io::{self, Read, Write};
use std::path::{Path, PathBuf};

const TMP_SUFFIX: &str = ".fg-tmp";

fn file_err(path: &Path, msg: impl Into<String>) -> Error {
    Error::File { path: path.display().to_string(), msg: msg.into() }
}

/// What an I/O error means for a user: "permission denied", "no such file or directory", ...
fn describe(e: &io::Error) -> String {
    match e.kind() {
        io::ErrorKind::PermissionDenied => "permission denied".into(),
        io::ErrorKind::NotFound => "no such file or directory".into(),
        _ => e.to_string(),
    }
}

fn parent_dir(path: &Path) -> &Path {
    match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p,
        _ => Path::new("."),
    }
}

/// This machine's name (temporary names carry it, so that cleanup on a shared filesystem only
/// ever considers processes of this host).
fn host_tag() -> String {
    let h = fs::read_to_string("/proc/sys/kernel/hostname").unwrap_or_default();
    let h: String = h.trim().chars().filter(|c| c.is_ascii_alphanumeric() || *c == '-').take(32).collect();
    if h.is_empty() {
        "host".into()
    } else {
        h
    }
}

/// `.{name}.{host}.` — the start of every temporary name for `path` (the name cut to 100 chars
/// so that the whole stays under the usual 255-byte limit).
fn tmp_prefix(path: &Path) -> Result<String> {
    let name = path.file_name().ok_or_else(|| file_err(path, "is not a file name"))?;
    let name: String = name.to_string_lossy().chars().take(100).collect();
    Ok(format!(".{name}.{}.", host_tag()))
}

/// Refuse a target that is a directory or a special file before writing anything.
fn check_target(path: &Path) -> Result<()> {
    if path.file_name().is_none() {
        return Err(file_err(path, "is a directory, not a file name"));
    }
    match fs::symlink_metadata(path) {
        Ok(m) if m.is_dir() => Err(file_err(path, "is a directory")),
        Ok(m) if !m.is_file() && !m.file_type().is_symlink() => {
            Err(file_err(path, "exists and is not a regular file (a FIFO, socket or device); give another path"))
        }
        Ok(_) => Ok(()),
        // A missing file is what a new output is; a missing or non-directory parent is reported
        // by `new_temp`, which says which.
        Err(e) if matches!(e.kind(), io::ErrorKind::NotFound | io::ErrorKind::NotADirectory) => Ok(()),
        Err(e) => Err(file_err(path, describe(&e))),
    }
}

fn new_temp(path: &Path) -> Result<tempfile::NamedTempFile> {
    let dir = parent_dir(path);
    let prefix = format!("{}{}.", tmp_prefix(path)?, std::process::id());
    let mut b = tempfile::Builder::new();
    b.prefix(&prefix).suffix(TMP_SUFFIX).rand_bytes(12);
    #[cfg(unix)]
    {
        // What `fs::write` would give the file (0666 less the umask), not tempfile's 0600.
        use std::os::unix::fs::PermissionsExt;
        b.permissions(fs::Permissions::from_mode(0o666));
    }
    b.tempfile_in(dir).map_err(|e| match fs::metadata(dir) {
        Err(d) if d.kind() == io::ErrorKind::NotFound => {
            file_err(path, format!("directory {} does not exist", dir.display()))
        }
        Ok(d) if !d.is_dir() => file_err(path, format!("{} is not a directory", dir.display())),
        _ => file_err(path, format!("cannot create a file in {}: {}", dir.display(), describe(&e))),
    })
}

/// Replace `path` with `bytes` atomically and durably (see the module documentation).
pub fn write_atomic(path: &Path, bytes: &[u8]) -> Result<()> {
    write_atomic_with(path, |w| w.write_all(bytes))
}

/// As [`write_atomic`], with the contents streamed by `fill` (large exports, token shards).
pub fn write_atomic_with(path: &Path, fill: impl FnOnce(&mut io::BufWriter<&File>) -> io::Result<()>) -> Result<()> {
    check_target(path)?;
    let tmp = new_temp(path)?;
    let cannot = |e: io::Error| file_err(path, format!("cannot write: {}", describe(&e)));
    {
        let mut w = io::BufWriter::new(tmp.as_file());
        fill(&mut w).map_err(cannot)?;
        w.flush().map_err(cannot)?;
    }
    tmp.as_file().sync_all().map_err(cannot)?;
    // On failure `persist` hands the temporary back; dropping it removes the file.
    tmp.persist(path).map_err(|e| cannot(e.error))?;
    sync_dir(parent_dir(path)).map_err(cannot)?;
    clean_stale(path);
    Ok(())
}

/// Make a completed rename durable. Only Unix lets a directory be opened and synced.
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

/// Whether process `pid` exists on this host (Linux: `/proc/PID`). `None` when unknowable.
fn pid_alive(pid: u32) -> Option<bool> {
    if !Path::new("/proc/self").exists() {
        return None;
    }
    Some(Path::new("/proc").join(pid.to_string()).exists())
}

/// Remove temporary files of `path` left by processes of this host that no longer exist (a
/// kill -9 mid-write). Best effort: anything unexpected is left alone.
pub fn clean_stale(path: &Path) {
    let Ok(prefix) = tmp_prefix(path) else { return };
    let Ok(entries) = fs::read_dir(parent_dir(path)) else { return };
    for e in entries.flatten() {
        let name = e.file_name();
        let Some(rest) = name.to_str().and_then(|n| n.strip_prefix(&prefix)).filter(|r| r.ends_with(TMP_SUFFIX)) else {
            continue;
        };
        let Some(pid) = rest.split('.').next().and_then(|p| p.parse::<u32>().ok()) else { continue };
        let is_file = e.file_type().is_ok_and(|t| t.is_file() || t.is_symlink());
        if is_file && pid != std::process::id() && pid_alive(pid) == Some(false) {
            let _ = fs::remove_file(e.path());
        }
    }
}

/// Check before any work that `path` can be written as `flag` (`--report`, `--json`, ...): its
/// directory exists and takes a new file, and it is not a directory or a special file. Nothing
/// is left behind.
pub fn check_output(flag: &str, path: &Path) -> Result<()> {
    let named = |e: Error| match e {
        Error::File { path, msg } => Error::File { path: format!("{flag} {path}"), msg },
        e => e,
    };
    check_target(path).map_err(named)?;
    // Creating (and dropping, which removes) the temporary proves the directory is writable.
    new_temp(path).map_err(named)?;
    Ok(())
}

/// Where a path points, for comparing outputs: the directory resolved, then the file name (the
/// file itself resolved when it exists, so two symlinks to one file compare equal).
fn identity(path: &Path) -> PathBuf {
    if let Ok(p) = fs::canonicalize(path) {
        return p;
    }
    let dir = fs::canonicalize(parent_dir(path)).unwrap_or_else(|_| parent_dir(path).to_path_buf());
    dir.join(path.file_name().unwrap_or(path.as_os_str()))
}

/// [`check_output`] for each `(flag, path)`, and no two flags naming the same file.
pub fn check_outputs(outputs: &[(&str, &Path)]) -> Result<()> {
    for (flag, p) in outputs {
        check_output(flag, p)?;
    }
    for (i, (fa, pa)) in outputs.iter().enumerate() {
        for (fb, pb) in &outputs[i + 1..] {
            if identity(pa) == identity(pb) {
                return Err(Error::InvalidArgument(format!(
                    "{fa} and {fb} name the same file {}: each output needs its own path",
                    pa.display()
                )));
            }
        }
    }
    Ok(())
}

/// An input file opened for reading: regular files only (a FIFO would block the read forever, a
/// directory or device is never what was meant), with its size.
pub fn open_input(path: &Path) -> Result<(File, u64)> {
    let m = fs::metadata(path).map_err(|e| file_err(path, format!("cannot read: {}", describe(&e))))?;
    if m.is_dir() {
        return Err(file_err(path, "is a directory, not a file"));
    }
    if !m.is_file() {
        return Err(file_err(path, "is not a regular file (a FIFO, socket or device); give a regular file"));
    }
    let mut opts = fs::OpenOptions::new();
    opts.read(true);
    #[cfg(unix)]
    {
        // Should the path be swapped for a FIFO after the check, opening it must not block.
        use std::os::unix::fs::OpenOptionsExt;
        opts.custom_flags(libc::O_NONBLOCK);
    }
    let f = opts.open(path).map_err(|e| file_err(path, format!("cannot read: {}", describe(&e))))?;
    let m = f.metadata().map_err(|e| file_err(path, format!("cannot read: {}", describe(&e))))?;
    if !m.is_file() {
        return Err(file_err(path, "is not a regular file"));
    }
    Ok((f, m.len()))
}

/// The whole of a regular file of at most `max_bytes` (checked before reading, and enforced
/// while reading should the file grow meanwhile); `what` names the limit in the error.
pub fn read_input(path: &Path, max_bytes: u64, what: &str) -> Result<Vec<u8>> {
    let (f, len) = open_input(path)?;
    if len > max_bytes {
        return Err(file_err(
            path,
            format!(
                "is {}, more than the {} a {what} may be",
                crate::host::human_bytes(len as usize),
                crate::host::human_bytes(max_bytes as usize)
            ),
        ));
    }
    let mut buf = Vec::new();
    buf.try_reserve_exact(len as usize)
        .map_err(|_| crate::host::alloc_failed(|| format!("reading {}", path.display()), len as usize))?;
    f.take(max_bytes.saturating_add(1))
        .read_to_end(&mut buf)
        .map_err(|e| file_err(path, format!("cannot read: {}", describe(&e))))?;
    if buf.len() as u64 > max_bytes {
        return Err(file_err(
            path,
            format!("grew past the {} limit while being read", crate::host::human_bytes(max_bytes as usize)),
        ));
    }
    Ok(buf)
}

/// Temporary names of `path` present now (for tests of the cleanup).
#[doc(hidden)]
pub fn temp_files_of(path: &Path) -> Vec<OsString> {
    let Ok(prefix) = tmp_prefix(path) else { return vec![] };
    let Ok(entries) = fs::read_dir(parent_dir(path)) else { return vec![] };
    entries
        .flatten()
        .map(|e| e.file_name())
        .filter(|n| n.to_str().is_some_and(|n| n.starts_with(&prefix) && n.ends_with(TMP_SUFFIX)))
        .collect()
}

/// The temporary name a process `pid` of this host would use for `path` (for tests).
#[doc(hidden)]
pub fn temp_name_for(path: &Path, pid: u32, random: &str) -> Result<PathBuf> {
    Ok(parent_dir(path).join(format!("{}{pid}.{random}{TMP_SUFFIX}", tmp_prefix(path)?)))
}
