#!/usr/bin/env bash
# GPT-2 124M data parallel beside PyTorch DDP in one device call (kind nvidia-h200-x2, about 3
# minutes): ferrograd on 1 GPU, ferrograd on 2 GPUs under `ferrograd launch`, PyTorch eager on
# 1 GPU and PyTorch DDP (eager) on 2 GPUs under torchrun; the same initial weights (written by
# ferrograd), the same token shards read in the same order, the same global batch (GLOBAL tokens
# a step: 2 micro-batches of BATCH x CONTEXT on 1 GPU, one on each of 2), bf16 autocast with f32
# master weights. Prints tokens/s, the 2-GPU scaling of each (target >= 1.95x) and ferrograd's
# ratio to DDP (target >= 1.0x); the full logs go to OUTDIR.
#
#   BUNDLE=.gpu DATA=.gpu/data/shakespeare bash bench/gpt2_dp_compare.sh [STEPS] [OUTDIR]
#
# Environment: DATA (token shards, default data/shakespeare), BUNDLE (the bundle folder; ferrograd
# runs as `bash $BUNDLE/run bin ferrograd`), PY_DIR (where gpt2_torch.py is; default beside this
# script), MODEL_FLAGS ("--model gpt2"), BATCH (16), CONTEXT (1024), GLOBAL (2 x BATCH x CONTEXT),
# BF16_COMM (1: also ferrograd on 2 GPUs with bf16 gradients), PRECOMPILE (1).
# Timing rule (both sides): tokens/s from the end of step min(10, STEPS/10) to the end, leaving
# out validation and checkpoints; with STEPS=30 that is the last 27 steps.
set -uo pipefail
steps=${1:-30}; out=${2:-${OUT:-/tmp}/gpt2-dp}
data=${DATA:-data/shakespeare}
bundle=${BUNDLE:-.gpu}
py_dir=${PY_DIR:-$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)}
read -r -a model <<< "${MODEL_FLAGS:---model gpt2}"
batch=${BATCH:-16}; ctx=${CONTEXT:-1024}; global=${GLOBAL:-$((2 * batch * ctx))}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
# NVLink multicast stays off (KINDS.md); our launcher sets it too, torchrun does not.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
fg=(bash "$bundle/run" bin ferrograd)
if ! compgen -G "$data/train_*.bin" >/dev/null; then
  echo "error: no token shards ($data/train_*.bin): scripts/get-shakespeare.sh makes them" >&2
  exit 2
fi
[ "${PRECOMPILE:-1}" = 1 ] && "${fg[@]}" kernels --precompile > "$out/precompile.log" 2>&1
common=(--steps "$steps" --batch "$batch" --context "$ctx" --total-batch "$global" --precision bf16
  --val-every 0 --val-batches 2 --log-every 5)
run() { # run NAME COMMAND...: its output in $out/NAME.log, the last lines shown
  local name=$1; shift
  echo "== $name: $*"
  local t0=$SECONDS
  "$@" > "$out/$name.log" 2>&1
  local rc=$?
  tail -n 3 "$out/$name.log"
  echo "$name rc=$rc $((SECONDS - t0))s" >> "$out/status.txt"
}
: > "$out/status.txt"
run ferrograd_1gpu "${fg[@]}" gpt train --device cuda:0 --data "$data" --out "$out/ferrograd_1gpu" "${model[@]}" \
  "${common[@]}" --save-init "$out/init.safetensors" --progress lines
run ferrograd_2gpu "${fg[@]}" launch --nproc-per-node 2 --master-port 29631 -- ferrograd gpt train \
  --data "$data" --out "$out/ferrograd_2gpu" --init "$out/init.safetensors" "${common[@]}" --progress lines
if [ "${BF16_COMM:-1}" = 1 ]; then
  run ferrograd_2gpu_bf16 "${fg[@]}" launch --nproc-per-node 2 --master-port 29632 -- ferrograd gpt train \
    --data "$data" --out "$out/ferrograd_2gpu_bf16" --init "$out/init.safetensors" "${common[@]}" \
    --comm-dtype bf16 --progress lines
fi
run torch_1gpu python3 "$py_dir/gpt2_torch.py" --init "$out/init.safetensors" --data "$data" "${common[@]}" \
  --mode eager --jsonl "$out/torch_1gpu.jsonl"
run torch_ddp_2gpu python3 -m torch.distributed.run --nproc-per-node 2 --master-port 29633 "$py_dir/gpt2_torch.py" \
  --init "$out/init.safetensors" --data "$data" "${common[@]}" --mode eager --jsonl "$out/torch_ddp_2gpu.jsonl"

python3 - "$out" "$steps" "$global" <<'PY' | tee "$out/summary.txt"
import json, os, sys
out, steps, glob_tokens = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])

def summary(path):
    try:
        lines = [json.loads(l) for l in open(path) if l.strip().startswith("{")]
    except OSError:
        return None
    s = [d for d in lines if d.get("kind") == "summary"]
    return s[-1] if s else None

runs = [
    ("ferrograd", 1, f"{out}/ferrograd_1gpu/log.jsonl"),
    ("ferrograd", 2, f"{out}/ferrograd_2gpu/log.jsonl"),
    ("ferrograd bf16 grads", 2, f"{out}/ferrograd_2gpu_bf16/log.jsonl"),
    ("pytorch eager", 1, f"{out}/torch_1gpu.jsonl"),
    ("pytorch DDP eager", 2, f"{out}/torch_ddp_2gpu.jsonl"),
]
got = {(n, g): summary(p) for n, g, p in runs}
print(f"\n==== GPT-2 data parallel: {steps} steps, {glob_tokens} tokens a step (global), bf16 autocast ====")
print(f"{'run':<22}{'GPUs':>5}{'tokens/s':>12}{'scaling':>9}{'final loss':>12}{'peak GiB':>10}")
base = {"ferrograd": got.get(("ferrograd", 1)), "pytorch": got.get(("pytorch eager", 1))}
for n, g, _ in runs:
    s = got[(n, g)]
    if s is None:
        if os.path.exists(f"{out}/status.txt"):
            print(f"{n:<22}{g:>5}   (no summary: see its log)")
        continue
    b = base["ferrograd" if n.startswith("ferrograd") else "pytorch"]
    scale = f"{s['tokens_per_s'] / b['tokens_per_s']:.3f}x" if b and g > 1 else "-"
    mem = s.get("peak_mem_bytes")
    print(f"{n:<22}{g:>5}{s['tokens_per_s']:>12,.0f}{scale:>9}{s.get('final_loss') or float('nan'):>12.4f}"
          f"{(mem or 0) / 2**30:>10.1f}")
f2, t2 = got.get(("ferrograd", 2)), got.get(("pytorch DDP eager", 2))
if f2 and t2:
    print(f"ferrograd 2 GPUs / PyTorch DDP 2 GPUs: {f2['tokens_per_s'] / t2['tokens_per_s']:.3f}x (target >= 1.0x)")
if f2 and base["ferrograd"]:
    print(f"ferrograd scaling 1 -> 2 GPUs: {f2['tokens_per_s'] / base['ferrograd']['tokens_per_s']:.3f}x (target >= 1.95x)")
print("peak GiB: ferrograd's allocator on rank 0 (2 GPUs: per GPU); PyTorch's max_memory_allocated on rank 0")
print("status:", "; ".join(l.strip() for l in open(f"{out}/status.txt")))
PY
