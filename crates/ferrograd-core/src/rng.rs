//! Philox 4x32-10 (Salmon et al., "Parallel random numbers: as easy as 1, 2, 3", SC'11): a
//! counter-based generator, so element `i` of a random tensor depends only on (seed, offset, i).
//! Any backend can compute any element independently, which is what lets the CPU and a GPU kernel
//! produce identical tensors from the same seed.
//!
//! Mapping (shared by every backend): element `i` reads block `offset + i / 4`, lane `i % 4`.
//! Uniform: `(u >> 8) * 2^-24` in `[0, 1)`. Normal: Box-Muller on lane pairs (0,1) and (2,3) of a
//! block, computed in f64: `r = sqrt(-2 ln u_a)`, `θ = 2π u_b`, even lanes take `r cos θ`, odd
//! lanes `r sin θ`, with `u_a = ((x >> 8) + 1) 2^-24` in `(0, 1]` so the log is finite.

const M0: u32 = 0xD251_1F53;
const M1: u32 = 0xCD9E_8D57;
const W0: u32 = 0x9E37_79B9;
const W1: u32 = 0xBB67_AE85;

#[inline]
fn mulhilo(a: u32, b: u32) -> (u32, u32) {
    let p = (a as u64) * (b as u64);
    ((p >> 32) as u32, p as u32)
}

/// One Philox 4x32-10 block.
#[inline]
pub fn philox4x32_10(ctr: [u32; 4], key: [u32; 2]) -> [u32; 4] {
    let (mut c, mut k) = (ctr, key);
    for round in 0..10 {
        if round > 0 {
            k = [k[0].wrapping_add(W0), k[1].wrapping_add(W1)];
        }
        let (hi0, lo0) = mulhilo(M0, c[0]);
        let (hi1, lo1) = mulhilo(M1, c[2]);
        c = [hi1 ^ c[1] ^ k[0], lo1, hi0 ^ c[3] ^ k[1], lo0];
    }
    c
}

fn key_of(seed: u64) -> [u32; 2] {
    [seed as u32, (seed >> 32) as u32]
}

fn block(seed: u64, index: u64) -> [u32; 4] {
    philox4x32_10([index as u32, (index >> 32) as u32, 0, 0], key_of(seed))
}

/// A 32-bit Philox output as a uniform f64 in `[0, 1)` (24 bits, as the CUDA kernels do).
#[inline]
pub fn to_uniform(x: u32) -> f64 {
    (x >> 8) as f64 * (1.0 / 16_777_216.0)
}

/// Uniform sample `i` of the stream starting at block `offset`.
pub fn uniform_at(seed: u64, offset: u64, i: u64) -> f64 {
    to_uniform(block(seed, offset + i / 4)[(i % 4) as usize])
}

/// Normal sample `i` of the stream starting at block `offset`.
pub fn normal_at(seed: u64, offset: u64, i: u64) -> f64 {
    let b = block(seed, offset + i / 4);
    let lane = (i % 4) as usize;
    let pair = lane & !1;
    let ua = ((b[pair] >> 8) as f64 + 1.0) * (1.0 / 16_777_216.0);
    let ub = to_uniform(b[pair + 1]);
    let r = (-2.0 * ua.ln()).sqrt();
    let theta = 2.0 * std::f64::consts::PI * ub;
    if lane.is_multiple_of(2) {
        r * theta.cos()
    } else {
        r * theta.sin()
    }
}

/// A seeded stream: each draw of `n` values consumes `ceil(n / 4)` blocks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Rng {
    /// The Philox key.
    pub seed: u64,
    /// The next unused block (4 values each).
    pub offset: u64,
}

impl Rng {
    /// A stream at the start of `seed`'s sequence.
    pub fn new(seed: u64) -> Self {
        Rng { seed, offset: 0 }
    }

    /// Reserve blocks for `n` values; returns the (seed, offset) a backend fills them from.
    pub fn advance(&mut self, n: usize) -> (u64, u64) {
        let start = self.offset;
        self.offset += (n as u64).div_ceil(4);
        (self.seed, start)
    }
}

static GLOBAL: std::sync::Mutex<Rng> = std::sync::Mutex::new(Rng { seed: 0x5EED, offset: 0 });

/// Seed the default generator used by `Tensor::rand`/`randn`/`dropout`.
pub fn manual_seed(seed: u64) {
    set_global_rng(Rng::new(seed));
}

/// The default generator's state (to save and restore it, e.g. in a checkpoint).
pub fn global_rng() -> Rng {
    *GLOBAL.lock().unwrap_or_else(|e| e.into_inner())
}

/// Restore the default generator's state.
pub fn set_global_rng(r: Rng) {
    *GLOBAL.lock().unwrap_or_else(|e| e.into_inner()) = r;
}

/// Run `f` on the default generator.
pub fn with_global_rng<T>(f: impl FnOnce(&mut Rng) -> T) -> T {
    f(&mut GLOBAL.lock().unwrap_or_else(|e| e.into_inner()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn philox_known_answers() {
        // Random123's kat_vectors for philox4x32_10.
        assert_eq!(philox4x32_10([0; 4], [0; 2]), [0x6627e8d5, 0xe169c58d, 0xbc57ac4c, 0x9b00dbd8]);
        assert_eq!(philox4x32_10([u32::MAX; 4], [u32::MAX; 2]), [0x408f276d, 0x41c83b0e, 0xa20bc7c6, 0x6d5451fd]);
    }

    #[test]
    fn uniform_range_and_moments() {
        let n = 40_000;
        let v: Vec<f64> = (0..n).map(|i| uniform_at(7, 0, i)).collect();
        assert!(v.iter().all(|&x| (0.0..1.0).contains(&x)));
        let mean = v.iter().sum::<f64>() / n as f64;
        assert!((mean - 0.5).abs() < 0.01, "{mean}");
        let z: Vec<f64> = (0..n).map(|i| normal_at(7, 0, i)).collect();
        let m = z.iter().sum::<f64>() / n as f64;
        let var = z.iter().map(|x| (x - m) * (x - m)).sum::<f64>() / n as f64;
        assert!(m.abs() < 0.02 && (var - 1.0).abs() < 0.03, "{m} {var}");
    }

    #[test]
    fn advance_is_disjoint() {
        let mut r = Rng::new(1);
        assert_eq!(r.advance(5), (1, 0));
        assert_eq!(r.advance(4), (1, 2));
        assert_eq!(r.offset, 3);
    }
}
