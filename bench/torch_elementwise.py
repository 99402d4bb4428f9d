#!/usr/bin/env python3
"""PyTorch twin of `ferrograd bench elementwise`: memory-bound f32 ops, GB/s and % of copy.

Same ops, shapes, byte counts and timing as ours (reads + write, 4 B each; CUDA events, warm-up,
batches, median per call). All ops at the first shape; copy, softmax, layer_norm and cross_entropy
at the others.

    copy        dst.copy_(x)                  (ours: dst.set(&x), a device-to-device memcpy)
    mul_scalar  torch.mul(x, 2.0)             (ours: x.mul_scalar(2.0), the copy-like kernel)
    add / mul   torch.add(x, y) / torch.mul(x, y)
    relu        torch.relu(x)       sigmoid  torch.sigmoid(x)       tanh  torch.tanh(x)
    transpose   x.t().contiguous()            (a permuted view made contiguous)
    softmax     torch.softmax(x, dim=-1)
    layer_norm  F.layer_norm(x, (cols,), w, b, eps=1e-5)
    cross_entropy  torch.autograd.grad(F.cross_entropy(x, t), x): the loss and the logits' gradient
                (3 passes: the forward reads x, the backward reads x and writes the gradient)

Every op is checked first: its output must be finite and its sampled rows must match a float64
computation within 1e-5. Inputs N(0, 1); w ~ U[0.5, 1.5), b ~ N(0, 1).

    python3 bench/torch_elementwise.py [--device cuda|cpu] [--shapes 8192x8192,65536x1024] [--json FILE]
"""

import argparse

import benchlib as bl

EPS = 1e-5
TOL = 1e-5
TOL_BF16 = 4e-3  # one bf16 rounding of the result (add_bf16, mul_bf16: bf16 copies of x and y)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    bl.common_args(p)
    p.add_argument("--shapes", type=bl.csv_shapes, default=[(8192, 8192), (65536, 1024)])
    a = p.parse_args()

    torch = bl.import_torch()
    import torch.nn.functional as F  # noqa: PLC0415,N812

    dev = bl.any_device(torch, a.device, "elementwise")
    cuda = dev.type == "cuda"
    torch.manual_seed(a.seed)
    gen = torch.Generator().manual_seed(a.seed + 1)
    name = torch.cuda.get_device_name(dev) if cuda else bl.environment(torch, dev)["cpu"]
    bl.log(f"memory-bound f32 ops on {dev} ({name}), torch {torch.__version__}")
    bl.log("GB/s = (elements read + written) x 4 B / median; % of copy = GB/s over this shape's device copy")
    bl.log("")

    rows = []
    with torch.inference_mode():
        for i, (r, c) in enumerate(a.shapes):
            x = torch.randn(r, c, device=dev)
            y = torch.randn(r, c, device=dev)
            xb, yb = x.bfloat16(), y.bfloat16()
            w = torch.rand(c, device=dev) + 0.5
            b = torch.randn(c, device=dev)
            dst = torch.randn(r, c, device=dev)

            def copy():
                dst.copy_(x)
                return dst

            # Autograd needs normal tensors: made outside inference mode (a functional op on an
            # inference tensor gives one), and the step recorded with grad enabled.
            with torch.inference_mode(False):
                xr = x.clone().requires_grad_(True)
                ce_targets = torch.randint(0, c, (r,), device=dev)

            def cross_entropy():
                with torch.inference_mode(False), torch.enable_grad():
                    (g,) = torch.autograd.grad(F.cross_entropy(xr, ce_targets), xr)
                return g

            idx = bl.sample_rows(r, 4, 4, lambda k, hi: torch.randint(0, hi, (k,), generator=gen).tolist())
            it = torch.tensor(idx, device=dev)

            ops = {
                "copy": (copy, 2, lambda xd, yd: xd),
                "mul_scalar": (lambda: torch.mul(x, 2.0), 2, lambda xd, yd: xd * 2.0),
                "add": (lambda: torch.add(x, y), 3, lambda xd, yd: xd + yd),
                "mul": (lambda: torch.mul(x, y), 3, lambda xd, yd: xd * yd),
                "relu": (lambda: torch.relu(x), 2, lambda xd, yd: xd.clamp_min(0)),
                "sigmoid": (lambda: torch.sigmoid(x), 2, lambda xd, yd: 1 / (1 + torch.exp(-xd))),
                "tanh": (lambda: torch.tanh(x), 2, lambda xd, yd: torch.tanh(xd)),
                # Viewed back as x's shape, so that the check reads x's rows (ferrograd: the same).
                "transpose": (lambda: x.t().contiguous().t(), 2, lambda xd, yd: xd),
                "softmax": (lambda: torch.softmax(x, dim=-1), 2, lambda xd, yd: torch.softmax(xd, dim=-1)),
                "layer_norm": (lambda: F.layer_norm(x, (c,), w, b, EPS), 2,
                               lambda xd, yd: F.layer_norm(xd, (c,), w.double(), b.double(), EPS)),
                "add_bf16": (lambda: torch.add(xb, yb), 3, lambda xd, yd: xd + yd),
                "mul_bf16": (lambda: torch.mul(xb, yb), 3, lambda xd, yd: xd * yd),
                "cross_entropy": (cross_entropy, 3,
                                  lambda xd, yd: (torch.softmax(xd, dim=-1)
                                                  - F.one_hot(ce_targets.index_select(0, it), c).double()) / r),
            }
            names = list(ops) if i == 0 else ["copy", "softmax", "layer_norm", "cross_entropy"]
            copy_gbps = None
            for op in names:
                fn, passes, ref = ops[op]
                out = fn()
                if not torch.isfinite(out).all():
                    bl.fail(f"{op} {r}x{c}: output has non-finite elements")
                bf16 = op.endswith("_bf16")
                xs, ys = (xb, yb) if bf16 else (x, y)
                want = ref(xs.index_select(0, it).double(), ys.index_select(0, it).double())
                bl.require(f"{op} {r}x{c}", bl.rel_err(torch, out.index_select(0, it).double(), want),
                           TOL_BF16 if bf16 else TOL)
                del out
                t = bl.time_device(torch, fn, cuda=cuda)
                gbps = passes * r * c * (2 if bf16 else 4) / t["median_s"] / 1e9
                if op == "copy":
                    copy_gbps = gbps
                rows.append(bl.row(f"{op} {r}x{c}", gbps, "GB/s", True, median_s=t["median_s"], reps=t["reps"],
                                   inner=t["inner"], pct_of_copy=100 * gbps / copy_gbps))
            del x, y, xb, yb, w, b, dst, xr, ce_targets

    bl.print_rows(rows, ("% of copy", "pct_of_copy"))
    timing = ("CUDA events on the current stream; warm-up, batches of calls, median per call" if cuda
              else "host clock; warm-up, batches of calls, median per call")
    rep = bl.report(torch, "elementwise", dev, timing, rows,
                    ["copy = dst.copy_(x) into an existing tensor; mul_scalar = torch.mul(x, 2.0)",
                     f"seed {a.seed}; x, y ~ N(0,1); layer_norm weight ~ U[0.5,1.5), bias ~ N(0,1), eps 1e-5"])
    bl.finish(rep, a.json)


if __name__ == "__main__":
    main()
