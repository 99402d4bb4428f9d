//! Where the host time of one small op goes (`ferrograd bench launch` times only the total): the
//! bare driver launch, cudarc's launch builder, our function lookup, the caching allocator, and
//! the whole `x.add(&y)`. A profiling tool, not a check: it is ignored by default and asserts
//! nothing about time. Run on a GPU machine with
//!
//! ```text
//! cargo test --release -p ferrograd-core --test cuda_launch_profile -- --ignored --nocapture
//! ```
//!
//! Each figure is the median over 41 chains of 256 calls of the host time per call while
//! enqueueing (the device is synchronized between chains, so the launch queue never fills).

use cudarc::driver::{result, PushKernelArg};
use ferrograd_core::cuda::klayout::KLayout;
use ferrograd_core::cuda::launch::cfg_1d;
use ferrograd_core::cuda::{modules, CudaDevice};
use ferrograd_core::{DType, Device, Layout, Result, Tensor};
use std::ffi::c_void;
use std::time::Instant;

const CHAIN: usize = 256;
const REPEATS: usize = 41;

/// Median host nanoseconds per call of `f` (called `CHAIN` times between synchronizations).
fn per_call(dev: &CudaDevice, mut f: impl FnMut() -> Result<()>) -> Result<f64> {
    for _ in 0..CHAIN {
        f()?;
    }
    dev.synchronize()?;
    let mut ns = Vec::with_capacity(REPEATS);
    for _ in 0..REPEATS {
        let t = Instant::now();
        for _ in 0..CHAIN {
            f()?;
        }
        ns.push(t.elapsed().as_nanos() as f64 / CHAIN as f64);
        dev.synchronize()?;
    }
    ns.sort_by(|a, b| a.total_cmp(b));
    Ok(ns[REPEATS / 2])
}

#[test]
#[ignore = "profiling tool: run with --ignored --nocapture on a GPU machine"]
fn launch_overhead_breakdown() -> Result<()> {
    let dev = match CudaDevice::get(0) {
        Ok(d) => d,
        Err(e) => {
            println!("skipping: {e}");
            return Ok(());
        }
    };
    let device = Device::Cuda(0);
    let err = |e: result::DriverError| ferrograd_core::Error::Cuda(format!("{e:?}"));
    let n = 1024usize;
    let x = Tensor::ones(n, DType::F32, device)?;
    let y = Tensor::ones(n, DType::F32, device)?;
    let out = Tensor::zeros(n, DType::F32, device)?;
    let (px, py, po) = (x.cuda_ptr()?, y.cuda_ptr()?, out.cuda_ptr()?);
    let binary = dev.load_module(&modules::BINARY)?.load_function("binary_f32").map_err(err)?;
    let fill = dev.load_module(&modules::COPY)?.load_function("fill_b32").map_err(err)?;
    let kl = KLayout::new(&Layout::contiguous(n))?;
    let cfg = cfg_1d(&dev, n);
    let stream = dev.current_cuda_stream().clone();
    let ctx = stream.context().clone();
    let (nn, op, bits) = (n as u64, 0i32, 0u64);
    let mut rows: Vec<(&str, f64)> = Vec::new();

    let mut args: [*mut c_void; 7] = [
        &kl as *const _ as *mut c_void,
        &px as *const _ as *mut c_void,
        &kl as *const _ as *mut c_void,
        &py as *const _ as *mut c_void,
        &po as *const _ as *mut c_void,
        &nn as *const _ as *mut c_void,
        &op as *const _ as *mut c_void,
    ];
    let raw = |f: &cudarc::driver::CudaFunction, args: &mut [*mut c_void]| -> Result<()> {
        // SAFETY: the arguments match the kernels' parameters and address live buffers.
        unsafe { result::launch_kernel(f.cu_function(), cfg.grid_dim, cfg.block_dim, 0, stream.cu_stream(), args) }
            .map_err(err)
    };
    ctx.bind_to_thread().map_err(err)?;
    rows.push(("cuLaunchKernel, binary_f32 (330 B of params)", per_call(&dev, || raw(&binary, &mut args))?));
    let mut fargs: [*mut c_void; 3] =
        [&po as *const _ as *mut c_void, &bits as *const _ as *mut c_void, &nn as *const _ as *mut c_void];
    rows.push(("cuLaunchKernel, fill_b32 (24 B of params)", per_call(&dev, || raw(&fill, &mut fargs))?));
    rows.push((
        "cuCtxGetCurrent + cuLaunchKernel (binary)",
        per_call(&dev, || {
            ctx.bind_to_thread().map_err(err)?;
            raw(&binary, &mut args)
        })?,
    ));
    rows.push((
        "cudarc launch_builder (binary, function resolved)",
        per_call(&dev, || {
            let mut b = stream.launch_builder(&binary);
            b.arg(&kl).arg(&px).arg(&kl).arg(&py).arg(&po).arg(&nn).arg(&op);
            // SAFETY: as above.
            unsafe { b.launch(cfg) }.map(|_| ()).map_err(err)
        })?,
    ));
    rows.push((
        "CudaDevice::launch_raw (lookup by name + launch)",
        per_call(&dev, || {
            // SAFETY: as above.
            unsafe { dev.launch_raw(&modules::BINARY, "binary_f32", cfg.grid_dim.0, 256, 0, &mut args) }
        })?,
    ));
    rows.push(("format! of the kernel name", {
        let t = Instant::now();
        let mut len = 0;
        for _ in 0..100_000 {
            len += std::hint::black_box(format!("binary_{}", DType::F32)).len();
        }
        assert!(len > 0);
        t.elapsed().as_nanos() as f64 / 100_000.0
    }));
    rows.push(("cached alloc + free (4 KiB)", per_call(&dev, || dev.cached_alloc_free(4096))?));
    rows.push(("CudaDevice::synchronize (idle device)", {
        let t = Instant::now();
        for _ in 0..1000 {
            dev.synchronize()?;
        }
        t.elapsed().as_nanos() as f64 / 1000.0
    }));
    let mut chain = x.clone();
    rows.push((
        "x = x.add(&y), whole op",
        per_call(&dev, || {
            chain = chain.add(&y)?;
            Ok(())
        })?,
    ));
    let (cx, cy) = (Tensor::ones(1, DType::F32, Device::Cpu)?, Tensor::ones(1, DType::F32, Device::Cpu)?);
    let mut c = cx.clone();
    rows.push((
        "x = x.add(&y) on the CPU, 1 element (framework)",
        per_call(&dev, || {
            c = c.add(&cy)?;
            Ok(())
        })?,
    ));
    println!("\nhost time per call on {} (median of {REPEATS} chains of {CHAIN}):", dev.info.name);
    for (what, ns) in rows {
        println!("  {what:<52} {:>8.0} ns", ns);
    }
    Ok(())
}
