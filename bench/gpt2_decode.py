#!/usr/bin/env python3
"""GPT-2 124M decode latency, ferrograd beside Hugging Face transformers on the same GPU.

A random `GPT2LMHeadModel` of GPT-2's shape (124M) is saved with `save_pretrained`; `ferrograd gpt
sample` decodes greedily from it (KV cache, each step's logits read back to the host, which the
sampler needs) and prints its median milliseconds per token; the same model in transformers
decodes the same number of tokens with its KV cache (`past_key_values`), each step's last logits
read back too. Rows: f32, bf16 (ferrograd `--bf16` autocast, transformers' weights in bf16),
and ferrograd's int8 W8A16 / W8A8 (quantized on load; no transformers twin). ferrograd replays its
decode step as a CUDA graph (its `--no-graph` rows run it op by op); the PyTorch column with a CUDA
graph is bench/torch_gpt2_graph_decode.py (static KV cache, the step captured once), whose f32
greedy tokens are checked against transformers' own.

    python3 bench/gpt2_decode.py [--ferrograd CMD] [--tokens 256] [--profile]

--profile also prints ferrograd's per-kernel device time of a bf16 decode (FERROGRAD_PROFILE=1):
the kernels' sum per token against the wall time per token says how much is host overhead.

Random weights decode as fast as trained ones: the work per token does not depend on them.
"""
import argparse
import os
import re
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import transformers

sys.path.insert(0, str(Path(__file__).resolve().parent))


def ferrograd(args, extra, env=None):
    cmd = shlex.split(args.ferrograd) + ["gpt", "sample"] + extra
    p = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if p.returncode != 0:
        sys.exit(f"{' '.join(cmd)} failed:\n{p.stderr[-2000:]}")
    m = re.search(r"([0-9.]+) ms/token median, ([0-9.]+) mean", p.stderr)
    if not m:
        sys.exit(f"no ms/token in:\n{p.stderr[-2000:]}")
    if env is not None:
        print(p.stderr[p.stderr.find("ferrograd profile"):])
    return float(m.group(1)), float(m.group(2))


@torch.no_grad()
def hf_decode(model, tokens, prompt):
    ids = torch.tensor([prompt], device="cuda")
    out = model(ids, use_cache=True)
    past, nxt = out.past_key_values, out.logits[:, -1].float().argmax(-1, keepdim=True)
    times, chosen = [], [int(nxt)]
    for _ in range(tokens - 1):
        t0 = time.perf_counter()
        out = model(nxt, past_key_values=past, use_cache=True)
        logits = out.logits[:, -1].float().cpu()
        times.append(time.perf_counter() - t0)
        past = out.past_key_values
        nxt = logits.argmax(-1, keepdim=True).cuda()
        chosen.append(int(nxt))
    return 1e3 * statistics.median(times), 1e3 * statistics.mean(times), chosen


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ferrograd", default=os.environ.get("FERROGRAD", "bash .gpu/run bin ferrograd"))
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--profile", action="store_true")
    args = ap.parse_args()
    torch.manual_seed(0)
    cfg = transformers.GPT2Config()  # GPT-2 124M
    model = transformers.GPT2LMHeadModel(cfg).eval()
    # ferrograd's tokenizer turns "ROMEO:" into 3 ids; transformers gets 3 ids too.
    prompt = [49, 2662, 46]
    rows = []
    with tempfile.TemporaryDirectory() as d:
        model.save_pretrained(d, safe_serialization=True)
        common = ["--checkpoint", d, "--prompt", "ROMEO:", "--tokens", str(args.tokens), "--temperature", "0",
                  "--ignore-eot", "--device", "cuda"]
        for name, extra in [("f32", []), ("bf16", ["--bf16"]), ("int8 W8A16", ["--bf16", "--int8", "w8a16"]),
                            ("int8 W8A8", ["--bf16", "--int8", "w8a8"]), ("f32 op by op", ["--no-graph"]),
                            ("bf16 op by op", ["--bf16", "--no-graph"])]:
            ferrograd(args, common + extra)  # warm: kernels compiled and cached
            rows.append((name, ferrograd(args, common + extra)))
        if args.profile:
            print("ferrograd bf16 decode under FERROGRAD_PROFILE=1:")
            ferrograd(args, common + ["--bf16"], env={**os.environ, "FERROGRAD_PROFILE": "1"})
    cuda = model.cuda()
    hf = {"f32": hf_decode(cuda, args.tokens, prompt)}
    # PyTorch with a static cache and the step as a CUDA graph, the weights of the same model
    # (taken before the model is cast to bf16 below).
    from torch_gpt2_graph_decode import GraphDecoder  # noqa: PLC0415
    graph = {}
    for name, dtype in [("f32", torch.float32), ("bf16", torch.bfloat16)]:
        dec = GraphDecoder(cuda, len(prompt) + args.tokens, dtype)
        dec.greedy(prompt, 16)
        graph[name] = dec.greedy(prompt, args.tokens)
        del dec
    hf_decode(cuda.to(torch.bfloat16), 16, prompt)
    hf["bf16"] = hf_decode(cuda, args.tokens, prompt)
    # PyTorch's SDPA picks cuDNN for bf16 on Hopper, which plans per key length (every decode step,
    # as ferrograd's auto choice did): the same loop with cuDNN's SDPA excluded.
    from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: PLC0415
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]):
        hf_decode(cuda, 16, prompt)
        hf["bf16, SDPA without cuDNN"] = hf_decode(cuda, args.tokens, prompt)
    same = sum(a == b for a, b in zip(graph["f32"][2], hf["f32"][2]))
    print(f"PyTorch graph twin, f32: {same} of {len(hf['f32'][2])} greedy tokens equal transformers' own")
    print(f"GPT-2 124M greedy decode, {args.tokens} tokens, batch 1, {torch.cuda.get_device_name()}, "
          f"torch {torch.__version__}, transformers {transformers.__version__}; ms/token median / mean")
    print("| precision | ferrograd (CUDA graph) | ferrograd op by op | PyTorch static cache + CUDA graph "
          "| transformers | ferrograd / PyTorch graph | ferrograd / transformers |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    res = dict(rows)
    for name in ["f32", "bf16", "int8 W8A16", "int8 W8A8"]:
        med, mean = res[name]
        eager = res.get(name + " op by op")
        g, t = graph.get(name), hf.get(name)
        cell = lambda x: f"{x[0]:.3f} / {x[1]:.3f}" if x else "-"  # noqa: E731
        print(f"| {name} | {med:.3f} / {mean:.3f} | {cell(eager)} | {cell(g)} | {cell(t)} | "
              f"{f'{g[0] / med:.2f}x' if g else '-'} | {f'{t[0] / med:.2f}x' if t else '-'} |")
    t = hf["bf16, SDPA without cuDNN"]
    print(f"transformers bf16 with SDPA without cuDNN: {t[0]:.3f} / {t[1]:.3f} ms/token "
          f"(ferrograd bf16 {t[0] / res['bf16'][0]:.2f}x faster)")


if __name__ == "__main__":
    main()
