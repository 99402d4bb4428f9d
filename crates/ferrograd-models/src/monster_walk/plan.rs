//! How many copies fit. One copy's real footprint is measured from the allocator's statistics
//! while it is built (never taken from arithmetic alone), and the plan divides the room the user
//! asked for by it.

use super::data::{CopyData, COPY_BYTES};
use ferrograd_core::cuda::CudaDevice;
use ferrograd_core::{Device, Error, Result};

/// Room kept for the model, optimizer state, one step's activations and the temporaries of
/// building a copy (the u8 one-hot alone is 26 MB).
pub const RESERVE_BYTES: usize = 256 << 20;

/// What the user asked for.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum PlanRequest {
    Copies(usize),
    /// Fraction of the device's free memory (on the CPU: of the memory the host reports available).
    Fill(f64),
    /// Plan as if the device had this many bytes.
    Budget(usize),
}

#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct MemoryPlan {
    pub copies: usize,
    /// One copy as the allocator counted it (includes its 512-byte rounding).
    pub copy_bytes_measured: usize,
    /// One copy by arithmetic (element counts times dtype sizes).
    pub copy_bytes_arithmetic: usize,
    /// copies x measured bytes.
    pub planned_bytes: usize,
    /// The room the plan divided (None for an explicit copy count).
    pub capacity_bytes: Option<usize>,
    pub reserve_bytes: usize,
}

/// Build copy 0 on `device` and measure what it holds. On CUDA this is the allocator's
/// allocated-bytes delta; on the CPU the tensors' byte counts.
pub fn measure_copy(device: Device) -> Result<(CopyData, usize)> {
    match device {
        Device::Cpu => {
            let c = CopyData::build(0, device)?;
            let b = c.bytes();
            Ok((c, b))
        }
        Device::Cuda(o) => {
            let dev = CudaDevice::get(o)?;
            dev.synchronize()?;
            let before = dev.memory_stats().allocated_bytes.current;
            let c = CopyData::build(0, device)?;
            let after = dev.memory_stats().allocated_bytes.current;
            Ok((c, after.saturating_sub(before)))
        }
    }
}

/// Turn a request into a copy count, given one copy's measured bytes and the device's free bytes.
/// All arithmetic is checked: a count whose bytes overflow is an error naming the request.
pub fn plan(req: PlanRequest, copy_bytes: usize, free_bytes: Option<usize>) -> Result<MemoryPlan> {
    let copy_bytes = copy_bytes.max(1);
    let fit = |room: usize, what: String| -> Result<(usize, Option<usize>)> {
        let n = room.saturating_sub(RESERVE_BYTES) / copy_bytes;
        if n == 0 {
            return Err(Error::InvalidArgument(format!(
                "{what} leaves room for no copy: one copy needs {} plus {} of working space",
                human(copy_bytes),
                human(RESERVE_BYTES)
            )));
        }
        Ok((n, Some(room)))
    };
    let (copies, capacity) = match req {
        PlanRequest::Copies(0) => return Err(Error::InvalidArgument("--copies must be at least 1".into())),
        PlanRequest::Copies(n) => (n, None),
        PlanRequest::Fill(f) if !(f > 0.0 && f <= 1.0) => {
            return Err(Error::InvalidArgument(format!("--fill {f} is not a fraction in (0, 1]")))
        }
        PlanRequest::Fill(f) => {
            let free = free_bytes.ok_or_else(|| {
                Error::InvalidArgument("--fill: this machine reports no free-memory figure; use --copies".into())
            })?;
            fit((free as f64 * f) as usize, format!("--fill {f} of {} free", human(free)))?
        }
        PlanRequest::Budget(b) => fit(b, format!("--budget {}", human(b)))?,
    };
    let planned_bytes = copies.checked_mul(copy_bytes).ok_or_else(|| {
        Error::InvalidArgument(format!(
            "--copies {copies} is far too large: {copies} copies of {} overflow a 64-bit byte count",
            human(copy_bytes)
        ))
    })?;
    Ok(MemoryPlan {
        copies,
        copy_bytes_measured: copy_bytes,
        copy_bytes_arithmetic: COPY_BYTES,
        planned_bytes,
        capacity_bytes: capacity,
        reserve_bytes: RESERVE_BYTES,
    })
}

pub fn human(b: usize) -> String {
    if b >= 1 << 30 {
        format!("{:.2} GiB", b as f64 / (1u64 << 30) as f64)
    } else {
        format!("{:.1} MiB", b as f64 / (1u64 << 20) as f64)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn arithmetic_of_a_12gb_plan() -> Result<()> {
        let (c, measured) = measure_copy(Device::Cpu)?;
        assert_eq!(measured, COPY_BYTES);
        assert_eq!(measured, c.bytes());
        // 357,911 entries: 1 byte + 4 + 8 + 288 = 301 bytes each.
        assert_eq!(COPY_BYTES, 357_911 * 301);
        let p = plan(PlanRequest::Budget(12_000_000_000), measured, None)?;
        assert_eq!(p.copies, (12_000_000_000 - RESERVE_BYTES) / COPY_BYTES);
        assert_eq!(p.copies, 108);
        assert_eq!(p.planned_bytes, p.copies * COPY_BYTES);
        assert!(p.planned_bytes + RESERVE_BYTES <= 12_000_000_000);
        Ok(())
    }

    #[test]
    fn bad_requests_are_clear_errors() {
        assert!(plan(PlanRequest::Copies(0), 10, None).unwrap_err().to_string().contains("--copies"));
        assert!(plan(PlanRequest::Fill(1.5), 10, Some(1 << 30)).unwrap_err().to_string().contains("--fill"));
        let e = plan(PlanRequest::Budget(1 << 20), COPY_BYTES, None).unwrap_err().to_string();
        assert!(e.contains("--budget") && e.contains("no copy"), "{e}");
        // Issue 11: `--copies 18446744073709551615` wrapped `copies * copy_bytes` and then asked
        // Vec::with_capacity for u64::MAX copies ("capacity overflow", exit 101).
        let e = plan(PlanRequest::Copies(usize::MAX), COPY_BYTES, None).unwrap_err();
        assert!(matches!(e, Error::InvalidArgument(_)), "{e}");
        assert!(e.to_string().contains("--copies"), "{e}");
    }
}
