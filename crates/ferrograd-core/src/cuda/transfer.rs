//! Host <-> device copies.
//!
//! - Small copies go straight to the driver on the compute stream.
//! - Large copies from pageable memory are staged through two pinned chunks on the copy stream:
//!   while the DMA engine moves chunk i, the host threads copy chunk i+1 into the other buffer
//!   (double buffering). The driver's own pageable path uses one thread and no overlap.
//! - Copies from pinned tensors are asynchronous: the host returns at once, the compute stream
//!   waits on an event, and the source is kept alive until the copy completes.
//! - `htod_many` packs many small tensors into one pinned buffer and moves them in one copy.
//!
//! The copy stream first waits for the compute stream, because a destination block handed out
//! by the allocator may have been freed by compute work that is still queued. ("Compute stream"
//! here is the thread's current stream, `CudaDevice::stream()`.)
//!
//! Copies to or from host memory cannot be part of a CUDA graph here (the host buffer would have to
//! outlive the graph, and reading back makes the host wait): each path refuses them during capture
//! (`sync::not_capturable`), and the calls that wait are counted (`sync::host_wait`).

use super::buffer::CudaBuffer;
use super::device::{driver_err, CudaDevice};
use super::event::Event;
use super::pinned::PinnedBuf;
use super::sync::{host_wait, not_capturable};
use crate::Result;
use cudarc::driver::{result, sys};
use rayon::prelude::*;
use std::sync::Arc;

/// Below this a plain driver copy is as fast as staging.
pub const STAGE_MIN: usize = 1 << 20;
/// Staging chunk: large enough to amortise the per-copy cost, small enough to overlap well.
pub const CHUNK: usize = 8 << 20;

fn bind(dev: &CudaDevice) -> Result<()> {
    dev.ctx.bind_to_thread().map_err(|e| driver_err("cuCtxSetCurrent", e))
}

/// Host memcpy on all cores: one thread cannot keep up with the DMA engine.
pub fn par_copy(dst: &mut [u8], src: &[u8]) {
    const PIECE: usize = 1 << 20;
    if src.len() < 2 * PIECE {
        dst.copy_from_slice(src);
    } else {
        dst.par_chunks_mut(PIECE).zip(src.par_chunks(PIECE)).for_each(|(d, s)| d.copy_from_slice(s));
    }
}

/// The copy stream waits for everything queued on the compute stream so far.
fn copy_after_compute(dev: &CudaDevice) -> Result<()> {
    let e = Event::new()?;
    e.record(dev.stream())?;
    e.wait_on(dev.copy_stream())
}

/// Every DMA on the copy stream goes through these two, so the profiler (`cuda/profile.rs`,
/// `FERROGRAD_PROFILE=1`) times and counts each one.
pub(crate) unsafe fn dma_htod(dev: &CudaDevice, dst: u64, src: *const u8, n: usize) -> Result<()> {
    let span = super::profile::begin_copy(dev, super::profile::CopyKind::HtoD, n);
    // SAFETY (caller): `src` is pinned (or staged by the driver) and `dst` holds `n` bytes.
    unsafe { sys::cuMemcpyHtoDAsync_v2(dst, src as *const _, n, dev.copy_stream().cu_stream()) }
        .result()
        .map_err(|e| driver_err("cuMemcpyHtoDAsync", e))?;
    if let Some(s) = span {
        s.end_copy(dev);
    }
    Ok(())
}

pub(crate) unsafe fn dma_dtoh(dev: &CudaDevice, dst: *mut u8, src: u64, n: usize) -> Result<()> {
    let span = super::profile::begin_copy(dev, super::profile::CopyKind::DtoH, n);
    // SAFETY (caller): `dst` is pinned and holds `n` bytes, `src` is a live device range.
    unsafe { sys::cuMemcpyDtoHAsync_v2(dst as *mut _, src, n, dev.copy_stream().cu_stream()) }
        .result()
        .map_err(|e| driver_err("cuMemcpyDtoHAsync", e))?;
    if let Some(s) = span {
        s.end_copy(dev);
    }
    Ok(())
}

/// Copy `src` into the start of `dst`. Returns once `src` may be reused.
pub fn htod(dev: &Arc<CudaDevice>, src: &[u8], dst: &CudaBuffer) -> Result<()> {
    if src.is_empty() {
        return Ok(());
    }
    debug_assert!(src.len() <= dst.bytes());
    bind(dev)?;
    if src.len() < STAGE_MIN {
        // A copy from pageable memory "might be synchronous with respect to host" (the driver's
        // words): counted as a wait.
        return host_wait("cuMemcpyHtoDAsync(pageable)", || {
            // SAFETY: `dst` holds at least `src.len()` bytes; the driver stages a pageable source
            // before the call returns.
            unsafe { result::memcpy_htod_async(dst.ptr(), src, dev.stream().cu_stream()) }
                .map_err(|e| driver_err("cuMemcpyHtoDAsync", e))
        });
    }
    not_capturable("cuMemcpyHtoDAsync")?;
    super::profile::note_useful(src.len());
    copy_after_compute(dev)?;
    let mut bufs = [PinnedBuf::new(dev, CHUNK)?, PinnedBuf::new(dev, CHUNK)?];
    let events = [Event::new()?, Event::new()?];
    let mut used = [false, false];
    let mut last = 0;
    for (i, chunk) in src.chunks(CHUNK).enumerate() {
        let s = i % 2;
        if used[s] {
            events[s].synchronize()?;
        }
        par_copy(bufs[s].as_mut_slice(chunk.len()), chunk);
        // SAFETY: the pinned chunk holds `chunk.len()` bytes and is not touched until its event.
        unsafe { dma_htod(dev, dst.ptr() + (i * CHUNK) as u64, bufs[s].as_ptr(), chunk.len())? };
        events[s].record(dev.copy_stream())?;
        used[s] = true;
        last = s;
    }
    events[last].wait_on(dev.stream())?;
    // The pinned chunks go back to the pool, so their copies must be done.
    for (e, u) in events.iter().zip(used) {
        if u {
            e.synchronize()?;
        }
    }
    Ok(())
}

/// DMA from pinned host memory on the copy stream without blocking the host; returns the event
/// that marks its completion. `keep` (the owner of `src`) lives until the copy is done. With
/// `after_compute` the copy first waits for compute queued so far (the destination came from the
/// compute stream's pool and may still be read by queued kernels).
///
/// # Safety
/// `src` must point to `n` readable bytes of page-locked memory owned by `keep`.
pub unsafe fn htod_pinned(
    dev: &Arc<CudaDevice>,
    src: *const u8,
    n: usize,
    dst: &CudaBuffer,
    keep: Box<dyn Send + Sync>,
    after_compute: bool,
) -> Result<Event> {
    not_capturable("cuMemcpyHtoDAsync")?;
    bind(dev)?;
    if after_compute {
        copy_after_compute(dev)?;
    }
    super::profile::note_useful(n);
    if n > 0 {
        // SAFETY: `src` is page-locked and kept alive by `keep` until `release` completes.
        unsafe { dma_htod(dev, dst.ptr(), src, n)? };
    }
    let (done, release) = (Event::new()?, Event::new()?);
    done.record(dev.copy_stream())?;
    release.record(dev.copy_stream())?;
    dev.defer(release, keep);
    Ok(done)
}

/// DMA `n` bytes at device address `src` into pinned host memory on the copy stream, after the
/// compute queued so far (which may still be writing `src`), without blocking the host; returns
/// the event that marks its completion. `keep` (the owner of `dst` and of `src`'s buffer) lives
/// until the copy is done.
///
/// # Safety
/// `dst` must point to `n` writable bytes of page-locked memory owned by `keep`, not read until
/// the returned event completes; `src` must be a live device range of `n` bytes owned by `keep`.
pub unsafe fn dtoh_pinned(
    dev: &Arc<CudaDevice>,
    src: u64,
    dst: *mut u8,
    n: usize,
    keep: Box<dyn Send + Sync>,
) -> Result<Event> {
    not_capturable("cuMemcpyDtoHAsync")?;
    bind(dev)?;
    copy_after_compute(dev)?;
    super::profile::note_useful(n);
    if n > 0 {
        // SAFETY (caller): `dst` is page-locked, holds `n` bytes and is kept alive by `keep`.
        unsafe { dma_dtoh(dev, dst, src, n)? };
    }
    let (done, release) = (Event::new()?, Event::new()?);
    done.record(dev.copy_stream())?;
    release.record(dev.copy_stream())?;
    dev.defer(release, keep);
    Ok(done)
}

/// Copy the start of `src` into `dst` and wait for it.
pub fn dtoh(dev: &Arc<CudaDevice>, src: &CudaBuffer, dst: &mut [u8]) -> Result<()> {
    if dst.is_empty() {
        return Ok(());
    }
    debug_assert!(dst.len() <= src.bytes());
    bind(dev)?;
    if dst.len() < STAGE_MIN {
        return host_wait("cuMemcpyDtoH", || {
            // SAFETY: `src` holds at least `dst.len()` bytes; we synchronise before `dst` is read.
            unsafe { result::memcpy_dtoh_async(dst, src.ptr(), dev.stream().cu_stream()) }
                .map_err(|e| driver_err("cuMemcpyDtoHAsync", e))?;
            dev.stream().synchronize().map_err(|e| driver_err("cuStreamSynchronize", e))
        });
    }
    let n = dst.len();
    let mut sink = |at: usize, chunk: &[u8]| {
        par_copy(&mut dst[at..at + chunk.len()], chunk);
        Ok(())
    };
    dtoh_stream(dev, src.ptr(), n, &mut sink)
}

/// `n` bytes at device address `src`, handed to `sink(offset, bytes)` chunk by chunk in order,
/// through two pinned chunks: the DMA of the next chunks runs while `sink` takes this one (how
/// `dtoh` fills a pageable buffer and how device tensors are written to files). The copies are
/// ordered after the compute queued so far. On an error (of `sink` or of a copy) the copies in
/// flight are waited for before the pinned chunks go back to the pool.
pub fn dtoh_stream(
    dev: &Arc<CudaDevice>,
    src: u64,
    n: usize,
    sink: &mut dyn FnMut(usize, &[u8]) -> Result<()>,
) -> Result<()> {
    if n == 0 {
        return Ok(());
    }
    not_capturable("cuMemcpyDtoH")?;
    bind(dev)?;
    super::profile::note_useful(n);
    copy_after_compute(dev)?;
    let mut bufs = [PinnedBuf::new(dev, CHUNK)?, PinnedBuf::new(dev, CHUNK)?];
    let events = [Event::new()?, Event::new()?];
    let mut queued = [false, false];
    let chunks = n.div_ceil(CHUNK);
    let len = |i: usize| CHUNK.min(n - i * CHUNK);
    let enqueue = |i: usize, buf: &mut PinnedBuf, ev: &Event| -> Result<()> {
        // SAFETY: the pinned buffer holds CHUNK bytes and is read only after `ev` completes.
        unsafe { dma_dtoh(dev, buf.as_mut_slice(len(i)).as_mut_ptr(), src + (i * CHUNK) as u64, len(i))? };
        ev.record(dev.copy_stream())
    };
    let mut run = || -> Result<()> {
        for i in 0..chunks.min(2) {
            enqueue(i, &mut bufs[i], &events[i])?;
            queued[i] = true;
        }
        for i in 0..chunks {
            let s = i % 2;
            events[s].synchronize()?;
            queued[s] = false;
            sink(i * CHUNK, bufs[s].as_slice(len(i)))?;
            if i + 2 < chunks {
                enqueue(i + 2, &mut bufs[s], &events[s])?;
                queued[s] = true;
            }
        }
        Ok(())
    };
    let result = run();
    for (e, q) in events.iter().zip(queued) {
        if q {
            e.synchronize()?;
        }
    }
    result
}

/// Alignment of each tensor inside a coalesced transfer (vector loads want 16 bytes; 256 keeps
/// cache lines separate).
pub const PACK_ALIGN: usize = 256;

/// Move several host byte ranges in one copy; returns the shared allocation and byte offsets.
pub(crate) fn htod_many(
    dev: &Arc<CudaDevice>,
    parts: &[&[u8]],
) -> Result<(Arc<super::buffer::AllocGuard>, Vec<usize>)> {
    let mut offsets = Vec::with_capacity(parts.len());
    let mut total = 0usize;
    for p in parts {
        offsets.push(total);
        total += p.len().div_ceil(PACK_ALIGN) * PACK_ALIGN;
    }
    not_capturable("cuMemcpyHtoDAsync")?;
    let guard = Arc::new(CudaBuffer::raw(dev, total)?);
    if total == 0 {
        return Ok((guard, offsets));
    }
    super::profile::note_useful(parts.iter().map(|p| p.len()).sum());
    let mut staging = PinnedBuf::new(dev, total)?;
    {
        let dst = staging.as_mut_slice(total);
        for (p, &o) in parts.iter().zip(&offsets) {
            dst[o..o + p.len()].copy_from_slice(p);
        }
    }
    let base = guard.allocation().map_or(0, |a| a.ptr());
    bind(dev)?;
    copy_after_compute(dev)?;
    // SAFETY: the staging buffer holds `total` bytes and is kept alive until the copy completes.
    unsafe { dma_htod(dev, base, staging.as_ptr(), total)? };
    let done = Event::new()?;
    done.record(dev.copy_stream())?;
    done.wait_on(dev.stream())?;
    dev.defer(done, Box::new(staging));
    Ok((guard, offsets))
}

/// Narrow f32 `src` to `via` (BF16 or F16; anything else is F16) into `out` (`2 * src.len()`
/// bytes), round to nearest even, on all cores.
pub fn narrow_into(src: &[f32], via: crate::DType, out: &mut [u8]) {
    const PAR: usize = 64 << 10;
    out.par_chunks_mut(PAR * 2).zip(src.par_chunks(PAR)).for_each(|(d, s)| narrow_piece(s, via, d));
}

/// `narrow_into` on the calling thread alone.
fn narrow_piece(src: &[f32], via: crate::DType, out: &mut [u8]) {
    use half::slice::HalfFloatSliceExt;
    if via == crate::DType::BF16 {
        bytemuck::cast_slice_mut::<u8, half::bf16>(out).convert_from_f32_slice(src);
    } else {
        bytemuck::cast_slice_mut::<u8, half::f16>(out).convert_from_f32_slice(src);
    }
}

/// Elements narrowed per piece of a compressed copy (2 MiB of f32 in, 1 MiB out): a piece is
/// small enough that the link starts soon after the first ones are narrowed and that the last
/// wave of copies is short, large enough that 1 MiB DMAs still run at the link's full speed
/// (pieces of 128 Ki to 2 Mi elements measured in BENCHMARKS.md, sixteenth session).
pub const NARROW_PIECE: usize = 512 << 10;

/// Narrow `src` (f32) to `via` (BF16 or F16, round to nearest even) into one pinned buffer and
/// copy it into `dst` (which holds `src.len()` elements of `via`). The compute stream waits for
/// the copy; the host returns without waiting for it.
///
/// Every core takes pieces in turn and queues each piece's DMA on the copy stream as soon as it
/// has narrowed it: the link moves pieces while the cores narrow the rest. (Narrowing one piece
/// at a time on all cores put a fork and join per piece on the critical path, and ran at half
/// this speed: BENCHMARKS.md, sixteenth session.)
pub fn htod_narrowed(dev: &Arc<CudaDevice>, src: &[f32], via: crate::DType, dst: &CudaBuffer) -> Result<()> {
    if !matches!(via, crate::DType::BF16 | crate::DType::F16) {
        return Err(crate::Error::UnsupportedDType { op: "to_device_compressed (via)", dtype: via });
    }
    if src.is_empty() {
        return Ok(());
    }
    debug_assert!(src.len() * 2 <= dst.bytes());
    not_capturable("cuMemcpyHtoDAsync")?;
    bind(dev)?;
    super::profile::note_useful(src.len() * 4);
    copy_after_compute(dev)?;
    let mut staging = PinnedBuf::new(dev, src.len() * 2)?;
    let out = staging.as_mut_slice(src.len() * 2);
    let base = dst.ptr();
    // One core queues at a time, so that the profiler's events around each DMA
    // (`dma_htod`) enclose that DMA alone on the copy stream.
    let queue = std::sync::Mutex::new(());
    let queued = out.par_chunks_mut(NARROW_PIECE * 2).zip(src.par_chunks(NARROW_PIECE)).enumerate().try_for_each(
        |(i, (b, s))| {
            narrow_piece(s, via, b);
            bind(dev)?;
            let _one = queue.lock().unwrap_or_else(|e| e.into_inner());
            // SAFETY: the piece lies in the pinned staging buffer, kept alive below until the
            // copy stream has passed every DMA queued here; `dst` holds `src.len()` elements.
            unsafe { dma_htod(dev, base + (i * NARROW_PIECE * 2) as u64, b.as_ptr(), b.len()) }
        },
    );
    let handed_over = queued.and_then(|()| {
        let (done, release) = (Event::new()?, Event::new()?);
        done.record(dev.copy_stream())?;
        done.wait_on(dev.stream())?;
        release.record(dev.copy_stream())?;
        Ok(release)
    });
    match handed_over {
        Ok(release) => {
            dev.defer(release, Box::new(staging));
            Ok(())
        }
        Err(e) => {
            // Pieces may still be in flight: the staging buffer must outlive them.
            let _ = dev.copy_stream().synchronize();
            Err(e)
        }
    }
}
