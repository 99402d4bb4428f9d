"""PyTorch twin of `ferrograd bench guide`: the memory guide's techniques where PyTorch has them.

Each row is a speedup (baseline time / technique time, median host time up to
torch.cuda.synchronize()), named as the guide's rows so that `ferrograd bench guide --torch FILE`
fills its PyTorch column from this script's --json:

- pinned memory        x.to(dev) against x.pin_memory() made once, .to(dev, non_blocking=True)
- memory pooling       torch.empty(1 MiB) (caching allocator) against cudaMalloc+cudaFree
                       (torch.cuda.caching_allocator_alloc is cached too: the raw pair is timed
                       through ctypes on libcudart, when it loads)
- transfer coalescing  100 separate .to(dev) against torch.cat + one .to(dev) + split
- compression          x.to(bfloat16).pin_memory().to(dev, non_blocking=True).float() against the
                       pinned f32 copy
- d2h pinned           pinned.copy_(xd, non_blocking=True) against xd.to("cpu")
- gds reads            safetensors.torch.load_file(file, device="cuda") of a --mib MiB tensor,
                       against torch.load of the same tensor to the CPU then .to(dev) (when
                       safetensors is installed; its GB/s is in the row's extra fields)

    python3 bench/torch_guide.py [--mib 256] [--json FILE]
"""

import argparse
import os
import tempfile
import time

import benchlib as bl

PLAN = dict(warmup=2, min_reps=5, max_reps=15, budget_s=0.8)
SMALL = dict(warmup=5, min_reps=20, max_reps=300, budget_s=0.3)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    bl.common_args(p)
    p.add_argument("--mib", type=int, default=256)
    a = p.parse_args()
    if a.mib < 1:
        bl.fail("--mib must be at least 1")
    torch = bl.import_torch()
    dev = bl.cuda_device(torch, a.device, "guide")
    torch.manual_seed(a.seed)
    sync = torch.cuda.synchronize
    n = a.mib * (1 << 20) // 4
    x = torch.rand(n) * 2 - 1
    rows = []

    def t(fn, plan=PLAN):
        def once():
            t0 = time.perf_counter()
            r = fn()
            sync()
            el = time.perf_counter() - t0
            del r
            return el
        return bl.measure_self_timed(once, **plan)["median_s"]

    def gb(s):
        return n * 4 / s / 1e9

    def add(name, base, tech, **extra):
        rows.append(bl.row(name, base / tech, "x", True, baseline_s=base, technique_s=tech, **extra))

    xp = x.pin_memory()
    pageable = t(lambda: x.to(dev))
    pinned = t(lambda: xp.to(dev, non_blocking=True))
    add("pinned memory", pageable, pinned, pageable_gbps=gb(pageable), pinned_gbps=gb(pinned))

    try:
        import ctypes
        rt = ctypes.CDLL("libcudart.so")
        ptr = ctypes.c_void_p()

        def raw():
            rt.cudaMalloc(ctypes.byref(ptr), ctypes.c_size_t(1 << 20))
            rt.cudaFree(ptr)
        raw_s = t(raw, SMALL)
        cached_s = t(lambda: torch.empty(1 << 18, device=dev), SMALL)
        add("memory pooling", raw_s, cached_s)
    except OSError as e:
        bl.log(f"memory pooling: skipped ({e})")

    smalls = [torch.rand(1024) for _ in range(100)]
    sizes = [s.numel() for s in smalls]
    sep = t(lambda: [s.to(dev) for s in smalls], SMALL)
    one = t(lambda: torch.cat(smalls).to(dev).split(sizes), SMALL)
    add("transfer coalescing", sep, one)

    comp = t(lambda: x.to(torch.bfloat16).pin_memory().to(dev, non_blocking=True).float())
    add("compression", pinned, comp, effective_gbps=gb(comp))

    xd = x.to(dev)
    hp = torch.empty(n, pin_memory=True)
    d2h_pageable = t(lambda: xd.to("cpu"))

    def d2h():
        hp.copy_(xd, non_blocking=True)
    d2h_pinned = t(d2h)
    add("d2h pinned", d2h_pageable, d2h_pinned, pageable_gbps=gb(d2h_pageable), pinned_gbps=gb(d2h_pinned))

    try:
        from safetensors.torch import load_file, save_file
        with tempfile.TemporaryDirectory() as d:
            st = os.path.join(d, "guide.safetensors")
            pt = os.path.join(d, "guide.pt")
            save_file({"x": x}, st)
            torch.save({"x": x}, pt)
            staged = t(lambda: torch.load(pt)["x"].to(dev))
            direct = t(lambda: load_file(st, device=str(dev)))
            add("gds reads", staged, direct, load_file_gbps=gb(direct), staged_gbps=gb(staged))
    except ImportError as e:
        bl.log(f"gds reads: skipped ({e})")

    bl.print_rows(rows)
    rep = bl.report(torch, "guide", dev, "median host time up to torch.cuda.synchronize(); speedup = baseline / "
                    "technique", rows, [f"seed {a.seed}; {a.mib} MiB of f32 uniform in [-1, 1)"])
    bl.finish(rep, a.json)


if __name__ == "__main__":
    main()
