#!/usr/bin/env python3
"""PyTorch twin of `ferrograd bench matmul --device cuda`: square C = A B, TFLOP/s.

Same work: A, B ~ N(0, 1) (never zeros) of the same dtype and sizes; f32 exact
(torch.backends.cuda.matmul.allow_tf32 = False, PyTorch's default; other flags as PyTorch ships
them, recorded in the JSON). Same checks: the product is computed once into a NaN-filled output,
must be finite everywhere, and its rows (all up to n = 512, else first, last and six random) must
match a float64 product within the same tolerances as ours. Same timing: CUDA events, warm-up,
batches of calls, median per call (benchlib.time_device). Rows are named `f32 n=4096` etc.

    python3 bench/torch_matmul.py [--dtype f32,bf16] [--sizes 1024,4096] [--json FILE]
"""

import argparse

import benchlib as bl

F32_SIZES = [128, 256, 512, 1024, 2048, 4096]
HALF_SIZES = [8192]
TOL = {"f32": 1e-4, "f16": 5e-3, "bf16": 1e-2}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    bl.common_args(p)
    p.add_argument("--dtype", type=lambda s: [d.strip() for d in s.split(",") if d.strip()],
                   help="f32, bf16, f16 (comma-separated); default f32 and bf16")
    p.add_argument("--sizes", type=bl.csv_ints, help="default 128..4096 for f32, 8192 for bf16/f16")
    a = p.parse_args()

    torch = bl.import_torch()
    dev = bl.cuda_device(torch, a.device, "matmul")
    torch.backends.cuda.matmul.allow_tf32 = False
    dtypes = {"f32": torch.float32, "bf16": torch.bfloat16, "f16": torch.float16}
    names = a.dtype or (["f32"] if a.sizes else ["f32", "bf16"])
    for d in names:
        if d not in dtypes:
            bl.fail(f"--dtype {d}: expected f32, bf16 or f16")
    plan = [(d, a.sizes or (F32_SIZES if d == "f32" else HALF_SIZES)) for d in names]

    torch.manual_seed(a.seed)
    gen = torch.Generator().manual_seed(a.seed + 1)
    bl.log(f"square matmul C = A B on {dev} ({torch.cuda.get_device_name(dev)}), torch {torch.__version__}")
    bl.log("torch.matmul, f32 exact (allow_tf32=False); CUDA events, median over batches after warm-up")
    bl.log("")
    bl.log(f"{'dtype':>5} | {'n':>6} | {'median ms':>10} | {'TFLOP/s':>8} | {'reps x inner':>12} | {'rel err':>9} {'rows':>5}")
    bl.log("-" * 78)
    rows = []
    with torch.inference_mode():
        for dname, sizes in plan:
            dt = dtypes[dname]
            for n in sizes:
                A = torch.randn(n, n, device=dev, dtype=dt)
                B = torch.randn(n, n, device=dev, dtype=dt)
                C = torch.full((n, n), float("nan"), device=dev, dtype=dt)
                torch.matmul(A, B, out=C)
                if not torch.isfinite(C).all():
                    bl.fail(f"{dname} n={n}: the product has non-finite elements")
                idx = bl.sample_rows(n, 512, 6, lambda k, hi: torch.randint(0, hi, (k,), generator=gen).tolist())
                it = torch.tensor(idx, device=dev)
                ref = A.index_select(0, it).double() @ B.double()
                err = bl.rel_err(torch, C.index_select(0, it), ref)
                bl.require(f"{dname} matmul n={n}", err, TOL[dname])
                del C, ref
                t = bl.time_device(torch, lambda: torch.matmul(A, B), cuda=True)
                tflops = 2 * n**3 / t["median_s"] / 1e12
                bl.log(f"{dname:>5} | {n:>6} | {t['median_s'] * 1e3:>10.4f} | {tflops:>8.2f} | "
                       f"{t['reps']:>5} x {t['inner']:>4} | {err:>9.2e} {len(idx):>5}")
                rows.append(bl.row(f"{dname} n={n}", tflops, "TFLOP/s", True, median_s=t["median_s"],
                                   min_s=t["min_s"], reps=t["reps"], inner=t["inner"], rel_err=err,
                                   rows_checked=len(idx)))
                del A, B
    rep = bl.report(torch, "matmul", dev, "CUDA events on the current stream; warm-up, batches of calls, "
                    "median per call", rows, [f"seed {a.seed}; inputs N(0,1) from torch.randn on the device"])
    bl.finish(rep, a.json)


if __name__ == "__main__":
    main()
