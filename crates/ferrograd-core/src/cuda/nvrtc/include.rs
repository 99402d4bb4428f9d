//! Where the CUDA headers (`cuda_fp16.h`, `cuda_bf16.h`) that NVRTC needs are found.

use super::error::KernelError;
use std::ffi::OsString;
use std::fs;
use std::path::{Path, PathBuf};

/// Directory (or `:`-separated list) searched first for the CUDA headers.
pub const CUDA_INCLUDE_ENV: &str = "FERROGRAD_CUDA_INCLUDE";

/// Headers our kernels include; a directory counts as a CUDA include dir only if it has all.
pub(crate) const REQUIRED_HEADERS: [&str; 2] = ["cuda_fp16.h", "cuda_bf16.h"];

/// Every directory [`find_cuda_include`] would look at, in order, for this process.
pub fn cuda_include_candidates() -> Vec<PathBuf> {
    let nvrtc_lib = loaded_nvrtc_path();
    include_candidates(&|k| std::env::var_os(k), nvrtc_lib.as_deref())
}

/// The first candidate holding `cuda_fp16.h` and `cuda_bf16.h`, or an error listing them all.
pub fn find_cuda_include() -> Result<PathBuf, KernelError> {
    first_include_dir(cuda_include_candidates())
}

fn first_include_dir(candidates: Vec<PathBuf>) -> Result<PathBuf, KernelError> {
    match candidates.iter().find(|d| REQUIRED_HEADERS.iter().all(|h| d.join(h).is_file())) {
        Some(dir) => Ok(dir.clone()),
        None => Err(KernelError::HeadersNotFound { searched: candidates }),
    }
}

/// Order: what the user named, then the headers next to the libnvrtc actually loaded (they
/// match its version), then the usual toolkit place, then pip wheels in any Python we can see.
fn include_candidates(env: &dyn Fn(&str) -> Option<OsString>, nvrtc_lib: Option<&Path>) -> Vec<PathBuf> {
    let mut out: Vec<PathBuf> = Vec::new();
    if let Some(list) = env(CUDA_INCLUDE_ENV) {
        out.extend(std::env::split_paths(&list).filter(|p| !p.as_os_str().is_empty()));
    }
    for var in ["CUDA_HOME", "CUDA_PATH"] {
        if let Some(root) = env(var).filter(|v| !v.is_empty()) {
            out.push(PathBuf::from(root).join("include"));
        }
    }
    // Toolkit: <root>/lib64/libnvrtc.so -> <root>/include; wheel: cu13/lib -> cu13/include.
    if let Some(lib_dir) = nvrtc_lib.and_then(Path::parent) {
        if let Some(root) = lib_dir.parent() {
            out.push(root.join("include"));
        }
    }
    out.push(PathBuf::from("/usr/local/cuda/include"));
    let mut prefixes: Vec<PathBuf> = Vec::new();
    for var in ["VIRTUAL_ENV", "CONDA_PREFIX"] {
        if let Some(p) = env(var).filter(|v| !v.is_empty()) {
            prefixes.push(PathBuf::from(p));
        }
    }
    if let Some(home) = env("HOME").filter(|v| !v.is_empty()) {
        prefixes.push(PathBuf::from(home).join(".local"));
    }
    prefixes.push(PathBuf::from("/usr/local"));
    prefixes.push(PathBuf::from("/usr"));
    for prefix in prefixes {
        for py in python_lib_dirs(&prefix.join("lib")) {
            for packages in ["site-packages", "dist-packages"] {
                out.push(py.join(packages).join("nvidia").join("cu13").join("include"));
            }
        }
    }
    let mut seen = std::collections::HashSet::new();
    out.retain(|p| seen.insert(p.clone()));
    out
}

/// `<lib>/python3*`, sorted so the search order does not depend on directory order.
fn python_lib_dirs(lib: &Path) -> Vec<PathBuf> {
    let Ok(entries) = fs::read_dir(lib) else {
        return Vec::new();
    };
    let mut dirs: Vec<PathBuf> = entries
        .filter_map(Result::ok)
        .filter(|e| e.file_name().to_string_lossy().starts_with("python3"))
        .map(|e| e.path())
        .filter(|p| p.is_dir())
        .collect();
    dirs.sort();
    dirs
}

/// Where the loader found libnvrtc, read from the process's own mappings (the loader does not
/// tell libloading's callers which path it picked).
#[cfg(target_os = "linux")]
pub(crate) fn loaded_nvrtc_path() -> Option<PathBuf> {
    let maps = fs::read_to_string("/proc/self/maps").ok()?;
    maps.lines().find_map(|line| {
        let path = line.split_whitespace().nth(5)?;
        let file = Path::new(path).file_name()?.to_str()?;
        (file.starts_with("libnvrtc.") && !file.contains("builtins")).then(|| PathBuf::from(path))
    })
}

#[cfg(not(target_os = "linux"))]
pub(crate) fn loaded_nvrtc_path() -> Option<PathBuf> {
    None
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cuda::nvrtc::testutil::{env_of, TempDir};

    fn fake_include(root: &Path, headers: &[&str]) -> PathBuf {
        fs::create_dir_all(root).expect("mkdir");
        for h in headers {
            fs::write(root.join(h), b"// fake").expect("write header");
        }
        root.to_path_buf()
    }

    /// Only the candidates inside a test's temporary tree: a real toolkit in /usr/local/cuda (as
    /// on the GPU machines) must not decide what these tests see.
    fn under(c: Vec<PathBuf>, root: &Path) -> Vec<PathBuf> {
        c.into_iter().filter(|p| p.starts_with(root)).collect()
    }

    #[test]
    fn header_search_order_and_wheel_layout() {
        let dir = TempDir::new("headers");
        let venv = dir.path().join("venv");
        let wheel = venv.join("lib/python3.12/site-packages/nvidia/cu13/include");
        fake_include(&wheel, &REQUIRED_HEADERS);
        let user = fake_include(&dir.path().join("mine"), &REQUIRED_HEADERS);
        let half_only = fake_include(&dir.path().join("cuda/include"), &["cuda_fp16.h"]);

        let env = env_of(vec![("VIRTUAL_ENV", venv.clone().into())]);
        let c = include_candidates(&env, None);
        assert!(c.contains(&wheel), "{c:?}");
        assert_eq!(first_include_dir(under(c, dir.path())), Ok(wheel.clone()));

        // The user's choice wins; a dir lacking cuda_bf16.h does not count.
        let env = env_of(vec![
            (CUDA_INCLUDE_ENV, user.clone().into()),
            ("CUDA_HOME", dir.path().join("cuda").into()),
            ("VIRTUAL_ENV", venv.clone().into()),
        ]);
        let c = include_candidates(&env, None);
        assert_eq!(c[0], user);
        assert_eq!(c[1], half_only);
        assert_eq!(first_include_dir(c), Ok(user));
        let env = env_of(vec![("CUDA_HOME", dir.path().join("cuda").into()), ("VIRTUAL_ENV", venv.clone().into())]);
        assert_eq!(first_include_dir(under(include_candidates(&env, None), dir.path())), Ok(wheel.clone()));

        // Next to the loaded library.
        let lib = wheel.parent().expect("cu13").join("lib/libnvrtc.so.13");
        let c = include_candidates(&env_of(vec![]), Some(&lib));
        assert_eq!(c[0], wheel);
    }

    #[test]
    fn header_search_failure_names_every_place() {
        let dir = TempDir::new("noheaders");
        let venv = dir.path().join("venv");
        fs::create_dir_all(venv.join("lib/python3.11")).expect("mkdir");
        let env = env_of(vec![
            (CUDA_INCLUDE_ENV, dir.path().join("a").into()),
            ("CUDA_PATH", dir.path().join("b").into()),
            ("VIRTUAL_ENV", venv.clone().into()),
        ]);
        let all = include_candidates(&env, None);
        assert!(all.contains(&PathBuf::from("/usr/local/cuda/include")), "{all:?}");
        let candidates = under(all, dir.path());
        let err = first_include_dir(candidates.clone()).expect_err("no headers anywhere");
        let msg = err.to_string();
        for c in &candidates {
            assert!(msg.contains(&c.display().to_string()), "{msg} lacks {}", c.display());
        }
        assert!(msg.contains("venv/lib/python3.11/site-packages/nvidia/cu13/include"), "{msg}");
    }
}
