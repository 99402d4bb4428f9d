//! The GPU architecture a CUBIN is built for, and the spellings a user may give it.

use super::error::KernelError;
use std::fmt;
use std::str::FromStr;

/// A real GPU architecture (`sm_XY`), the unit a CUBIN is built for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Arch {
    major: u32,
    minor: u32,
    specific: bool,
}

impl Arch {
    /// Ampere (A100).
    pub const SM80: Arch = Arch::new(8, 0);
    /// Hopper (H100, H200).
    pub const SM90: Arch = Arch::new(9, 0);

    /// `sm_{major}{minor}`, not arch-specific.
    pub const fn new(major: u32, minor: u32) -> Arch {
        Arch { major, minor, specific: false }
    }

    /// The `a` variant (`sm_90a`): unlocks instructions that exist only on that exact chip
    /// (wgmma, setmaxnreg), at the price of a CUBIN that loads on nothing else.
    pub const fn arch_specific(self) -> Arch {
        Arch { specific: true, ..self }
    }

    /// From the driver's compute-capability attributes, which are `c_int`s.
    pub fn from_compute_capability(major: i32, minor: i32) -> Result<Arch, KernelError> {
        match (u32::try_from(major), u32::try_from(minor)) {
            (Ok(ma), Ok(mi)) if ma > 0 && mi < 10 => Ok(Arch::new(ma, mi)),
            _ => Err(KernelError::InvalidArch(format!("{major}.{minor}"))),
        }
    }

    /// Major compute capability.
    pub fn major(self) -> u32 {
        self.major
    }

    /// Minor compute capability.
    pub fn minor(self) -> u32 {
        self.minor
    }

    /// Whether this is an `a` target (`sm_90a`), whose features run only on that exact architecture.
    pub fn is_arch_specific(self) -> bool {
        self.specific
    }

    /// The number NVRTC uses in `nvrtcGetSupportedArchs` (90 for sm_90 and sm_90a).
    pub fn number(self) -> u32 {
        self.major * 10 + self.minor
    }
}

/// The SM number a CUBIN was built for (90 for sm_90 and sm_90a), read from its ELF header, or
/// `None` when the bytes are not a CUDA ELF image (e_machine EM_CUDA = 190). The number sits in
/// e_flags: bits 0..8 up to ELF ABI version 7, bits 8..16 from version 8 (CUDA 12.8+), which NVRTC
/// 13.0 writes (sm_90 -> e_flags 0x6005a04).
pub fn cubin_sm(cubin: &[u8]) -> Option<u32> {
    if cubin.len() <= 64 || &cubin[..4] != b"\x7fELF" || u16::from_le_bytes([cubin[18], cubin[19]]) != 190 {
        return None;
    }
    let flags = u32::from_le_bytes([cubin[48], cubin[49], cubin[50], cubin[51]]);
    Some(if cubin[8] >= 8 { (flags >> 8) & 0xff } else { flags & 0xff })
}

impl fmt::Display for Arch {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let suffix = if self.specific { "a" } else { "" };
        write!(f, "sm_{}{}{suffix}", self.major, self.minor)
    }
}

/// Accepts `sm_90`, `sm_90a`, `90`, `9.0`: the spellings of `nvcc`, `nvidia-smi` and PyTorch's
/// `TORCH_CUDA_ARCH_LIST`, so a user can paste whichever they have.
impl FromStr for Arch {
    type Err = KernelError;

    fn from_str(s: &str) -> Result<Arch, KernelError> {
        let bad = || KernelError::InvalidArch(s.to_string());
        let t = s.trim();
        let t = t.strip_prefix("sm_").unwrap_or(t);
        let (t, specific) = match t.strip_suffix('a') {
            Some(rest) => (rest, true),
            None => (t, false),
        };
        let arch = if let Some((ma, mi)) = t.split_once('.') {
            let major = ma.parse::<u32>().map_err(|_| bad())?;
            let minor = mi.parse::<u32>().map_err(|_| bad())?;
            if minor > 9 {
                return Err(bad());
            }
            Arch::new(major, minor)
        } else {
            if !(2..=3).contains(&t.len()) || !t.bytes().all(|b| b.is_ascii_digit()) {
                return Err(bad());
            }
            let n = t.parse::<u32>().map_err(|_| bad())?;
            Arch::new(n / 10, n % 10)
        };
        if arch.major == 0 {
            return Err(bad());
        }
        Ok(if specific { arch.arch_specific() } else { arch })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cubin_sm_reads_both_elf_abis_and_refuses_other_bytes() {
        let mut elf = vec![0u8; 80];
        elf[..4].copy_from_slice(b"\x7fELF");
        elf[18..20].copy_from_slice(&190u16.to_le_bytes());
        elf[8] = 8; // ABI 8: the SM number in bits 8..16 (NVRTC 13.0 writes 0x6005a04 for sm_90)
        elf[48..52].copy_from_slice(&0x0600_5a04u32.to_le_bytes());
        assert_eq!(cubin_sm(&elf), Some(90));
        elf[8] = 7; // ABI 7 and before: bits 0..8
        elf[48..52].copy_from_slice(&0x0050_0550u32.to_le_bytes());
        assert_eq!(cubin_sm(&elf), Some(80));
        elf[18] = 62; // x86-64, not CUDA
        assert_eq!(cubin_sm(&elf), None);
        assert_eq!(cubin_sm(b"\x7fELF"), None);
        assert_eq!(cubin_sm(&[0u8; 100]), None);
    }

    #[test]
    fn arch_parses_common_spellings() {
        for (s, want) in [
            ("sm_90", Arch::SM90),
            ("90", Arch::SM90),
            ("9.0", Arch::SM90),
            ("sm_80", Arch::SM80),
            ("sm_86", Arch::new(8, 6)),
            ("sm_100", Arch::new(10, 0)),
            ("120", Arch::new(12, 0)),
            ("sm_90a", Arch::SM90.arch_specific()),
        ] {
            assert_eq!(s.parse::<Arch>(), Ok(want), "{s}");
        }
        for s in ["", "sm_", "sm_9", "sm_x0", "9.10", "0.5", "sm_1000", "compute_90"] {
            assert!(s.parse::<Arch>().is_err(), "{s}");
        }
        assert_eq!(Arch::new(10, 0).to_string(), "sm_100");
        assert_eq!(Arch::new(10, 0).number(), 100);
        assert_eq!(Arch::from_compute_capability(9, 0), Ok(Arch::SM90));
        assert!(Arch::from_compute_capability(-1, 0).is_err());
    }
}
