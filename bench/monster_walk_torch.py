#!/usr/bin/env python3
"""PyTorch twin of `ferrograd monster-walk` (shared/MONSTER_WALK.md).

Same model (71-47-23-11-5-11-23-47-71, ReLU between, linear output), same init weights (read from
the safetensors file ferrograd also loads with --init), same data (the `values` of copies
0..N-1 exported by `ferrograd monster-walk export --values-of N`), Adam lr 1e-3, one copy per step,
every copy resident on the GPU. Two variants, each from the same init:

  eager: torch.optim.Adam(fused=True), plain Python loop
  graph: one whole step (forward, backward, Adam) captured as a CUDA graph and replayed

  python3 bench/monster_walk_torch.py --write-init init.safetensors --seed 0
  python3 bench/monster_walk_torch.py --init init.safetensors --values values.safetensors \
      --copies 113 --epochs 71 --json torch.json
"""
import argparse
import json
import sys
import time

import torch
import torch.nn as nn
from safetensors.torch import load_file, save_file

WIDTHS = [71, 47, 23, 11, 5, 11, 23, 47, 71]


def make_model():
    layers = []
    for i in range(len(WIDTHS) - 1):
        layers.append(nn.Linear(WIDTHS[i], WIDTHS[i + 1]))
        if i < len(WIDTHS) - 2:
            layers.append(nn.ReLU())
    return nn.Sequential(*layers)


def fill_like_ferrograd(values, copies):
    """The other three resident representations, so the GPU holds what ferrograd's run holds."""
    r = torch.arange(71, device=values.device, dtype=torch.float32)
    t = torch.round(values * (r + 1))
    theta = 2 * torch.pi * t / (r + 2)
    return {
        "residues": t.to(torch.uint8),
        "complex": torch.stack([theta.cos(), theta.sin()], -1),
        "ring_onehot": torch.nn.functional.one_hot(t.long().reshape(copies, -1), 72).float(),
    }


def train(model, xs, epochs, lr, graph, adam_impl="fused"):
    # adam_impl "foreach" is PyTorch's other Adam: same formula, another rounding order (used to
    # measure how far two correct runs drift apart over thousands of steps).
    kw = {"fused": True} if adam_impl == "fused" else {"foreach": True}
    opt = torch.optim.Adam(model.parameters(), lr=lr, betas=(0.9, 0.999), eps=1e-8, capturable=graph, **kw)
    loss_fn = nn.functional.mse_loss
    copies = xs.shape[0]
    first = None
    if not graph:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(epochs):
            for c in range(copies):
                x = xs[c]
                loss = loss_fn(model(x), x)
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
                if first is None:
                    first = loss.item()
        torch.cuda.synchronize()
        return time.perf_counter() - t0, first, loss.item()
    # Whole-step capture (PyTorch docs, "whole network capture"): warm up on a side stream, then
    # capture forward + backward + step; each replay trains on whatever static_x holds. The warm-up
    # steps count as training steps (the model starts from the same init either way).
    static_x = xs[0].clone()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    warm = 0
    with torch.cuda.stream(s):
        for c in range(3):
            static_x.copy_(xs[c % copies])
            opt.zero_grad(set_to_none=True)
            loss = loss_fn(model(static_x), static_x)
            loss.backward()
            opt.step()
            warm += 1
            if first is None:
                first = loss.item()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    opt.zero_grad(set_to_none=True)
    with torch.cuda.graph(g):
        static_loss = loss_fn(model(static_x), static_x)
        static_loss.backward()
        opt.step()
    torch.cuda.synchronize()
    steps = epochs * copies - warm
    t0 = time.perf_counter()
    for i in range(steps):
        static_x.copy_(xs[(i + warm) % copies])
        g.replay()
    torch.cuda.synchronize()
    return time.perf_counter() - t0, first, static_loss.item()


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--write-init", help="write PyTorch-default init weights here and exit")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--init")
    p.add_argument("--values")
    p.add_argument("--copies", type=int, default=113)
    p.add_argument("--epochs", type=int, default=71)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--variants", default="eager,graph", help="eager, graph, eager-foreach")
    p.add_argument("--json")
    a = p.parse_args()
    if a.write_init:
        torch.manual_seed(a.seed)
        save_file({k: v.contiguous() for k, v in make_model().state_dict().items()}, a.write_init)
        print(f"wrote {a.write_init}")
        return
    if not (a.init and a.values):
        p.error("--init and --values are required to train")
    if not torch.cuda.is_available():
        sys.exit("error: no CUDA device for the PyTorch twin")
    dev = torch.device("cuda")
    vals = load_file(a.values)["values"]
    if vals.shape[0] < a.copies:
        # Copies repeat every 95 (the walk's rotation); the export may hold fewer than --copies.
        reps = (a.copies + vals.shape[0] - 1) // vals.shape[0]
        vals = vals.repeat(reps, 1, 1, 1)
    vals = vals[: a.copies].to(dev)
    resident = fill_like_ferrograd(vals, a.copies)
    xs = vals.reshape(a.copies, 71 * 71, 71)
    init = load_file(a.init)
    rows = {}
    for variant in a.variants.split(","):
        model = make_model().to(dev)
        model.load_state_dict({k: v.to(dev) for k, v in init.items()})
        secs, first, final = train(model, xs, a.epochs, a.lr, variant == "graph",
                                   "foreach" if variant.endswith("foreach") else "fused")
        samples = a.epochs * a.copies * 71 * 71
        rows[variant] = {"training_time_s": secs, "samples_per_s": samples / secs, "first_loss": first,
                         "final_loss": final}
        print(f"torch {variant}: {secs:.3f} s, {samples / secs:.0f} samples/s, loss {first:.6f} -> {final:.6f}",
              flush=True)
    out = {"bench": "monster-walk", "device": torch.cuda.get_device_name(), "copies": a.copies,
           "epochs": a.epochs, "resident_bytes": sum(t.numel() * t.element_size() for t in resident.values())
           + vals.numel() * 4, "torch": torch.__version__, "variants": rows}
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=2)


if __name__ == "__main__":
    main()
