#!/usr/bin/env python3
"""PyTorch twin of `ferrograd bench optim`: one torch.optim.Adam(fused=True) step over the same
100 f32 tensors (sizes cycling 4 Ki, 64 Ki, 256 Ki, 1 Mi elements; 34 M parameters), timed with
CUDA events, median per step (benchlib.time_device, as ours).

    python3 bench/torch_optim.py [--tensors 100] [--json FILE]
"""

import argparse

import benchlib as bl

SIZES = [4 << 10, 64 << 10, 256 << 10, 1 << 20]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    bl.common_args(p)
    p.add_argument("--tensors", type=int, default=100)
    a = p.parse_args()
    if a.tensors < 1:
        bl.fail("--tensors must be at least 1")
    torch = bl.import_torch()
    dev = bl.cuda_device(torch, a.device, "optim")
    torch.manual_seed(a.seed)
    params = [torch.randn(SIZES[i % len(SIZES)], device=dev, requires_grad=True) for i in range(a.tensors)]
    for q in params:
        q.grad = torch.randn_like(q)
    opt = torch.optim.Adam(params, lr=1e-3, fused=True)
    total = sum(q.numel() for q in params)
    bl.log(f"Adam step over {a.tensors} f32 tensors ({total / 1e6:.1f} M parameters) on {dev}, torch {torch.__version__}")
    t = bl.time_device(torch, opt.step, cuda=True)
    rows = [
        bl.row(f"adam step, {a.tensors} tensors", t["median_s"] * 1e6, "µs", False, median_s=t["median_s"],
               reps=t["reps"]),
        bl.row(f"adam bandwidth, {a.tensors} tensors", 7 * 4 * total / t["median_s"] / 1e9, "GB/s", True),
    ]
    bl.print_rows(rows)
    rep = bl.report(torch, "optim", dev, "CUDA events around each step; median per step", rows,
                    [f"torch.optim.Adam(fused=True); sizes cycle {SIZES}; {total} parameters"])
    bl.finish(rep, a.json)


if __name__ == "__main__":
    main()
