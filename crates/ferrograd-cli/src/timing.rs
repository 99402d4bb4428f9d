//! Timing for benchmarks: warm up, repeat within a time budget, report the median.
//!
//! The number of repetitions adapts to the cost of one run: cheap runs repeat until the budget is
//! spent (up to `max_reps`), costly ones stop at `min_reps`, so a slow baseline at a large size
//! still finishes in seconds.

use std::time::{Duration, Instant};

#[derive(Debug, Clone, Copy)]
pub struct Plan {
    /// Untimed runs first: page faults, thread-pool start-up, caches.
    pub warmup: usize,
    pub min_reps: usize,
    pub max_reps: usize,
    /// Timed runs stop once this much time was spent and `min_reps` are done.
    pub budget: Duration,
}

#[derive(Debug, Clone)]
pub struct Timing {
    /// Every timed run, in the order they ran.
    pub runs: Vec<Duration>,
}

impl Timing {
    pub fn median(&self) -> Duration {
        median(&self.runs)
    }
    pub fn min(&self) -> Duration {
        self.runs.iter().copied().min().unwrap_or_default()
    }
    pub fn reps(&self) -> usize {
        self.runs.len()
    }
}

/// Run `f` per `plan` and time each timed run. `f`'s result goes through `black_box` so the work
/// cannot be optimised away.
pub fn measure<T>(plan: Plan, mut f: impl FnMut() -> T) -> Timing {
    for _ in 0..plan.warmup {
        std::hint::black_box(f());
    }
    let max_reps = plan.max_reps.max(plan.min_reps).max(1);
    let mut runs = Vec::with_capacity(max_reps.min(1024));
    let start = Instant::now();
    while runs.len() < max_reps && (runs.len() < plan.min_reps.max(1) || start.elapsed() < plan.budget) {
        let t = Instant::now();
        std::hint::black_box(f());
        runs.push(t.elapsed());
    }
    Timing { runs }
}

/// The median; the mean of the middle two for an even count; zero for none.
pub fn median(runs: &[Duration]) -> Duration {
    if runs.is_empty() {
        return Duration::ZERO;
    }
    let mut v = runs.to_vec();
    v.sort_unstable();
    let n = v.len();
    if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ms(v: &[u64]) -> Vec<Duration> {
        v.iter().map(|&x| Duration::from_millis(x)).collect()
    }

    #[test]
    fn median_odd_even_empty() {
        assert_eq!(median(&ms(&[5, 1, 3])), Duration::from_millis(3));
        assert_eq!(median(&ms(&[4, 1, 3, 2])), Duration::from_micros(2500));
        assert_eq!(median(&[]), Duration::ZERO);
    }

    #[test]
    fn reps_respect_min_and_max() {
        let mut calls = 0;
        let plan = Plan { warmup: 2, min_reps: 3, max_reps: 5, budget: Duration::from_secs(60) };
        let t = measure(plan, || calls += 1);
        assert_eq!(t.reps(), 5);
        assert_eq!(calls, 7);

        let plan = Plan { warmup: 0, min_reps: 3, max_reps: 100, budget: Duration::ZERO };
        assert_eq!(measure(plan, || ()).reps(), 3);
    }
}
