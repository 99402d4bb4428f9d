#!/usr/bin/env python3
"""PyTorch twin of `ferrograd bench attention`: F.scaled_dot_product_attention forward and
forward + backward TFLOP/s and peak memory.

Same work: B * H = 64 (B = 4, H = 16), T = 512..8192, head dims 64 and 128, causal and not; q, k, v
are the [B, H, T, D] views of one [B, T, 3, H, D] buffer of N(0, 1) samples, dO is N(0, 1)
[B, H, T, D]. FLOPs 4 B H T^2 D (halved when causal), forward + backward 3.5 times that. The
backward is `torch.autograd.grad(o, (q, k, v), dO)`. Same checks: the forward into a NaN-filled
allocator state is checked on sampled rows against float64; peak memory is
`torch.cuda.max_memory_allocated` over one forward + backward (inputs included). Same timing:
CUDA events, warm-up, batches, median per call (benchlib.time_device). PyTorch picks its SDPA
backend itself (the kernels it ran are recorded in the notes); extra rows, marked
`[torch flash backend]` and `[torch cudnn backend]`, force its FlashAttention-2 and its cuDNN
backends for reference (--no-flash-rows skips them). `--dropout P` times every call with
`dropout_p=P` (row names gain ` p=P`, as ours); PyTorch's mask cannot be reproduced here, so the
sampled-row check then runs on the same inputs without dropout.

    python3 bench/torch_attention.py [--dtype bf16] [--seqs 512,1024] [--head-dims 64,128]
                                     [--causal full,causal] [--dropout 0.1] [--json FILE]
"""

import argparse
import math

import benchlib as bl

TOL = {"f32": 1e-4, "f16": 5e-3, "bf16": 2e-2}


def row_name(mode: str, dtype: str, d: int, causal: bool, t: int, dropout: float = 0.0) -> str:
    p = f" p={dropout}" if dropout > 0 else ""
    return f"{mode} {dtype} d={d} {'causal' if causal else 'full'} T={t}{p}"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    bl.common_args(p)
    p.add_argument("--dtype", default="bf16", choices=["bf16", "f16", "f32"])
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--seqs", type=bl.csv_ints, default=[512, 1024, 2048, 4096, 8192])
    p.add_argument("--head-dims", type=bl.csv_ints, default=[64, 128])
    p.add_argument("--causal", default="full,causal", help="comma-separated: full, causal")
    p.add_argument("--dropout", type=float, default=0.0, help="dropout_p of every timed call, in [0, 1)")
    p.add_argument("--no-flash-rows", dest="flash_rows", action="store_false",
                   help="skip the extra rows that force PyTorch's FlashAttention-2 and cuDNN backends")
    a = p.parse_args()
    if not 0.0 <= a.dropout < 1.0:
        bl.fail(f"--dropout {a.dropout}: expected a probability in [0, 1)")
    pd = a.dropout
    causals = []
    for c in a.causal.split(","):
        c = c.strip()
        if c not in ("full", "causal"):
            bl.fail(f"--causal {c}: expected full or causal")
        causals.append(c == "causal")

    torch = bl.import_torch()
    import torch.nn.functional as F  # noqa: PLC0415

    dev = bl.cuda_device(torch, a.device, "attention")
    torch.backends.cuda.matmul.allow_tf32 = False
    dt = {"f32": torch.float32, "bf16": torch.bfloat16, "f16": torch.float16}[a.dtype]
    torch.manual_seed(a.seed)
    gen = torch.Generator().manual_seed(a.seed + 1)
    B, H = a.batch, a.heads
    bl.log(f"F.scaled_dot_product_attention, {a.dtype}, B={B} H={H}, on {dev} "
           f"({torch.cuda.get_device_name(dev)}), torch {torch.__version__}")
    bl.log("q, k, v: views of one [B, T, 3, H, D] buffer; CUDA events, median over batches")
    bl.log("")
    head = (f"{'what':32} | {'fwd ms':>10} | {'TFLOP/s':>8} | {'f+b ms':>10} | {'TFLOP/s':>8} | "
            f"{'peak MiB':>9} | {'rel err':>9}")
    bl.log(head)
    bl.log("-" * len(head))

    rows, kernels = [], set()
    for d in a.head_dims:
        for causal in causals:
            for t in a.seqs:
                qkv = torch.randn(B, t, 3, H, d, device=dev, dtype=dt)
                q, k, v = (qkv[:, :, i].permute(0, 2, 1, 3) for i in range(3))
                dout = torch.randn(B, H, t, d, device=dev, dtype=dt)
                flops = 4 * B * H * t * t * d / (2 if causal else 1)

                with torch.no_grad():
                    o = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
                # Sampled rows (first, last, six random) against float64.
                picks = [(0, 0, 0), (B - 1, H - 1, t - 1)] + [
                    tuple(int(torch.randint(0, n, (1,), generator=gen)) for n in (B, H, t)) for _ in range(6)]
                got, want = [], []
                for (b, h, i) in picks:
                    qi = q[b, h, i].double()
                    n = i + 1 if causal else t
                    kh, vh = k[b, h, :n].double(), v[b, h, :n].double()
                    s = (kh @ qi) / math.sqrt(d)
                    want.append(torch.softmax(s, 0) @ vh)
                    got.append(o[b, h, i])
                err = bl.rel_err(torch, torch.stack(got), torch.stack(want))
                bl.require(row_name("fwd", a.dtype, d, causal, t, pd), err, TOL[a.dtype])
                del o

                def fwd():
                    with torch.no_grad():
                        return F.scaled_dot_product_attention(q, k, v, dropout_p=pd, is_causal=causal)

                qg, kg, vg = (x.detach().requires_grad_() for x in (q, k, v))

                def fwd_bwd():
                    o = F.scaled_dot_product_attention(qg, kg, vg, dropout_p=pd, is_causal=causal)
                    return torch.autograd.grad(o, (qg, kg, vg), dout)

                if not kernels:
                    try:
                        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                            fwd_bwd()
                            torch.cuda.synchronize()
                        kernels.update(e.name for e in prof.events() if str(e.device_type).endswith("CUDA"))
                    except Exception as e:  # noqa: BLE001 (the profiler is only for the notes)
                        kernels.add(f"(profiler failed: {e})")

                tf = bl.time_device(torch, fwd, cuda=True)
                tb = bl.time_device(torch, fwd_bwd, cuda=True)
                forced = []
                if a.flash_rows:
                    # PyTorch's FlashAttention-2 and cuDNN backends forced, for reference (rows PyTorch only).
                    from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: PLC0415
                    for name, be in (("flash", SDPBackend.FLASH_ATTENTION), ("cudnn", SDPBackend.CUDNN_ATTENTION)):
                        try:
                            with sdpa_kernel(be):
                                forced.append((name, bl.time_device(torch, fwd, cuda=True),
                                               bl.time_device(torch, fwd_bwd, cuda=True)))
                        except RuntimeError as e:
                            bl.log(f"{name} backend unavailable: {e}")
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats(dev)
                grads = fwd_bwd()
                del grads
                torch.cuda.synchronize()
                peak = torch.cuda.max_memory_allocated(dev) / 2**20
                ff, fb = flops / tf["median_s"] / 1e12, 3.5 * flops / tb["median_s"] / 1e12
                label = f"{a.dtype} d={d} {'causal' if causal else 'full'} T={t}" + (f" p={pd}" if pd > 0 else "")
                bl.log(f"{label:32} | {tf['median_s'] * 1e3:>10.4f} | {ff:>8.1f} | {tb['median_s'] * 1e3:>10.4f} | "
                       f"{fb:>8.1f} | {peak:>9.1f} | {err:>9.2e}")
                rows.append(bl.row(row_name("fwd", a.dtype, d, causal, t, pd), ff, "TFLOP/s", True,
                                   median_s=tf["median_s"], reps=tf["reps"], rel_err=err))
                rows.append(bl.row(row_name("fwd+bwd", a.dtype, d, causal, t, pd), fb, "TFLOP/s", True,
                                   median_s=tb["median_s"], reps=tb["reps"]))
                rows.append(bl.row(row_name("peak fwd+bwd", a.dtype, d, causal, t, pd), peak, "MiB", False))
                for name, t_f, t_b in forced:
                    for mode, tt, f in (("fwd", t_f, flops), ("fwd+bwd", t_b, 3.5 * flops)):
                        rows.append(bl.row(row_name(mode, a.dtype, d, causal, t, pd) + f" [torch {name} backend]",
                                           f / tt["median_s"] / 1e12, "TFLOP/s", True, median_s=tt["median_s"],
                                           reps=tt["reps"]))
                    bl.log(f"{'  [' + name + ' backend]':32} | {t_f['median_s'] * 1e3:>10.4f} | "
                           f"{flops / t_f['median_s'] / 1e12:>8.1f} | {t_b['median_s'] * 1e3:>10.4f} | "
                           f"{3.5 * flops / t_b['median_s'] / 1e12:>8.1f} |")
                del qkv, q, k, v, qg, kg, vg, dout

    attn = sorted(k for k in kernels if any(s in k.lower() for s in ("flash", "fmha", "cudnn", "attention", "sdpa", "profiler")))
    notes = [f"B={B} H={H}; q, k, v views of one [B, T, 3, H, D] buffer; dO N(0,1); backward = autograd.grad"
             + (f"; dropout_p={pd} in every timed call (the row check ran without it)" if pd > 0 else ""),
             "SDPA backends enabled: " + ", ".join(
                 f"{n}={getattr(torch.backends.cuda, n + '_sdp_enabled', lambda: '?')()}"
                 for n in ("flash", "mem_efficient", "cudnn", "math")),
             "attention kernels PyTorch ran (first configuration): " + ("; ".join(attn) or "(none matched)")]
    for n in notes:
        bl.log(n)
    bl.finish(bl.report(torch, "attention", dev, "CUDA events; warm-up, batches, median per call", rows, notes), a.json)


if __name__ == "__main__":
    main()
