//! `CudaStorage`: a device buffer of one dtype, and its moves to and from the host. The ops on it
//! are in `cuda/ops/` (one file per kernel family, as in `kernels/`), the fused ops in
//! `src/fused/`.

use super::buffer::CudaBuffer;
use super::device::CudaDevice;
use crate::cpu::CpuStorage;
use crate::{DType, Layout, Result};
use std::sync::Arc;

/// Device memory holding a tensor's elements: a block of the caching allocator, returned to it on
/// drop (after any stream that used it is done).
pub struct CudaStorage {
    pub(crate) buf: CudaBuffer,
}

impl std::fmt::Debug for CudaStorage {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "CudaStorage({} x {}, cuda:{})", self.buf.len, self.buf.dtype, self.buf.dev.ordinal)
    }
}

impl CudaStorage {
    /// The device it lives on.
    pub fn dev(&self) -> &Arc<CudaDevice> {
        &self.buf.dev
    }

    /// Elements held.
    pub fn len(&self) -> usize {
        self.buf.len
    }

    /// Whether it holds no element.
    pub fn is_empty(&self) -> bool {
        self.buf.len == 0
    }

    /// The element type.
    pub fn dtype(&self) -> DType {
        self.buf.dtype
    }

    pub(crate) fn uninit(dev: &Arc<CudaDevice>, len: usize, dtype: DType) -> Result<CudaStorage> {
        Ok(CudaStorage { buf: CudaBuffer::uninit(dev, len, dtype)? })
    }

    pub(crate) fn uninit_for_copy(dev: &Arc<CudaDevice>, len: usize, dtype: DType) -> Result<CudaStorage> {
        Ok(CudaStorage { buf: CudaBuffer::uninit_for_copy(dev, len, dtype)? })
    }

    /// Upload a host storage (pageable memory; the driver stages it, and the call returns once the
    /// host buffer may be reused).
    pub fn from_cpu(dev: &Arc<CudaDevice>, cpu: &CpuStorage) -> Result<CudaStorage> {
        let s = Self::uninit(dev, cpu.len(), crate::backend::BackendStorage::dtype(cpu))?;
        super::transfer::htod(dev, cpu.as_bytes(), &s.buf)?;
        Ok(s)
    }

    /// Upload several host storages in one copy; the results share one device allocation.
    pub fn from_cpu_many(dev: &Arc<CudaDevice>, parts: &[&CpuStorage]) -> Result<Vec<CudaStorage>> {
        let bytes: Vec<&[u8]> = parts.iter().map(|p| p.as_bytes()).collect();
        let (guard, offsets) = super::transfer::htod_many(dev, &bytes)?;
        Ok(parts
            .iter()
            .zip(offsets)
            .map(|(p, off)| {
                let dtype = crate::backend::BackendStorage::dtype(*p);
                CudaStorage { buf: CudaBuffer::sub(dev, guard.clone(), off, p.len(), dtype) }
            })
            .collect())
    }

    /// Download the whole buffer (blocks until the data is on the host). The device's error flag
    /// is checked then: a bad index met by a kernel queued before is reported here.
    pub fn to_cpu(&self) -> Result<CpuStorage> {
        let mut out = CpuStorage::full(0.0, self.len(), self.dtype())?;
        super::transfer::dtoh(self.dev(), &self.buf, out.as_bytes_mut())?;
        self.dev().take_device_error()?;
        Ok(out)
    }

    /// A host copy of the elements a layout views.
    pub fn to_cpu_view(&self, l: &Layout) -> Result<CpuStorage> {
        if l.is_contiguous() && l.offset() == 0 && l.elem_count() == self.len() {
            return self.to_cpu();
        }
        crate::backend::BackendStorage::copy_strided(self, l)?.to_cpu()
    }

    /// The device address of a layout's first element, copying a non-contiguous view first (the
    /// copy is returned so that it lives until the launch that reads it has been enqueued).
    pub(crate) fn contiguous_ptr(&self, l: &Layout) -> Result<(u64, Option<CudaStorage>)> {
        if l.is_contiguous() {
            Ok((self.buf.ptr_at(l.offset()), None))
        } else {
            let c = crate::backend::BackendStorage::copy_strided(self, l)?;
            Ok((c.buf.ptr(), Some(c)))
        }
    }
}
