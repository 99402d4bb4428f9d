#!/usr/bin/env python3
"""PyTorch twin of `ferrograd bench linear`: linear + bias + GELU (tanh), forward and forward+backward.

Same work: x [rows, in] ~ N(0, 1) (requires grad, as a hidden layer's input), weight [out, in] and
bias [out] ~ U(+-1/sqrt(in)) (nn.Linear's initialisation), output gradient dy ~ N(0, 1), all in the
same dtype; GPT-2's MLP shapes by default (16 x 1024 tokens, 768 -> 3072, 3072 -> 768,
1024 -> 4096). Eager PyTorch, as a model written with torch.nn.functional runs:

    fwd      with torch.no_grad(): F.gelu(F.linear(x, w, b), approximate="tanh")
    fwd+bwd  y = F.gelu(F.linear(x, w, b), approximate="tanh"); torch.autograd.grad(y, (x, w, b), dy)

(autograd.grad returns dx, dW, db without accumulating into .grad, as ferrograd's GradStore.)
With the default shapes and GELU, also GPT-2's MLP block, F.linear -> F.gelu -> F.linear (768 ->
3072 -> 768 and 1024 -> 4096 -> 1024), rows `bf16 mlp 768->3072->768 rows=16384 fwd+bwd`.
TFLOP/s = matmul FLOPs (2, resp. 6, x rows x in x out) / median time. f32 is exact
(allow_tf32 = False). Checked first: every output finite, y, dx, dW and db against float64 on the
GPU within the same tolerances as ours. Timing: CUDA events, warm-up, batches, median per call
(benchlib.time_device). Rows are named `bf16 gelu 768->3072 rows=16384 fwd+bwd` as ours.

    python3 bench/torch_linear.py [--dtype bf16] [--act gelu|relu|none] [--rows 16384]
                                  [--features 768x3072,3072x768] [--json FILE]
"""

import argparse
import math

import benchlib as bl

FEATURES = [(768, 3072), (3072, 768), (1024, 4096)]
MLP = [(768, 3072), (1024, 4096)]
ROWS = 16 * 1024
TOL = {"f32": 1e-3, "f16": 5e-3, "bf16": 2e-2}


def bench_mlp(torch, F, dev, dt, dname: str, m: int, d: int, h: int) -> list:
    """GPT-2's MLP block, F.linear -> F.gelu(tanh) -> F.linear, fwd and fwd+bwd, checked against float64."""
    case = f"{d}->{h}->{d} rows={m}"
    b1, b2 = 1.0 / math.sqrt(d), 1.0 / math.sqrt(h)
    x = torch.randn(m, d, device=dev, dtype=dt).requires_grad_()
    w1 = ((torch.rand(h, d, device=dev, dtype=dt) * 2 - 1) * b1).requires_grad_()
    c1 = ((torch.rand(h, device=dev, dtype=dt) * 2 - 1) * b1).requires_grad_()
    w2 = ((torch.rand(d, h, device=dev, dtype=dt) * 2 - 1) * b2).requires_grad_()
    c2 = ((torch.rand(d, device=dev, dtype=dt) * 2 - 1) * b2).requires_grad_()
    dy = torch.randn(m, d, device=dev, dtype=dt)
    params = (x, w1, c1, w2, c2)

    def block(p):
        return F.linear(F.gelu(F.linear(p[0], p[1], p[2]), approximate="tanh"), p[3], p[4])

    def fwd():
        with torch.no_grad():
            return block(params)

    def step():
        y = block(params)
        return y, torch.autograd.grad(y, params, dy)

    y, grads = step()
    p64 = [t.detach().double().requires_grad_() for t in params]
    y64 = block(p64)
    ref = (y64.detach(), *torch.autograd.grad(y64, p64, dy.double()))
    err = 0.0
    for what, got, want in zip(("y", "dx", "dW1", "db1", "dW2", "db2"), (y, *grads), ref):
        if not torch.isfinite(got).all():
            bl.fail(f"mlp {dname} {case}: {what} has non-finite elements")
        e = bl.rel_err(torch, got.detach(), want)
        bl.require(f"mlp {dname} {case} {what}", e, TOL[dname])
        err = max(err, e)
    del y, grads, p64, y64, ref
    rows = []
    flops = 4.0 * m * d * h
    for what, fn, fl in (("fwd", fwd, flops), ("fwd+bwd", step, 3 * flops)):
        t = bl.time_device(torch, fn, cuda=True)
        rows.append(bl.row(f"{dname} mlp {case} {what}", fl / t["median_s"] / 1e12, "TFLOP/s", True,
                           median_s=t["median_s"], min_s=t["min_s"], reps=t["reps"], inner=t["inner"], rel_err=err))
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    bl.common_args(p)
    p.add_argument("--dtype", default="bf16", type=lambda s: [d.strip() for d in s.split(",") if d.strip()],
                   help="bf16, f16, f32 (comma-separated); default bf16")
    p.add_argument("--act", default="gelu", choices=["gelu", "relu", "none"], help="gelu is the tanh form")
    p.add_argument("--rows", type=int, default=ROWS, help="tokens per problem (default 16384)")
    p.add_argument("--features", type=bl.csv_shapes, help="INxOUT pairs (default 768x3072,3072x768,1024x4096)")
    p.add_argument("--breakdown", action="store_true", help="also time each kernel of the step alone (µs)")
    a = p.parse_args()
    if a.rows <= 0:
        bl.fail("--rows must be at least 1")

    torch = bl.import_torch()
    F = torch.nn.functional
    dev = bl.cuda_device(torch, a.device, "linear")
    torch.backends.cuda.matmul.allow_tf32 = False
    dtypes = {"f32": torch.float32, "bf16": torch.bfloat16, "f16": torch.float16}
    for d in a.dtype:
        if d not in dtypes:
            bl.fail(f"--dtype {d}: expected bf16, f16 or f32")
    acts = {"gelu": lambda z: F.gelu(z, approximate="tanh"), "relu": F.relu, "none": lambda z: z}
    act = acts[a.act]
    features = a.features or FEATURES

    torch.manual_seed(a.seed)
    bl.log(f"linear + bias + {a.act} on {dev} ({torch.cuda.get_device_name(dev)}), torch {torch.__version__}")
    bl.log("eager F.linear + activation, autograd.grad; CUDA events, median over batches; TFLOP/s = matmul FLOPs / median")
    rows = []
    for dname in a.dtype:
        dt = dtypes[dname]
        for k, n in features:
            m = a.rows
            case = f"{k}->{n} rows={m}"
            bound = 1.0 / math.sqrt(k)
            x = torch.randn(m, k, device=dev, dtype=dt).requires_grad_()
            w = ((torch.rand(n, k, device=dev, dtype=dt) * 2 - 1) * bound).requires_grad_()
            b = ((torch.rand(n, device=dev, dtype=dt) * 2 - 1) * bound).requires_grad_()
            dy = torch.randn(m, n, device=dev, dtype=dt)

            def fwd():
                with torch.no_grad():
                    return act(F.linear(x, w, b))

            def step():
                y = act(F.linear(x, w, b))
                return y, torch.autograd.grad(y, (x, w, b), dy)

            # Correctness first, against float64 on the GPU.
            y, (dx, dw, db) = step()
            for what, t in (("y", y), ("dx", dx), ("dW", dw), ("db", db)):
                if not torch.isfinite(t).all():
                    bl.fail(f"linear {dname} {case}: {what} has non-finite elements")
            x64, w64, b64 = (t.detach().double().requires_grad_() for t in (x, w, b))
            y64 = act(F.linear(x64, w64, b64))
            ref = (y64.detach(), *torch.autograd.grad(y64, (x64, w64, b64), dy.double()))
            err = 0.0
            for what, got, want in zip(("y", "dx", "dW", "db"), (y, dx, dw, db), ref):
                e = bl.rel_err(torch, got.detach(), want)
                bl.require(f"linear {dname} {a.act} {case} {what}", e, TOL[dname])
                err = max(err, e)
            del y, dx, dw, db, x64, w64, b64, y64, ref

            flops = 2.0 * m * k * n
            for what, fn, fl in (("fwd", fwd, flops), ("fwd+bwd", step, 3 * flops)):
                t = bl.time_device(torch, fn, cuda=True)
                name = f"{dname} {a.act} {case} {what}"
                rows.append(bl.row(name, fl / t["median_s"] / 1e12, "TFLOP/s", True, median_s=t["median_s"],
                                   min_s=t["min_s"], reps=t["reps"], inner=t["inner"], rel_err=err))
            if a.breakdown:
                with torch.no_grad():
                    z = F.linear(x, w, b)
                    yz = act(z)
                    if a.act == "gelu":
                        dz = torch.ops.aten.gelu_backward(dy, z, approximate="tanh")
                    elif a.act == "relu":
                        dz = torch.ops.aten.threshold_backward(dy, yz, 0)
                    else:
                        dz = dy
                    parts = [("addmm", lambda: F.linear(x, w, b)), ("act", lambda: act(z))]
                    if a.act == "gelu":
                        parts.append(("gelu_backward", lambda: torch.ops.aten.gelu_backward(dy, z, approximate="tanh")))
                    parts += [("mm dx", lambda: torch.mm(dz, w)), ("mm dW", lambda: torch.mm(dz.t(), x)),
                              ("sum db", lambda: dz.sum(0))]
                    for pname, fn in parts:
                        t = bl.time_device(torch, fn, cuda=True)
                        rows.append(bl.row(f"{dname} {a.act} {case} part torch {pname}", t["median_s"] * 1e6, "µs",
                                           False, median_s=t["median_s"], reps=t["reps"]))
                    del z, yz, dz
            del x, w, b, dy
    if a.features is None and a.act == "gelu":
        for dname in a.dtype:
            for d, h in MLP:
                rows += bench_mlp(torch, F, dev, dtypes[dname], dname, a.rows, d, h)
    bl.print_rows(rows)
    rep = bl.report(torch, "linear", dev, "CUDA events on the current stream; warm-up, batches of calls, "
                    "median per call", rows,
                    [f"seed {a.seed}; x ~ N(0,1), w and b ~ U(+-1/sqrt(in)), dy ~ N(0,1); eager F.linear + "
                     f"{a.act}; fwd+bwd = forward + autograd.grad for x, w, b"])
    bl.finish(rep, a.json)


if __name__ == "__main__":
    main()
