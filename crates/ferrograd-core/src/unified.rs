//! Unified (managed) tensors: CUDA tensors whose storage is one managed allocation
//! (`cuda/managed.rs`), so the host reads and writes them in place, without a copy, between
//! kernels. Every op accepts them like any CUDA tensor; op outputs are ordinary device memory.

use crate::cuda::buffer::CudaBuffer;
use crate::cuda::managed::Advice;
use crate::cuda::{CudaDevice, CudaStorage};
use crate::storage::Storage;
use crate::{Device, Error, Result, Tensor, WithDType};

fn not_unified(op: &'static str, t: &Tensor) -> Error {
    Error::InvalidArgument(format!(
        "{op}: the tensor ({:?}, {}) is not unified (Tensor::to_unified)",
        t.dims(),
        t.device()
    ))
}

impl Tensor {
    /// A copy of this tensor in managed memory of GPU `ordinal`: a CUDA tensor whose bytes the
    /// host can also read and write in place ([`Tensor::with_unified_host`]). The data is written
    /// by the host straight into the managed pages (no explicit copy); the library then advises
    /// the driver to prefer the GPU and prefetches the pages there on the current stream.
    /// Refused with [`Error::OutOfMemory`] when it would not fit in the device's free memory
    /// (oversubscribed managed memory can hang a GPU).
    pub fn to_unified(&self, ordinal: usize) -> Result<Tensor> {
        let dev = CudaDevice::get(ordinal)?;
        let buf = CudaBuffer::managed(&dev, self.elem_count(), self.dtype())?;
        let m = buf.managed_alloc().ok_or_else(|| Error::Cuda("managed buffer without an allocation".into()))?;
        let esz = self.dtype().size_in_bytes();
        // A fresh allocation: no device work touches it yet, so the host may write it. A
        // contiguous source is read in place (no intermediate copy).
        let g = self.storage();
        match (g.as_cpu(), self.layout().contiguous_range()) {
            // SAFETY: nothing else holds the new range.
            (Some(c), Some((s, e))) => unsafe {
                crate::cuda::transfer::par_copy(m.host_slice_mut(), &c.as_bytes()[s * esz..e * esz])
            },
            _ => {
                drop(g);
                let src = self.cpu_storage()?;
                // SAFETY: as above.
                unsafe { crate::cuda::transfer::par_copy(m.host_slice_mut(), src.as_bytes()) };
            }
        }
        m.advise(Advice::PreferredLocation(Device::Cuda(ordinal)))?;
        m.prefetch(Device::Cuda(ordinal))?;
        Ok(Tensor::from_storage(Storage::Cuda(CudaStorage { buf }), self.shape().clone(), None))
    }

    /// Whether this tensor's storage is managed memory ([`Tensor::to_unified`]).
    pub fn is_unified(&self) -> bool {
        matches!(&*self.storage(), Storage::Cuda(c) if c.buf.managed_alloc().is_some())
    }

    /// Migrates a unified tensor's pages to `device` (a GPU, or the CPU) on the current stream,
    /// ahead of their use there (`cuMemPrefetchAsync`); the host does not wait.
    pub fn prefetch_unified(&self, device: Device) -> Result<()> {
        match &*self.storage() {
            Storage::Cuda(c) => match c.buf.managed_alloc() {
                Some(m) => m.prefetch(device),
                None => Err(not_unified("prefetch_unified", self)),
            },
            Storage::Cpu(_) => Err(not_unified("prefetch_unified", self)),
        }
    }

    /// A usage hint for a unified tensor's pages (`cuMemAdvise`).
    pub fn advise_unified(&self, advice: Advice) -> Result<()> {
        match &*self.storage() {
            Storage::Cuda(c) => match c.buf.managed_alloc() {
                Some(m) => m.advise(advice),
                None => Err(not_unified("advise_unified", self)),
            },
            Storage::Cpu(_) => Err(not_unified("advise_unified", self)),
        }
    }

    /// Calls `f` with this unified tensor's elements as a host slice, in place (no copy): waits
    /// for the device first (the host may not touch pages a kernel uses) and prefetches the pages
    /// to the host. The tensor must be contiguous and of dtype `T`.
    pub fn with_unified_host<T: WithDType, R>(&self, f: impl FnOnce(&[T]) -> R) -> Result<R> {
        let (m, start, end) = self.unified_range::<T>("with_unified_host")?;
        m.host_ready()?;
        // SAFETY: the device is idle (host_ready synchronised); a kernel the closure might queue on
        // this tensor only reads it (ops never write their inputs), so the shared slice stays valid.
        let bytes = unsafe { m.host_slice() };
        let all: &[T] = bytemuck::try_cast_slice(bytes).map_err(|e| Error::Cuda(format!("managed view: {e:?}")))?;
        Ok(f(&all[start..end]))
    }

    /// Like [`Tensor::with_unified_host`], writable: the host changes the tensor in place, and
    /// kernels queued afterwards see the new values. Every handle sharing the storage sees them.
    /// `f` must not queue device work on this tensor or open another host view of it.
    pub fn with_unified_host_mut<T: WithDType, R>(&self, f: impl FnOnce(&mut [T]) -> R) -> Result<R> {
        let (m, start, end) = self.unified_range::<T>("with_unified_host_mut")?;
        m.host_ready()?;
        // SAFETY: the device is idle; the contract above keeps other readers out while `f` runs.
        let bytes = unsafe { m.host_slice_mut() };
        let all: &mut [T] =
            bytemuck::try_cast_slice_mut(bytes).map_err(|e| Error::Cuda(format!("managed view: {e:?}")))?;
        let r = f(&mut all[start..end]);
        Ok(r)
    }

    fn unified_range<T: WithDType>(
        &self,
        op: &'static str,
    ) -> Result<(std::sync::Arc<crate::cuda::managed::ManagedAlloc>, usize, usize)> {
        if T::DTYPE != self.dtype() {
            return Err(Error::DTypeMismatch { op, lhs: self.dtype(), rhs: T::DTYPE });
        }
        let Some((start, end)) = self.layout().contiguous_range() else {
            return Err(Error::InvalidArgument(format!("{op}: the view {:?} is not contiguous", self.dims())));
        };
        match &*self.storage() {
            Storage::Cuda(c) => match c.buf.managed_alloc() {
                Some(m) => Ok((m.clone(), start, end)),
                None => Err(not_unified(op, self)),
            },
            Storage::Cpu(_) => Err(not_unified(op, self)),
        }
    }
}
