//! A generator shared by the layers that draw at forward time (dropout) and the code that saves
//! and restores it (checkpoints). `forward` takes `&self`, so the state sits behind a mutex.

use ferrograd_core::Rng;
use std::sync::{Arc, Mutex, MutexGuard};

/// A Philox generator behind a shared lock: clones draw from (and advance) the same stream.
#[derive(Debug, Clone)]
pub struct SharedRng(Arc<Mutex<Rng>>);

impl SharedRng {
    /// A generator at the start of `seed`'s stream.
    pub fn new(seed: u64) -> Self {
        SharedRng(Arc::new(Mutex::new(Rng::new(seed))))
    }

    /// A generator in state `rng`.
    pub fn from_rng(rng: Rng) -> Self {
        SharedRng(Arc::new(Mutex::new(rng)))
    }

    /// The generator itself; a poisoned lock still holds a valid state (two integers), so it is
    /// recovered rather than propagated.
    pub fn lock(&self) -> MutexGuard<'_, Rng> {
        self.0.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// A copy of the current state (seed and offset: all of it).
    pub fn get(&self) -> Rng {
        *self.lock()
    }

    /// Restore a state (from a checkpoint).
    pub fn set(&self, rng: Rng) {
        *self.lock() = rng;
    }
}
