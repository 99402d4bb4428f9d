#!/usr/bin/env python3
"""PyTorch twin of `ferrograd gpt train`: the same GPT-2, the same initial weights, the same batches
in the same order, the same optimizer and schedule; eager or torch.compile.

  python3 bench/gpt2_torch.py --init init.safetensors --data data/shakespeare --steps 200 \
      --batch 16 --context 1024 --precision bf16 --mode compile --log torch_compile.jsonl

- Weights: the safetensors file `ferrograd gpt train --save-init FILE` writes (Hugging Face
  GPT2LMHeadModel names, Conv1D [in, out] weights, no lm_head; the model config in its metadata).
  Like ferrograd, the model pads wte to a multiple of 64 rows with zeros and computes the loss over
  the real vocabulary only.
- Data: llm.c token shards, read in ferrograd's order (crates/ferrograd-models/src/gpt/loader.rs):
  shards by file name; a micro-batch reads B*T+1 tokens at position p (x = the first B*T, y = the
  last B*T), then p += B*T; if p + B*T + 1 runs past the shard, the next shard (wrapping) from 0;
  shards shorter than B*T+1 are skipped. Validation: the first --val-batches micro-batches of the
  val shards.
- Step: --total-batch / (B*T) micro-batches, each loss scaled by 1/k, gradients summed; clip the
  global norm to --clip; AdamW (fused on CUDA) with betas (0.9, 0.95), eps 1e-8, weight decay on
  parameters of rank >= 2 only; lr: linear warm-up lr*(s+1)/warmup for s < warmup, then cosine from
  lr to lr*min_ratio at --steps (ferrograd's LrSchedule::WarmupCosine).
- bf16: autocast(bfloat16) with f32 weights; f32: no TF32 anywhere. Attention is
  F.scaled_dot_product_attention(is_causal=True).
- Data parallel: under `torchrun --nproc_per_node N` (WORLD_SIZE > 1) the model is wrapped in
  DistributedDataParallel (NCCL, default 25 MiB buckets, gradients all-reduced during backward;
  `no_sync()` on all but the last micro-step), each rank on cuda:LOCAL_RANK, and --total-batch is
  the global batch: k / N micro-batches per rank, rank r reading micro-batches r, r+N, ... of the
  single-process order (ferrograd's rule, gpt/loader.rs `set_stride`). The logged loss is the mean
  over the ranks, tokens/s counts the whole group, and rank 0 alone prints and writes the log.

Output: one JSON line per logged step, {"kind": "train", "step", "loss", "lr", "grad_norm",
"tokens_per_s", "elapsed_s"}, validation lines {"kind": "val", "step", "val_loss"} and a last
{"kind": "summary", "tokens_per_s", "peak_mem_bytes", "startup_s", ...}: the schema of
ferrograd's log.jsonl, so `ferrograd gpt plot` draws both. Timing rules are ferrograd's: tokens/s
from the end of step min(10, max(1, steps/10)) to the end; startup from the start of this script
to the end of the first step.
"""
import time

T_START = time.perf_counter()

import argparse  # noqa: E402
import contextlib  # noqa: E402
import glob  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import os  # noqa: E402
import sys  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from safetensors import safe_open  # noqa: E402

MAGIC, VERSION = 20240520, 1


# ---- data ---------------------------------------------------------------------------------------

def shard_paths(data, split):
    names = sorted(glob.glob(os.path.join(data, "*.bin")))
    out = []
    for p in names:
        stem = os.path.basename(p)[:-4]
        if stem.startswith(f"{split}_") or f"_{split}_" in stem or stem.endswith(f"_{split}"):
            out.append(p)
    if not out:
        sys.exit(f"error: no {split} shards in {data} (make them with `ferrograd gpt prepare`)")
    return out


def read_shard(path):
    header = np.fromfile(path, dtype=np.int32, count=256)
    if header[0] != MAGIC or header[1] != VERSION:
        sys.exit(f"error: {path}: not an llm.c token shard")
    toks = np.fromfile(path, dtype=np.uint16, offset=1024)
    if len(toks) != header[2]:
        sys.exit(f"error: {path}: header says {header[2]} tokens, file has {len(toks)}")
    return toks


class Loader:
    def __init__(self, data, split, b, t, device, rank=0, world=1):
        self.rank, self.world = rank, world
        self.paths = shard_paths(data, split)
        self.lens = [int(np.fromfile(p, dtype=np.int32, count=3)[2]) for p in self.paths]
        self.b, self.t, self.device = b, t, device
        if max(self.lens) < b * t + 1:
            sys.exit(f"error: {split} shards too short for a micro-batch of {b} x {t}")
        self.reset()

    def reset(self):
        self.shard, self.pos, self.loaded = 0, 0, None

    def advance(self):
        """Where the next micro-batch of the single-process order starts; moves past it."""
        n = self.b * self.t
        while self.pos + n + 1 > self.lens[self.shard]:
            self.shard, self.pos = (self.shard + 1) % len(self.paths), 0
        at = (self.shard, self.pos)
        self.pos += n
        return at

    def next(self):
        n = self.b * self.t
        # Micro-batch `rank` of the next `world` (ferrograd's TokenLoader::set_stride).
        mine = [self.advance() for _ in range(self.world)][self.rank]
        shard, pos = mine
        if self.loaded is None or self.loaded[0] != shard:
            self.loaded = (shard, read_shard(self.paths[shard]))
        buf = torch.from_numpy(self.loaded[1][pos:pos + n + 1].astype(np.int64))
        x, y = buf[:-1].view(self.b, self.t), buf[1:].view(self.b, self.t)
        if self.device.type == "cuda":
            return x.pin_memory().to(self.device, non_blocking=True), y.pin_memory().to(self.device, non_blocking=True)
        return x, y


# ---- model --------------------------------------------------------------------------------------

class Attention(nn.Module):
    def __init__(self, c, h):
        super().__init__()
        self.h = h
        self.c_attn = nn.Linear(c, 3 * c)
        self.c_proj = nn.Linear(c, c)

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = self.c_attn(x).view(b, t, 3, self.h, c // self.h).unbind(2)
        y = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        return self.c_proj(y.transpose(1, 2).reshape(b, t, c))


class Mlp(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.c_fc = nn.Linear(c, 4 * c)
        self.c_proj = nn.Linear(4 * c, c)

    def forward(self, x):
        return self.c_proj(F.gelu(self.c_fc(x), approximate="tanh"))


class Block(nn.Module):
    def __init__(self, c, h, eps):
        super().__init__()
        self.ln_1, self.attn = nn.LayerNorm(c, eps=eps), Attention(c, h)
        self.ln_2, self.mlp = nn.LayerNorm(c, eps=eps), Mlp(c)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class Gpt(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        c, self.vocab = cfg["n_embd"], cfg["vocab_size"]
        padded = (self.vocab + 63) // 64 * 64
        self.wte = nn.Embedding(padded, c)
        self.wpe = nn.Embedding(cfg["n_positions"], c)
        self.h = nn.ModuleList(Block(c, cfg["n_head"], cfg["layer_norm_epsilon"]) for _ in range(cfg["n_layer"]))
        self.ln_f = nn.LayerNorm(c, eps=cfg["layer_norm_epsilon"])

    def forward(self, idx, targets):
        t = idx.shape[1]
        x = self.wte(idx) + self.wpe.weight[:t]
        for blk in self.h:
            x = blk(x)
        logits = F.linear(self.ln_f(x), self.wte.weight)  # tied lm_head, padded vocabulary
        real = logits[..., :self.vocab].float()
        return F.cross_entropy(real.reshape(-1, self.vocab), targets.reshape(-1))


def load_init(path, device):
    with safe_open(path, framework="pt") as f:
        meta = f.metadata() or {}
        if "gpt_config" not in meta:
            sys.exit(f"error: {path}: no gpt_config metadata (write it with `ferrograd gpt train --save-init`)")
        cfg = json.loads(meta["gpt_config"])
        sd = {k.removeprefix("transformer."): f.get_tensor(k) for k in f.keys()}
    model = Gpt(cfg)
    own = dict(model.named_parameters())
    with torch.no_grad():
        for name, p in own.items():
            w = sd.pop(name)
            if name == "wte.weight":
                p.zero_()
                p[: w.shape[0]].copy_(w)
            elif w.dim() == 2 and name != "wpe.weight":
                p.copy_(w.t())  # Conv1D [in, out] -> nn.Linear [out, in]
            else:
                p.copy_(w)
    if sd:
        sys.exit(f"error: {path}: unexpected tensors {sorted(sd)[:3]}")
    return model.to(device), cfg


# ---- training -----------------------------------------------------------------------------------

def lr_at(step, a, warmup):
    if step < warmup:
        return a.lr * (step + 1) / warmup
    lo = a.lr * a.min_lr_ratio
    progress = 1.0 if a.steps <= warmup else min(max((step - warmup) / (a.steps - warmup), 0.0), 1.0)
    return lo + 0.5 * (a.lr - lo) * (1 + math.cos(math.pi * progress))


def main():
    ap = argparse.ArgumentParser(description="PyTorch twin of ferrograd gpt train")
    ap.add_argument("--init", required=True, help="safetensors from `ferrograd gpt train --save-init`")
    ap.add_argument("--data", required=True)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--total-batch", type=int)
    ap.add_argument("--lr", type=float, default=6e-4)
    ap.add_argument("--warmup", type=int)
    ap.add_argument("--min-lr-ratio", type=float, default=0.1)
    ap.add_argument("--weight-decay", type=float, default=0.1)
    ap.add_argument("--clip", type=float, default=1.0)
    ap.add_argument("--precision", choices=["bf16", "f32"], default="bf16")
    ap.add_argument("--mode", choices=["eager", "compile"], default="eager")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--log-every", type=int, default=1)
    ap.add_argument("--val-every", type=int, default=0)
    ap.add_argument("--val-batches", type=int, default=20)
    # --jsonl too: under torchrun a bare --log is an ambiguous prefix of its own --log-dir/--logs-specs
    # (argparse classifies every option string, even those after the script).
    ap.add_argument("--log", "--jsonl", dest="log", help="write the JSON lines here as well as to stdout")
    a = ap.parse_args()

    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    ddp = world > 1
    if ddp:
        import torch.distributed as dist
        from torch.nn.parallel import DistributedDataParallel as DDP
        local = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local)
        a.device = f"cuda:{local}"
        dist.init_process_group("nccl", device_id=torch.device(a.device))
    device = torch.device(a.device)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.set_float32_matmul_precision("highest")
    model, cfg = load_init(a.init, device)
    b, t = a.batch, a.context
    total = a.total_batch or b * t * world
    if total % (b * t * world):
        sys.exit(f"error: --total-batch {total} is not a multiple of {b} x {t} x {world} rank(s)")
    k = total // (b * t * world)
    warmup = a.warmup if a.warmup is not None else min(700, a.steps // 10)
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": a.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    fused = {"fused": True} if device.type == "cuda" else {}
    opt = torch.optim.AdamW(groups, lr=a.lr, betas=(0.9, 0.95), eps=1e-8, **fused)
    wrapped = DDP(model, device_ids=[device.index]) if ddp else model
    fwd = torch.compile(wrapped) if a.mode == "compile" else wrapped
    train = Loader(a.data, "train", b, t, device, rank, world)
    val = Loader(a.data, "val", b, t, device) if a.val_batches > 0 else None
    amp = torch.autocast(device.type, dtype=torch.bfloat16, enabled=a.precision == "bf16")
    logf = open(a.log, "w") if a.log and rank == 0 else None

    def emit(d):
        if rank != 0:
            return
        line = json.dumps(d)
        print(line, flush=True)
        if logf:
            logf.write(line + "\n")
            logf.flush()

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize()

    def evaluate():
        val.reset()
        model.eval()
        s = torch.zeros((), device=device)
        with torch.no_grad(), amp:
            for _ in range(a.val_batches):
                x, y = val.next()
                s += fwd(x, y).float()
        model.train()
        return s.item() / a.val_batches

    emit({"kind": "start", "impl": f"pytorch {a.mode}", "torch": torch.__version__, "device": str(device),
          "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
          "micro_batch": b, "context": t, "grad_accum": k, "world": world, "precision": a.precision,
          "config": cfg})
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    skip = min(max(1, min(10, a.steps // 10)), max(a.steps - 1, 0))
    summary = {"kind": "summary", "impl": f"pytorch {a.mode}", "steps": a.steps}
    t0 = time.perf_counter()
    window, window_steps, window_start, steady, paused = None, 0, time.perf_counter(), None, 0.0
    first = final = final_val = None
    # MEMORY_PHASES=1: allocated bytes after each phase of steps 1-3 (where the peak is, beside
    # ferrograd's FERROGRAD_MEMORY_PHASES).
    phases = os.environ.get("MEMORY_PHASES") == "1" and device.type == "cuda"

    def phase(name):
        if phases and step <= 3:
            g = 1 << 30
            print(f"memory step {step} after {name}: allocated {torch.cuda.memory_allocated(device) / g:.3f} GiB,"
                  f" peak {torch.cuda.max_memory_allocated(device) / g:.3f} GiB", file=sys.stderr, flush=True)

    for step in range(1, a.steps + 1):
        lr = lr_at(step - 1, a, warmup)
        for g in opt.param_groups:
            g["lr"] = lr
        loss_sum = torch.zeros((), device=device)
        for i in range(k):
            x, y = train.next()
            # DDP all-reduces during the last micro-step's backward only.
            grad_sync = wrapped.no_sync() if ddp and i + 1 < k else contextlib.nullcontext()
            with grad_sync:
                with amp:
                    loss = fwd(x, y)
                phase("forward")
                (loss / k).backward()
                phase("backward")
            loss_sum += loss.detach().float()
        if a.clip > 0:
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), a.clip)
        else:
            norm = torch.stack([p.grad.float().norm() for p in model.parameters() if p.grad is not None]).norm()
        opt.step()
        phase("optimizer")
        opt.zero_grad(set_to_none=True)
        mean = loss_sum / k
        window = mean if window is None else window + mean
        window_steps += 1
        if step == 1:
            sync()
            summary["startup_s"] = time.perf_counter() - T_START
        if step == skip and steady is None:
            sync()
            steady = (step, time.perf_counter())
        if step % a.log_every == 0 or step == a.steps:
            if ddp:
                dist.all_reduce(window, op=dist.ReduceOp.AVG)
            loss_v = window.item() / window_steps
            secs = time.perf_counter() - window_start
            emit({"kind": "train", "step": step, "loss": loss_v, "lr": lr, "grad_norm": norm.item(),
                  "tokens_per_s": window_steps * total / max(secs, 1e-9), "elapsed_s": time.perf_counter() - t0})
            first = loss_v if first is None else first
            final = loss_v
            window, window_steps, window_start = None, 0, time.perf_counter()
        if val is not None and ((a.val_every and step % a.val_every == 0) or step == a.steps):
            pause = time.perf_counter()
            final_val = evaluate()
            emit({"kind": "val", "step": step, "val_loss": final_val})
            window_start = time.perf_counter()
            if steady:
                paused += window_start - pause
    sync()
    train_s = time.perf_counter() - t0
    if steady and a.steps > steady[0]:
        tps = (a.steps - steady[0]) * total / (time.perf_counter() - steady[1] - paused)
    else:
        tps = a.steps * total / train_s
    summary.update({"first_loss": first, "final_loss": final, "final_val_loss": final_val, "tokens_per_s": tps,
                    "train_s": train_s,
                    "peak_mem_bytes": torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None})
    emit(summary)
    if ddp:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
