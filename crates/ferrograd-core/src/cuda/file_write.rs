//! Device tensors into files (checkpoints written from the GPU): each tensor's bytes come back
//! through two pinned chunks, the DMA of the next chunk running while the host writes this one
//! (`transfer::dtoh_stream`), so a save never holds a host copy of the whole tensor, let alone of
//! the file. `ferrograd_nn::checkpoint::save_safetensors` writes the header and calls this per
//! tensor inside its atomic write.

use crate::storage::Storage;
use crate::{Device, Error, Result, Tensor};
use std::io::Write;

/// Write the elements of CUDA tensor `t` (row-major, little-endian as on the device) to `w`. A
/// non-contiguous view is made contiguous on the device first. An I/O error of `w` comes back as
/// [`Error::Io`].
pub fn write_tensor(t: &Tensor, w: &mut dyn Write) -> Result<()> {
    let Device::Cuda(_) = t.device() else {
        return Err(Error::DeviceMismatch { op: "write_tensor", lhs: t.device(), rhs: Device::Cuda(0) });
    };
    let storage = t.storage();
    let Storage::Cuda(c) = &*storage else {
        return Err(Error::DeviceMismatch { op: "write_tensor", lhs: Device::Cpu, rhs: t.device() });
    };
    // `_copy` keeps a contiguous copy of a strided view alive while its bytes are read.
    let (ptr, _copy) = c.contiguous_ptr(t.layout())?;
    let n = t.elem_count() * t.dtype().size_in_bytes();
    let mut sink = |_: usize, bytes: &[u8]| w.write_all(bytes).map_err(Error::Io);
    super::transfer::dtoh_stream(c.dev(), ptr, n, &mut sink)
}
