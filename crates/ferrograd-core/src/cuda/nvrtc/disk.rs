//! The on-disk CUBIN cache: one file per [`CacheKey`], written atomically, checked on read.

use super::key::{hex, CacheKey};
use sha2::{Digest, Sha256};
use std::ffi::OsString;
use std::fs;
use std::io;
use std::path::{Path, PathBuf};
use std::time::Duration;

/// Directory of the on-disk cache; empty disables it.
pub const CACHE_DIR_ENV: &str = "FERROGRAD_CACHE_DIR";

// Entry layout, integers little-endian:
//   magic [8] | format version u32 | flags u32 (reserved, 0) | key [32] | compile time µs u64 |
//   payload length u64 | payload SHA-256 [32] | payload
// The key is repeated inside so that a file copied or renamed onto another key's name is caught;
// the length and hash catch truncation, a torn write from a crashed process, and bit rot.
const MAGIC: [u8; 8] = *b"FGCUBIN\0";
const FORMAT_VERSION: u32 = 1;
const OFF_VERSION: usize = 8;
const OFF_KEY: usize = 16;
const OFF_COMPILE_MICROS: usize = 48;
const OFF_PAYLOAD_LEN: usize = 56;
const OFF_PAYLOAD_SHA: usize = 64;
/// Bytes before the payload.
pub const HEADER_LEN: usize = 96;

/// A CUBIN read back from disk.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CachedCubin {
    /// The CUBIN bytes.
    pub cubin: Vec<u8>,
    /// What NVRTC took when the entry was written: the time a cache hit saves.
    pub compile_time: Duration,
}

/// Outcome of [`DiskCache::get`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Lookup {
    /// A valid entry.
    Hit(CachedCubin),
    /// No entry.
    Miss,
    /// The file exists but cannot be trusted; the reason says why. Recompile and `put` over it.
    Corrupt(String),
}

/// A directory of CUBINs, one file per [`CacheKey`], written atomically.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DiskCache {
    dir: PathBuf,
}

impl DiskCache {
    /// A cache in `dir` (created on the first write).
    pub fn new(dir: impl Into<PathBuf>) -> DiskCache {
        DiskCache { dir: dir.into() }
    }

    /// `$FERROGRAD_CACHE_DIR`, else `$HOME/.cache/ferrograd/kernels`; `None` when the variable
    /// is set but empty (caching switched off) or there is no home directory.
    pub fn from_env() -> Option<DiskCache> {
        default_cache_dir(&|k| std::env::var_os(k)).map(DiskCache::new)
    }

    /// The directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The file an entry of `key` lives in (`HEX.cubin`).
    pub fn path_for(&self, key: &CacheKey) -> PathBuf {
        self.dir.join(format!("{}.cubin", key.to_hex()))
    }

    /// A missing file is a miss, an untrustworthy one `Corrupt`; only I/O trouble other than
    /// "not found" is an error.
    pub fn get(&self, key: &CacheKey) -> io::Result<Lookup> {
        let bytes = match fs::read(self.path_for(key)) {
            Ok(b) => b,
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(Lookup::Miss),
            Err(e) => return Err(e),
        };
        Ok(decode_entry(key, &bytes))
    }

    /// Write through the project's one atomic write (`crate::io::write_atomic`: an exclusive
    /// temporary file in the same directory, fsync, rename): readers in other processes see the
    /// old entry or the new one, never half of one, two processes writing the same key both leave
    /// a valid file, and a symlink planted in the cache directory is never followed.
    pub fn put(&self, key: &CacheKey, cubin: &[u8], compile_time: Duration) -> io::Result<PathBuf> {
        fs::create_dir_all(&self.dir)?;
        let path = self.path_for(key);
        let entry = encode_entry(key, cubin, compile_time);
        crate::io::write_atomic(&path, &entry).map_err(|e| io::Error::other(e.to_string()))?;
        Ok(path)
    }
}

fn default_cache_dir(env: &dyn Fn(&str) -> Option<OsString>) -> Option<PathBuf> {
    match env(CACHE_DIR_ENV) {
        Some(dir) if dir.is_empty() => None,
        Some(dir) => Some(PathBuf::from(dir)),
        None => env("HOME")
            .filter(|h| !h.is_empty())
            .map(|home| PathBuf::from(home).join(".cache").join("ferrograd").join("kernels")),
    }
}

fn encode_entry(key: &CacheKey, cubin: &[u8], compile_time: Duration) -> Vec<u8> {
    let micros = u64::try_from(compile_time.as_micros()).unwrap_or(u64::MAX);
    let mut out = Vec::with_capacity(HEADER_LEN + cubin.len());
    out.extend_from_slice(&MAGIC);
    out.extend_from_slice(&FORMAT_VERSION.to_le_bytes());
    out.extend_from_slice(&0u32.to_le_bytes());
    out.extend_from_slice(key.as_bytes());
    out.extend_from_slice(&micros.to_le_bytes());
    out.extend_from_slice(&(cubin.len() as u64).to_le_bytes());
    out.extend_from_slice(&Sha256::digest(cubin));
    debug_assert_eq!(out.len(), HEADER_LEN);
    out.extend_from_slice(cubin);
    out
}

fn decode_entry(key: &CacheKey, bytes: &[u8]) -> Lookup {
    let corrupt = |why: String| Lookup::Corrupt(why);
    if bytes.len() < HEADER_LEN {
        return corrupt(format!("{} bytes, shorter than the {HEADER_LEN}-byte header", bytes.len()));
    }
    let u32_at = |o: usize| bytes[o..o + 4].try_into().map(u32::from_le_bytes);
    let u64_at = |o: usize| bytes[o..o + 8].try_into().map(u64::from_le_bytes);
    if bytes[..8] != MAGIC {
        return corrupt("bad magic: not a ferrograd kernel cache entry".to_string());
    }
    match u32_at(OFF_VERSION) {
        Ok(FORMAT_VERSION) => {}
        Ok(v) => return corrupt(format!("format version {v}, this build reads {FORMAT_VERSION}")),
        Err(_) => return corrupt("unreadable format version".to_string()),
    }
    if bytes[OFF_KEY..OFF_KEY + 32] != key.as_bytes()[..] {
        return corrupt(format!("holds key {}, not {key}", hex(&bytes[OFF_KEY..OFF_KEY + 32])));
    }
    let (Ok(micros), Ok(len)) = (u64_at(OFF_COMPILE_MICROS), u64_at(OFF_PAYLOAD_LEN)) else {
        return corrupt("unreadable header".to_string());
    };
    let payload = &bytes[HEADER_LEN..];
    if payload.len() as u64 != len {
        return corrupt(format!("payload is {} bytes, header says {len}", payload.len()));
    }
    if Sha256::digest(payload)[..] != bytes[OFF_PAYLOAD_SHA..OFF_PAYLOAD_SHA + 32] {
        return corrupt("payload checksum mismatch".to_string());
    }
    Lookup::Hit(CachedCubin { cubin: payload.to_vec(), compile_time: Duration::from_micros(micros) })
}
#[cfg(test)]
mod tests {
    use super::*;
    use crate::cuda::nvrtc::testutil::{env_of, key, TempDir};

    fn fake_cubin() -> Vec<u8> {
        let mut v = b"\x7fELF fake cubin ".to_vec();
        v.extend((0..1000u32).map(|i| (i * 7 % 251) as u8));
        v
    }

    fn hit(cache: &DiskCache, k: &CacheKey) -> CachedCubin {
        match cache.get(k).expect("read cache") {
            Lookup::Hit(c) => c,
            other => panic!("expected a hit, got {other:?}"),
        }
    }

    fn corrupt_reason(cache: &DiskCache, k: &CacheKey) -> String {
        match cache.get(k).expect("read cache") {
            Lookup::Corrupt(why) => why,
            other => panic!("expected a corrupt entry, got {other:?}"),
        }
    }
    #[test]
    fn disk_cache_miss_then_hit() {
        let dir = TempDir::new("hit");
        let cache = DiskCache::new(dir.path().join("nested/kernels"));
        let k = key("a");
        assert_eq!(cache.get(&k).expect("read"), Lookup::Miss);
        let path = cache.put(&k, &fake_cubin(), Duration::from_millis(812)).expect("write");
        assert_eq!(path, cache.path_for(&k));
        assert_eq!(fs::metadata(&path).expect("stat").len() as usize, HEADER_LEN + fake_cubin().len());
        let got = hit(&cache, &k);
        assert_eq!(got.cubin, fake_cubin());
        assert_eq!(got.compile_time, Duration::from_millis(812));
        // No temp files left behind.
        let names: Vec<_> = fs::read_dir(cache.dir()).expect("ls").filter_map(Result::ok).collect();
        assert_eq!(names.len(), 1);
    }

    #[test]
    fn disk_cache_other_key_misses() {
        let dir = TempDir::new("otherkey");
        let cache = DiskCache::new(dir.path());
        cache.put(&key("a"), &fake_cubin(), Duration::ZERO).expect("write");
        assert_eq!(cache.get(&key("b")).expect("read"), Lookup::Miss);
    }

    #[test]
    fn disk_cache_entry_under_wrong_name_is_corrupt() {
        let dir = TempDir::new("wrongname");
        let cache = DiskCache::new(dir.path());
        let (a, b) = (key("a"), key("b"));
        cache.put(&a, &fake_cubin(), Duration::ZERO).expect("write");
        fs::copy(cache.path_for(&a), cache.path_for(&b)).expect("copy");
        assert!(corrupt_reason(&cache, &b).contains("holds key"));
    }

    #[test]
    fn disk_cache_flipped_payload_byte_is_corrupt_and_put_repairs_it() {
        let dir = TempDir::new("flip");
        let cache = DiskCache::new(dir.path());
        let k = key("a");
        let path = cache.put(&k, &fake_cubin(), Duration::ZERO).expect("write");
        let mut bytes = fs::read(&path).expect("read");
        bytes[HEADER_LEN + 100] ^= 0x01;
        fs::write(&path, &bytes).expect("write");
        assert!(corrupt_reason(&cache, &k).contains("checksum"));
        cache.put(&k, &fake_cubin(), Duration::ZERO).expect("overwrite");
        assert_eq!(hit(&cache, &k).cubin, fake_cubin());
    }

    #[test]
    fn disk_cache_flipped_header_bytes_are_corrupt() {
        let dir = TempDir::new("header");
        let cache = DiskCache::new(dir.path());
        let k = key("a");
        let path = cache.put(&k, &fake_cubin(), Duration::ZERO).expect("write");
        let clean = fs::read(&path).expect("read");
        for (offset, expect) in [
            (0, "magic"),
            (OFF_VERSION, "format version"),
            (OFF_KEY + 5, "holds key"),
            (OFF_PAYLOAD_LEN, "header says"),
            (OFF_PAYLOAD_SHA + 31, "checksum"),
        ] {
            let mut bytes = clean.clone();
            bytes[offset] ^= 0x40;
            fs::write(&path, &bytes).expect("write");
            let why = corrupt_reason(&cache, &k);
            assert!(why.contains(expect), "flip at {offset}: {why}");
        }
    }

    #[test]
    fn disk_cache_truncated_entries_are_corrupt() {
        let dir = TempDir::new("trunc");
        let cache = DiskCache::new(dir.path());
        let k = key("a");
        let path = cache.put(&k, &fake_cubin(), Duration::ZERO).expect("write");
        let full = fs::read(&path).expect("read");
        for len in [0, 7, HEADER_LEN - 1, HEADER_LEN, full.len() - 1] {
            fs::write(&path, &full[..len]).expect("truncate");
            let why = corrupt_reason(&cache, &k);
            assert!(why.contains("bytes"), "len {len}: {why}");
        }
        let mut longer = full.clone();
        longer.push(0);
        fs::write(&path, &longer).expect("extend");
        assert!(corrupt_reason(&cache, &k).contains("header says"));
    }

    #[test]
    fn disk_cache_empty_payload_round_trips() {
        let dir = TempDir::new("empty");
        let cache = DiskCache::new(dir.path());
        cache.put(&key("a"), &[], Duration::ZERO).expect("write");
        assert!(hit(&cache, &key("a")).cubin.is_empty());
    }

    #[test]
    fn disk_cache_unwritable_dir_is_an_error_not_a_panic() {
        let dir = TempDir::new("unwritable");
        // A regular file where the directory should be: create_dir_all fails for any user.
        let blocker = dir.path().join("file");
        fs::write(&blocker, b"x").expect("write");
        let cache = DiskCache::new(blocker.join("kernels"));
        assert!(cache.put(&key("a"), &fake_cubin(), Duration::ZERO).is_err());
        assert!(cache.get(&key("a")).is_err());
    }

    #[test]
    fn cache_dir_from_env() {
        let env = env_of(vec![(CACHE_DIR_ENV, "/x/y".into()), ("HOME", "/home/u".into())]);
        assert_eq!(default_cache_dir(&env), Some(PathBuf::from("/x/y")));
        let env = env_of(vec![("HOME", "/home/u".into())]);
        assert_eq!(default_cache_dir(&env), Some(PathBuf::from("/home/u/.cache/ferrograd/kernels")));
        let env = env_of(vec![(CACHE_DIR_ENV, "".into()), ("HOME", "/home/u".into())]);
        assert_eq!(default_cache_dir(&env), None);
        assert_eq!(default_cache_dir(&env_of(vec![])), None);
    }
}
