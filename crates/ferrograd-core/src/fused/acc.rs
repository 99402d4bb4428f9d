//! The accumulation type of the fused ops' CPU references (attention, selective scan): f64 for
//! f64 inputs, f32 for the others, with the conversions both need.

/// The accumulation type: f64 for f64 inputs, f32 for the others.
pub(crate) trait Acc:
    num_traits::Float + std::ops::AddAssign + bytemuck::Zeroable + Send + Sync + 'static
{
    fn of(x: f64) -> Self;
    fn f64(self) -> f64;
}

impl Acc for f32 {
    fn of(x: f64) -> f32 {
        x as f32
    }
    fn f64(self) -> f64 {
        self as f64
    }
}

impl Acc for f64 {
    fn of(x: f64) -> f64 {
        x
    }
    fn f64(self) -> f64 {
        self
    }
}
