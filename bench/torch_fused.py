#!/usr/bin/env python3
"""PyTorch twin of `ferrograd bench fused`: residual add + layer norm (`h = x + r; y = F.layer_norm(h)`)
and bias + GELU (`F.gelu(x + b, approximate="tanh")`), forward and forward + backward GB/s, eager and
torch.compile; and the classifier (`F.log_softmax` + `F.nll_loss`, forward and backward: the mean loss
and the logits' gradient), GB/s over the fewest bytes (logits read once, gradient written once:
2 x N), logits ~ N(0, 2^2) in the dtype, uniform targets.

Same work: [rows, cols] (16384 x 768, GPT-2's tokens x width, by default) in bf16. add_layer_norm: x, r, dh,
dy ~ N(0, 1), weight ~ U[0.5, 1.5), bias ~ N(0, 1), eps 1e-5; bytes: forward 4 x N elements (x, r read; h, y
written), forward + backward 8 x N (plus h, dy, dh read and dx written); the backward is
`torch.autograd.grad((h, y), (x, r, w, b), (dh, dy))`. bias_gelu: x ~ N(0, 2^2), b, dy ~ N(0, 1); bytes:
forward 2 x N (x read, y written), forward + backward 5 x N (plus dy, x read and dx written); the backward
is `torch.autograd.grad(y, (x, b), dy)`. Same checks: the forward is checked on sampled rows against
float64. Same timing: CUDA events, warm-up, batches, median per call (benchlib.time_device). Rows
marked `[torch.compile]` are the same functions compiled (PyTorch only: the fused baseline to beat).

    python3 bench/torch_fused.py [--dtype bf16] [--shapes 16384x768] [--no-compile] [--json FILE]
"""

import argparse

import benchlib as bl

EPS = 1e-5
TOL = {"f32": 1e-5, "f16": 2e-3, "bf16": 1.5e-2}


def row_name(op: str, mode: str, dtype: str, r: int, c: int) -> str:
    return f"{op} {mode} {dtype} {r}x{c}"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    bl.common_args(p)
    p.add_argument("--dtype", default="bf16", choices=["bf16", "f16", "f32"])
    p.add_argument("--shapes", type=bl.csv_shapes, default=[(16384, 768)])
    p.add_argument("--classifier", default="8192x50257",
                   help="classifier shapes ROWSxCLASSES, comma-separated, or none")
    p.add_argument("--no-compile", dest="compile", action="store_false", help="skip the torch.compile rows")
    a = p.parse_args()

    torch = bl.import_torch()
    import torch.nn.functional as F  # noqa: PLC0415,N812

    dev = bl.cuda_device(torch, a.device, "fused")
    dt = {"f32": torch.float32, "bf16": torch.bfloat16, "f16": torch.float16}[a.dtype]
    es = {"f32": 4, "bf16": 2, "f16": 2}[a.dtype]
    torch.manual_seed(a.seed)
    gen = torch.Generator().manual_seed(a.seed + 1)
    bl.log(f"residual add + layer norm and bias + GELU, {a.dtype}, on {dev} ({torch.cuda.get_device_name(dev)}), "
           f"torch {torch.__version__}")
    bl.log("GB/s = bytes the op must move (add_layer_norm fwd 4 x N elements, fwd+bwd 8 x N; bias_gelu 2 x N, "
           "5 x N) / median; CUDA events")
    bl.log("")

    def add_ln(x, r, w, b):
        h = x + r
        return h, F.layer_norm(h, (h.shape[-1],), w, b, EPS)

    def bias_gelu(x, b):
        return F.gelu(x + b, approximate="tanh")

    def timed_rows(op, r, c, fwd, fwd_bwd, passes, tag):
        fwd_bwd()  # compile the backward outside the timing
        tf = bl.time_device(torch, fwd, cuda=True)
        tb = bl.time_device(torch, fwd_bwd, cuda=True)
        n = r * c * es
        for mode, t, p in (("fwd", tf, passes[0]), ("fwd+bwd", tb, passes[1])):
            rows.append(bl.row(row_name(op, mode, a.dtype, r, c) + tag, p * n / t["median_s"] / 1e9, "GB/s",
                               True, median_s=t["median_s"], reps=t["reps"]))

    rows = []
    for (r, c) in a.shapes:
        x = torch.randn(r, c, device=dev, dtype=dt)
        res = torch.randn(r, c, device=dev, dtype=dt)
        w = (torch.rand(c, device=dev) + 0.5).to(dt)
        b = torch.randn(c, device=dev, dtype=dt)
        dh = torch.randn(r, c, device=dev, dtype=dt)
        dy = torch.randn(r, c, device=dev, dtype=dt)
        ins = [t.detach().requires_grad_() for t in (x, res, w, b)]

        variants = [("", add_ln)]
        if a.compile:
            variants.append((" [torch.compile]", torch.compile(add_ln)))
        for tag, fn in variants:
            def fwd(fn=fn):
                with torch.no_grad():
                    return fn(x, res, w, b)

            def fwd_bwd(fn=fn):
                h, y = fn(*ins)
                return torch.autograd.grad((h, y), ins, (dh, dy))

            _, y = fwd()
            idx = bl.sample_rows(r, 4, 4, lambda k, hi: torch.randint(0, hi, (k,), generator=gen).tolist())
            it = torch.tensor(idx, device=dev)
            hd = (x.index_select(0, it) + res.index_select(0, it)).double()  # h rounded to dt, as the op
            want = F.layer_norm(hd, (c,), w.double(), b.double(), EPS)
            err = bl.rel_err(torch, y.index_select(0, it).double(), want)
            bl.require(row_name("add_layer_norm", "fwd", a.dtype, r, c) + tag, err, TOL[a.dtype])
            del y
            timed_rows("add_layer_norm", r, c, fwd, fwd_bwd, (4, 8), tag)
        del x, res, w, b, dh, dy, ins

        x = torch.randn(r, c, device=dev, dtype=dt) * 2
        b = torch.randn(c, device=dev, dtype=dt)
        dy = torch.randn(r, c, device=dev, dtype=dt)
        ins = [t.detach().requires_grad_() for t in (x, b)]
        variants = [("", bias_gelu)]
        if a.compile:
            variants.append((" [torch.compile]", torch.compile(bias_gelu)))
        for tag, fn in variants:
            def fwd(fn=fn):
                with torch.no_grad():
                    return fn(x, b)

            def fwd_bwd(fn=fn):
                return torch.autograd.grad(fn(*ins), ins, dy)

            y = fwd()
            idx = bl.sample_rows(r, 4, 4, lambda k, hi: torch.randint(0, hi, (k,), generator=gen).tolist())
            it = torch.tensor(idx, device=dev)
            zd = (x.index_select(0, it) + b).double()  # x + b rounded to dt, as the op
            want = F.gelu(zd, approximate="tanh")
            err = bl.rel_err(torch, y.index_select(0, it).double(), want)
            bl.require(row_name("bias_gelu", "fwd", a.dtype, r, c) + tag, err, TOL[a.dtype])
            del y
            timed_rows("bias_gelu", r, c, fwd, fwd_bwd, (2, 5), tag)
        del x, b, dy, ins
    shapes = [] if a.classifier.strip() == "none" else bl.csv_shapes(a.classifier)
    for (r, c) in shapes:
        x = (torch.randn(r, c, device=dev) * 2.0).to(dt)
        t = torch.randint(0, c, (r,), device=dev, generator=None)

        def ce(x):
            return F.nll_loss(F.log_softmax(x, dim=-1), t)

        variants = [("", ce)]
        if a.compile:
            variants.append((" [torch.compile]", torch.compile(ce)))
        for tag, fn in variants:
            def fwd_bwd(fn=fn):
                xv = x.detach().requires_grad_()
                return torch.autograd.grad(fn(xv), xv)[0]

            d = fwd_bwd()
            idx = bl.sample_rows(r, 4, 4, lambda k, hi: torch.randint(0, hi, (k,), generator=gen).tolist())
            it = torch.tensor(idx, device=dev)
            xd = x.index_select(0, it).double()
            want = (torch.softmax(xd, -1) - F.one_hot(t.index_select(0, it), c).double()) / r
            err = bl.rel_err(torch, d.index_select(0, it).double(), want)
            bl.require(f"classifier fwd+bwd {a.dtype} {r}x{c}{tag}", err, 2 * TOL[a.dtype])
            del d
            tb = bl.time_device(torch, fwd_bwd, cuda=True)
            rows.append(bl.row(f"classifier fwd+bwd {a.dtype} {r}x{c}{tag}", 2 * r * c * es / tb["median_s"] / 1e9,
                               "GB/s", True, median_s=tb["median_s"], reps=tb["reps"]))
        del x, t

    bl.print_rows(rows)
    notes = [f"seed {a.seed}; x, r, dh, dy ~ N(0,1); weight ~ U[0.5,1.5), bias ~ N(0,1), eps 1e-5",
             "fwd+bwd = torch.autograd.grad((h, y), (x, r, w, b), (dh, dy)); [torch.compile] rows: same fn compiled",
             "bias_gelu: x ~ N(0, 2^2), b, dy ~ N(0,1); fwd+bwd = torch.autograd.grad(y, (x, b), dy)"]
    bl.finish(bl.report(torch, "fused", dev, "CUDA events; warm-up, batches, median per call", rows, notes), a.json)


if __name__ == "__main__":
    main()
