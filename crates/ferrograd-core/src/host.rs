//! Host (CPU) memory: how much this process may still allocate, and the checks that turn a plan
//! that cannot fit into a typed [`Error::HostOutOfMemory`] instead of an abort ("memory allocation
//! of N bytes failed") or a visit from the kernel's OOM killer.
//!
//! Figures come from `/proc/meminfo` (`MemAvailable`, `MemTotal`) and, inside a container, the
//! cgroup's limit (v2 `memory.max`, v1 `memory.limit_in_bytes`) less what the cgroup already uses
//! (reclaimable page cache not counted), whichever is smaller. `FERROGRAD_HOST_MEMORY_LIMIT`
//! (`8GiB`, `500MB`, ...) caps the figure further, for tests and shared machines. Where none of
//! these exist (not Linux) the figure is unknown and only `try_reserve` guards allocations.

use crate::{Error, Result};
use std::path::{Path, PathBuf};

/// The environment variable that caps the memory ferrograd plans with on the host.
pub const HOST_MEMORY_LIMIT_ENV: &str = "FERROGRAD_HOST_MEMORY_LIMIT";

/// Allocations at least this large are checked against the available figure before they are
/// made (reading it costs tens of microseconds; filling this much memory costs milliseconds).
pub const CHECK_ABOVE_BYTES: usize = 256 << 20;

/// Host memory figures from [`host_memory`] (the cgroup limit when one applies, else the machine).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HostMemory {
    /// Bytes this process can still allocate without swapping or being killed (an estimate).
    pub available: usize,
    /// The machine's (or cgroup's) total.
    pub total: usize,
}

/// The current figures, or `None` where the platform reports none.
pub fn host_memory() -> Option<HostMemory> {
    let env_cap = match std::env::var(HOST_MEMORY_LIMIT_ENV) {
        Ok(v) if !v.trim().is_empty() => crate::cuda::alloc::parse_byte_size(&v),
        _ => None,
    };
    let proc = std::fs::read_to_string("/proc/meminfo").ok().and_then(|t| meminfo(&t));
    let mut m = proc.or(env_cap.map(|c| HostMemory { available: c, total: c }))?;
    if let Some(c) = cgroup_memory() {
        m.available = m.available.min(c.available);
        m.total = m.total.min(c.total);
    }
    if let Some(cap) = env_cap {
        m.available = m.available.min(cap);
        m.total = m.total.min(cap);
    }
    Some(m)
}

/// `MemAvailable` and `MemTotal` of a `/proc/meminfo` text, in bytes.
pub fn meminfo(text: &str) -> Option<HostMemory> {
    let field = |name: &str| -> Option<usize> {
        let line = text.lines().find(|l| l.starts_with(name))?;
        let kib: usize = line[name.len()..].trim().trim_end_matches("kB").trim().parse().ok()?;
        kib.checked_mul(1024)
    };
    let total = field("MemTotal:")?;
    // Kernels before 3.14 have no MemAvailable: free + page cache is the usual estimate.
    let available =
        field("MemAvailable:").or_else(|| Some(field("MemFree:")?.saturating_add(field("Cached:").unwrap_or(0))))?;
    Some(HostMemory { available: available.min(total), total })
}

/// The cgroup (v2, then v1) limit less current use, when a limit is set.
fn cgroup_memory() -> Option<HostMemory> {
    let own = std::fs::read_to_string("/proc/self/cgroup").unwrap_or_default();
    cgroup_v2(&own).or_else(|| cgroup_v1(&own))
}

/// Candidate directories: the process's own cgroup path under `root`, then `root` itself (inside
/// a container the listed path is often not mounted, and the root is the container's cgroup).
fn cgroup_dirs(root: &Path, own: &str, controller: Option<&str>) -> Vec<PathBuf> {
    let rel = own.lines().find_map(|l| {
        let mut parts = l.splitn(3, ':');
        let (_, ctrls, path) = (parts.next()?, parts.next()?, parts.next()?);
        let matches = match controller {
            None => ctrls.is_empty(),
            Some(c) => ctrls.split(',').any(|x| x == c),
        };
        matches.then(|| path.trim_start_matches('/').to_string())
    });
    let mut dirs = Vec::new();
    if let Some(rel) = rel.filter(|r| !r.is_empty()) {
        dirs.push(root.join(rel));
    }
    dirs.push(root.to_path_buf());
    dirs
}

fn read_num(p: &Path) -> Option<usize> {
    std::fs::read_to_string(p).ok()?.trim().parse().ok()
}

/// Bytes of `inactive_file` (page cache the kernel reclaims before it kills) in a memory.stat.
fn inactive_file(dir: &Path, key: &str) -> usize {
    std::fs::read_to_string(dir.join("memory.stat"))
        .ok()
        .and_then(|s| s.lines().find_map(|l| l.strip_prefix(key)?.trim().parse().ok()))
        .unwrap_or(0)
}

fn limit_room(limit: usize, used: usize, reclaimable: usize) -> Option<HostMemory> {
    // v1 reports "no limit" as a huge page-aligned number; anything past 2^60 means none.
    (limit < 1 << 60)
        .then(|| HostMemory { available: limit.saturating_sub(used.saturating_sub(reclaimable)), total: limit })
}

fn cgroup_v2(own: &str) -> Option<HostMemory> {
    for dir in cgroup_dirs(Path::new("/sys/fs/cgroup"), own, None) {
        let Ok(max) = std::fs::read_to_string(dir.join("memory.max")) else { continue };
        let limit: usize = max.trim().parse().ok()?; // "max": no limit
        let used = read_num(&dir.join("memory.current"))?;
        return limit_room(limit, used, inactive_file(&dir, "inactive_file "));
    }
    None
}

fn cgroup_v1(own: &str) -> Option<HostMemory> {
    for dir in cgroup_dirs(Path::new("/sys/fs/cgroup/memory"), own, Some("memory")) {
        let Some(limit) = read_num(&dir.join("memory.limit_in_bytes")) else { continue };
        let used = read_num(&dir.join("memory.usage_in_bytes"))?;
        return limit_room(limit, used, inactive_file(&dir, "total_inactive_file "));
    }
    None
}

/// Refuse `bytes` of new host memory for `what` when the machine reports less available. With no
/// figures (non-Linux) this passes and allocation itself (`try_reserve`) is the guard.
pub fn check_fits(what: impl FnOnce() -> String, bytes: usize) -> Result<()> {
    match host_memory() {
        Some(m) if bytes > m.available => Err(Error::HostOutOfMemory {
            what: what(),
            requested: bytes,
            available: Some(m.available),
            total: Some(m.total),
        }),
        _ => Ok(()),
    }
}

/// Refuse a plan of `bytes` on `device` that cannot fit: on the CPU as [`check_fits`]; on a GPU
/// against the driver's free memory plus the blocks ferrograd's allocator has cached, within its
/// cap (`FERROGRAD_CUDA_MEMORY_LIMIT`), as an `Error::OutOfMemory` with the allocator's figures,
/// the same error a failed allocation gives, but before any work.
pub fn check_fits_on(device: crate::Device, what: impl FnOnce() -> String, bytes: usize) -> Result<()> {
    let ordinal = match device {
        crate::Device::Cpu => return check_fits(what, bytes),
        crate::Device::Cuda(o) => o,
    };
    let dev = crate::cuda::CudaDevice::get(ordinal)?;
    let (free, total) = dev.mem_info()?;
    let stats = dev.memory_stats();
    let (allocated, reserved) = (stats.allocated_bytes.current, stats.reserved_bytes.current);
    let mut room = free.saturating_add(reserved.saturating_sub(allocated));
    if let Some(limit) = dev.memory_limit() {
        room = room.min(limit.saturating_sub(allocated));
    }
    if bytes <= room {
        return Ok(());
    }
    Err(Error::OutOfMemory {
        requested: bytes,
        free,
        total,
        allocated,
        reserved,
        hint: format!("{} needs more than the {} this device has room for.", what(), human_bytes(room)),
    })
}

/// The error for an allocation that `try_reserve` refused (or that cannot even be expressed).
pub fn alloc_failed(what: impl FnOnce() -> String, bytes: usize) -> Error {
    let m = host_memory();
    Error::HostOutOfMemory {
        what: what(),
        requested: bytes,
        available: m.map(|m| m.available),
        total: m.map(|m| m.total),
    }
}

/// `1.50 GiB`, `12.0 MiB`, `512 B`.
pub fn human_bytes(b: usize) -> String {
    const UNITS: [&str; 6] = ["B", "KiB", "MiB", "GiB", "TiB", "PiB"];
    let mut v = b as f64;
    let mut u = 0;
    while v >= 1024.0 && u + 1 < UNITS.len() {
        v /= 1024.0;
        u += 1;
    }
    if u == 0 {
        format!("{b} B")
    } else {
        format!("{v:.2} {}", UNITS[u])
    }
}

/// "12.3 GiB of 23.5 GiB are available", or that the figure is unknown.
pub fn describe_room(available: Option<usize>, total: Option<usize>) -> String {
    match (available, total) {
        (Some(a), Some(t)) => format!("{} of {} are available", human_bytes(a), human_bytes(t)),
        (Some(a), None) => format!("{} are available", human_bytes(a)),
        _ => "the allocation failed (the machine reports no memory figures)".into(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn meminfo_parses_available_and_falls_back_to_free_plus_cache() {
        let m = meminfo("MemTotal:       24684096 kB\nMemFree:  100 kB\nMemAvailable:   23873516 kB\n").unwrap();
        assert_eq!(m, HostMemory { available: 23873516 * 1024, total: 24684096 * 1024 });
        let old = meminfo("MemTotal: 1000 kB\nMemFree: 100 kB\nCached: 50 kB\n").unwrap();
        assert_eq!(old.available, 150 * 1024);
        assert!(meminfo("garbage").is_none());
    }

    #[test]
    fn cgroup_paths_and_limits() {
        let own = "4:memory:/a/b\n0::/c\n";
        assert_eq!(cgroup_dirs(Path::new("/r"), own, Some("memory")), vec![PathBuf::from("/r/a/b"), "/r".into()]);
        assert_eq!(cgroup_dirs(Path::new("/r"), own, None), vec![PathBuf::from("/r/c"), "/r".into()]);
        assert_eq!(limit_room(1000, 600, 100), Some(HostMemory { available: 500, total: 1000 }));
        assert_eq!(limit_room(9223372036854771712, 5, 0), None);
    }

    #[test]
    fn a_plan_larger_than_the_machine_is_refused_with_figures() {
        if host_memory().is_none() {
            println!("no host memory figures on this platform");
            return;
        }
        let e = check_fits(|| "a test plan".into(), usize::MAX).unwrap_err();
        let msg = e.to_string();
        assert!(matches!(e, Error::HostOutOfMemory { available: Some(_), .. }), "{msg}");
        assert!(msg.contains("a test plan") && msg.contains("available"), "{msg}");
        check_fits(|| "one byte".into(), 1).unwrap();
    }
}
