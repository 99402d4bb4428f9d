//! Per-epoch sample order: a Fisher-Yates shuffle driven by Philox, keyed by the seed and with the
//! epoch in the counter, so epoch `e` of seed `s` is the same permutation on every run and machine,
//! and any epoch can be produced without replaying the ones before it (resuming mid-run).

use ferrograd_core::rng::philox4x32_10;

/// The permutation of `0..n` for `epoch` of `seed` (the same on every run and machine).
pub fn shuffled_order(n: usize, seed: u64, epoch: u64) -> Vec<usize> {
    let mut v: Vec<usize> = (0..n).collect();
    let key = [seed as u32, (seed >> 32) as u32];
    for i in (1..n).rev() {
        let i64_ = i as u64;
        let r = philox4x32_10([i64_ as u32, (i64_ >> 32) as u32, epoch as u32, (epoch >> 32) as u32], key);
        let x = r[0] as u64 | ((r[1] as u64) << 32);
        // 64 random bits modulo at most 2^32-ish: the bias is below 2^-31, invisible here.
        let j = (x % (i64_ + 1)) as usize;
        v.swap(i, j);
    }
    v
}
