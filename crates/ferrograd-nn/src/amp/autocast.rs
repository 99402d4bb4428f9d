//! A thread-local autocast dtype, set by a guard. Layers consult `autocast_dtype()`: `Linear`
//! casts its input and weight down for the matmul and its output back to f32; everything else
//! keeps computing in f32. Parameters are never cast in place (they are the f32 master weights);
//! the casts are graph ops, so gradients reach the parameters as f32.

use ferrograd_core::{DType, Error, Result};
use std::cell::Cell;

thread_local! {
    static AUTOCAST: Cell<Option<DType>> = const { Cell::new(None) };
}

/// The low-precision dtype of the innermost active autocast scope on this thread.
pub fn autocast_dtype() -> Option<DType> {
    AUTOCAST.with(|a| a.get())
}

/// Restores the previous autocast state on drop (scopes nest).
#[must_use = "autocast ends when the guard is dropped"]
pub struct AutocastGuard(Option<DType>);

impl Drop for AutocastGuard {
    fn drop(&mut self) {
        AUTOCAST.with(|a| a.set(self.0));
    }
}

/// Enter an autocast scope for `dtype` (BF16 or F16) on this thread.
pub fn autocast(dtype: DType) -> Result<AutocastGuard> {
    if !matches!(dtype, DType::BF16 | DType::F16) {
        return Err(Error::InvalidArgument(format!("autocast runs in bf16 or f16, not {dtype}")));
    }
    Ok(AutocastGuard(AUTOCAST.with(|a| a.replace(Some(dtype)))))
}

/// Run `f` under autocast.
pub fn with_autocast<T>(dtype: DType, f: impl FnOnce() -> Result<T>) -> Result<T> {
    let _g = autocast(dtype)?;
    f()
}
