"""Can a cooperative (persistent) launch use thread-block clusters on this GPU, and what do the
synchronizations cost? Groundwork for issue 14 (bench/kernels: experiments beside the kernels).

The persistent Monster Walk kernel spends ~7 of its ~24 us a step between blocks: grid barriers
through L2 and reduce-scatters of 132 partial gradient rows (BENCHMARKS.md, 2026-11-24 twelfth
session). Clusters would let 2-16 SMs pre-sum their partials over distributed shared memory and
share one refresh. Before designing that kernel, this probe measures, with the driver API only
(ctypes, NVRTC; no PyTorch):

  1. cuOccupancyMaxActiveClusters for cluster sizes 1-16 at the kernel's shape (512 threads, the
     given dynamic shared memory). On the H100 of 2026-11-24 it answered 0 (no error) for every
     size, so the probe then launches one block per SM (rounded down to whole clusters) anyway:
     a cooperative launch is refused when its blocks cannot all be resident;
  2. whether cuLaunchKernelEx accepts CU_LAUNCH_ATTRIBUTE_COOPERATIVE together with a cluster
     dimension, and a grid of every resident cluster then runs to the end (a grid barrier that
     would hang if a block were not resident: bounded by a spin limit, so it reports, not hangs);
  3. per iteration, with clock64 on every block: a cluster barrier (barrier.cluster arrive.release
     / wait.acquire), a read of the next block's shared memory through mapa + ld.shared::cluster
     (checked against the value that block wrote), and a grid barrier (red.release.gpu + polling
     ld.acquire.gpu, as mlp_persistent.cu's grid_sync).

    python3 bench/kernels/cluster_probe.py [--smem-kib 154] [--iters 2000]

Prints one line per cluster size and a verdict; exit status 0 when every launched size ran and
checked out.
"""
import argparse
import ctypes
import os
import sys

SRC = r"""
extern "C" __global__ void __launch_bounds__(512, 1)
probe(unsigned* bar, unsigned long long* out, unsigned* bad, int iters, unsigned spin_limit) {
  extern __shared__ float sm[];
  unsigned rank, csize;
  asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(rank));
  asm volatile("mov.u32 %0, %%cluster_nctarank;" : "=r"(csize));
  const unsigned tid = threadIdx.x, G = gridDim.x;
  unsigned target = 0;
  unsigned long long t_cl = 0, t_rd = 0, t_gb = 0;
  for (int it = 0; it < iters; ++it) {
    sm[tid] = (float)(blockIdx.x * 1024 + (it & 255) + tid);
    unsigned long long c0 = clock64();
    asm volatile("barrier.cluster.arrive.release.aligned;\nbarrier.cluster.wait.acquire.aligned;\n" ::: "memory");
    unsigned long long c1 = clock64();
    const unsigned peer = (rank + 1) % csize;
    unsigned laddr = (unsigned)__cvta_generic_to_shared(&sm[tid]), raddr;
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(raddr) : "r"(laddr), "r"(peer));
    float v;
    asm volatile("ld.shared::cluster.f32 %0, [%1];" : "=f"(v) : "r"(raddr) : "memory");
    const unsigned peer_block = blockIdx.x - rank + peer;
    if (v != (float)(peer_block * 1024 + (it & 255) + tid)) atomicAdd(bad, 1u);
    // The peer must not overwrite sm[] before every block of the cluster has read it.
    asm volatile("barrier.cluster.arrive.release.aligned;\nbarrier.cluster.wait.acquire.aligned;\n" ::: "memory");
    unsigned long long c2 = clock64();
    __syncthreads();
    target += G;
    if (tid == 0) {
      asm volatile("red.release.gpu.global.add.u32 [%0], 1;" ::"l"(bar) : "memory");
      unsigned n = 0, v2;
      do {
        asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v2) : "l"(bar) : "memory");
      } while ((int)(v2 - target) < 0 && ++n < spin_limit);
      if (n >= spin_limit) atomicAdd(bad + 1, 1u);
    }
    __syncthreads();
    unsigned long long c3 = clock64();
    t_cl += c1 - c0;
    t_rd += c2 - c1;
    t_gb += c3 - c2;
  }
  if (tid == 0) {
    out[3 * blockIdx.x + 0] = t_cl;
    out[3 * blockIdx.x + 1] = t_rd;
    out[3 * blockIdx.x + 2] = t_gb;
  }
}
"""


def lib(names):
    for n in names:
        try:
            return ctypes.CDLL(n)
        except OSError:
            continue
    sys.exit("not found: " + ", ".join(names))


cuda = lib(["libcuda.so.1", "libcuda.so"])
nvrtc = lib(
    ["libnvrtc.so", "libnvrtc.so.13", "libnvrtc.so.12"]
    + [os.path.join(d, "libnvrtc.so") for d in ("/usr/local/cuda/lib64", "/usr/local/cuda/targets/x86_64-linux/lib")]
)


def ck(r, what):
    if r != 0:
        s = ctypes.c_char_p()
        cuda.cuGetErrorString(r, ctypes.byref(s))
        raise RuntimeError(f"{what}: error {r} ({s.value.decode() if s.value else '?'})")


class Attr(ctypes.Structure):  # CUlaunchAttribute: id, pad to 8, a 64-byte value union
    _fields_ = [("id", ctypes.c_uint), ("pad", ctypes.c_char * 4), ("value", ctypes.c_char * 64)]


class Config(ctypes.Structure):  # CUlaunchConfig
    _fields_ = [("gx", ctypes.c_uint), ("gy", ctypes.c_uint), ("gz", ctypes.c_uint), ("bx", ctypes.c_uint),
                ("by", ctypes.c_uint), ("bz", ctypes.c_uint), ("smem", ctypes.c_uint), ("stream", ctypes.c_void_p),
                ("attrs", ctypes.POINTER(Attr)), ("nattrs", ctypes.c_uint)]


ATTR_COOPERATIVE, ATTR_CLUSTER_DIM = 2, 4
FUNC_MAX_DYN_SMEM, FUNC_NON_PORTABLE_CLUSTER = 8, 14


def attrs(cluster, coop):
    a = (Attr * 2)()
    a[0].id = ATTR_CLUSTER_DIM
    ctypes.memmove(a[0].value, (ctypes.c_uint * 3)(cluster, 1, 1), 12)
    a[1].id = ATTR_COOPERATIVE
    ctypes.memmove(a[1].value, ctypes.byref(ctypes.c_int(1 if coop else 0)), 4)
    return a


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--smem-kib", type=int, default=154, help="dynamic shared memory a block (the kernel's 154 KiB)")
    ap.add_argument("--iters", type=int, default=2000)
    a = ap.parse_args()
    ck(cuda.cuInit(0), "cuInit")
    dev = ctypes.c_int()
    ck(cuda.cuDeviceGet(ctypes.byref(dev), 0), "cuDeviceGet")
    ctx = ctypes.c_void_p()
    ck(cuda.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev), "retain")
    ck(cuda.cuCtxSetCurrent(ctx), "set current")
    name = ctypes.create_string_buffer(128)
    cuda.cuDeviceGetName(name, 128, dev)
    sms, clk = ctypes.c_int(), ctypes.c_int()
    cuda.cuDeviceGetAttribute(ctypes.byref(sms), 16, dev)  # MULTIPROCESSOR_COUNT
    cuda.cuDeviceGetAttribute(ctypes.byref(clk), 13, dev)  # CLOCK_RATE, kHz
    print(f"{name.value.decode()}: {sms.value} SMs, {clk.value / 1e6:.2f} GHz max; 512 threads, {a.smem_kib} KiB a block")

    prog = ctypes.c_void_p()
    assert nvrtc.nvrtcCreateProgram(ctypes.byref(prog), SRC.encode(), b"probe.cu", 0, None, None) == 0
    opts = (ctypes.c_char_p * 2)(b"--gpu-architecture=sm_90", b"-std=c++17")
    if nvrtc.nvrtcCompileProgram(prog, 2, opts) != 0:
        n = ctypes.c_size_t()
        nvrtc.nvrtcGetProgramLogSize(prog, ctypes.byref(n))
        log = ctypes.create_string_buffer(n.value)
        nvrtc.nvrtcGetProgramLog(prog, log)
        sys.exit(log.value.decode())
    n = ctypes.c_size_t()
    nvrtc.nvrtcGetCUBINSize(prog, ctypes.byref(n))
    cubin = ctypes.create_string_buffer(n.value)
    nvrtc.nvrtcGetCUBIN(prog, cubin)
    mod, fn = ctypes.c_void_p(), ctypes.c_void_p()
    ck(cuda.cuModuleLoadData(ctypes.byref(mod), cubin), "module")
    ck(cuda.cuModuleGetFunction(ctypes.byref(fn), mod, b"probe"), "function")
    smem = a.smem_kib * 1024
    ck(cuda.cuFuncSetAttribute(fn, FUNC_MAX_DYN_SMEM, smem), "max dynamic smem")
    ck(cuda.cuFuncSetAttribute(fn, FUNC_NON_PORTABLE_CLUSTER, 1), "non-portable clusters")

    ok, launched = True, 0
    base_gb = None
    for cs in (1, 2, 4, 8, 16):
        at = attrs(cs, False)
        cfg = Config(cs, 1, 1, 512, 1, 1, smem, None, at, 1)
        nc = ctypes.c_int()
        r = cuda.cuOccupancyMaxActiveClusters(ctypes.byref(nc), fn, ctypes.byref(cfg))
        if r != 0 or nc.value == 0:
            # Say so, then try a grid of one block an SM anyway: the launch's own answer is the fact.
            print(f"cluster {cs:2d}: cuOccupancyMaxActiveClusters answered {nc.value} clusters (error {r}); "
                  f"launching {sms.value // cs} clusters anyway (a cooperative launch is refused if not all fit)")
            nc.value = sms.value // cs
        G = nc.value * cs
        bar, out, bad = ctypes.c_uint64(), ctypes.c_uint64(), ctypes.c_uint64()
        ck(cuda.cuMemAlloc_v2(ctypes.byref(bar), 4), "alloc")
        ck(cuda.cuMemAlloc_v2(ctypes.byref(out), 24 * G), "alloc")
        ck(cuda.cuMemAlloc_v2(ctypes.byref(bad), 8), "alloc")
        cuda.cuMemsetD8_v2(bar, 0, 4)
        cuda.cuMemsetD8_v2(bad, 0, 8)
        at = attrs(cs, True)
        cfg = Config(G, 1, 1, 512, 1, 1, smem, None, at, 2)
        args = [ctypes.c_uint64(bar.value), ctypes.c_uint64(out.value), ctypes.c_uint64(bad.value),
                ctypes.c_int(a.iters), ctypes.c_uint(1 << 14)]
        params = (ctypes.c_void_p * len(args))(*[ctypes.cast(ctypes.byref(x), ctypes.c_void_p) for x in args])
        r = cuda.cuLaunchKernelEx(ctypes.byref(cfg), fn, params, None)
        if r != 0:
            s = ctypes.c_char_p()
            cuda.cuGetErrorString(r, ctypes.byref(s))
            print(f"cluster {cs:2d}: {nc.value} clusters = {G} blocks resident; cooperative cluster launch refused: "
                  f"error {r} ({s.value.decode() if s.value else '?'})")
            ok = False
            continue
        ck(cuda.cuCtxSynchronize(), "synchronize")
        launched += 1
        host = (ctypes.c_uint64 * (3 * G))()
        cuda.cuMemcpyDtoH_v2(host, out, 24 * G)
        hb = (ctypes.c_uint * 2)()
        cuda.cuMemcpyDtoH_v2(hb, bad, 8)
        ghz = clk.value / 1e6
        per = [sum(host[3 * b + k] for b in range(G)) / G / a.iters / ghz / 1000 for k in range(3)]
        good = hb[0] == 0 and hb[1] == 0
        ok &= good
        if cs == 1:
            base_gb = per[2]
        print(f"cluster {cs:2d}: {nc.value:3d} clusters = {G:3d} blocks resident; cooperative launch ran; "
              f"per iteration (us, mean block, at the max clock): cluster barrier {per[0]:.3f}, "
              f"DSMEM read + cluster barrier {per[1]:.3f}, grid barrier {per[2]:.3f}; "
              f"{'DSMEM values right' if hb[0] == 0 else f'{hb[0]} WRONG DSMEM values'}"
              f"{'' if hb[1] == 0 else f', grid barrier gave up {hb[1]} times (blocks not co-resident)'}")
        for p in (bar, out, bad):
            cuda.cuMemFree_v2(p)
    ok &= launched > 0
    print("verdict:", "every launched cluster size ran cooperatively and checked out" if ok else "see the lines above")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
