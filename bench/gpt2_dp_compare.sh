#!/usr/bin/env bash
# GPT-2 data parallel beside PyTorch DDP in one device call: for each model in MODELS and each GPU
# count in GPUS, ferrograd (one process on 1 GPU, `ferrograd launch --nproc-per-node N` above) and
# PyTorch (one process, `torchrun --nproc-per-node N` above); the same initial weights per model
# (written by ferrograd's 1-GPU run), the same token shards read in the same order, the same
# global batch at every GPU count (GLOBAL tokens a step: fewer GPUs accumulate more micro-batches
# of BATCH x CONTEXT), bf16 autocast with f32 master weights. Prints tokens/s, each side's scaling
# against its own 1-GPU run (issue 15's target: >= 1.95x on 2 GPUs; issue 20's: >= 95% efficiency)
# and ferrograd's ratio to PyTorch at every count (target >= 1.0x); full logs and a CSV go to
# OUTDIR. Defaults: GPT-2 124M on 1 and 2 GPUs with eager twins (kind nvidia-h200-x2, ~3 minutes).
#
#   BUNDLE=.gpu DATA=.gpu/data/shakespeare bash bench/gpt2_dp_compare.sh [STEPS] [OUTDIR]
#   GPUS="1 2 4 8" MODELS="gpt2 gpt2-medium" TORCH_MODE=compile GLOBAL=524288 bash bench/gpt2_dp_compare.sh 20
#
# Environment: DATA (token shards, default data/shakespeare), BUNDLE (the bundle folder; ferrograd
# runs as `bash $BUNDLE/run bin ferrograd`), PY_DIR (where gpt2_torch.py is; default beside this
# script), GPUS ("1 2"; counts above the machine's GPU count are skipped and said), MODELS
# ("gpt2"), BATCH (16), CONTEXT (1024), GLOBAL (max(GPUS) x BATCH x CONTEXT), TORCH_MODE (eager |
# compile), BF16_COMM (1: also ferrograd with bf16 gradients at the largest count), PRECOMPILE (1).
# Timing rule (both sides): tokens/s from the end of step min(10, STEPS/10) to the end, leaving
# out validation and checkpoints; with STEPS=30 that is the last 27 steps.
set -uo pipefail
steps=${1:-30}; out=${2:-${OUT:-/tmp}/gpt2-dp}
data=${DATA:-data/shakespeare}
bundle=${BUNDLE:-.gpu}
py_dir=${PY_DIR:-$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)}
read -r -a gpus <<< "${GPUS:-1 2}"
read -r -a models <<< "${MODELS:-gpt2}"
torch_mode=${TORCH_MODE:-eager}
have=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)
max=1; for g in "${gpus[@]}"; do [ "$g" -gt "$max" ] && max=$g; done
batch=${BATCH:-16}; ctx=${CONTEXT:-1024}; global=${GLOBAL:-$((max * batch * ctx))}
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
: > "$out/status.txt"
run() { # run NAME COMMAND...: its output in $out/NAME.log, the last lines shown
  local name=$1; shift
  echo "== $name: $*"
  local t0=$SECONDS
  "$@" > "$out/$name.log" 2>&1
  local rc=$?
  tail -n 3 "$out/$name.log"
  echo "$name rc=$rc $((SECONDS - t0))s" >> "$out/status.txt"
}
port=29631
for m in "${models[@]}"; do
  init="$out/init-$m.safetensors"
  for g in "${gpus[@]}"; do
    if [ "$g" -gt "$have" ]; then
      echo "$m ${g}gpu skipped: this machine has $have GPUs" >> "$out/status.txt"; continue
    fi
    port=$((port + 3))
    if [ "$g" = 1 ]; then
      run "fg-$m-1" "${fg[@]}" gpt train --device cuda:0 --data "$data" --out "$out/fg-$m-1" --model "$m" \
        "${common[@]}" --save-init "$init" --progress lines
      run "pt-$m-1" python3 "$py_dir/gpt2_torch.py" --init "$init" --data "$data" "${common[@]}" \
        --mode "$torch_mode" --jsonl "$out/pt-$m-1.jsonl"
      continue
    fi
    run "fg-$m-$g" "${fg[@]}" launch --nproc-per-node "$g" --master-port "$port" -- ferrograd gpt train \
      --data "$data" --out "$out/fg-$m-$g" --init "$init" "${common[@]}" --progress lines
    if [ "${BF16_COMM:-1}" = 1 ] && [ "$g" = "$max" ]; then
      run "fgbf16-$m-$g" "${fg[@]}" launch --nproc-per-node "$g" --master-port $((port + 1)) -- ferrograd \
        gpt train --data "$data" --out "$out/fgbf16-$m-$g" --init "$init" "${common[@]}" --comm-dtype bf16 \
        --progress lines
    fi
    run "pt-$m-$g" python3 -m torch.distributed.run --nproc-per-node "$g" --master-port $((port + 2)) \
      "$py_dir/gpt2_torch.py" --init "$init" --data "$data" "${common[@]}" --mode "$torch_mode" \
      --jsonl "$out/pt-$m-$g.jsonl"
  done
done

python3 - "$out" "$steps" "$global" "$torch_mode" <<'PY' | tee "$out/summary.txt"
import glob, json, os, re, sys
out, steps, glob_tokens, mode = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]

def summary(path):
    try:
        lines = [json.loads(l) for l in open(path) if l.strip().startswith("{")]
    except OSError:
        return None
    s = [d for d in lines if d.get("kind") == "summary"]
    return s[-1] if s else None

# name -> (side, model, gpus, log): ferrograd writes OUT/NAME/log.jsonl, the twin OUT/NAME.jsonl
runs = []
for name in sorted(set(re.sub(r"\.log$", "", os.path.basename(p)) for p in glob.glob(f"{out}/*-*-*.log"))):
    side, model, g = re.match(r"(fg|fgbf16|pt)-(.+)-(\d+)$", name).groups()
    log = f"{out}/{name}/log.jsonl" if side.startswith("fg") else f"{out}/{name}.jsonl"
    runs.append((side, model, int(g), summary(log)))
label = {"fg": "ferrograd", "fgbf16": "ferrograd bf16 grads", "pt": f"pytorch {mode}"}
print(f"\n==== GPT-2 data parallel: {steps} steps, {glob_tokens} tokens a step (global), bf16 autocast ====")
print(f"{'model':<12}{'run':<22}{'GPUs':>5}{'tokens/s':>12}{'scaling':>9}{'effic.':>8}{'vs PyTorch':>11}"
      f"{'final loss':>12}{'peak GiB':>10}")
got = {(side, model, g): s for side, model, g, s in runs}
csv = ["model,run,gpus,tokens_per_s,scaling,efficiency,vs_pytorch,final_loss,peak_gib"]
for side, model, g, s in sorted(runs, key=lambda r: (r[1], r[0] == "pt", r[0], r[2])):
    if s is None:
        print(f"{model:<12}{label[side]:<22}{g:>5}   (no summary: see {side}-{model}-{g}.log)")
        continue
    one = got.get(("pt" if side == "pt" else "fg", model, 1))
    scale = s["tokens_per_s"] / one["tokens_per_s"] if one and g > 1 else None
    pt = got.get(("pt", model, g))
    vs = s["tokens_per_s"] / pt["tokens_per_s"] if side != "pt" and pt else None
    mem = (s.get("peak_mem_bytes") or 0) / 2**30
    f = lambda x, spec, suf="": f"{x:{spec}}{suf}" if x is not None else "-"
    print(f"{model:<12}{label[side]:<22}{g:>5}{s['tokens_per_s']:>12,.0f}{f(scale, '.3f', 'x'):>9}"
          f"{f(scale / g * 100 if scale else None, '.1f', '%'):>8}{f(vs, '.3f', 'x'):>11}"
          f"{s.get('final_loss') or float('nan'):>12.4f}{mem:>10.1f}")
    csv.append(f"{model},{label[side]},{g},{s['tokens_per_s']:.0f},{scale or ''},{scale / g if scale else ''},"
               f"{vs or ''},{s.get('final_loss')},{mem:.2f}")
open(f"{out}/scaling.csv", "w").write("\n".join(csv) + "\n")
print("scaling: tokens/s against the same side's 1-GPU run; efficiency = scaling / GPUs;")
print("peak GiB: ferrograd's allocator on rank 0 (per GPU); PyTorch's max_memory_allocated on rank 0")
print("status:", "; ".join(l.strip() for l in open(f"{out}/status.txt")))
try:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6, 4))
    for (side, model) in sorted({(r[0], r[1]) for r in runs if r[3]}):
        pts = sorted((g, s["tokens_per_s"]) for sd, m, g, s in runs if sd == side and m == model and s)
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=f"{label[side]} {model}")
    ax.set_xlabel("GPUs"); ax.set_ylabel("tokens/s"); ax.set_xscale("log", base=2); ax.legend(fontsize=7)
    ax.set_title("GPT-2 data parallel, bf16"); fig.tight_layout(); fig.savefig(f"{out}/scaling.png", dpi=120)
    print(f"plot: {out}/scaling.png")
except ImportError:
    print("plot: matplotlib not installed; the table is in scaling.csv")
PY
