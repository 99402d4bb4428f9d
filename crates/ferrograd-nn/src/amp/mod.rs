//! Mixed precision: an autocast scope that runs matmul-heavy layers in bf16/f16 while parameters,
//! reductions, norms, softmax and losses stay in f32; and a dynamic loss scaler for f16.

mod autocast;
mod grad_scaler;

pub use autocast::{autocast, autocast_dtype, with_autocast, AutocastGuard};
pub use grad_scaler::{GradScaler, GradScalerConfig, GradScalerState};
