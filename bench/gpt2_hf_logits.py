#!/usr/bin/env python3
"""Hugging Face check of `ferrograd gpt`: the same weights give the same logits.

1. A small random `transformers.GPT2LMHeadModel` (every parameter perturbed, so biases and layer
   norms matter), saved with `save_pretrained` (config.json + model.safetensors).
2. `ferrograd gpt logits` loads that directory and writes its logits for a token sequence; they
   must equal the model's own in float32 to --tol (default 1e-4, absolute).
3. The reverse: ferrograd writes the model it loaded as a save_pretrained directory
   (`--save-pretrained`), `GPT2LMHeadModel.from_pretrained` reads it, and its logits must match too.

    python3 bench/gpt2_hf_logits.py [--ferrograd CMD] [--device cpu|cuda] [--layers 2 --heads 2 --dim 128]

Exit status 0 when both agree, 1 otherwise. Needs torch, transformers and safetensors.
"""
import argparse
import os
import shlex
import subprocess
import sys
import tempfile

import torch
from safetensors.torch import load_file


def ferrograd_cmd(given):
    """The ferrograd command as a list: --ferrograd or $FERROGRAD (a path, or a command line such
    as `bash .gpu/run bin ferrograd`), else the first binary found."""
    for c in [given, os.environ.get("FERROGRAD")]:
        if c:
            return shlex.split(c)
    for c in [".gpu/bin/ferrograd", "target/release/ferrograd", "target/debug/ferrograd"]:
        if os.path.exists(c):
            return [c]
    sys.exit("error: no ferrograd binary (build it, or pass --ferrograd / set FERROGRAD)")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ferrograd")
    ap.add_argument("--device", default="cpu", help="where ferrograd runs (cpu, cuda)")
    ap.add_argument("--layers", type=int, default=2)
    # Head dim 64 (GPT-2's): on CUDA the attention kernels run, not the fallback for other dims.
    ap.add_argument("--heads", type=int, default=2)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--positions", type=int, default=128)
    ap.add_argument("--tokens", type=int, default=37, help="sequence length (odd on purpose)")
    ap.add_argument("--tol", type=float, default=1e-4)
    ap.add_argument("--keep", help="keep the files in this directory")
    a = ap.parse_args()
    from transformers import GPT2Config, GPT2LMHeadModel

    fg = ferrograd_cmd(a.ferrograd)
    torch.manual_seed(0)
    cfg = GPT2Config(vocab_size=50257, n_positions=a.positions, n_embd=a.dim, n_layer=a.layers, n_head=a.heads,
                     activation_function="gelu_new", resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    model = GPT2LMHeadModel(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias") or ".ln_" in name:
                p.add_(0.1 * torch.randn_like(p))
    ids = torch.randint(0, cfg.vocab_size, (1, a.tokens), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = model(ids).logits[0].float()

    d = a.keep or tempfile.mkdtemp(prefix="gpt2-hf-")
    os.makedirs(d, exist_ok=True)
    hf_dir, ours_dir, out = os.path.join(d, "hf"), os.path.join(d, "ferrograd"), os.path.join(d, "logits.safetensors")
    model.save_pretrained(hf_dir, safe_serialization=True)
    cmd = fg + ["gpt", "logits", "--checkpoint", hf_dir, "--ids", ",".join(str(int(t)) for t in ids[0]),
           "--out", out, "--device", a.device, "--save-pretrained", ours_dir]
    print("$", " ".join(cmd[:len(fg) + 2]), "...", flush=True)
    subprocess.run(cmd, check=True)
    got = load_file(out)["logits"].float()
    err = (got - want).abs().max().item()
    ok = got.shape == want.shape and err <= a.tol
    print(f"transformers -> ferrograd: logits {tuple(got.shape)}, max |diff| {err:.3e} (tol {a.tol:g}):"
          f" {'PASS' if ok else 'FAIL'}")

    back = GPT2LMHeadModel.from_pretrained(ours_dir).eval()
    with torch.no_grad():
        again = back(ids).logits[0].float()
    err2 = (again - want).abs().max().item()
    ok2 = err2 <= a.tol
    print(f"ferrograd -> transformers: from_pretrained of our save_pretrained, max |diff| {err2:.3e}:"
          f" {'PASS' if ok2 else 'FAIL'}")
    sys.exit(0 if ok and ok2 else 1)


if __name__ == "__main__":
    main()
