//! Moving tensors between devices: plain, pinned (asynchronous), prefetched (the copy overlaps the
//! compute already queued) and coalesced (many tensors, one copy).

use crate::cpu::CpuStorage;
use crate::cuda::{CudaDevice, CudaStorage};
use crate::storage::Storage;
use crate::{Device, Result, Tensor, TensorId};
use std::sync::Arc;

/// A host->device copy in flight on the copy stream. `wait` orders the thread's current stream
/// after it and hands out the tensor; until then, compute queued on the device does not wait for
/// the copy.
pub struct Prefetch {
    tensor: Tensor,
    done: Option<(Arc<CudaDevice>, crate::cuda::event::Event)>,
}

impl Prefetch {
    /// The tensor, with every op queued from now on ordered after its copy.
    pub fn wait(self) -> Result<Tensor> {
        if let Some((dev, ev)) = self.done {
            dev.ctx.bind_to_thread().map_err(|e| crate::cuda::device::driver_err("cuCtxSetCurrent", e))?;
            ev.wait_on(dev.stream())?;
            if let Some(c) = self.tensor.storage().as_cuda() {
                c.buf.record_use_on(dev.current_stream_id())?;
            }
        }
        Ok(self.tensor)
    }
}

impl Tensor {
    /// This tensor on `device` (a copy, or `self` when already there). From a pinned CPU tensor
    /// the copy is asynchronous: the host returns before the data has arrived.
    pub fn to_device(&self, device: Device) -> Result<Tensor> {
        if device == self.device() {
            return Ok(self.clone());
        }
        if let (Device::Cpu, Device::Cuda(o)) = (self.device(), device) {
            let dev = CudaDevice::get(o)?;
            if self.0.pinned.is_some() {
                return self.copy_pinned(&dev, false)?.wait();
            }
            // A contiguous host tensor is staged straight from its own buffer.
            let g = self.storage();
            if let (Some(c), Some((start, end))) = (g.as_cpu(), self.layout().contiguous_range()) {
                let esz = self.dtype().size_in_bytes();
                let dst = CudaStorage::uninit(&dev, end - start, self.dtype())?;
                crate::cuda::transfer::htod(&dev, &c.as_bytes()[start * esz..end * esz], &dst.buf)?;
                return Ok(Self::from_storage(Storage::Cuda(dst), self.shape().clone(), None));
            }
        }
        if let (Device::Cuda(i), Device::Cuda(j)) = (self.device(), device) {
            if let Some(t) = self.copy_peer(i, j)? {
                return Ok(t);
            }
        }
        let c = self.cpu_storage()?;
        Ok(Self::from_storage(Self::cpu_to_device(c, device)?, self.shape().clone(), None))
    }

    /// GPU `i` to GPU `j` directly (`cuda/peer.rs`), or `None` where the pair has no peer access
    /// and the copy must stage through the host.
    fn copy_peer(&self, i: usize, j: usize) -> Result<Option<Tensor>> {
        let (src, dst) = (CudaDevice::get(i)?, CudaDevice::get(j)?);
        if !crate::cuda::peer::peer_access(&src, &dst)? {
            return Ok(None);
        }
        let t = if self.is_contiguous() { self.clone() } else { self.contiguous()? };
        let esz = self.dtype().size_in_bytes();
        let n = t.elem_count();
        let out = CudaStorage::uninit(&dst, n, self.dtype())?;
        let src_ptr = match &*t.storage() {
            Storage::Cuda(c) => c.buf.ptr_at(t.layout().offset()),
            Storage::Cpu(_) => return Ok(None),
        };
        crate::cuda::peer::copy(&src, src_ptr, &dst, out.buf.ptr(), n * esz)?;
        Ok(Some(Self::from_storage(Storage::Cuda(out), self.shape().clone(), None)))
    }

    /// Start copying this tensor to `device` and return at once. From a pinned CPU tensor the copy
    /// runs on the copy stream, overlapping compute queued before and after it until `wait`;
    /// otherwise this is `to_device`.
    pub fn to_device_async(&self, device: Device) -> Result<Prefetch> {
        match (self.device(), device, self.0.pinned.is_some()) {
            (Device::Cpu, Device::Cuda(o), true) => self.copy_pinned(&CudaDevice::get(o)?, true),
            _ => Ok(Prefetch { tensor: self.to_device(device)?, done: None }),
        }
    }

    /// DMA from the pinned buffer. With `own_stream` the destination comes from the copy stream's
    /// pool, so the copy need not wait for compute; otherwise from the compute stream's pool, so
    /// it waits for compute queued so far (the block's previous user).
    fn copy_pinned(&self, dev: &Arc<CudaDevice>, own_stream: bool) -> Result<Prefetch> {
        let g = self.storage();
        let (Some(c), Some((start, end))) = (g.as_cpu(), self.layout().contiguous_range()) else {
            drop(g);
            return self.contiguous()?.pin_memory()?.copy_pinned(dev, own_stream);
        };
        let esz = self.dtype().size_in_bytes();
        let bytes = &c.as_bytes()[start * esz..end * esz];
        let dst = if own_stream {
            CudaStorage::uninit_for_copy(dev, end - start, self.dtype())?
        } else {
            CudaStorage::uninit(dev, end - start, self.dtype())?
        };
        // The pin comes first: a tuple drops in order, and the pages must be unregistered before
        // the buffer they cover is freed (or malloc's next buffer there cannot be pinned).
        let keep: Box<dyn Send + Sync> = Box::new((self.0.pinned.clone(), self.0.storage.clone()));
        // SAFETY: `bytes` lies inside this tensor's registered (page-locked) range and `keep` owns it.
        let done = unsafe {
            crate::cuda::transfer::htod_pinned(dev, bytes.as_ptr(), bytes.len(), &dst.buf, keep, !own_stream)?
        };
        Ok(Prefetch {
            tensor: Self::from_storage(Storage::Cuda(dst), self.shape().clone(), None),
            done: Some((dev.clone(), done)),
        })
    }

    /// A CPU copy of this tensor in page-locked memory, so that moving it to a GPU runs at full DMA
    /// speed and asynchronously. Needs a CUDA driver. The data starts on a page boundary inside a
    /// buffer padded by two pages, and only whole pages of that buffer are registered, so pinned
    /// tensors never share a page (the driver refuses to register a page twice).
    pub fn pin_memory(&self) -> Result<Tensor> {
        let src = self.cpu_storage()?;
        Self::new_pinned(self.shape().clone(), self.dtype(), Some(src.as_bytes()))
    }

    /// A contiguous CPU tensor of `shape` in page-locked memory, holding `fill` (its bytes) or, with
    /// `None`, zeros: the layout [`Tensor::pin_memory`] describes.
    pub(crate) fn new_pinned(shape: crate::Shape, dtype: crate::DType, fill: Option<&[u8]>) -> Result<Tensor> {
        const PAGE: usize = 4096;
        let dev = CudaDevice::get(0)?;
        let esz = dtype.size_in_bytes();
        let n = shape.elem_count();
        let mut buf = CpuStorage::full(0.0, n + 2 * PAGE / esz, dtype)?;
        let base = buf.as_bytes().as_ptr() as usize;
        let skip = (base.next_multiple_of(PAGE) - base) / esz;
        if let Some(src) = fill {
            buf.as_bytes_mut()[skip * esz..(skip + n) * esz].copy_from_slice(src);
        }
        let start = base + skip * esz;
        let len = (n * esz).next_multiple_of(PAGE).max(PAGE);
        let pin = crate::cuda::pinned::HostPin::register(&dev, start as *const u8, len)?;
        let t = Self::from_storage(Storage::Cpu(buf), n, None);
        let layout = crate::Layout::contiguous_with_offset(shape, skip);
        Ok(Tensor(Arc::new(crate::tensor::Inner {
            id: TensorId::new(),
            pinned: Some(Arc::new(pin)),
            storage: t.0.storage.clone(),
            layout,
            op: None,
            is_variable: false,
            dtype,
            device: Device::Cpu,
        })))
    }

    /// Whether this CPU tensor's buffer is page-locked ([`Tensor::pin_memory`]), so copies to a GPU
    /// can run asynchronously.
    pub fn is_pinned(&self) -> bool {
        self.0.pinned.is_some()
    }

    /// Declares that work queued on `stream` uses this CUDA tensor too (PyTorch's
    /// `record_stream`): when the tensor is freed, its memory is not handed out again before that
    /// work is done. Needed when a tensor made on one stream is used on another and may be dropped
    /// before the streams are joined.
    pub fn record_stream(&self, stream: &crate::cuda::Stream) -> Result<()> {
        let want = crate::Device::Cuda(stream.device().ordinal);
        match &*self.storage() {
            Storage::Cuda(c) if c.dev().ordinal == stream.device().ordinal => c.buf.record_use_on(stream.id()),
            _ => Err(crate::Error::DeviceMismatch { op: "record_stream", lhs: self.device(), rhs: want }),
        }
    }

    /// Move many tensors to `device` at once: to a GPU they travel in one coalesced copy.
    pub fn to_device_many(tensors: &[Tensor], device: Device) -> Result<Vec<Tensor>> {
        let Device::Cuda(o) = device else {
            return tensors.iter().map(|t| t.to_device(device)).collect();
        };
        if tensors.iter().any(|t| t.device() != Device::Cpu) {
            return tensors.iter().map(|t| t.to_device(device)).collect();
        }
        let dev = CudaDevice::get(o)?;
        let host = tensors.iter().map(|t| t.cpu_storage()).collect::<Result<Vec<_>>>()?;
        let refs: Vec<&CpuStorage> = host.iter().collect();
        let gpu = CudaStorage::from_cpu_many(&dev, &refs)?;
        Ok(gpu
            .into_iter()
            .zip(tensors)
            .map(|(s, t)| Self::from_storage(Storage::Cuda(s), t.shape().clone(), None))
            .collect())
    }
}
