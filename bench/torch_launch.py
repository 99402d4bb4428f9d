#!/usr/bin/env python3
"""PyTorch twin of `ferrograd bench launch`: per-op host overhead of a chain of small adds.

`x = torch.add(x, y)` 10,000 times on 1024-element f32 tensors (inference mode, as ours records no
graph). On CUDA: host time per add while enqueueing (no synchronize inside) and adds per second
including the final torch.cuda.synchronize(); on the CPU: time per add and adds per second.
`--device cuda` reports both devices, `--device cpu` the CPU only. Median of 5 chains after a
warm-up chain, whose result is checked against x0 + ops * y in float64.

    python3 bench/torch_launch.py [--device cuda|cpu] [--ops 10000] [--json FILE]
"""

import argparse
import time

import benchlib as bl


def chain(torch, dev, a):
    x0 = torch.randn(a.elems, device=dev)
    y = torch.randn(a.elems, device=dev)

    def sync():
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)

    def run():
        t0 = time.perf_counter()
        x = x0
        for _ in range(a.ops):
            x = torch.add(x, y)
        enq = time.perf_counter() - t0
        sync()
        return enq, time.perf_counter() - t0, x

    _, _, x = run()
    want = x0.double() + a.ops * y.double()
    bl.require(f"chain of adds on {dev}", bl.rel_err(torch, x, want), 1e-3)
    enq, tot = [], []
    for _ in range(a.repeats):
        e, t, x = run()
        enq.append(e)
        tot.append(t)
    return bl.median(enq), bl.median(tot)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    bl.common_args(p)
    p.add_argument("--ops", type=int, default=10_000)
    p.add_argument("--elems", type=int, default=1024)
    p.add_argument("--repeats", type=int, default=5)
    a = p.parse_args()
    if min(a.ops, a.elems, a.repeats) < 1:
        bl.fail("--ops, --elems and --repeats must be at least 1")

    torch = bl.import_torch()
    dev = bl.any_device(torch, a.device, "launch")
    torch.manual_seed(a.seed)
    bl.log(f"chain of {a.ops} adds x = torch.add(x, y) on {a.elems} f32 elements; median of {a.repeats} chains "
           f"after a warm-up chain; torch {torch.__version__}")
    bl.log("")
    rows = []
    devices = [dev, torch.device("cpu")] if dev.type == "cuda" else [dev]
    with torch.inference_mode():
        for d in devices:
            enq, tot = chain(torch, d, a)
            if d.type == "cuda":
                rows.append(bl.row("cuda: host time per add (enqueue)", enq / a.ops * 1e6, "µs/op", False,
                                   reps=a.repeats))
                rows.append(bl.row("cuda: adds per second (incl. final sync)", a.ops / tot, "ops/s", True,
                                   reps=a.repeats, median_s=tot))
            else:
                rows.append(bl.row("cpu: time per add", enq / a.ops * 1e6, "µs/op", False, reps=a.repeats))
                rows.append(bl.row("cpu: adds per second", a.ops / tot, "ops/s", True, reps=a.repeats, median_s=tot))
    bl.print_rows(rows)
    rep = bl.report(torch, "launch", dev, "host clock around the chain (enqueue) and around the chain plus "
                    "torch.cuda.synchronize() (total); medians", rows,
                    [f"{a.ops} adds per chain on {a.elems} f32 elements; seed {a.seed}; torch.inference_mode()"])
    bl.finish(rep, a.json)


if __name__ == "__main__":
    main()
