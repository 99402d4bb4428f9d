#!/usr/bin/env python3
"""PyTorch twin of `ferrograd bench allreduce`: NCCL all-reduce bus bandwidth through
torch.distributed.all_reduce, one process per GPU.

Same work and timing as ours: per size a correctness check (rank r contributes r + 1), `--warmup`
untimed all-reduces, then 5 batches of `--iters` back-to-back all_reduce(SUM) on random values,
each batch after a barrier and timed on the host clock around the loop and a final
torch.cuda.synchronize(); the median batch's time per all-reduce of the slowest rank (all_reduce
MAX of the per-rank times). algbw = bytes / time; busbw = algbw * 2(n-1)/n (nccl-tests), the row's
value. Rank 0 prints and writes the JSON.

    python3 -m torch.distributed.run --nproc-per-node 2 bench/torch_allreduce.py \\
        [--sizes 1,16,64,256,1024] [--dtype f32] [--iters 20] [--warmup 5] [--json FILE]
"""

import argparse
import os
import time

import benchlib as bl

BATCHES = 5


def size_name(mib: float) -> str:
    return f"{mib:.0f} MiB" if mib >= 1 and float(mib).is_integer() else f"{mib * 1024:.0f} KiB"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", default="1,16,64,256,1024", help="buffer sizes in MiB, comma-separated")
    p.add_argument("--dtype", default="f32", choices=["f32", "bf16", "f16"])
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--json", metavar="FILE")
    p.add_argument("--seed", type=int, default=42)
    a = p.parse_args()
    sizes = [float(s) for s in a.sizes.split(",") if s.strip()]
    if a.iters < 1 or not sizes or any(s <= 0 for s in sizes):
        bl.fail("--iters must be at least 1 and every --sizes entry positive")
    if "RANK" not in os.environ:
        bl.fail("run under torchrun: python3 -m torch.distributed.run --nproc-per-node 2 bench/torch_allreduce.py")

    torch = bl.import_torch()
    import torch.distributed as dist  # noqa: PLC0415

    local = int(os.environ.get("LOCAL_RANK", "0"))
    dev = bl.cuda_device(torch, f"cuda:{local}", "allreduce")
    dist.init_process_group("nccl", device_id=dev)
    rank, world = dist.get_rank(), dist.get_world_size()
    if world < 2:
        bl.fail("allreduce needs at least two processes")
    dtype = {"f32": torch.float32, "bf16": torch.bfloat16, "f16": torch.float16}[a.dtype]
    esz = torch.tensor([], dtype=dtype).element_size()
    main_rank = rank == 0
    nccl = ".".join(map(str, torch.cuda.nccl.version()))
    if main_rank:
        bl.log(f"all-reduce ({a.dtype} sum) over {world} ranks, torch {torch.__version__}, NCCL {nccl}, "
               f"rank 0 on {dev} ({torch.cuda.get_device_name(dev)})")
        bl.log(f"host clock around {BATCHES} batches of {a.iters} back-to-back all-reduces after {a.warmup} "
               "warm-up; median batch, slowest rank")
        bl.log("")
    gen = torch.Generator(device=dev).manual_seed(a.seed + rank)
    rows = []
    for mib in sizes:
        n = max(int(mib * 2**20) // esz, world)
        n += (-n) % world
        check = torch.full((n,), float(rank + 1), dtype=dtype, device=dev)
        dist.all_reduce(check)
        want = world * (world + 1) / 2
        ends = [check[0].item(), check[-1].item()]
        if any(v != want for v in ends):
            bl.fail(f"all-reduce of {size_name(mib)} gave {ends}, expected {want}")
        del check
        buf = (torch.rand(n, generator=gen, device=dev) * 2 - 1).to(dtype)
        for _ in range(a.warmup):
            dist.all_reduce(buf)
        per_op = []
        for _ in range(BATCHES):
            dist.barrier()
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(a.iters):
                dist.all_reduce(buf)
            torch.cuda.synchronize()
            per_op.append((time.perf_counter() - t0) / a.iters)
        mine = sorted(per_op)[BATCHES // 2]
        slowest = torch.tensor([mine], dtype=torch.float64, device=dev)
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
        t = slowest.item()
        nbytes = n * esz
        algbw = nbytes / t / 1e9
        busbw = algbw * 2 * (world - 1) / world
        rows.append(bl.row(f"allreduce {a.dtype} {size_name(mib)}", busbw, "GB/s", True, median_s=t, reps=BATCHES,
                           iters_per_rep=a.iters, algbw_gbps=algbw, bytes=nbytes, ranks=world))
    if main_rank:
        bl.print_rows(rows, ("algbw GB/s", "algbw_gbps"))
        rep = bl.report(torch, "allreduce", dev, "host clock around 5 batches of back-to-back all-reduces; "
                        "median batch per op, slowest rank", rows,
                        [f"{world} ranks; value = bus bandwidth = algbw x 2(n-1)/n (nccl-tests); time is per all-reduce"])
        rep["nccl"] = nccl
        bl.finish(rep, a.json)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
