#!/usr/bin/env python3
"""PyTorch twin of `ferrograd bench alloc`: allocate and free 64 MiB of device memory.

- cached allocate+free   torch.empty(n, dtype=torch.uint8, device=dev); del   (PyTorch's caching
                         allocator; ours: CudaDevice::cached_alloc_free)
- raw driver allocate+free  cuMemAlloc_v2 + cuMemFree_v2 called through ctypes on libcuda.so.1,
                         in the primary context PyTorch made current: the same two driver calls
                         ours makes (CudaDevice::raw_alloc_free). The ctypes call costs well under
                         a microsecond against ~100 µs of driver work. Not
                         torch.cuda.caching_allocator_alloc: that goes through the cache.
- uncached allocate+free (PyTorch only)  torch.empty + del + torch.cuda.empty_cache(): what a
                         PyTorch allocation costs when the cache cannot serve it.

Same timing as ours: host clock (these calls enqueue no device work), batches of calls, median
per call over batches after warm-up (benchlib.time_device with cuda=False).

    python3 bench/torch_alloc.py [--mib 64] [--json FILE]
"""

import argparse
import ctypes

import benchlib as bl

CACHED = bl.DevicePlan(warmup=100, min_reps=50, max_reps=2000, budget_s=0.3, target_batch_s=100e-6, max_inner=100)
RAW = bl.DevicePlan(warmup=5, min_reps=30, max_reps=1000, budget_s=0.5, target_batch_s=100e-6, max_inner=100)


class Driver:
    """The two driver calls, checked."""

    def __init__(self):
        try:
            self.lib = ctypes.CDLL("libcuda.so.1")
        except OSError as e:
            bl.fail(f"cannot load libcuda.so.1 for the raw driver allocation ({e})")
        self.alloc = self.lib.cuMemAlloc_v2
        self.alloc.argtypes = [ctypes.POINTER(ctypes.c_uint64), ctypes.c_size_t]
        self.alloc.restype = ctypes.c_int
        self.free = self.lib.cuMemFree_v2
        self.free.argtypes = [ctypes.c_uint64]
        self.free.restype = ctypes.c_int
        ctx = ctypes.c_void_p()
        rc = self.lib.cuCtxGetCurrent(ctypes.byref(ctx))
        if rc != 0 or not ctx.value:
            bl.fail(f"no current CUDA context for the raw driver allocation (cuCtxGetCurrent returned {rc})")
        self.ptr = ctypes.c_uint64()

    def alloc_free(self, nbytes: int) -> None:
        rc = self.alloc(ctypes.byref(self.ptr), nbytes)
        if rc != 0:
            bl.fail(f"cuMemAlloc_v2({nbytes}) returned CUresult {rc}")
        rc = self.free(self.ptr.value)
        if rc != 0:
            bl.fail(f"cuMemFree_v2 returned CUresult {rc}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    bl.common_args(p)
    p.add_argument("--mib", type=int, default=64)
    a = p.parse_args()
    if a.mib < 1:
        bl.fail("--mib must be at least 1")

    torch = bl.import_torch()
    dev = bl.cuda_device(torch, a.device, "alloc")
    nbytes = a.mib << 20
    torch.empty(1, device=dev)  # creates the context and makes it current on this thread
    torch.cuda.synchronize()
    bl.log(f"allocate + free {a.mib} MiB on {dev} ({torch.cuda.get_device_name(dev)}), torch {torch.__version__}")
    bl.log("host clock, batches of calls, median per call after warm-up")
    bl.log("")

    def cached():
        t = torch.empty(nbytes, dtype=torch.uint8, device=dev)
        del t

    def uncached():
        t = torch.empty(nbytes, dtype=torch.uint8, device=dev)
        del t
        torch.cuda.empty_cache()

    drv = Driver()
    # segment.all.allocated counts cudaMalloc calls; warm-up makes the one the timed calls reuse.
    before = torch.cuda.memory_stats(dev).get("segment.all.allocated", 0)
    tc = bl.time_device(torch, cached, cuda=False, plan=CACHED)
    after = torch.cuda.memory_stats(dev).get("segment.all.allocated", 0)
    driver_allocs = max(0, after - before - 1)
    tr = bl.time_device(torch, lambda: drv.alloc_free(nbytes), cuda=False, plan=RAW)
    tu = bl.time_device(torch, uncached, cuda=False, plan=RAW)

    def r(name, t, **kw):
        return bl.row(name, t["median_s"] * 1e6, "µs", False, median_s=t["median_s"], min_s=t["min_s"],
                      reps=t["reps"], inner=t["inner"], **kw)

    rows = [
        r(f"cached allocate+free {a.mib} MiB", tc, driver_allocs_while_timed=driver_allocs),
        r(f"raw driver allocate+free {a.mib} MiB", tr),
        r(f"uncached allocate+free {a.mib} MiB (empty + del + empty_cache)", tu),
    ]
    bl.print_rows(rows)
    bl.log(f"\ncached path: {driver_allocs} driver allocations during the timed calls; "
           f"raw/cached = {tr['median_s'] / tc['median_s']:.0f}x")
    rep = bl.report(torch, "alloc", dev, "host clock; batches of calls; median per call after warm-up", rows,
                    ["raw driver = cuMemAlloc_v2 + cuMemFree_v2 through ctypes on libcuda.so.1, bypassing every cache",
                     "cached = torch.empty(uint8) + del through PyTorch's CUDA caching allocator"])
    bl.finish(rep, a.json)


if __name__ == "__main__":
    main()
