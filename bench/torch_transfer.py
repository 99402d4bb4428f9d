#!/usr/bin/env python3
"""PyTorch twin of `ferrograd bench transfer`: host <-> device copies.

Same work and timing as ours: host clock around the copy and torch.cuda.synchronize(), the
destination's allocation inside the timed part and its release outside, median over repetitions
after warm-up, GB/s decimal. f32 uniform in [-1, 1), never zeros; every path checked once for a
bit-exact round trip.

- h2d pageable  x.to(dev)                              (ours: Tensor::to_device, staged)
- h2d pinned    x.pin_memory() -> .to(dev, non_blocking=True)   (ours: pin_memory + to_device)
- d2h pageable  xd.to("cpu")                            (ours: to_device(Device::Cpu))
- d2h pinned    pinned.copy_(xd, non_blocking=True)     (ours: copy_to_pinned_async into Tensor::empty_pinned)
- h2d compressed bf16  x.to(torch.bfloat16).pin_memory().to(dev, non_blocking=True).float()
                (ours: to_device_compressed(dev, BF16): narrow into pinned memory, pipelined; GB/s of f32)
- d2d           xd.to("cuda:1") where a second GPU exists   (ours: to_device(Device::Cuda(1)), peer to peer)
- 100 x 4 KiB: 100 separate .to(dev), against torch.cat + one .to(dev) + split (ours:
  Tensor::to_device_many, which packs into pinned memory and makes one copy)

    python3 bench/torch_transfer.py [--mib 256] [--count 100] [--kib 4] [--json FILE]
"""

import argparse
import time

import benchlib as bl

BIG = dict(warmup=2, min_reps=10, max_reps=30, budget_s=1.5)
SMALL = dict(warmup=5, min_reps=20, max_reps=500, budget_s=0.4)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    bl.common_args(p)
    p.add_argument("--mib", type=int, default=256)
    p.add_argument("--count", type=int, default=100)
    p.add_argument("--kib", type=int, default=4)
    a = p.parse_args()
    if min(a.mib, a.count, a.kib) < 1:
        bl.fail("--mib, --count and --kib must be at least 1")

    torch = bl.import_torch()
    dev = bl.cuda_device(torch, a.device, "transfer")
    torch.manual_seed(a.seed)
    sync = torch.cuda.synchronize
    bl.log(f"host <-> device copies on {dev} ({torch.cuda.get_device_name(dev)}), torch {torch.__version__}")
    bl.log("host clock around the copy and torch.cuda.synchronize(); median after warm-up; GB/s = 1e9 B/s")
    bl.log("")

    n = a.mib * (1 << 20) // 4
    nbytes = n * 4
    x = torch.rand(n) * 2 - 1
    rows = []

    def same(what, got, want):
        if not torch.equal(got.cpu(), want):
            bl.fail(f"{what}: the data that arrived differs from what was sent")

    def timed(make):
        def once():
            t0 = time.perf_counter()
            r = make()
            sync()
            el = time.perf_counter() - t0
            del r
            return el
        return once

    def gbps(name, t):
        rows.append(bl.row(name, nbytes / t["median_s"] / 1e9, "GB/s", True, median_s=t["median_s"], reps=t["reps"]))

    same("h2d pageable", x.to(dev), x)
    gbps(f"h2d pageable {a.mib} MiB", bl.measure_self_timed(timed(lambda: x.to(dev)), **BIG))

    xp = x.pin_memory()
    same("h2d pinned", xp.to(dev, non_blocking=True), x)
    gbps(f"h2d pinned {a.mib} MiB", bl.measure_self_timed(timed(lambda: xp.to(dev, non_blocking=True)), **BIG))

    xd = x.to(dev)
    sync()
    same("d2h pageable", xd.to("cpu"), x)
    gbps(f"d2h pageable {a.mib} MiB", bl.measure_self_timed(timed(lambda: xd.to("cpu")), **BIG))

    hp = torch.empty(n, pin_memory=True)
    hp.copy_(xd, non_blocking=True)
    sync()
    same("d2h pinned", hp, x)

    def d2h_pinned():
        hp.copy_(xd, non_blocking=True)
        return None
    gbps(f"d2h pinned {a.mib} MiB", bl.measure_self_timed(timed(d2h_pinned), **BIG))

    def compressed():
        return x.to(torch.bfloat16).pin_memory().to(dev, non_blocking=True).float()
    same("h2d compressed bf16", compressed(), x.to(torch.bfloat16).float())
    gbps(f"h2d compressed bf16 {a.mib} MiB (effective)", bl.measure_self_timed(timed(compressed), **BIG))

    # GPU to GPU (ours: Tensor::to_device(Device::Cuda(j)), peer to peer where the pair allows).
    if torch.cuda.device_count() > 1:
        other = torch.device("cuda", (dev.index + 1) % torch.cuda.device_count())
        same(f"d2d {dev}->{other}", xd.to(other), x)

        def d2d():
            t0 = time.perf_counter()
            r = xd.to(other)
            torch.cuda.synchronize(dev)
            torch.cuda.synchronize(other)
            el = time.perf_counter() - t0
            del r
            return el
        peer = torch.cuda.can_device_access_peer(dev.index, other.index)
        t = bl.measure_self_timed(d2d, **BIG)
        rows.append(bl.row(f"d2d {dev}->{other} {a.mib} MiB", nbytes / t["median_s"] / 1e9, "GB/s", True,
                           median_s=t["median_s"], reps=t["reps"], peer_access=peer))
    del xp, xd, hp, x

    elems = a.kib * 1024 // 4
    smalls = [torch.rand(elems) * 2 - 1 for _ in range(a.count)]
    sizes = [t.numel() for t in smalls]
    for t, s in zip(smalls, [t.to(dev) for t in smalls]):
        same("separate small copies", s, t)
    for t, s in zip(smalls, torch.cat(smalls).to(dev).split(sizes)):
        same("coalesced copy", s, t)
    label = f"{a.count} x {a.kib} KiB h2d"
    t = bl.measure_self_timed(timed(lambda: [s.to(dev) for s in smalls]), **SMALL)
    rows.append(bl.row(f"{label}: separate copies", t["median_s"] * 1e6, "µs", False, median_s=t["median_s"],
                       reps=t["reps"]))
    t = bl.measure_self_timed(timed(lambda: torch.cat(smalls).to(dev).split(sizes)), **SMALL)
    rows.append(bl.row(f"{label}: one coalesced copy", t["median_s"] * 1e6, "µs", False, median_s=t["median_s"],
                       reps=t["reps"]))

    bl.print_rows(rows)
    rep = bl.report(torch, "transfer", dev, "host clock around the copy plus torch.cuda.synchronize(); median of "
                    "repetitions after warm-up", rows,
                    ["one coalesced copy = torch.cat (host) + one pageable .to(dev) + split (views)",
                     f"seed {a.seed}; f32 uniform in [-1, 1); every path checked bit-exact once"])
    bl.finish(rep, a.json)


if __name__ == "__main__":
    main()
