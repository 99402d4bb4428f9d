//! Streams on a real GPU: the current-stream guard, events ordering streams, `record_stream`,
//! cuBLAS on a user stream, the per-device TF32 policy and the counted host waits. Without a usable
//! GPU every test prints one line and passes.

mod common;

use common::cuda_device as gpu;
use ferrograd_core::cuda::{matmul_precision, set_matmul_precision, CudaDevice, MatmulPrecision, SyncCounter};
use ferrograd_core::{DType, Device, Result, Rng, Tensor};
use std::sync::{Mutex, MutexGuard};

/// Held by the tests whose f32 matmuls must run under one precision: the TF32 test changes the
/// policy, and the test threads of this binary share the device.
static PRECISION: Mutex<()> = Mutex::new(());

fn precision_lock() -> MutexGuard<'static, ()> {
    PRECISION.lock().unwrap_or_else(|e| e.into_inner())
}

/// Several milliseconds of work on the current stream, so that what follows on another stream
/// would overtake it if nothing ordered the two.
fn busy(device: Device) -> Result<Tensor> {
    let a = Tensor::randn_with(&mut Rng::new(11), 0.0, 1e-3, (2048, 2048), DType::F32, device)?;
    let mut x = a.clone();
    for _ in 0..6 {
        x = x.matmul(&a)?;
    }
    Ok(x)
}

#[test]
fn current_stream_guard_redirects_ops_and_restores() -> Result<()> {
    let Some(dev) = gpu() else { return Ok(()) };
    let device = Device::Cuda(dev.ordinal);
    let (s1, s2) = (dev.new_stream()?, dev.new_stream()?);
    assert_ne!(s1, s2);
    assert!(dev.current_stream().is_default() && !s1.is_default());
    let x = Tensor::randn_with(&mut Rng::new(1), 0.0, 1.0, (64, 64), DType::F32, device)?;
    let want: Vec<f32> = x.to_vec::<f32>()?.iter().map(|v| v * 3.0 + 1.0).collect();
    s1.wait_stream(&dev.default_stream())?;
    let y = {
        let _g = s1.make_current();
        assert_eq!(dev.current_stream(), s1);
        {
            let _inner = s2.make_current();
            assert_eq!(dev.current_stream(), s2);
        }
        assert_eq!(dev.current_stream(), s1, "an inner guard restores the outer stream");
        x.mul_scalar(3.0)?.add_scalar(1.0)?
    };
    assert!(dev.current_stream().is_default());
    dev.default_stream().wait_stream(&s1)?;
    assert_eq!(y.to_vec::<f32>()?, want);
    // Another thread has its own current stream.
    let _g = s1.make_current();
    let d2 = dev.clone();
    let other = std::thread::spawn(move || d2.current_stream().is_default()).join();
    assert_eq!(other.ok(), Some(true));
    Ok(())
}

#[test]
fn events_order_work_across_streams() -> Result<()> {
    let Some(dev) = gpu() else { return Ok(()) };
    let device = Device::Cuda(dev.ordinal);
    let (s1, s2) = (dev.new_stream()?, dev.new_stream()?);
    s1.wait_stream(&dev.default_stream())?;
    let (x, done) = {
        let _g = s1.make_current();
        let x = busy(device)?;
        (x, s1.record_event()?)
    };
    let y = {
        let _g = s2.make_current();
        s2.wait_event(&done)?;
        x.record_stream(&s2)?;
        x.sum_all()?
    };
    dev.default_stream().wait_stream(&s2)?;
    dev.default_stream().wait_stream(&s1)?;
    let want = x.to_f64_vec()?.iter().sum::<f64>();
    let got = y.item_f64()?;
    assert!((got - want).abs() <= 1e-3 * want.abs().max(1.0), "{got} vs {want}");
    s2.synchronize()?;
    assert!(s2.is_done()? && done.is_done());
    Ok(())
}

/// A tensor made on the default stream, read on another one, then dropped: with `record_stream`
/// its memory is not handed to the next allocation before the other stream has read it.
#[test]
fn record_stream_keeps_memory_until_the_other_stream_is_done() -> Result<()> {
    let Some(dev) = gpu() else { return Ok(()) };
    let device = Device::Cuda(dev.ordinal);
    let s = dev.new_stream()?;
    let host: Vec<f32> = (0..(1 << 20)).map(|i| (i % 1000) as f32).collect();
    for _ in 0..3 {
        let x = Tensor::from_slice(&host, host.len(), device)?;
        s.wait_stream(&dev.default_stream())?;
        let y = {
            let _g = s.make_current();
            let _slow = busy(device)?;
            x.record_stream(&s)?;
            x.mul_scalar(2.0)?
        };
        drop(x);
        // Same size on the default stream: without record_stream it would get x's block and
        // overwrite it while `s` is still busy.
        let z = Tensor::full(-7.0, host.len(), DType::F32, device)?;
        dev.default_stream().wait_stream(&s)?;
        let got = y.to_vec::<f32>()?;
        assert!(got.iter().zip(&host).all(|(g, h)| *g == 2.0 * h), "x was overwritten before s read it");
        assert_eq!(z.to_vec::<f32>()?[0], -7.0);
    }
    Ok(())
}

#[test]
fn matmul_on_a_user_stream_equals_the_default_stream() -> Result<()> {
    let Some(dev) = gpu() else { return Ok(()) };
    let _precision = precision_lock();
    let device = Device::Cuda(dev.ordinal);
    let mut rng = Rng::new(3);
    let a = Tensor::randn_with(&mut rng, 0.0, 1.0, (3, 300, 200), DType::F32, device)?;
    let b = Tensor::randn_with(&mut rng, 0.0, 1.0, (3, 200, 150), DType::F32, device)?;
    let want = a.matmul(&b)?.to_vec::<f32>()?;
    let s = dev.new_stream()?;
    s.wait_stream(&dev.default_stream())?;
    let c = {
        let _g = s.make_current();
        a.matmul(&b)?
    };
    dev.default_stream().wait_stream(&s)?;
    assert_eq!(c.to_vec::<f32>()?, want, "cuBLAS on another stream, same kernels");
    assert_eq!(a.matmul(&b)?.to_vec::<f32>()?, want, "and back on the default stream");
    Ok(())
}

#[test]
fn tf32_policy_is_per_device_with_a_process_default() -> Result<()> {
    let Some(dev) = gpu() else { return Ok(()) };
    let _precision = precision_lock();
    // A second GPU, where there is one, keeps its own policy.
    let other = CudaDevice::get(1).ok();
    let device = Device::Cuda(dev.ordinal);
    let mut rng = Rng::new(4);
    let a = Tensor::randn_with(&mut rng, 0.0, 1.0, (256, 512), DType::F32, device)?;
    let b = Tensor::randn_with(&mut rng, 0.0, 1.0, (512, 256), DType::F32, device)?;
    let exact = a.to_dtype(DType::F64)?.matmul(&b.to_dtype(DType::F64)?)?.to_f64_vec()?;
    let err = |c: &Tensor| -> Result<f64> {
        Ok(c.to_f64_vec()?.iter().zip(&exact).map(|(x, y)| (x - y).abs()).fold(0.0, f64::max))
    };
    assert_eq!(dev.matmul_precision(), matmul_precision(), "a device starts from the process default");
    dev.set_matmul_precision(MatmulPrecision::High);
    assert_eq!(matmul_precision(), MatmulPrecision::Highest, "the default is untouched");
    if let Some(other) = &other {
        assert_eq!(other.matmul_precision(), MatmulPrecision::Highest, "cuda:1 keeps its policy");
    }
    let tf32 = err(&a.matmul(&b)?)?;
    dev.set_matmul_precision(MatmulPrecision::Highest);
    let f32 = err(&a.matmul(&b)?)?;
    assert!(tf32 > 10.0 * f32, "TF32 error {tf32} vs f32 error {f32}");
    set_matmul_precision(MatmulPrecision::High);
    assert_eq!(dev.matmul_precision(), MatmulPrecision::High, "the process setter reaches open devices");
    if let Some(other) = &other {
        assert_eq!(other.matmul_precision(), MatmulPrecision::High, "... every open device");
    }
    set_matmul_precision(MatmulPrecision::Highest);
    assert_eq!(dev.matmul_precision(), MatmulPrecision::Highest);
    Ok(())
}

#[test]
fn host_waits_are_counted_by_name() -> Result<()> {
    let Some(dev) = gpu() else { return Ok(()) };
    let device = Device::Cuda(dev.ordinal);
    let x = Tensor::ones(100, DType::F32, device)?;
    let c = SyncCounter::start();
    let _ = x.add(&x)?;
    assert_eq!(c.total(), 0, "an op waits for nothing: {:?}", c.calls());
    let _ = x.sum_all()?.item_f64()?;
    dev.synchronize()?;
    dev.default_stream().synchronize()?;
    let mut calls = c.calls();
    calls.sort();
    assert_eq!(calls, vec![("cuCtxSynchronize", 1), ("cuMemcpyDtoH", 1), ("cuStreamSynchronize", 1)]);
    Ok(())
}
