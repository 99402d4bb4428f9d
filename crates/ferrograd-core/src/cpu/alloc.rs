//! Fallible host allocation for the CPU backend. Every buffer whose size comes from a tensor goes
//! through here, so a size the machine cannot hold is a typed `Error::HostOutOfMemory` with the
//! figures, never an abort ("memory allocation of N bytes failed"): large requests are first
//! checked against the memory the host reports available (`host::check_fits`; overcommit would
//! otherwise accept them and the OOM killer end the process later), then reserved with
//! `try_reserve_exact`.

use crate::host;
use crate::Result;

fn what<T>(n: usize) -> impl FnOnce() -> String {
    move || {
        let ty = std::any::type_name::<T>().rsplit("::").next().unwrap_or("element");
        format!("a CPU buffer of {n} {ty} elements")
    }
}

/// An empty vector with room for exactly `n` elements.
pub(crate) fn with_capacity<T>(n: usize) -> Result<Vec<T>> {
    let bytes = n.checked_mul(std::mem::size_of::<T>()).ok_or_else(|| host::alloc_failed(what::<T>(n), usize::MAX))?;
    if bytes >= host::CHECK_ABOVE_BYTES {
        host::check_fits(what::<T>(n), bytes)?;
    }
    let mut v = Vec::new();
    v.try_reserve_exact(n).map_err(|_| host::alloc_failed(what::<T>(n), bytes))?;
    Ok(v)
}

/// `n` copies of `value`.
pub(crate) fn filled<T: Clone>(value: T, n: usize) -> Result<Vec<T>> {
    let mut v = with_capacity(n)?;
    v.resize(n, value);
    Ok(v)
}

/// `n` zeroed elements.
pub(crate) fn zeroed<T: bytemuck::Zeroable + Clone>(n: usize) -> Result<Vec<T>> {
    filled(T::zeroed(), n)
}

/// The items of an iterator of known length, in a buffer reserved up front.
pub(crate) fn collect<T>(it: impl ExactSizeIterator<Item = T>) -> Result<Vec<T>> {
    let mut v = with_capacity(it.len())?;
    v.extend(it);
    Ok(v)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn impossible_sizes_are_errors_not_aborts() {
        let e = with_capacity::<f64>(usize::MAX / 4).unwrap_err();
        assert!(matches!(e, crate::Error::HostOutOfMemory { .. }), "{e}");
        let e = zeroed::<f32>(isize::MAX as usize / 4).unwrap_err();
        assert!(e.to_string().contains("host out of memory"), "{e}");
        assert_eq!(filled(7u8, 3).unwrap(), vec![7, 7, 7]);
        assert_eq!(collect([1, 2].into_iter()).unwrap(), vec![1, 2]);
    }
}
