//! The shipped CUBINs as a `PrebuiltKernels` set: manifests parsed once, each CUBIN inflated
//! (and its checksum checked) the first time a process asks for it.

use ferrograd_core::cuda::nvrtc::{Arch, CacheKey, NvrtcVersion, PrebuiltCubin, PrebuiltKernels};
use sha2::{Digest, Sha256};
use std::collections::HashMap;
use std::io::Read;
use std::sync::{Arc, OnceLock};
use std::time::Duration;

/// One shipped module.
#[derive(Debug)]
pub struct Entry {
    /// The module's name.
    pub name: String,
    /// The architecture it was built for (`sm_90a` for a Hopper-only module).
    pub target: Arch,
    /// Its cache key.
    pub key: CacheKey,
    /// Where its deflate stream sits in the architecture's `.bin`.
    pub offset: usize,
    /// The deflate stream's length.
    pub deflated: usize,
    /// The CUBIN's length.
    pub len: usize,
    /// SHA-256 of the CUBIN.
    pub sha256: [u8; 32],
    /// What NVRTC took to build it.
    pub nvrtc_ms: u64,
    blob: &'static [u8],
    inflated: OnceLock<Result<Arc<[u8]>, String>>,
}

impl Entry {
    /// The CUBIN, inflated on first use and checked against its length and checksum.
    pub fn cubin(&self) -> Result<Arc<[u8]>, String> {
        self.inflated.get_or_init(|| self.inflate()).clone()
    }

    fn inflate(&self) -> Result<Arc<[u8]>, String> {
        let stream =
            self.offset.checked_add(self.deflated).and_then(|end| self.blob.get(self.offset..end)).ok_or_else(
                || format!("{}: bytes {}+{} lie outside the file", self.name, self.offset, self.deflated),
            )?;
        let mut cubin = Vec::with_capacity(self.len);
        flate2::read::DeflateDecoder::new(stream)
            .take(self.len as u64 + 1)
            .read_to_end(&mut cubin)
            .map_err(|e| format!("{}: does not inflate: {e}", self.name))?;
        if cubin.len() != self.len || <[u8; 32]>::from(Sha256::digest(&cubin)) != self.sha256 {
            return Err(format!("{}: inflates to other bytes than were shipped (checksum)", self.name));
        }
        Ok(cubin.into())
    }
}

/// Every shipped architecture's modules.
#[derive(Debug)]
pub struct Prebuilt {
    nvrtc: NvrtcVersion,
    archs: Vec<Arch>,
    by_key: HashMap<CacheKey, Entry>,
}

impl Prebuilt {
    /// Parses `(arch, manifest, blob)` triples; all must come from one NVRTC version.
    pub fn parse(shipped: &[(Arch, &str, &'static [u8])]) -> Result<Prebuilt, String> {
        let mut nvrtc = None;
        let mut by_key = HashMap::new();
        for &(arch, manifest, blob) in shipped {
            let (version, entries) =
                parse_manifest(arch, manifest, blob).map_err(|e| format!("{arch}.manifest: {e}"))?;
            if nvrtc.is_some_and(|v| v != version) {
                return Err(format!(
                    "{arch}.manifest: built by NVRTC {version}, the others by {}",
                    nvrtc.unwrap_or(version)
                ));
            }
            nvrtc = Some(version);
            for e in entries {
                by_key.insert(e.key, e);
            }
        }
        let nvrtc = nvrtc.unwrap_or(NvrtcVersion { major: 0, minor: 0 });
        Ok(Prebuilt { nvrtc, archs: shipped.iter().map(|s| s.0).collect(), by_key })
    }

    /// The modules shipped for `arch` (its `sm_90a` ones included for sm_90), by name.
    pub fn modules(&self, arch: Arch) -> Vec<&Entry> {
        let mut v: Vec<&Entry> = self.by_key.values().filter(|e| e.target.number() == arch.number()).collect();
        v.sort_by(|a, b| a.name.cmp(&b.name));
        v
    }

    /// The shipped module whose key is `key`.
    pub fn entry(&self, key: &CacheKey) -> Option<&Entry> {
        self.by_key.get(key)
    }
}

impl PrebuiltKernels for Prebuilt {
    fn nvrtc(&self) -> NvrtcVersion {
        self.nvrtc
    }

    fn get(&self, key: &CacheKey) -> Result<Option<PrebuiltCubin>, String> {
        let Some(e) = self.by_key.get(key) else { return Ok(None) };
        Ok(Some(PrebuiltCubin { cubin: e.cubin()?, compile_time: Duration::from_millis(e.nvrtc_ms) }))
    }

    fn describe(&self) -> String {
        let archs: Vec<String> =
            self.archs.iter().map(|a| format!("{a} ({} modules)", self.modules(*a).len())).collect();
        format!("shipped CUBINs built by NVRTC {} for {}", self.nvrtc, archs.join(", "))
    }
}

fn parse_manifest(arch: Arch, text: &str, blob: &'static [u8]) -> Result<(NvrtcVersion, Vec<Entry>), String> {
    let mut nvrtc = None;
    let mut entries = Vec::new();
    for (i, line) in text.lines().enumerate() {
        let at = |what: String| format!("line {}: {what}", i + 1);
        let f: Vec<&str> = line.split_whitespace().collect();
        match f.as_slice() {
            [] => {}
            [first, ..] if first.starts_with('#') => {}
            ["nvrtc", v] => nvrtc = Some(parse_version(v).ok_or_else(|| at(format!("bad NVRTC version {v:?}")))?),
            ["arch", a] if a.parse::<Arch>().ok() == Some(arch) => {}
            ["arch", a] => return Err(at(format!("says arch {a}, its file name {arch}"))),
            [name, target, key, offset, deflated, len, sha, ms] => {
                let num = |s: &str, what: &str| s.parse::<usize>().map_err(|_| at(format!("bad {what} {s:?}")));
                let target: Arch = target.parse().map_err(|_| at(format!("bad target {target:?}")))?;
                entries.push(Entry {
                    name: name.to_string(),
                    target,
                    key: CacheKey::from_bytes(unhex(key).ok_or_else(|| at(format!("bad key {key:?}")))?),
                    offset: num(offset, "offset")?,
                    deflated: num(deflated, "length")?,
                    len: num(len, "length")?,
                    sha256: unhex(sha).ok_or_else(|| at(format!("bad checksum {sha:?}")))?,
                    nvrtc_ms: num(ms, "time")? as u64,
                    blob,
                    inflated: OnceLock::new(),
                });
            }
            _ => return Err(at(format!("cannot read {line:?}"))),
        }
    }
    Ok((nvrtc.ok_or("no `nvrtc` line")?, entries))
}

fn parse_version(v: &str) -> Option<NvrtcVersion> {
    let (major, minor) = v.split_once('.')?;
    Some(NvrtcVersion { major: major.parse().ok()?, minor: minor.parse().ok()? })
}

pub(crate) fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn unhex(s: &str) -> Option<[u8; 32]> {
    if s.len() != 64 {
        return None;
    }
    let mut out = [0u8; 32];
    for (i, b) in out.iter_mut().enumerate() {
        *b = u8::from_str_radix(s.get(2 * i..2 * i + 2)?, 16).ok()?;
    }
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_damaged_manifest_or_blob_is_an_error_never_a_panic() {
        let v = "nvrtc 13.0\narch sm_90\n";
        let k = "ab".repeat(32);
        let line = |off: usize, len: usize| format!("m sm_90 {k} {off} {len} 5 {k} 3\n");
        assert!(Prebuilt::parse(&[(Arch::SM90, "arch sm_90\n", b"")]).unwrap_err().contains("no `nvrtc` line"));
        assert!(Prebuilt::parse(&[(Arch::SM90, "nvrtc 13.0\narch sm_80\n", b"")]).unwrap_err().contains("line 2"));
        assert!(Prebuilt::parse(&[(Arch::SM90, &format!("{v}m sm_90 zz 0 1 5 {k} 3\n"), b"")]).is_err());
        // Offsets past the end, and bytes that are not deflate: the lookup errs, nothing panics.
        for (text, blob) in [(line(usize::MAX, 2), &b"xy"[..]), (line(0, 2), b"xy"), (line(5, 1), b"xy")] {
            let set = Prebuilt::parse(&[(Arch::SM90, &format!("{v}{text}"), blob)]).expect("parses");
            let key = CacheKey::from_bytes(unhex(&k).expect("hex"));
            assert!(set.get(&key).is_err(), "{text}");
        }
    }

    #[test]
    fn sets_from_two_nvrtc_versions_are_refused() {
        let a = (Arch::SM80, "nvrtc 13.0\narch sm_80\n", &b""[..]);
        let b = (Arch::SM90, "nvrtc 13.1\narch sm_90\n", &b""[..]);
        assert!(Prebuilt::parse(&[a, b]).unwrap_err().contains("13.1"));
        assert_eq!(Prebuilt::parse(&[a]).expect("one").nvrtc(), NvrtcVersion { major: 13, minor: 0 });
    }
}
