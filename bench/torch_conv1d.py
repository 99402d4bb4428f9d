#!/usr/bin/env python3
"""PyTorch twin of `ferrograd bench conv1d`: Mamba's causal depthwise conv1d in PyTorch, forward and
forward + backward time and peak memory.

The op is mamba_ssm's reference path (causal_conv1d is not installed on the lent GPU):
`F.conv1d(x, w[:, None, :], b, padding=k - 1, groups=C)[..., :L]`, i.e. nn.Conv1d(C, C, k,
groups=C, padding=k-1) with its output cut to the input's length. Eager, in the inputs' dtype
(cuDNN). Same work as ours: batch 4, 1536 channels, width 4, with bias, lengths 256, 1024, 4096;
x, dy N(0, 1), w, b U(-1/sqrt(k), 1/sqrt(k)). The backward is `torch.autograd.grad(y, (x, w, b),
dy)`. Checks: against a float64 run of the same call on 8 channels of the first batch row, before
timing. Timing: CUDA events, median (benchlib.time_device).

    python3 bench/torch_conv1d.py [--dtype bf16] [--seqs 256,1024,4096] [--json FILE]
"""

import argparse

import benchlib as bl

TOL = {"f32": 1e-5, "bf16": 1e-2}


def row_name(mode: str, dtype: str, b: int, d: int, k: int, l: int) -> str:
    return f"{mode} {dtype} B={b} D={d} K={k} L={l}"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    bl.common_args(p)
    bl.seq_op_args(p, "k", 4)
    a = p.parse_args()

    torch = bl.import_torch()
    import torch.nn.functional as F  # noqa: PLC0415

    dev = bl.cuda_device(torch, a.device, "conv1d")
    dt = {"f32": torch.float32, "bf16": torch.bfloat16}[a.dtype]
    torch.manual_seed(a.seed)
    torch.backends.cudnn.allow_tf32 = False  # f32 rows are f32, as ours
    Bn, Dn, K = a.batch, a.dim, a.k

    def conv(x, w, b):
        return F.conv1d(x, w[:, None, :], b, padding=K - 1, groups=x.shape[1])[..., : x.shape[2]]

    bl.log(f"causal depthwise conv1d (F.conv1d groups=C, padding=k-1, cut to L), {a.dtype}, B={Bn} D={Dn} K={K}, "
           f"with bias, on {dev} ({torch.cuda.get_device_name(dev)}), torch {torch.__version__}")
    bl.log("eager; CUDA events, median")
    bl.log("")
    head = f"{'what':34} | {'fwd ms':>10} | {'f+b ms':>10} | {'peak MiB':>9} | {'rel err':>9}"
    bl.log(head)
    bl.log("-" * len(head))
    rows = []
    bound = 1.0 / K**0.5
    for L in a.seqs:
        x = torch.randn(Bn, Dn, L, device=dev, dtype=dt)
        w = ((torch.rand(Dn, K, device=dev) * 2 - 1) * bound).to(dt)
        b = ((torch.rand(Dn, device=dev) * 2 - 1) * bound).to(dt)
        dy = torch.randn(Bn, Dn, L, device=dev, dtype=dt)
        sl = [x[:1, :8], w[:8], b[:8]]
        want = conv(*[t.double() for t in sl])
        with torch.no_grad():
            got = conv(*sl)
        err = bl.rel_err(torch, got, want)
        what = row_name("fwd", a.dtype, Bn, Dn, K, L)
        bl.require(what, err, TOL[a.dtype])
        leaves = [t.detach().requires_grad_() for t in (x, w, b)]

        def fwd(x=x, w=w, b=b):
            with torch.no_grad():
                return conv(x, w, b)

        def fwd_bwd(leaves=leaves, dy=dy):
            return torch.autograd.grad(conv(*leaves), leaves, dy)

        tf, tb, peak = bl.seq_op_measure(torch, dev, fwd, fwd_bwd)
        label = row_name("", a.dtype, Bn, Dn, K, L).strip()
        bl.log(f"{label:34} | {tf['median_s'] * 1e3:>10.4f} | {tb['median_s'] * 1e3:>10.4f} | {peak:>9.1f} | "
               f"{err:>9.2e}")
        rows += bl.seq_op_rows(lambda mode, L=L: row_name(mode, a.dtype, Bn, Dn, K, L), tf, tb, peak, err)
        del x, w, b, dy, leaves
    notes = [f"B={Bn} D={Dn} K={K} with bias; F.conv1d(groups=C, padding=k-1)[..., :L] eager (mamba_ssm's "
             "reference path); backward = autograd.grad for x, w, b"]
    for n in notes:
        bl.log(n)
    bl.finish(bl.report(torch, "conv1d", dev, "CUDA events; warm-up, batches, median per call", rows, notes), a.json)


if __name__ == "__main__":
    main()
