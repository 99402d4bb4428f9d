#!/usr/bin/env python3
"""PyTorch twin of `ferrograd bench predictor`: the latency of one inference call of a 3-layer MLP
(width 512, ReLU, f32) at batch 1 and 32, eager and replayed as a CUDA graph.

One call is what `ferrograd_core::cuda::Predictor` does: the input from a pinned host tensor into
a fixed device buffer (`copy_(non_blocking=True)`), the forward (eager, or `graph.replay()` of a
`torch.cuda.CUDAGraph` captured on that buffer after warm-up on a side stream, as the PyTorch docs
show), the output into a pinned host tensor (`non_blocking=True`), one `torch.cuda.synchronize()`.
Same model shape (nn.Sequential of nn.Linear / nn.ReLU, PyTorch's default init from --seed), same
row names (`eager B=1`, `graph B=32`), p50 and p99 of the host wall time per call over --calls
calls after a tenth as many warm-up calls; TF32 off (ferrograd's f32 matmuls are exact f32).
Checks: both modes against the eager forward before timing.

    python3 bench/predictor_torch.py [--batches 1,32] [--calls 5000] [--json FILE]
"""

import argparse
import time

import benchlib as bl


def quantile(sorted_xs, q):
    i = min(max(int(-(-q * len(sorted_xs) // 1)), 1), len(sorted_xs)) - 1
    return sorted_xs[i]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    bl.common_args(p)
    p.add_argument("--width", type=int, default=512)
    p.add_argument("--layers", type=int, default=3)
    p.add_argument("--batches", type=bl.csv_ints, default=[1, 32])
    p.add_argument("--calls", type=int, default=5000)
    a = p.parse_args()
    torch = bl.import_torch()
    dev = bl.cuda_device(torch, a.device, "predictor")
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.manual_seed(a.seed)
    layers = []
    for i in range(a.layers):
        layers.append(torch.nn.Linear(a.width, a.width))
        if i + 1 < a.layers:
            layers.append(torch.nn.ReLU())
    model = torch.nn.Sequential(*layers).to(dev).eval()
    bl.log(f"predictor (torch {torch.__version__}): MLP {a.layers} layers x {a.width} (ReLU, f32) on {dev}; "
           f"{a.calls} calls after {a.calls // 10} warm-up")
    bl.log(f"{'what':<12} | {'p50 µs':>10} | {'p99 µs':>10} | {'mean µs':>10}")
    rows = []
    with torch.inference_mode():
        for batch in a.batches:
            x = torch.randn(batch, a.width)
            want = model(x.to(dev)).cpu()
            host_in = torch.empty(batch, a.width).pin_memory()
            host_out = torch.empty(batch, a.width).pin_memory()
            host_in.copy_(x)
            static_in = torch.full((batch, a.width), 0.5, device=dev)
            for mode in ("eager", "graph"):
                if mode == "graph":
                    s = torch.cuda.Stream()
                    s.wait_stream(torch.cuda.current_stream())
                    with torch.cuda.stream(s):
                        for _ in range(3):
                            model(static_in)
                    torch.cuda.current_stream().wait_stream(s)
                    g = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(g):
                        static_out = model(static_in)

                    def call():
                        static_in.copy_(host_in, non_blocking=True)
                        g.replay()
                        host_out.copy_(static_out, non_blocking=True)
                        torch.cuda.synchronize()
                else:
                    def call():
                        static_in.copy_(host_in, non_blocking=True)
                        y = model(static_in)
                        host_out.copy_(y, non_blocking=True)
                        torch.cuda.synchronize()
                call()
                err = ((host_out - want).abs() / (1 + want.abs())).max().item()
                bl.require(f"{mode} B={batch}", err, 1e-4)
                for _ in range(a.calls // 10):
                    call()
                t = []
                for _ in range(a.calls):
                    s0 = time.perf_counter()
                    call()
                    t.append(time.perf_counter() - s0)
                t.sort()
                p50, p99, mean = quantile(t, 0.5), quantile(t, 0.99), sum(t) / len(t)
                name = f"{mode} B={batch}"
                bl.log(f"{name:<12} | {p50 * 1e6:>10.1f} | {p99 * 1e6:>10.1f} | {mean * 1e6:>10.1f}")
                rows.append(bl.row(name, p50 * 1e6, "us", False, p50_us=p50 * 1e6, p99_us=p99 * 1e6,
                                   mean_us=mean * 1e6, calls=a.calls))
    rep = bl.report(torch, "predictor", dev, "host wall time per call (H2D from pinned, forward, D2H, sync)", rows)
    bl.finish(rep, a.json)


if __name__ == "__main__":
    main()
