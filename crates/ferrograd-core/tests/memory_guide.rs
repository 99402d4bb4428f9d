//! The memory guide's features on a real GPU (issue 17): device -> host copies into pinned memory,
//! unified (managed) tensors and their oversubscription guard, compressed and expanded transfers,
//! and the profiler's transfer metrics. Without a usable GPU each GPU test prints one line and
//! passes; the argument checks that need no GPU run everywhere.

mod common;

use common::gpu_unpoisoned as gpu;
use ferrograd_core::cuda::managed::{Advice, ManagedAlloc};
use ferrograd_core::cuda::{profile, set_poison_allocations, CudaDevice};
use ferrograd_core::{DType, Device, Error, Result, Rng, Tensor};

fn data(seed: u64, n: usize) -> Result<Tensor> {
    Tensor::rand_with(&mut Rng::new(seed), -3.0, 3.0, n, DType::F32, Device::Cpu)
}

#[test]
fn pinned_copy_refuses_bad_arguments_without_a_gpu() -> Result<()> {
    // A CPU source is refused before any driver call.
    let x = data(1, 16)?;
    let e = x.copy_to_pinned_async(&x).err().map(|e| e.to_string()).unwrap_or_default();
    assert!(e.contains("copy_to_pinned_async"), "{e}");
    let e = x.to_device_compressed(Device::Cpu, DType::BF16).err().map(|e| e.to_string()).unwrap_or_default();
    assert!(e.contains("to_device_compressed"), "{e}");
    let e = x.to_device_compressed(Device::Cuda(0), DType::I8).err().map(|e| e.to_string()).unwrap_or_default();
    assert!(e.contains("to_device_compressed"), "{e}");
    let u = Tensor::from_vec(vec![1u32, 2], 2, Device::Cpu)?;
    assert!(u.to_device_expanded(Device::Cuda(0), DType::F32).is_err(), "u32 -> f32 is not lossless");
    assert!(x.to_device_one_hot(Device::Cuda(0), 4, DType::F32).is_err(), "float ids are refused");
    assert!(!x.is_unified());
    assert!(x.prefetch_unified(Device::Cpu).is_err());
    Ok(())
}

#[test]
fn device_to_pinned_host_copies_are_exact_and_asynchronous() -> Result<()> {
    let Some(dev) = gpu() else { return Ok(()) };
    set_poison_allocations(true);
    // 20 MiB and a small odd size; both through one DMA each.
    for n in [5 * (1 << 20) + 7, 1001] {
        let x = data(2, n)?;
        let want = x.to_vec::<f32>()?;
        let d = x.to_device(dev)?.mul_scalar(2.0)?; // produced by a kernel still queued
        let host = d.to_host_pinned()?;
        assert!(host.is_pinned() && host.device() == Device::Cpu);
        let got = host.to_vec::<f32>()?;
        assert!(got.iter().zip(&want).all(|(g, w)| g.to_bits() == (2.0 * w).to_bits()), "n={n}");
        // Into an existing pinned tensor, reused: the second copy overwrites the first.
        let dst = Tensor::empty_pinned(n, DType::F32)?;
        let first = d.copy_to_pinned_async(&dst)?.wait()?;
        assert_eq!(first.to_vec::<f32>()?, got);
        let e = x.to_device(dev)?.neg()?;
        let pending = e.copy_to_pinned_async(&dst)?;
        drop(e); // the copy keeps its source alive
        let second = pending.wait()?;
        assert!(second.same_storage(&dst));
        assert!(second.to_vec::<f32>()?.iter().zip(&want).all(|(g, w)| g.to_bits() == (-w).to_bits()));
    }
    // A strided source is made contiguous first.
    let m = data(3, 600)?.reshape((20, 30))?;
    let t = m.to_device(dev)?.t()?;
    assert_eq!(t.to_host_pinned()?.to_vec::<f32>()?, m.t()?.to_vec::<f32>()?);
    // Wrong destinations are typed errors.
    let d = m.to_device(dev)?;
    let bad_shape = Tensor::empty_pinned((30, 20), DType::F32)?;
    assert!(matches!(d.copy_to_pinned_async(&bad_shape), Err(Error::ShapeMismatch { .. })));
    let bad_dtype = Tensor::empty_pinned((20, 30), DType::BF16)?;
    assert!(matches!(d.copy_to_pinned_async(&bad_dtype), Err(Error::DTypeMismatch { .. })));
    let pageable = Tensor::zeros((20, 30), DType::F32, Device::Cpu)?;
    assert!(matches!(d.copy_to_pinned_async(&pageable), Err(Error::InvalidArgument(_))));
    set_poison_allocations(false);
    Ok(())
}

#[test]
fn unified_tensors_are_read_and_written_on_both_sides() -> Result<()> {
    let Some(dev) = gpu() else { return Ok(()) };
    let x = data(4, 3 * (1 << 18) + 5)?;
    let want = x.to_vec::<f32>()?;
    let u = x.to_unified(0)?;
    assert!(u.is_unified() && u.device() == dev);
    // The device reads it (an op), the host reads it in place.
    let doubled = u.mul_scalar(2.0)?;
    u.with_unified_host::<f32, _>(|s| assert_eq!(s, &want[..]))?;
    // The host writes it in place; a kernel queued afterwards sees the new values.
    u.with_unified_host_mut::<f32, _>(|s| s.iter_mut().for_each(|v| *v += 1.0))?;
    let plus = u.to_vec::<f32>()?;
    assert!(plus.iter().zip(&want).all(|(p, w)| p.to_bits() == (w + 1.0).to_bits()));
    let tripled = u.mul_scalar(3.0)?.to_vec::<f32>()?;
    assert!(tripled.iter().zip(&want).all(|(t, w)| t.to_bits() == ((w + 1.0) * 3.0).to_bits()));
    // The earlier op read the old values (it was queued before the host write waited for it).
    assert!(doubled.to_vec::<f32>()?.iter().zip(&want).all(|(d, w)| d.to_bits() == (2.0 * w).to_bits()));
    // Hints and prefetches in both directions.
    u.advise_unified(Advice::ReadMostly)?;
    u.advise_unified(Advice::AccessedBy(dev))?;
    u.prefetch_unified(Device::Cpu)?;
    u.prefetch_unified(dev)?;
    assert_eq!(
        u.sum_all()?.to_dtype(DType::F64)?.item::<f64>()?.round(),
        u.to_vec::<f32>()?.iter().map(|&v| v as f64).sum::<f64>().round()
    );
    // A view of a unified tensor reads through the host view as well.
    let v = u.narrow(0, 10, 100)?;
    v.with_unified_host::<f32, _>(|s| assert_eq!(s, &plus[10..110]))?;
    assert!(matches!(u.with_unified_host::<u8, _>(|_| ()), Err(Error::DTypeMismatch { .. })));
    // An ordinary CUDA tensor is not unified.
    assert!(!doubled.is_unified() && doubled.prefetch_unified(Device::Cpu).is_err());
    Ok(())
}

#[test]
fn managed_oversubscription_is_refused_with_a_typed_error() -> Result<()> {
    let Some(_) = gpu() else { return Ok(()) };
    let d = CudaDevice::get(0)?;
    let (free, total) = d.mem_info()?;
    // As much as the whole device: never handed to the driver.
    match ManagedAlloc::new(&d, total) {
        Err(Error::OutOfMemory { requested, hint, .. }) => {
            assert_eq!(requested, total);
            assert!(hint.contains("oversubscribing"), "{hint}");
        }
        Err(e) => panic!("expected OutOfMemory, got {e}"),
        Ok(_) => panic!("a managed allocation of the whole device ({total} bytes, {free} free) was accepted"),
    }
    // A small one is fine and frees cleanly.
    let m = ManagedAlloc::new(&d, 1 << 20)?;
    assert_eq!(m.bytes(), 1 << 20);
    Ok(())
}

#[test]
fn compressed_transfers_round_trip_within_half_an_ulp() -> Result<()> {
    let Some(dev) = gpu() else { return Ok(()) };
    set_poison_allocations(true);
    // Several pipelined pieces and a partial last one.
    let n = 5 * (1 << 20) + 3;
    let x = data(5, n)?;
    let want = x.to_vec::<f32>()?;
    for (via, rel) in [(DType::BF16, 2f32.powi(-8)), (DType::F16, 2f32.powi(-11))] {
        let g = x.to_device_compressed(dev, via)?;
        assert_eq!((g.dtype(), g.device(), g.dims()), (DType::F32, dev, x.dims()));
        let got = g.to_vec::<f32>()?;
        // Half an ulp of the narrow type (round to nearest): `rel` relative for normal numbers, and
        // at most 2^-25 absolute among f16's subnormals (|x| < 6.1e-5).
        let bad = got.iter().zip(&want).find(|(g, w)| (*g - *w).abs() > rel * w.abs() + 2f32.powi(-25));
        assert!(bad.is_none(), "{via}: {bad:?} is further apart than half an ulp");
        // Not a trivial copy: the values did get narrowed (bf16/f16 cannot hold these exactly).
        assert!(got.iter().zip(&want).any(|(g, w)| g != w), "{via}");
        // Same as narrowing on the CPU.
        let cpu = x.to_dtype(via)?.to_dtype(DType::F32)?.to_vec::<f32>()?;
        assert!(got.iter().zip(&cpu).all(|(a, b)| a.to_bits() == b.to_bits()), "{via}: differs from the CPU cast");
    }
    // Lossless: u8 residues widened on the GPU, exactly.
    let r: Vec<u8> = (0..100_003u32).map(|i| (i.wrapping_mul(2654435761) >> 24) as u8).collect();
    let t = Tensor::from_vec(r.clone(), r.len(), Device::Cpu)?;
    let f = t.to_device_expanded(dev, DType::F32)?;
    assert_eq!(f.dtype(), DType::F32);
    assert!(f.to_vec::<f32>()?.iter().zip(&r).all(|(a, &b)| *a == b as f32));
    // One-hot rows built on the GPU.
    let ids = Tensor::from_vec(vec![3u32, 0, 2, 3, 1], 5, Device::Cpu)?;
    let oh = ids.to_device_one_hot(dev, 4, DType::F32)?;
    assert_eq!(oh.dims(), &[5, 4]);
    let rows = oh.to_vec2::<f32>()?;
    for (row, &id) in rows.iter().zip(&[3usize, 0, 2, 3, 1]) {
        for (c, &v) in row.iter().enumerate() {
            assert_eq!(v, if c == id { 1.0 } else { 0.0 });
        }
    }
    set_poison_allocations(false);
    Ok(())
}

#[test]
fn profile_reports_transfer_metrics() -> Result<()> {
    let Some(dev) = gpu() else { return Ok(()) };
    let busy = Tensor::randn_with(&mut Rng::new(7), 0.0, 1.0, (1024, 1024), DType::F32, dev)?;
    let x = data(6, 4 << 20)?; // 16 MiB
    let p = x.pin_memory()?;
    CudaDevice::get(0)?.synchronize()?;
    profile::set_enabled(true);
    let _ = profile::report()?; // start from an empty record
    let d = p.to_device(dev)?; // one pinned DMA: useful == moved
    let _ = busy.matmul(&busy)?;
    let c = x.to_device_compressed(dev, DType::BF16)?; // moves half of what it delivers
    let back = d.to_host_pinned()?;
    CudaDevice::get(0)?.synchronize()?;
    let m = profile::transfer_metrics()?.ok_or_else(|| Error::Cuda("no transfer was recorded".into()))?;
    profile::set_enabled(false);
    let bytes = (4u64 << 20) * 4;
    // Pinned h2d (16 MiB) + compressed (8 MiB moved, 16 delivered) + pinned d2h (16 MiB).
    assert_eq!(m.bytes_moved, bytes + bytes / 2 + bytes, "{m:?}");
    assert_eq!(m.useful_bytes, 3 * bytes, "{m:?}");
    assert!(m.copy_ms > 0.0 && m.copy_ms <= m.span_ms + 1e-6 && m.exposed_ms <= m.copy_ms + 1e-9, "{m:?}");
    assert!(m.gbps() > 0.1 && m.gbps().is_finite(), "{m:?}");
    assert!((0.0..=100.0 + 1e-9).contains(&m.overlap_pct()) && (0.0..=100.0 + 1e-9).contains(&m.overhead_pct()));
    let text = m.lines(Some(profile::measure_peak_gbps(&CudaDevice::get(0)?)?));
    println!("{text}");
    assert!(text.contains("overlap efficiency") && text.contains("measured peak"));
    drop((back, c));
    Ok(())
}

#[test]
fn file_reads_into_device_memory_give_identical_bytes_on_both_paths() -> Result<()> {
    use ferrograd_core::cuda::file_read::{read_tensor, ReadPath};
    let dir = tempfile::tempdir().map_err(Error::Io)?;
    let path = dir.path().join("shard.bin");
    // 21 MiB of f32 after a 1 KiB header: several pinned chunks and a partial last one.
    let n = 21 * (1 << 18) + 3;
    let x = data(8, n)?;
    let mut bytes = vec![7u8; 1024];
    bytes.extend(x.to_vec::<f32>()?.iter().flat_map(|v| v.to_le_bytes()));
    std::fs::write(&path, &bytes).map_err(Error::Io)?;
    let Some(_) = gpu() else { return Ok(()) };
    set_poison_allocations(true);
    let (pinned, how) = read_tensor(&path, 1024, n, DType::F32, 0, false)?;
    assert_eq!(how, ReadPath::Pinned);
    let (direct, how2) = read_tensor(&path, 1024, n, DType::F32, 0, true)?;
    println!("file read paths: {how} and {how2} (cuFile: {:?})", ferrograd_core::cuda::file_read::cufile_status());
    let want = x.to_vec::<f32>()?;
    assert!(pinned.to_vec::<f32>()?.iter().zip(&want).all(|(a, b)| a.to_bits() == b.to_bits()), "{how}");
    assert!(direct.to_vec::<f32>()?.iter().zip(&want).all(|(a, b)| a.to_bits() == b.to_bits()), "{how2}");
    // Past the end of the file: a typed error.
    assert!(matches!(read_tensor(&path, 1025, n, DType::F32, 0, false), Err(Error::File { .. })));
    set_poison_allocations(false);
    Ok(())
}
