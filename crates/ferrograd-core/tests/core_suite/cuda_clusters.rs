//! `CudaDevice::launch_cooperative_cluster_raw` on a GPU (sm_90 and later; skipped elsewhere): a
//! cooperative launch of thread-block clusters at the persistent kernel's shape (512 threads, 154
//! KiB of dynamic shared memory, one block an SM), where every block reads its cluster
//! neighbour's shared memory (DSMEM) and the whole grid passes grid barriers. The values prove
//! the cluster layout (rank, neighbour, which block it is), and the barriers' spin limit proves
//! co-residency without ever hanging.

use crate::common;

use ferrograd_core::cuda::modules::Module;
use ferrograd_core::cuda::CudaDevice;
use ferrograd_core::{DType, Device, Result, Tensor};
use std::ffi::c_void;

const PROBE: Module = Module::new(
    "cluster_probe_test",
    r#"
extern "C" __global__ void __launch_bounds__(512, 1)
cluster_probe(float* out, unsigned* bar, unsigned* bad, int iters) {
  extern __shared__ float sm[];
  unsigned rank, csize;
  asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(rank));
  asm volatile("mov.u32 %0, %%cluster_nctarank;" : "=r"(csize));
  const unsigned tid = threadIdx.x, peer = (rank + 1) % csize;
  unsigned target = 0;
  float got = -1.f;
  for (int it = 0; it < iters; ++it) {
    sm[tid] = (float)(blockIdx.x * 1024 + tid + it);
    asm volatile("barrier.cluster.arrive.release.aligned;\nbarrier.cluster.wait.acquire.aligned;\n" ::: "memory");
    unsigned raddr;
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;"
                 : "=r"(raddr) : "r"((unsigned)__cvta_generic_to_shared(&sm[tid])), "r"(peer));
    asm volatile("ld.shared::cluster.f32 %0, [%1];" : "=f"(got) : "r"(raddr) : "memory");
    asm volatile("barrier.cluster.arrive.release.aligned;\nbarrier.cluster.wait.acquire.aligned;\n" ::: "memory");
    __syncthreads();
    target += gridDim.x;
    if (tid == 0) {
      asm volatile("red.release.gpu.global.add.u32 [%0], 1;" ::"l"(bar) : "memory");
      unsigned v, n = 0;
      do {
        asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(bar) : "memory");
      } while ((int)(v - target) < 0 && ++n < (1u << 22));
      if (n >= (1u << 22)) atomicAdd(bad, 1u);
    }
    __syncthreads();
  }
  out[blockIdx.x * 512 + tid] = got;
  if (tid == 0) out[gridDim.x * 512 + blockIdx.x] = (float)rank;
}
"#,
);

#[test]
fn cooperative_clusters_share_shared_memory_and_pass_grid_barriers() -> Result<()> {
    let Some(dev) = common::cuda_device() else { return Ok(()) };
    if dev.info.compute_capability.0 < 9 || !dev.supports_cooperative_launch()? {
        println!("skipping: clusters need sm_90 and cooperative launch");
        return Ok(());
    }
    let sms = dev.info.multiprocessors.max(1) as u32;
    let (iters, smem) = (50i32, 154u32 * 1024);
    for cluster in [1u32, 2, 4, 8, 16] {
        // How many clusters fit at once depends on the chip (its GPCs' SM counts differ from one
        // H100 to the next): start from one block an SM and drop a cluster at a time while the
        // driver answers COOPERATIVE_LAUNCH_TOO_LARGE.
        let mut grid = sms / cluster * cluster;
        let out = loop {
            match run(&dev, grid, cluster, iters, smem) {
                Ok(out) => break out,
                Err(e) if e.to_string().contains("COOPERATIVE_LAUNCH_TOO_LARGE") && grid > cluster => grid -= cluster,
                Err(e) => return Err(e),
            }
        };
        assert!(grid * 2 >= sms, "cluster {cluster}: only {grid} of {sms} blocks co-resident");
        let (got, bad) = out;
        assert_eq!(bad, 0, "cluster {cluster}: a grid barrier gave up (blocks not co-resident)");
        for b in 0..grid {
            let rank = b % cluster;
            assert_eq!(got[grid as usize * 512 + b as usize], rank as f32, "cluster {cluster}: block {b}'s rank");
            let peer_block = b - rank + (rank + 1) % cluster;
            for t in [0u32, 1, 255, 511] {
                let want = (peer_block * 1024 + t) as f32 + (iters - 1) as f32;
                assert_eq!(got[(b * 512 + t) as usize], want, "cluster {cluster}: block {b} thread {t}");
            }
        }
        println!(
            "clusters of {cluster}: {grid} blocks co-resident ({} clusters), DSMEM and grid barriers right",
            grid / cluster
        );
    }
    // A shape the driver never sees.
    let mut none: Vec<*mut c_void> = vec![];
    // SAFETY: rejected before any launch.
    let e = unsafe { dev.launch_cooperative_cluster_raw(&PROBE, "cluster_probe", 132, 8, 512, smem, &mut none) };
    assert!(e.is_err_and(|e| e.to_string().contains("multiple")));
    Ok(())
}

/// One cooperative cluster launch of the probe: what every thread read from its neighbour (and
/// each block's rank after them), and how many grid barriers gave up.
fn run(dev: &CudaDevice, grid: u32, cluster: u32, iters: i32, smem: u32) -> Result<(Vec<f32>, u32)> {
    let n = grid as usize * 513;
    // Poisoned outputs: NaN where the kernel must write.
    let out = Tensor::full(f64::NAN, n, DType::F32, Device::Cuda(0))?;
    let bar = Tensor::zeros(1, DType::U32, Device::Cuda(0))?;
    let bad = Tensor::zeros(1, DType::U32, Device::Cuda(0))?;
    let (mut po, mut pb, mut pbad, mut it) = (out.cuda_ptr()?, bar.cuda_ptr()?, bad.cuda_ptr()?, iters);
    let mut args: Vec<*mut c_void> = vec![
        &mut po as *mut _ as *mut c_void,
        &mut pb as *mut _ as *mut c_void,
        &mut pbad as *mut _ as *mut c_void,
        &mut it as *mut _ as *mut c_void,
    ];
    // SAFETY: four arguments of the kernel's types; out holds grid x 513 floats, bar and bad one u32.
    unsafe { dev.launch_cooperative_cluster_raw(&PROBE, "cluster_probe", grid, cluster, 512, smem, &mut args)? };
    dev.synchronize()?;
    Ok((out.to_vec::<f32>()?, bad.to_vec::<u32>()?[0]))
}
