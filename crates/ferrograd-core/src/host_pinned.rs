//! Device -> host copies into page-locked memory: one asynchronous DMA on the copy stream, at the
//! full speed of the link, with an event the caller waits on when it needs the data (PyTorch's
//! `pinned.copy_(x, non_blocking=True)`). `to_device(Device::Cpu)` instead returns a new pageable
//! `Vec`, staged through pinned chunks (`cuda/transfer.rs`).

use crate::cuda::event::Event;
use crate::cuda::CudaDevice;
use crate::storage::Storage;
use crate::{DType, Device, Error, Result, Shape, Tensor};
use std::sync::Arc;

/// A device -> host copy in flight. [`HostCopy::wait`] blocks until the data has arrived and hands
/// out the pinned CPU tensor; until then the destination must not be read.
pub struct HostCopy {
    tensor: Tensor,
    done: Option<(Arc<CudaDevice>, Event)>,
}

impl HostCopy {
    /// Whether the copy has finished (a poll; never waits).
    pub fn is_done(&self) -> bool {
        self.done.as_ref().is_none_or(|(_, e)| e.is_done())
    }

    /// Waits for the copy (a counted host wait) and returns the pinned CPU tensor.
    pub fn wait(self) -> Result<Tensor> {
        if let Some((_, e)) = &self.done {
            e.synchronize()?;
        }
        Ok(self.tensor)
    }
}

impl Tensor {
    /// An empty (zero-filled) contiguous CPU tensor in page-locked memory: the destination of
    /// [`Tensor::copy_to_pinned_async`], reusable across steps. Needs a CUDA driver.
    pub fn empty_pinned<S: Into<Shape>>(shape: S, dtype: DType) -> Result<Tensor> {
        Self::new_pinned(shape.into(), dtype, None)
    }

    /// This CUDA tensor copied into a new pinned CPU tensor; waits for the copy.
    pub fn to_host_pinned(&self) -> Result<Tensor> {
        self.to_host_pinned_async()?.wait()
    }

    /// Starts copying this CUDA tensor into a new pinned CPU tensor and returns at once.
    pub fn to_host_pinned_async(&self) -> Result<HostCopy> {
        let dst = Self::empty_pinned(self.shape().clone(), self.dtype())?;
        self.copy_to_pinned_async(&dst)
    }

    /// Starts copying this CUDA tensor into `dst`, an existing pinned CPU tensor of the same shape
    /// and dtype ([`Tensor::empty_pinned`], [`Tensor::pin_memory`]), and returns at once: one DMA
    /// on the copy stream, ordered after the compute queued so far. `dst` (and every handle that
    /// shares its storage) must not be read before [`HostCopy::wait`].
    pub fn copy_to_pinned_async(&self, dst: &Tensor) -> Result<HostCopy> {
        const OP: &str = "copy_to_pinned_async";
        let Device::Cuda(o) = self.device() else {
            return Err(Error::DeviceMismatch { op: OP, lhs: self.device(), rhs: Device::Cuda(0) });
        };
        if dst.device() != Device::Cpu || !dst.is_pinned() {
            return Err(Error::InvalidArgument(format!(
                "{OP}: the destination must be a pinned CPU tensor (Tensor::empty_pinned), got one on {}{}",
                dst.device(),
                if dst.is_pinned() { "" } else { " that is not pinned" }
            )));
        }
        if dst.dims() != self.dims() {
            return Err(Error::ShapeMismatch { op: OP, lhs: self.dims().to_vec(), rhs: dst.dims().to_vec() });
        }
        if dst.dtype() != self.dtype() {
            return Err(Error::DTypeMismatch { op: OP, lhs: self.dtype(), rhs: dst.dtype() });
        }
        let Some((dstart, dend)) = dst.layout().contiguous_range() else {
            return Err(Error::InvalidArgument(format!("{OP}: the destination view is not contiguous")));
        };
        let dev = CudaDevice::get(o)?;
        let src = if self.is_contiguous() { self.clone() } else { self.contiguous()? };
        let esz = self.dtype().size_in_bytes();
        let n = (dend - dstart) * esz;
        let src_ptr = match &*src.storage() {
            Storage::Cuda(c) => c.buf.ptr_at(src.layout().offset()),
            Storage::Cpu(_) => return Err(Error::Cuda(format!("{OP}: a CUDA tensor without CUDA storage"))),
        };
        let dst_ptr = match &mut *dst.storage_mut() {
            Storage::Cpu(c) => c.as_bytes_mut()[dstart * esz..].as_mut_ptr(),
            Storage::Cuda(_) => return Err(Error::Cuda(format!("{OP}: a CPU tensor without CPU storage"))),
        };
        // The pin drops before the host buffer (tuple order); the source's storage stays alive
        // (and its block unreused) until the copy is done.
        let keep: Box<dyn Send + Sync> = Box::new((dst.0.pinned.clone(), dst.0.storage.clone(), src.0.storage.clone()));
        // SAFETY: `dst_ptr` addresses `n` bytes inside the page-locked range of `dst`, which `keep`
        // owns, as it owns the device range of `n` bytes at `src_ptr`.
        let done = unsafe { crate::cuda::transfer::dtoh_pinned(&dev, src_ptr, dst_ptr, n, keep)? };
        Ok(HostCopy { tensor: dst.clone(), done: Some((dev, done)) })
    }
}
