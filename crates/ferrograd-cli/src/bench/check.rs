//! Correctness checks that run before a bench may post a number: a fast wrong kernel is not a
//! result. Outputs are compared with a float64 reference computed on the CPU, by the norm-wise
//! relative error ‖out − ref‖ / ‖ref‖ (NaN or infinity never passes), on a few sampled rows when
//! the full tensor would cost too much host time. On CUDA the check runs with allocation
//! poisoning on (new buffers filled with NaN), so an element a kernel forgot to write fails it.

use crate::CliResult;
use ferrograd_core::{Rng, Tensor};

/// ‖x − y‖₂ / ‖y‖₂ in f64; infinite when lengths differ or anything is not finite (the core's, which
/// the workloads beside each fused op use too).
pub use ferrograd_core::fused::bench::rel_err;

/// The rows to check: all of them up to `all_up_to`, else the first, the last and `extra` drawn
/// from the seeded generator (sorted, distinct).
pub fn sample_rows(n: usize, all_up_to: usize, extra: usize, rng: &mut Rng) -> Vec<usize> {
    if n <= all_up_to {
        return (0..n).collect();
    }
    let (seed, off) = rng.advance(extra);
    let mut rows: Vec<usize> = vec![0, n - 1];
    rows.extend((0..extra as u64).map(|i| {
        let u = ferrograd_core::rng::uniform_at(seed, off, i);
        ((u * n as f64) as usize).min(n - 1)
    }));
    rows.sort_unstable();
    rows.dedup();
    rows
}

/// The given rows of a 2-d tensor as f64 (exact for every dtype), fetched one row at a time
/// unless all rows are wanted.
pub fn rows_f64(t: &Tensor, rows: &[usize]) -> CliResult<Vec<Vec<f64>>> {
    let (n, cols) = (t.dims()[0], t.dims()[1]);
    if rows.len() == n {
        let all = t.to_f64_vec()?;
        return Ok(all.chunks(cols.max(1)).map(<[f64]>::to_vec).collect());
    }
    rows.iter().map(|&i| Ok(t.narrow(0, i, 1)?.to_f64_vec()?)).collect()
}

/// Fail with a message naming `what` when `err` is over `tol` (or not finite).
pub fn require(what: &str, err: f64, tol: f64) -> CliResult<()> {
    if err.is_finite() && err <= tol {
        Ok(())
    } else {
        Err(format!(
            "{what}: result disagrees with the float64 reference (relative error {err:.3e} > {tol:.0e}); \
             not timing a wrong kernel"
        )
        .into())
    }
}

/// Every element of `t` is finite (catches elements a kernel left as poison). One reduction on
/// the device, one scalar back.
pub fn all_finite(t: &Tensor) -> CliResult<bool> {
    let s = t.to_dtype(ferrograd_core::DType::F32)?.abs()?.sum_all()?.item_f64()?;
    Ok(s.is_finite())
}

/// Run `f` with new CUDA buffers poisoned (NaN), restoring the setting afterwards.
pub fn poisoned<T>(f: impl FnOnce() -> CliResult<T>) -> CliResult<T> {
    ferrograd_core::cuda::set_poison_allocations(true);
    let r = f();
    ferrograd_core::cuda::set_poison_allocations(false);
    r
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rel_err_is_normwise_and_rejects_nan() {
        assert_eq!(rel_err(&[1.0, 2.0], &[1.0, 2.0]), 0.0);
        assert!((rel_err(&[3.0, 0.0], &[0.0, 4.0]) - 5.0 / 4.0).abs() < 1e-12);
        assert_eq!(rel_err(&[f64::NAN], &[1.0]), f64::INFINITY);
        assert_eq!(rel_err(&[1.0], &[1.0, 2.0]), f64::INFINITY);
        assert!(require("x", 1e-7, 1e-5).is_ok());
        assert!(require("x", f64::NAN, 1e-5).is_err());
        assert!(require("x", 1e-3, 1e-5).unwrap_err().to_string().contains("not timing a wrong kernel"));
    }

    #[test]
    fn sampled_rows_include_both_ends() {
        let mut rng = Rng::new(1);
        assert_eq!(sample_rows(5, 8, 3, &mut rng), vec![0, 1, 2, 3, 4]);
        let r = sample_rows(10_000, 8, 6, &mut rng);
        assert_eq!(r[0], 0);
        assert_eq!(*r.last().unwrap(), 9_999);
        assert!(r.len() >= 3 && r.windows(2).all(|w| w[0] < w[1]), "{r:?}");
    }
}
