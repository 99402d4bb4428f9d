//! The walk down the Monster group's order, in exact big integers, and the digit sums that define
//! each copy's tensor.

use num_bigint::BigUint;
use num_traits::One;

/// Walk steps, bases and rings: the tensor of one copy is [STEPS, BASES, RINGS].
pub const STEPS: usize = 71;
pub const BASES: usize = 71;
pub const RINGS: usize = 71;
/// One-hot classes: residues are < 72, and 72 is a multiple of 8 for tensor cores.
pub const CLASSES: usize = 72;
/// Entries of one copy's tensor.
pub const ENTRIES: usize = STEPS * BASES * RINGS;
/// Samples (rows `values[s][b][:]`) in one copy.
pub const SAMPLES: usize = STEPS * BASES;

/// (prime, multiplicity) of |M|, largest prime first.
const PRIME_POWERS: [(u32, u32); 15] = [
    (71, 1),
    (59, 1),
    (47, 1),
    (41, 1),
    (31, 1),
    (29, 1),
    (23, 1),
    (19, 1),
    (17, 1),
    (13, 3),
    (11, 2),
    (7, 6),
    (5, 9),
    (3, 20),
    (2, 46),
];

/// The 95 prime factors of |M| with multiplicity, largest first.
pub fn factors() -> Vec<u32> {
    PRIME_POWERS.iter().flat_map(|&(p, k)| std::iter::repeat_n(p, k as usize)).collect()
}

/// |M| = 808017424794512875886459904961710757005754368000000000.
pub fn monster_order() -> BigUint {
    factors().into_iter().fold(BigUint::one(), |acc, p| acc * p)
}

/// `v_0 .. v_70` of copy `copy`: F rotated left by `copy mod 95`, divided out one by one.
pub fn walk(copy: usize) -> Vec<BigUint> {
    let f = factors();
    let mut v = monster_order();
    let mut out = Vec::with_capacity(STEPS);
    for s in 0..STEPS {
        out.push(v.clone());
        v /= f[(copy + s) % f.len()];
    }
    out
}

/// `digitsum(v_s in base b + 2)` for s, b in 0..71, row-major [STEPS, BASES].
pub fn digit_sums(copy: usize) -> Vec<u32> {
    let mut out = Vec::with_capacity(STEPS * BASES);
    for v in walk(copy) {
        for b in 0..BASES {
            out.push(v.to_radix_le(b as u32 + 2).iter().map(|&d| d as u32).sum());
        }
    }
    out
}

/// The copy's tensor `T[s][b][r] = digitsum mod (r + 2)` computed on the CPU with integers:
/// the reference the device-built residues are tested against.
pub fn residues_reference(copy: usize) -> Vec<u8> {
    let d = digit_sums(copy);
    let mut out = Vec::with_capacity(ENTRIES);
    for ds in d {
        for r in 0..RINGS {
            out.push((ds % (r as u32 + 2)) as u8);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn order_and_factors() {
        assert_eq!(factors().len(), 95);
        assert_eq!(monster_order().to_string(), "808017424794512875886459904961710757005754368000000000");
        assert_eq!(monster_order().bits(), 180);
    }

    #[test]
    fn spec_check_values() {
        let w = walk(0);
        assert_eq!(w[70], BigUint::from(33_554_432u32));
        let t = residues_reference(0);
        let at = |s: usize, b: usize, r: usize| t[(s * BASES + b) * RINGS + r];
        assert_eq!((0..8).map(|r| at(0, 0, r)).collect::<Vec<_>>(), vec![1, 1, 3, 2, 1, 4, 3, 4]);
        assert_eq!((67..71).map(|r| at(70, 70, r)).collect::<Vec<_>>(), vec![49, 47, 45, 43]);
        let mut seen = [false; CLASSES];
        t.iter().for_each(|&x| seen[x as usize] = true);
        assert_eq!(seen.iter().filter(|&&s| s).count(), 72);
    }

    #[test]
    fn rotation_repeats_every_95_copies() {
        assert_eq!(digit_sums(3), digit_sums(98));
        assert_ne!(digit_sums(3), digit_sums(4));
    }
}
