//! Kept low-precision copies ("shadows") of f32 master weights, updated by the optimizer in the
//! same kernel that updates the weights.
//!
//! Why: under autocast every linear over f32 master weights casts its weight and bias down at
//! every forward (`fused/linear/master.rs`). For GPT-2 124M that is 120 small cast kernels a step
//! (1.25 ms of an H200's 33 ms step, profiled 2026-11-23): each reads 4 bytes and writes 2 per
//! parameter, and most are too small to reach the memory's bandwidth. The fused Adam already
//! reads and writes every parameter; writing its bf16 rounding too costs 2 bytes a parameter and
//! no launch. PyTorch's autocast keeps a cast cache for the same reason, but only within one
//! autocast region; this one lives across steps because the optimizer keeps it true.
//!
//! The contract: a [`ShadowSet`] registers a copy per master (a contiguous f32 CUDA tensor, the
//! whole buffer). While it lives,
//! - `master::lower` (the fused linear and mlp's master-weight cast) reads the registered copy
//!   instead of casting: `BackendStorage::kept_cast`;
//! - the fused Adam (`cuda/ops/optim.rs`) writes each registered master's copy with the master,
//!   `__float2bfloat16_rn` of the new value, the very rounding the cast kernel applies, so a step
//!   computes the same bits with or without the set;
//! - anything else that writes a master (loading a checkpoint, a broadcast, an all-gather, a ZeRO
//!   shard's update, which sees only part of the buffer) leaves its copy stale until
//!   [`ShadowSet::refresh`]: the owner of the set calls it after such writes, or does not make a set.
//!
//! The set keeps its masters alive, so a master's address cannot be reused by another tensor while
//! its key is registered. All copies of a set share one allocation (one `cuMemAlloc` at most, not a
//! hundred) and their addresses never change: a CUDA graph that captured a forward or an optimizer
//! step keeps reading and writing them, and `refresh` casts into the same bytes.

use super::buffer::{AllocGuard, CudaBuffer};
use super::device::CudaDevice;
use super::klayout::KLayout;
use super::launch::{cfg_1d, launch};
use super::modules;
use super::storage::CudaStorage;
use crate::storage::Storage;
use crate::{DType, Device, Error, Layout, Result, Tensor};
use std::collections::HashMap;
use std::sync::{Arc, Mutex, PoisonError};

/// A registered master: its device and address and its element count.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
struct Key {
    ordinal: usize,
    ptr: u64,
    len: usize,
}

/// Where a master's copy lives: a byte range of a set's allocation.
#[derive(Clone)]
struct Kept {
    guard: Arc<AllocGuard>,
    byte_offset: usize,
    dtype: DType,
    ptr: u64,
}

static REGISTRY: Mutex<Option<HashMap<Key, Kept>>> = Mutex::new(None);

fn with_registry<T>(f: impl FnOnce(&mut HashMap<Key, Kept>) -> T) -> T {
    let mut r = REGISTRY.lock().unwrap_or_else(PoisonError::into_inner);
    f(r.get_or_insert_with(HashMap::new))
}

/// Copies start 256 bytes apart (the allocator's and cuBLASLt's alignment).
const ALIGN: usize = 256;

/// The key of a master tensor: a contiguous f32 CUDA tensor, read whole from its offset.
fn key_of(t: &Tensor) -> Option<(Key, Arc<CudaDevice>)> {
    if t.dtype() != DType::F32 || !t.is_contiguous() {
        return None;
    }
    let st = t.storage();
    let Storage::Cuda(c) = &*st else { return None };
    let dev = c.buf.dev.clone();
    Some((Key { ordinal: dev.ordinal, ptr: c.buf.ptr_at(t.layout().offset()), len: t.elem_count() }, dev))
}

/// The registered copy of the `len` elements of `s` read densely from element `offset`, in
/// `dtype`: what `master::lower` would otherwise cast.
pub(crate) fn kept_cast(s: &CudaStorage, l: &Layout, dtype: DType) -> Option<CudaStorage> {
    if s.dtype() != DType::F32 || !l.is_contiguous() {
        return None;
    }
    let dev = &s.buf.dev;
    let key = Key { ordinal: dev.ordinal, ptr: s.buf.ptr_at(l.offset()), len: l.elem_count() };
    let c = with_registry(|r| r.get(&key).cloned())?;
    (c.dtype == dtype).then(|| CudaStorage { buf: CudaBuffer::sub(dev, c.guard, c.byte_offset, key.len, dtype) })
}

/// The copy the optimizer writes with the master at `ptr` (`len` f32 elements on device
/// `ordinal`): its address and whether it is f16 (else bf16).
pub(crate) fn copy_ptr(ordinal: usize, ptr: u64, len: usize) -> Option<(u64, bool)> {
    with_registry(|r| r.get(&Key { ordinal, ptr, len }).map(|c| (c.ptr, c.dtype == DType::F16)))
}

/// Low-precision copies of f32 master weights that the fused Adam keeps equal to the cast of
/// each master (see the module documentation for the contract). Dropping the set unregisters the
/// copies and frees them once nothing reads them.
pub struct ShadowSet {
    masters: Vec<Tensor>,
    keys: Vec<Key>,
    dtype: DType,
}

impl std::fmt::Debug for ShadowSet {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "ShadowSet({} x {})", self.keys.len(), self.dtype)
    }
}

impl ShadowSet {
    /// Copies of `masters` in `dtype` (bf16 or f16), cast now. Masters that are not contiguous
    /// f32 CUDA tensors of one device, or that appear twice, are skipped (their linears keep
    /// casting); a master already in another live set is refused.
    pub fn new(masters: &[Tensor], dtype: DType) -> Result<ShadowSet> {
        if !matches!(dtype, DType::BF16 | DType::F16) {
            return Err(Error::InvalidArgument(format!("ShadowSet: bf16 or f16 copies, not {dtype}")));
        }
        let mut picked: Vec<(Tensor, Key)> = Vec::new();
        let mut dev: Option<Arc<CudaDevice>> = None;
        for m in masters {
            let Some((key, d)) = key_of(m) else { continue };
            if dev.as_ref().is_some_and(|x| x.ordinal != d.ordinal) || picked.iter().any(|(_, k)| *k == key) {
                continue;
            }
            dev.get_or_insert(d);
            picked.push((m.clone(), key));
        }
        let set = ShadowSet { masters: Vec::new(), keys: Vec::new(), dtype };
        let Some(dev) = dev else { return Ok(set) };
        let mut offsets = Vec::with_capacity(picked.len());
        let mut bytes = 0usize;
        for (_, k) in &picked {
            offsets.push(bytes);
            bytes = bytes
                .checked_add((k.len * dtype.size_in_bytes()).next_multiple_of(ALIGN))
                .ok_or_else(|| Error::InvalidArgument("ShadowSet: the copies overflow the address space".into()))?;
        }
        let guard = Arc::new(CudaBuffer::raw(&dev, bytes.max(ALIGN))?);
        let mut set = set;
        with_registry(|r| {
            if let Some((_, k)) = picked.iter().find(|(_, k)| r.contains_key(k)) {
                return Err(Error::InvalidArgument(format!(
                    "ShadowSet: the master at {:#x} ({} elements) already has a copy in another set",
                    k.ptr, k.len
                )));
            }
            for ((m, k), off) in picked.into_iter().zip(offsets) {
                let buf = CudaBuffer::sub(&dev, guard.clone(), off, k.len, dtype);
                r.insert(k, Kept { guard: guard.clone(), byte_offset: off, dtype, ptr: buf.ptr() });
                set.masters.push(m);
                set.keys.push(k);
            }
            Ok(())
        })?;
        set.refresh()?;
        Ok(set)
    }

    /// Cast every master into its copy again (after a write the optimizer did not make). Writes the
    /// same addresses, so a captured graph stays valid; stream-ordered, no host wait.
    pub fn refresh(&self) -> Result<()> {
        for (m, k) in self.masters.iter().zip(&self.keys) {
            let Some((dst, _)) = copy_ptr(k.ordinal, k.ptr, k.len) else { continue };
            let Device::Cuda(o) = m.device() else { continue };
            let dev = CudaDevice::get(o)?;
            if k.len == 0 {
                continue;
            }
            let src = k.ptr;
            let name = format!("cast_f32_{}", self.dtype);
            launch!(dev, modules::CAST, name, cfg_1d(&dev, k.len);
                KLayout::new(&Layout::contiguous(k.len))?, src, dst, k.len as u64);
        }
        Ok(())
    }

    /// How many masters have a copy.
    pub fn len(&self) -> usize {
        self.keys.len()
    }

    /// Whether no master got a copy (none was a contiguous f32 CUDA tensor).
    pub fn is_empty(&self) -> bool {
        self.keys.is_empty()
    }

    /// The copies' dtype.
    pub fn dtype(&self) -> DType {
        self.dtype
    }

    /// The copy of `master` as a tensor (its shape, contiguous), if the set holds one: for tests
    /// and for callers that read the rounded weights (a decode step).
    pub fn copy_of(&self, master: &Tensor) -> Option<Tensor> {
        let (key, dev) = key_of(master)?;
        if !self.keys.contains(&key) {
            return None;
        }
        let c = with_registry(|r| r.get(&key).cloned())?;
        let buf = CudaBuffer::sub(&dev, c.guard, c.byte_offset, key.len, c.dtype);
        Some(Tensor::from_storage(Storage::Cuda(CudaStorage { buf }), master.shape().clone(), None))
    }
}

impl Drop for ShadowSet {
    fn drop(&mut self) {
        with_registry(|r| {
            for k in &self.keys {
                r.remove(k);
            }
        });
    }
}
