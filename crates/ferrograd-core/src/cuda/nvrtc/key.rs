//! The cache key: a SHA-256 over everything that decides a CUBIN's bytes.

use super::arch::Arch;
use super::compiler::NvrtcVersion;
use super::source::Header;
use sha2::{Digest, Sha256};
use std::fmt;

/// SHA-256 naming one CUBIN: equal keys must mean byte-identical compiler input.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct CacheKey([u8; 32]);

impl CacheKey {
    /// Each field is tagged and length-prefixed so that moving bytes from one field into the
    /// next (source ending in "x", option starting with "x") cannot produce the same key.
    /// Headers are hashed by name and text, so editing a shared header recompiles exactly the
    /// modules that include it.
    pub fn new(
        name: &str,
        source: &str,
        headers: &[Header],
        options: &[String],
        nvrtc: NvrtcVersion,
        arch: Arch,
    ) -> CacheKey {
        fn field(h: &mut Sha256, tag: &[u8], bytes: &[u8]) {
            h.update(tag);
            h.update((bytes.len() as u64).to_le_bytes());
            h.update(bytes);
        }
        let mut h = Sha256::new();
        field(&mut h, b"ferrograd-kernel-key/1", b"");
        field(&mut h, b"name", name.as_bytes());
        field(&mut h, b"source", source.as_bytes());
        for hd in headers {
            field(&mut h, b"header", hd.name.as_bytes());
            field(&mut h, b"header-text", hd.src.as_bytes());
        }
        for opt in options {
            field(&mut h, b"option", opt.as_bytes());
        }
        field(&mut h, b"nvrtc", nvrtc.to_string().as_bytes());
        field(&mut h, b"arch", arch.to_string().as_bytes());
        CacheKey(h.finalize().into())
    }

    /// A key from its 32 bytes.
    pub const fn from_bytes(bytes: [u8; 32]) -> CacheKey {
        CacheKey(bytes)
    }

    /// The key's bytes.
    pub fn as_bytes(&self) -> &[u8; 32] {
        &self.0
    }

    /// The key as 64 hex digits (the cache file's name).
    pub fn to_hex(&self) -> String {
        hex(&self.0)
    }
}

impl fmt::Display for CacheKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.to_hex())
    }
}

impl fmt::Debug for CacheKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "CacheKey({})", self.to_hex())
    }
}

pub(crate) fn hex(bytes: &[u8]) -> String {
    use fmt::Write as _;
    let mut s = String::with_capacity(bytes.len() * 2);
    for b in bytes {
        // Writing to a String cannot fail.
        let _ = write!(s, "{b:02x}");
    }
    s
}
#[cfg(test)]
mod tests {
    use super::*;
    use crate::cuda::nvrtc::source::{nvrtc_options, CompileOptions, Define, KernelSource};

    const V13: NvrtcVersion = NvrtcVersion { major: 13, minor: 0 };

    #[test]
    fn cache_key_depends_on_every_input() {
        let opts = nvrtc_options(Arch::SM90, &KernelSource::new("k", ""));
        let key = |name, src, headers: &[Header], opts: &[String], nvrtc, arch| {
            CacheKey::new(name, src, headers, opts, nvrtc, arch)
        };
        let base = key("k", "src", &[], &opts, V13, Arch::SM90);
        assert_eq!(base, key("k", "src", &[], &opts, V13, Arch::SM90));
        let fast = nvrtc_options(Arch::SM90, &KernelSource::new("k", "").with_options(CompileOptions::FAST_MATH));
        let defined = nvrtc_options(Arch::SM90, &KernelSource::new("k", "").with_defines(&[Define::int("N", 8)]));
        let h = Header::new;
        let others = [
            key("j", "src", &[], &opts, V13, Arch::SM90),
            key("k", "src2", &[], &opts, V13, Arch::SM90),
            key("k", "src", &[], &fast, V13, Arch::SM90),
            key("k", "src", &[], &defined, V13, Arch::SM90),
            key("k", "src", &[], &opts, NvrtcVersion { major: 13, minor: 1 }, Arch::SM90),
            key("k", "src", &[], &opts, V13, Arch::SM80),
            key("k", "src", &[h("a.cuh", "x")], &opts, V13, Arch::SM90),
            key("k", "src", &[h("a.cuh", "y")], &opts, V13, Arch::SM90),
            key("k", "src", &[h("b.cuh", "x")], &opts, V13, Arch::SM90),
            // Bytes moved across a field boundary.
            key("k", "sr", &[], &["c".to_string()], V13, Arch::SM90),
            key("k", "src", &[h("a.cuh", ""), h("x", "")], &opts, V13, Arch::SM90),
        ];
        for (i, other) in others.iter().enumerate() {
            assert_ne!(base, *other, "{i}");
            for later in &others[i + 1..] {
                assert_ne!(other, later);
            }
        }
        assert_eq!(base.to_hex().len(), 64);
    }
}
