//! Transfers and memory on a real GPU: staged and pinned copies, coalesced moves, allocator
//! statistics, memory status. Without a usable GPU every test prints one line and passes.

mod common;

use common::gpu_unpoisoned as gpu;
use ferrograd_core::cuda::{memory_status, set_matmul_precision, CudaDevice, MatmulPrecision};
use ferrograd_core::{DType, Device, GradStore, Result, Rng, Tensor};

#[test]
fn staged_round_trip_of_large_tensors() -> Result<()> {
    let Some(dev) = gpu() else { return Ok(()) };
    // 37 MiB: several staging chunks and a partial last chunk, both directions.
    let n = 37 * (1 << 18) + 123;
    let x = Tensor::randn_with(&mut Rng::new(1), 0.0, 1.0, n, DType::F32, Device::Cpu)?;
    let g = x.to_device(dev)?;
    let (gs, cs) = (g.sum_all()?.item::<f32>()?, x.sum_all()?.item::<f32>()?);
    assert!((gs - cs).abs() <= 1e-3 * (n as f32).sqrt(), "{gs} vs {cs}");
    assert_eq!(g.to_vec::<f32>()?, x.to_vec::<f32>()?);
    // A strided view of a device tensor reads back correctly.
    let m = g.narrow(0, 5, 4000)?.reshape((40, 100))?.t()?;
    assert_eq!(m.to_vec::<f32>()?, x.narrow(0, 5, 4000)?.reshape((40, 100))?.t()?.to_vec::<f32>()?);
    Ok(())
}

#[test]
fn pinned_tensors_copy_asynchronously_and_correctly() -> Result<()> {
    let Some(dev) = gpu() else { return Ok(()) };
    let x = Tensor::randn_with(&mut Rng::new(2), 0.0, 1.0, (1024, 1024), DType::F32, Device::Cpu)?;
    let p = x.pin_memory()?;
    assert!(p.is_pinned() && !x.is_pinned());
    let g = p.to_device(dev)?;
    drop(p); // the copy keeps the pinned source alive until it has completed
    assert_eq!(g.mul_scalar(2.0)?.to_vec::<f32>()?, x.mul_scalar(2.0)?.to_vec::<f32>()?);
    Ok(())
}

#[test]
fn small_pinned_tensors_and_prefetches() -> Result<()> {
    let Some(dev) = gpu() else { return Ok(()) };
    let mut rng = Rng::new(5);
    // Many small pinned tensors: each must get pages of its own (the driver refuses a page twice).
    let xs: Vec<Tensor> = (0..64)
        .map(|i| Tensor::randn_with(&mut rng, 0.0, 1.0, i + 1, DType::F32, Device::Cpu)?.pin_memory())
        .collect::<Result<_>>()?;
    // Prefetch all, queue compute in between, then wait: values must arrive intact.
    let busy = Tensor::randn_with(&mut rng, 0.0, 1.0, (2048, 2048), DType::F32, dev)?;
    let pending: Vec<_> = xs.iter().map(|x| x.to_device_async(dev)).collect::<Result<_>>()?;
    let _ = busy.matmul(&busy)?;
    for (x, p) in xs.iter().zip(pending) {
        let g = p.wait()?;
        assert_eq!(g.mul_scalar(3.0)?.to_vec::<f32>()?, x.mul_scalar(3.0)?.to_vec::<f32>()?);
    }
    Ok(())
}

#[test]
fn many_small_tensors_move_in_one_copy() -> Result<()> {
    let Some(dev) = gpu() else { return Ok(()) };
    let mut rng = Rng::new(3);
    let xs: Vec<Tensor> = (0..100)
        .map(|i| {
            let d = [DType::F32, DType::F16, DType::U8, DType::I32][i % 4];
            Tensor::rand_with(&mut rng, 0.0, 50.0, (i % 7 + 1, 13), DType::F32, Device::Cpu)?.to_dtype(d)
        })
        .collect::<Result<_>>()?;
    let gs = Tensor::to_device_many(&xs, dev)?;
    for (x, g) in xs.iter().zip(&gs) {
        assert_eq!(g.device(), dev);
        assert_eq!(g.dtype(), x.dtype());
        assert_eq!(g.to_f64_vec()?, x.to_f64_vec()?);
        assert_eq!(g.add(g)?.to_f64_vec()?, x.add(x)?.to_f64_vec()?);
    }
    Ok(())
}

#[test]
fn memory_status_and_allocator_stats() -> Result<()> {
    let Some(dev) = gpu() else { return Ok(()) };
    let cd = CudaDevice::get(0)?;
    let before = cd.memory_stats();
    let t = Tensor::zeros((1024, 1024), DType::F32, dev)?;
    let during = cd.memory_stats();
    assert!(during.allocated_bytes.current >= before.allocated_bytes.current + (4 << 20));
    assert!(during.reserved_bytes.current >= during.allocated_bytes.current);
    drop(t);
    let after = cd.memory_stats();
    assert_eq!(after.allocated_bytes.current, before.allocated_bytes.current);
    let s = memory_status()?;
    assert!(!s.is_empty());
    assert!(s[0].total > 0 && s[0].used <= s[0].total && (0.0..=1.0).contains(&s[0].utilization));
    println!("{} {:.1}% used", s[0].name, 100.0 * s[0].utilization);
    Ok(())
}

#[test]
fn tf32_is_opt_in() -> Result<()> {
    let Some(dev) = gpu() else { return Ok(()) };
    let mut rng = Rng::new(4);
    let a = Tensor::randn_with(&mut rng, 0.0, 1.0, (256, 512), DType::F32, Device::Cpu)?;
    let b = Tensor::randn_with(&mut rng, 0.0, 1.0, (512, 256), DType::F32, Device::Cpu)?;
    let want = a.to_dtype(DType::F64)?.matmul(&b.to_dtype(DType::F64)?)?;
    let rel = |t: &Tensor| -> Result<f64> {
        let d = t.to_dtype(DType::F64)?.to_device(Device::Cpu)?.sub(&want)?.sqr()?.sum_all()?.item::<f64>()?;
        Ok((d / want.sqr()?.sum_all()?.item::<f64>()?).sqrt())
    };
    let (ga, gb) = (a.to_device(dev)?, b.to_device(dev)?);
    let exact = rel(&ga.matmul(&gb)?)?;
    set_matmul_precision(MatmulPrecision::High);
    let tf32 = rel(&ga.matmul(&gb)?);
    set_matmul_precision(MatmulPrecision::Highest);
    let tf32 = tf32?;
    println!("f32 rel err {exact:e}, tf32 {tf32:e}");
    assert!(exact < 1e-6, "{exact}");
    assert!(tf32 < 1e-2, "{tf32}");
    Ok(())
}

/// A walk that owns its root (`backward_consume`) frees each op's saved tensors as it passes it
/// (PyTorch without `retain_graph`); one that borrows it (`backward_into_with`) holds the whole
/// graph until the caller lets go. Measured at the last leaf's report: a chain of 8 products
/// keeps about 8 activations in the second case and about none in the first.
#[test]
fn consuming_walk_frees_activations_as_it_goes() -> Result<()> {
    let Some(dev) = gpu() else { return Ok(()) };
    let cd = CudaDevice::get(0)?;
    let n = 1usize << 20; // 4 MiB a tensor
    let mut rng = Rng::new(42);
    let ws: Vec<Tensor> = (0..8)
        .map(|_| {
            Ok(Tensor::randn_with(&mut rng, 1.0, 0.01, n, DType::F32, Device::Cpu)?.to_device(dev)?.requires_grad())
        })
        .collect::<Result<_>>()?;
    let x = Tensor::randn_with(&mut rng, 0.0, 1.0, n, DType::F32, Device::Cpu)?.to_device(dev)?;
    let build = || -> Result<Tensor> { ws.iter().try_fold(x.clone(), |y, w| y.mul(w)) };
    let seed = Tensor::ones(n, DType::F32, dev)?;
    // Allocated bytes when the walk reports its last leaf (w[0], the first factor).
    let at_last_leaf = |consume: bool| -> Result<(usize, Vec<f64>)> {
        let root = build()?;
        let mut store = GradStore::default();
        let mut last = 0usize;
        let mut hook = |_: &Tensor, _: &Tensor| -> Result<()> {
            last = cd.memory_stats().allocated_bytes.current;
            Ok(())
        };
        if consume {
            root.backward_consume(&seed, &mut store, Some(&mut hook))?;
        } else {
            root.backward_into_with_seed_hook(&seed, &mut store, &mut hook)?;
            drop(root);
        }
        Ok((last, store.get(&ws[0]).expect("dw0").to_f64_vec()?))
    };
    let (kept, g_kept) = at_last_leaf(false)?;
    let (taken, g_taken) = at_last_leaf(true)?;
    assert_eq!(g_kept, g_taken, "the same gradient either way");
    let act = n * 4;
    assert!(taken + 5 * act <= kept, "allocated at the last leaf: {taken} B consuming vs {kept} B borrowing");
    Ok(())
}
