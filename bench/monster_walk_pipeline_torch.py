"""PyTorch twin of `ferrograd monster-walk --pipeline 4` under torchrun: the 71-47-23-11-5-11-23-47-71
autoencoder cut into the design document's four stage groups (8 Linear layers, 2 per group), the
groups spread over the ranks (2 GPUs: two groups per GPU), trained with torch.distributed.pipelining's
ScheduleGPipe or Schedule1F1B, Adam (lr 1e-3), MSE, batches of 5041 rows split into micro-batches.

    torchrun --nproc-per-node 2 bench/monster_walk_pipeline_torch.py --copies 113 --epochs 8 \
        --micro-batches 8 --schedule 1f1b --json out.json

Throughput does not depend on the values, so the rows are uniform random numbers (the same count
of rows and steps as the ferrograd run); the JSON gives samples/s and the last loss.
"""

import argparse
import json
import os
import time

import torch
import torch.distributed as dist
from torch import nn

WIDTHS = [71, 47, 23, 11, 5, 11, 23, 47, 71]
SAMPLES = 5041


def group_module(first, last):
    layers = []
    for i in range(first, last):
        layers.append(nn.Linear(WIDTHS[i], WIDTHS[i + 1]))
        if i + 1 < len(WIDTHS) - 1:
            layers.append(nn.ReLU())
    return nn.Sequential(*layers)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--copies", type=int, default=113)
    ap.add_argument("--epochs", type=int, default=8)
    ap.add_argument("--micro-batches", type=int, default=8)
    ap.add_argument("--schedule", default="1f1b", choices=["gpipe", "1f1b"])
    ap.add_argument("--json")
    a = ap.parse_args()
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local = int(os.environ.get("LOCAL_RANK", rank))
    dev = torch.device(f"cuda:{local}")
    torch.cuda.set_device(dev)
    dist.init_process_group("nccl", device_id=dev)
    per = 8 // world
    torch.manual_seed(0)
    full = [group_module(i, i + 1) for i in range(8)]  # every rank draws the whole model alike
    mod = nn.Sequential(*[m for i, m in enumerate(full) if rank * per <= i < (rank + 1) * per]).to(dev)
    mb = SAMPLES // a.micro_batches
    batch = mb * a.micro_batches  # pipelining splits evenly: 5041 rounds down to a multiple of m
    try:
        stage = PipelineStage(mod, rank, world, dev)
    except TypeError:  # torch 2.4 wants an example micro-batch input
        x0 = torch.zeros(mb, WIDTHS[rank * per], device=dev)
        stage = PipelineStage(mod, rank, world, dev, input_args=(x0,))
    cls = ScheduleGPipe if a.schedule == "gpipe" else Schedule1F1B
    sched = cls(stage, n_microbatches=a.micro_batches, loss_fn=nn.functional.mse_loss)
    opt = torch.optim.Adam(mod.parameters(), lr=1e-3)
    g = torch.Generator(device=dev).manual_seed(1)
    data = torch.rand(a.copies, batch, 71, device=dev, generator=g) if rank in (0, world - 1) else None
    steps = a.copies * a.epochs
    last = None
    for k in range(steps + 3):  # 3 warm-up steps, untimed
        if k == 3:
            torch.cuda.synchronize()
            dist.barrier()
            t0 = time.perf_counter()
        x = data[k % a.copies] if data is not None else None
        opt.zero_grad(set_to_none=True)
        if world == 1:
            losses = []
            sched.step(x, target=x, losses=losses)
        elif rank == 0:
            sched.step(x)
        elif rank == world - 1:
            losses = []
            sched.step(target=x, losses=losses)
        else:
            sched.step()
        opt.step()
        if rank == world - 1:
            last = losses
    torch.cuda.synchronize()
    dist.barrier()
    dt = time.perf_counter() - t0
    if rank == world - 1:
        loss = float(torch.stack([l.detach() for l in last]).mean())
        r = {
            "name": "torch.distributed.pipelining",
            "schedule": a.schedule,
            "ranks": world,
            "micro_batches": a.micro_batches,
            "batch": batch,
            "steps": steps,
            "training_time_s": dt,
            "samples_per_s": steps * batch / dt,
            "final_loss": loss,
            "torch": torch.__version__,
        }
        print(json.dumps(r))
        if a.json:
            with open(a.json, "w") as f:
                json.dump(r, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
