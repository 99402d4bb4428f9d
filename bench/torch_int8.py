#!/usr/bin/env python3
"""PyTorch twin of `ferrograd bench int8`: int8 x int8 -> int32 matmul (torch._int_mm) TOPS against
the bf16 matmul, and the W8A8 / W8A16 linears in eager PyTorch, square n x n.

Same work: int8 values from per-row symmetric quantization of N(0,1) draws (s = max|row| / 127,
q = round(x / s) clamped to [-127, 127]); torch._int_mm(A, B.t()) with B [n, n] row-major (the TN
form cuBLASLt's IMMA kernels take, as ours); bf16 torch.matmul of the dequantized values; W8A8 =
per-token quantization of x, _int_mm, rescale by both scales, + bias; W8A16 = dequantize the weight
to bf16, F.linear. Same checks: the int8 product of sampled rows equals an int64 product exactly;
bf16 within 1e-2 of f64; the linears within 3e-2 (W8A8) / 1e-2 (W8A16) of the bf16 linear. Same
timing: CUDA events, warm-up, batches, median per call (benchlib.time_device). Row names as ours.

    python3 bench/torch_int8.py [--sizes 4096] [--json FILE]
"""

import argparse

import benchlib as bl


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    bl.common_args(p)
    p.add_argument("--sizes", type=bl.csv_ints, default=[4096])
    a = p.parse_args()
    torch = bl.import_torch()
    F = torch.nn.functional
    dev = bl.cuda_device(torch, a.device, "int8")
    torch.manual_seed(a.seed)
    gen = torch.Generator().manual_seed(a.seed + 1)

    def quant_rows(x):
        s = x.abs().amax(dim=1).float() / 127.0
        s = torch.where(s > 0, s, torch.ones_like(s))
        q = torch.clamp(torch.round(x.float() * (1.0 / s)[:, None]), -127, 127).to(torch.int8)
        return q, s

    bl.log(f"int8 matmul (torch._int_mm) vs bf16, and int8 linears, on {dev} "
           f"({torch.cuda.get_device_name(dev)}), torch {torch.__version__}")
    bl.log(f"{'what':<22} | {'value':>10} | {'median ms':>12} | {'check':>9}")
    bl.log("-" * 62)
    rows = []

    def add(name, n, t, unit, **extra):
        v = 2 * n**3 / t["median_s"] / 1e12
        bl.log(f"{name:<22} | {v:>10.1f} | {t['median_s'] * 1e3:>12.4f} | {extra.get('check', extra.get('rel_err', '-'))!s:>9}")
        rows.append(bl.row(name, v, unit, True, median_s=t["median_s"], min_s=t["min_s"], reps=t["reps"],
                           inner=t["inner"], **extra))

    with torch.inference_mode():
        for n in a.sizes:
            af = torch.randn(n, n, device=dev)
            A, sa = quant_rows(af)
            B, sb = quant_rows(torch.randn(n, n, device=dev))
            C = torch._int_mm(A, B.t())
            idx = bl.sample_rows(n, 64, 6, lambda k, hi: torch.randint(0, hi, (k,), generator=gen).tolist())
            it = torch.tensor(idx, device=dev)
            ref = (A.index_select(0, it).long().cpu() @ B.long().cpu().t())
            if not torch.equal(C.index_select(0, it).long().cpu(), ref):
                bl.fail(f"int8 n={n}: torch._int_mm differs from the int64 product")
            add(f"int8 n={n}", n, bl.time_device(torch, lambda: torch._int_mm(A, B.t()), cuda=True), "TOPS",
                check="exact")

            ab = (A.float() * sa[:, None]).bfloat16()
            bb = (B.float() * sb[:, None]).bfloat16().t().contiguous()
            cb = torch.matmul(ab, bb)
            err = bl.rel_err(torch, cb.index_select(0, it), ab.index_select(0, it).double() @ bb.double())
            bl.require(f"bf16 n={n}", err, 1e-2)
            add(f"bf16 n={n}", n, bl.time_device(torch, lambda: torch.matmul(ab, bb), cuda=True), "TFLOP/s",
                rel_err=err)

            x = af.bfloat16()
            wb = ab
            bias = torch.randn(n, device=dev).bfloat16()
            flt = F.linear(x, wb, bias)

            def w8a8():
                xq, xs = quant_rows(x)
                acc = torch._int_mm(xq, A.t())
                return (acc.float() * xs[:, None] * sa[None, :] + bias.float()).bfloat16()

            def w8a16():
                return F.linear(x, (A.float() * sa[:, None]).bfloat16(), bias)

            for name, f, tol in [("w8a8", w8a8, 3e-2), ("w8a16", w8a16, 1e-2)]:
                e = bl.rel_err(torch, f(), flt.double())
                bl.require(f"{name} n={n} vs bf16 linear", e, tol)
                add(f"{name} linear n={n}", n, bl.time_device(torch, f, cuda=True), "TFLOP/s", rel_err_vs_bf16=e)
            add(f"bf16 linear n={n}", n, bl.time_device(torch, lambda: F.linear(x, wb, bias), cuda=True), "TFLOP/s")
    rep = bl.report(torch, "int8", dev, "CUDA events on the current stream; warm-up, batches of calls, "
                    "median per call", rows, [f"seed {a.seed}; int8 values = per-row symmetric quantization "
                                              "of torch.randn draws"])
    bl.finish(rep, a.json)


if __name__ == "__main__":
    main()
