//! Writing an architecture's `.bin` and `.manifest` (`ferrograd kernels --write-prebuilt`).

use ferrograd_core::cuda::nvrtc::{Arch, CompiledKernel, NvrtcVersion};
use sha2::{Digest, Sha256};
use std::fmt::Write as _;
use std::io::Write as _;
use std::path::{Path, PathBuf};

/// Why the files could not be written.
#[derive(Debug, thiserror::Error)]
pub enum WriteError {
    /// A file could not be written (the library's atomic write: the old file is untouched).
    #[error(transparent)]
    File(#[from] ferrograd_core::Error),
    /// A kernel was compiled for another architecture than the files are for.
    #[error("{name} was built for {target}, not {arch}")]
    WrongArch {
        /// The module.
        name: String,
        /// What it was built for.
        target: Arch,
        /// What the files are for.
        arch: Arch,
    },
}

/// Writes `<dir>/<arch>.bin` and `<dir>/<arch>.manifest` for `kernels`, built by NVRTC `nvrtc`
/// for `arch`; returns the two paths. Each file is replaced atomically, the CUBINs first: a
/// manifest never names bytes that are not there, and a run stopped between the two leaves an
/// old manifest whose checksums reject the new bytes (those modules are compiled then).
pub fn write(
    dir: &Path,
    arch: Arch,
    nvrtc: NvrtcVersion,
    kernels: &[CompiledKernel],
) -> Result<[PathBuf; 2], WriteError> {
    let mut sorted: Vec<&CompiledKernel> = kernels.iter().collect();
    sorted.sort_by(|a, b| a.name.cmp(&b.name));
    let mut blob = Vec::new();
    let mut manifest = format!(
        "# ferrograd's kernel modules for {arch}, prebuilt: written by `ferrograd kernels --write-prebuilt`\n\
         # (scripts/prebuild-kernels.sh); do not edit. Format: crates/ferrograd-kernels/src/lib.rs.\n\
         nvrtc {nvrtc}\narch {arch}\n"
    );
    for k in sorted {
        if k.arch.number() != arch.number() {
            return Err(WriteError::WrongArch { name: k.name.clone(), target: k.arch, arch });
        }
        let offset = blob.len();
        let mut enc = flate2::write::DeflateEncoder::new(&mut blob, flate2::Compression::best());
        // Writing into a Vec cannot fail.
        let _ = enc.write_all(&k.cubin);
        let _ = enc.finish();
        let sha: [u8; 32] = Sha256::digest(&k.cubin).into();
        let _ = writeln!(
            manifest,
            "{} {} {} {offset} {} {} {} {}",
            k.name,
            k.arch,
            k.key.to_hex(),
            blob.len() - offset,
            k.cubin.len(),
            crate::set::hex(&sha),
            k.compile_time.as_millis()
        );
    }
    let bin = dir.join(format!("{arch}.bin"));
    let text = dir.join(format!("{arch}.manifest"));
    ferrograd_core::io::write_atomic(&bin, &blob)?;
    ferrograd_core::io::write_atomic(&text, manifest.as_bytes())?;
    Ok([bin, text])
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::set::Prebuilt;
    use ferrograd_core::cuda::nvrtc::{KernelSource, Origin, PrebuiltKernels};
    use std::sync::Arc;
    use std::time::Duration;

    const V13: NvrtcVersion = NvrtcVersion { major: 13, minor: 0 };

    fn compiled(name: &'static str, arch: Arch, bytes: Vec<u8>) -> CompiledKernel {
        CompiledKernel {
            name: name.to_string(),
            arch,
            key: KernelSource::new(name, name).cache_key(arch, V13),
            cubin: Arc::from(bytes),
            from_cache: false,
            origin: Origin::Compiled,
            compile_time: Duration::from_millis(1234),
            elapsed: Duration::ZERO,
            cache_warning: None,
        }
    }

    #[test]
    fn written_files_read_back_to_the_same_cubins() {
        let dir = std::env::temp_dir().join(format!("fg-prebuilt-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("temp dir");
        // Not all zeros: a varied pattern, and one that compresses well.
        let a: Vec<u8> = (0..5000u32).map(|i| (i.wrapping_mul(2654435761) >> 13) as u8).collect();
        let b: Vec<u8> = (0..9000u32).map(|i| (i % 7) as u8).collect();
        let wg = compiled("wg", Arch::SM90.arch_specific(), vec![3, 1, 4, 1, 5]);
        let kernels = [compiled("b", Arch::SM90, b.clone()), compiled("a", Arch::SM90, a.clone()), wg];
        let [bin, manifest] = write(&dir, Arch::SM90, V13, &kernels).expect("write");
        let blob: &'static [u8] = Box::leak(std::fs::read(&bin).expect("bin").into_boxed_slice());
        let text = std::fs::read_to_string(&manifest).expect("manifest");
        let set = Prebuilt::parse(&[(Arch::SM90, &text, blob)]).expect("parse");
        assert_eq!(set.nvrtc(), V13);
        let names: Vec<&str> = set.modules(Arch::SM90).iter().map(|e| e.name.as_str()).collect();
        assert_eq!(names, ["a", "b", "wg"]);
        for (k, want) in kernels.iter().zip([&b[..], &a[..], &[3, 1, 4, 1, 5][..]]) {
            let got = set.get(&k.key).expect("lookup").expect("shipped");
            assert_eq!(&*got.cubin, want, "{}", k.name);
            assert_eq!(got.compile_time, Duration::from_millis(1234));
        }
        assert!(blob.len() < a.len() + b.len(), "deflated: {} bytes", blob.len());
        // A kernel of another architecture is refused, and the files stay as they were.
        let other = compiled("c", Arch::SM80, vec![1]);
        assert!(matches!(write(&dir, Arch::SM90, V13, &[other]), Err(WriteError::WrongArch { .. })));
        assert_eq!(std::fs::read_to_string(&manifest).expect("manifest"), text);
        let _ = std::fs::remove_dir_all(&dir);
    }
}
