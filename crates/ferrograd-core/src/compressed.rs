//! Compressed host -> device transfers: move fewer bytes over the link and rebuild the data on the
//! GPU, where memory bandwidth is two orders of magnitude higher.
//!
//! - Lossy: f32 narrowed to bf16/f16 on the host (each core narrows pieces into pinned memory and
//!   queues each piece's DMA at once: `cuda::transfer::htod_narrowed`),
//!   half the bytes copied, widened back to f32 on the GPU by the cast kernel. Error: at most half
//!   an ulp of the narrow type (2^-8 relative for bf16, 2^-11 for f16; f16 overflows to inf past
//!   65504 and loses precision below 6.1e-5).
//! - Lossless: small integers (u8/i8 residues, class ids) copied as they are and widened on the GPU
//!   ([`Tensor::to_device_expanded`]), or expanded into one-hot rows there
//!   ([`Tensor::to_device_one_hot`]).
//!
//! When it pays ([`CompressionRule`]): the copy takes about max(narrow, copy of half the bytes)
//! with the pipeline (plus its fill and drain), against a plain copy of all the bytes; so
//! compression wins when the host narrows f32 clearly faster than the link moves it (copy-bound),
//! and loses when the host is the bottleneck (CPU-bound). `ferrograd bench transfer` measures both
//! sides. On the lent H200 machines 16 cores narrow at about the link's speed (the host's memory
//! bandwidth is the limit: they copy memory at 58 GB/s), so compression does not pay there.

use crate::cuda::{CudaDevice, CudaStorage};
use crate::storage::Storage;
use crate::{DType, Device, Error, Result, Tensor};

impl Tensor {
    /// This f32 CPU tensor on GPU `device` as f32, moved as `via` (`DType::BF16` or `DType::F16`):
    /// half the bytes over the link, narrowed on the host, widened on the GPU. Lossy (see the
    /// module comment); returns before the copy has finished (ops queued later wait for it).
    pub fn to_device_compressed(&self, device: Device, via: DType) -> Result<Tensor> {
        const OP: &str = "to_device_compressed";
        let Device::Cuda(o) = device else {
            return Err(Error::DeviceMismatch { op: OP, lhs: self.device(), rhs: device });
        };
        if self.device() != Device::Cpu {
            return Err(Error::DeviceMismatch { op: OP, lhs: self.device(), rhs: Device::Cpu });
        }
        if self.dtype() != DType::F32 {
            return Err(Error::UnsupportedDType { op: OP, dtype: self.dtype() });
        }
        if !matches!(via, DType::BF16 | DType::F16) {
            return Err(Error::UnsupportedDType { op: "to_device_compressed (via)", dtype: via });
        }
        let dev = CudaDevice::get(o)?;
        let n = self.elem_count();
        let narrow = CudaStorage::uninit(&dev, n, via)?;
        // A contiguous tensor is narrowed straight from its own buffer (a copy of 256 MiB into a
        // fresh allocation costs more in page faults than the whole transfer).
        let g = self.storage();
        match (g.as_cpu(), self.layout().contiguous_range()) {
            (Some(c), Some((start, end))) => {
                crate::cuda::transfer::htod_narrowed(&dev, &c.as_slice::<f32>()?[start..end], via, &narrow.buf)?
            }
            _ => {
                drop(g);
                let src = self.cpu_storage()?;
                crate::cuda::transfer::htod_narrowed(&dev, src.as_slice::<f32>()?, via, &narrow.buf)?
            }
        }
        Tensor::from_storage(Storage::Cuda(narrow), self.shape().clone(), None).to_dtype(DType::F32)
    }

    /// This small-integer CPU tensor (u8 or i8; u32 or i32 when `to` is f64) on GPU `device` as
    /// `to`, copied at its own width and widened there: lossless, and 4x fewer bytes than moving
    /// the f32 result.
    pub fn to_device_expanded(&self, device: Device, to: DType) -> Result<Tensor> {
        const OP: &str = "to_device_expanded";
        if !device.is_cuda() {
            return Err(Error::DeviceMismatch { op: OP, lhs: self.device(), rhs: device });
        }
        let exact = match self.dtype() {
            DType::U8 => to != DType::I8,
            DType::I8 => !matches!(to, DType::U8 | DType::U32),
            DType::U32 | DType::I32 => to == DType::F64 || to == self.dtype(),
            _ => false,
        };
        if !exact {
            return Err(Error::InvalidArgument(format!(
                "{OP}: {} -> {to} is not a lossless widening (u8/i8 to a wider type, u32/i32 to f64)",
                self.dtype()
            )));
        }
        self.to_device(device)?.to_dtype(to)
    }

    /// Class ids (an integer CPU tensor of shape `[..]`, each below `classes`) on GPU `device` as
    /// one-hot rows of shape `[.., classes]` and dtype `to`: the ids cross the link, the
    /// `classes`-times larger result is built on the GPU. Ids at or past `classes` give all-zero
    /// rows (as a comparison would); check them first where that matters.
    pub fn to_device_one_hot(&self, device: Device, classes: usize, to: DType) -> Result<Tensor> {
        const OP: &str = "to_device_one_hot";
        if self.dtype().is_float() {
            return Err(Error::UnsupportedDType { op: OP, dtype: self.dtype() });
        }
        if classes == 0 {
            return Err(Error::InvalidArgument(format!("{OP}: classes must be at least 1")));
        }
        let ids = self.to_device(device)?.unsqueeze(-1)?;
        let range = Tensor::arange(0.0, classes as f64, 1.0, self.dtype(), device)?;
        ids.eq(&range)?.to_dtype(to)
    }
}

/// The measured rule for compressed copies: compression pays when the host narrows f32 faster
/// than the link copies it, by enough to cover the pipeline's fill and drain.
///
/// The pipeline (`cuda::transfer::htod_narrowed`) has each of `cores` cores narrow pieces of
/// [`NARROW_PIECE`](crate::cuda::transfer::NARROW_PIECE) elements and queue each piece's DMA.
/// Its time is the longer of two chains: all the narrowing, then the copy of the last wave of
/// pieces (one a core); or the first piece's narrowing on one core, then all the copying.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct CompressionRule {
    /// Plain pinned host -> device copy bandwidth, GB/s.
    pub copy_gbps: f64,
    /// Host narrowing throughput on all cores, GB/s of f32 input.
    pub narrow_gbps: f64,
    /// Cores narrowing at once (rayon's threads).
    pub cores: usize,
}

impl CompressionRule {
    /// The rule for a pinned copy at `copy_gbps`, with this host's narrowing throughput measured
    /// over `elems` elements (as many as the copies it should judge: a smaller buffer stays in
    /// the CPU's caches and narrows faster than a real one).
    pub fn measure(copy_gbps: f64, elems: usize, via: DType) -> Result<CompressionRule> {
        let narrow_gbps = Self::measure_narrow_gbps(elems, via)?;
        Ok(CompressionRule { copy_gbps, narrow_gbps, cores: rayon::current_num_threads() })
    }

    /// Seconds for a plain pinned copy of `bytes` of f32.
    pub fn plain_s(&self, bytes: f64) -> f64 {
        bytes / (self.copy_gbps.max(1e-9) * 1e9)
    }

    /// Seconds for the compressed copy of `bytes` of f32 (see the type's comment).
    pub fn compressed_s(&self, bytes: f64) -> f64 {
        let (narrow, copy) = (self.narrow_gbps.max(1e-9) * 1e9, self.copy_gbps.max(1e-9) * 1e9);
        let cores = self.cores.max(1) as f64;
        // One core narrows a piece at a core's share of the throughput.
        let piece = (crate::cuda::transfer::NARROW_PIECE as f64 * 4.0).min(bytes);
        let fill = piece * cores / narrow;
        let wave = (cores * piece).min(bytes);
        let narrow_then_drain = (bytes / narrow).max(fill) + wave / 2.0 / copy;
        let fill_then_copy = fill + bytes / 2.0 / copy;
        narrow_then_drain.max(fill_then_copy)
    }

    /// Expected speedup of the compressed copy of `bytes` of f32 (below 2).
    pub fn speedup(&self, bytes: f64) -> f64 {
        self.plain_s(bytes) / self.compressed_s(bytes)
    }

    /// Whether compression is expected to beat a plain pinned copy of `bytes` of f32.
    pub fn pays(&self, bytes: f64) -> bool {
        self.speedup(bytes) > 1.0
    }

    /// Host f32 -> `via` narrowing throughput on this machine (GB/s of f32 input), the best of a
    /// few passes over `elems` elements on all cores.
    pub fn measure_narrow_gbps(elems: usize, via: DType) -> Result<f64> {
        if !matches!(via, DType::BF16 | DType::F16) {
            return Err(Error::UnsupportedDType { op: "measure_narrow_gbps", dtype: via });
        }
        let src: Vec<f32> = (0..elems).map(|i| (i % 1000) as f32 * 1e-3 - 0.5).collect();
        let mut out = vec![0u8; elems * 2];
        let mut best = 0f64;
        for _ in 0..5 {
            let t0 = std::time::Instant::now();
            crate::cuda::transfer::narrow_into(&src, via, &mut out);
            let s = t0.elapsed().as_secs_f64();
            best = best.max(elems as f64 * 4.0 / s.max(1e-12) / 1e9);
        }
        std::hint::black_box(&out);
        Ok(best)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rule_is_copy_bound_vs_cpu_bound() {
        let gib = (1u64 << 30) as f64;
        let piece = crate::cuda::transfer::NARROW_PIECE as f64 * 4.0;
        // Host narrows at 200 GB/s on 16 cores, link copies at 50: copy-bound. The link waits
        // for the first piece (one core narrows it at 12.5 GB/s), then moves half the bytes.
        let r = CompressionRule { copy_gbps: 50.0, narrow_gbps: 200.0, cores: 16 };
        let want = piece / (200e9 / 16.0) + gib / 2.0 / 50e9;
        assert!((r.compressed_s(gib) - want).abs() < 1e-12, "{} vs {want}", r.compressed_s(gib));
        assert!(r.pays(gib) && r.speedup(gib) > 1.8 && r.speedup(gib) < 2.0);
        // Host narrows at 75: the link waits on the host, then drains the last wave.
        let r = CompressionRule { copy_gbps: 50.0, narrow_gbps: 75.0, cores: 16 };
        let want = gib / 75e9 + 16.0 * piece / 2.0 / 50e9;
        assert!((r.compressed_s(gib) - want).abs() < 1e-12);
        assert!(r.speedup(gib) > 1.4 && r.speedup(gib) < 1.5);
        // Host narrows as fast as the link copies (the lent H200 machines): the drain makes it a loss.
        let r = CompressionRule { copy_gbps: 54.5, narrow_gbps: 54.5, cores: 16 };
        assert!(!r.pays(256.0 * 1048576.0));
        // Host narrows at 30 GB/s: CPU-bound, compression loses.
        let r = CompressionRule { copy_gbps: 50.0, narrow_gbps: 30.0, cores: 16 };
        assert!(!r.pays(gib));
        assert!(r.compressed_s(gib) > r.plain_s(gib));
        // A copy smaller than one piece: one core narrows all of it (at 10 GB/s), then it is copied.
        let r = CompressionRule { copy_gbps: 50.0, narrow_gbps: 160.0, cores: 16 };
        let small = 1e6;
        let want = small / 10e9 + small / 2.0 / 50e9;
        assert!((r.compressed_s(small) - want).abs() < 1e-15, "{} vs {want}", r.compressed_s(small));
    }

    #[test]
    fn host_narrowing_matches_the_cpu_cast() {
        let x =
            Tensor::rand_with(&mut crate::Rng::new(3), -70000.0, 70000.0, 300_001, DType::F32, Device::Cpu).unwrap();
        let src = x.to_vec::<f32>().unwrap();
        for via in [DType::BF16, DType::F16] {
            let mut out = vec![0u8; src.len() * 2];
            crate::cuda::transfer::narrow_into(&src, via, &mut out);
            let want = x.to_dtype(via).unwrap().cpu_storage().unwrap();
            assert_eq!(&out[..], want.as_bytes(), "{via}");
        }
    }

    #[test]
    fn narrowing_throughput_is_measured() {
        let g = CompressionRule::measure_narrow_gbps(1 << 16, DType::BF16).unwrap();
        assert!(g > 0.0 && g.is_finite());
        assert!(CompressionRule::measure_narrow_gbps(16, DType::F32).is_err());
    }
}
