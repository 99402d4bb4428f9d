#!/usr/bin/env bash
# One command on a GPU machine: Monster Walk in ferrograd (the persistent kernel in its three
# precisions, the fused step, the autograd path) and in PyTorch (eager and CUDA graph), from the
# same init weights and data, then the ratios.
#   bash bench/monster_walk_compare.sh [COPIES] [EPOCHS] [OUTDIR]
# TORCH_VARIANTS=graph skips PyTorch's eager run (17 s on an H200).
set -euo pipefail
copies=${1:-113}; epochs=${2:-71}; out=${3:-${OUT:-/tmp}/monster-walk}
fg=${FERROGRAD:-.gpu/bin/ferrograd}; [ -x "$fg" ] || fg=target/release/ferrograd
variants=${TORCH_VARIANTS:-eager,graph}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
python3 bench/monster_walk_torch.py --write-init "$out/init.safetensors" --seed 0
n=$(( copies < 95 ? copies : 95 ))   # copies repeat every 95
"$fg" monster-walk export --values-of "$n" --out "$out/values.safetensors"
mw() { "$fg" monster-walk --device cuda --copies "$copies" --epochs "$epochs" --init "$out/init.safetensors" "$@"; }
mw --report "$out/ferrograd.json"
mw --precision tf32 --report "$out/ferrograd_tf32.json" | tail -4
mw --precision bf16 --report "$out/ferrograd_bf16.json" | tail -4
mw --step fused --report "$out/ferrograd_fused.json" | tail -3
mw --step unfused --report "$out/ferrograd_unfused.json" | tail -3
python3 bench/monster_walk_torch.py --init "$out/init.safetensors" --values "$out/values.safetensors" \
  --copies "$copies" --epochs "$epochs" --variants "$variants" --json "$out/torch.json"
# Early agreement (20 steps): both sides should match to rounding before chaos sets in.
"$fg" monster-walk --device cuda --copies 2 --epochs 10 --init "$out/init.safetensors" --report "$out/f20.json" >/dev/null
python3 bench/monster_walk_torch.py --init "$out/init.safetensors" --values "$out/values.safetensors" \
  --copies 2 --epochs 10 --variants eager --json "$out/t20.json" >/dev/null
python3 - "$out" <<'PY'
import json, os, sys
d = sys.argv[1]
f = json.load(open(f"{d}/ferrograd.json")); t = json.load(open(f"{d}/torch.json"))
runs = [f] + [json.load(open(f"{d}/{n}.json")) for n in
              ("ferrograd_tf32", "ferrograd_bf16", "ferrograd_fused", "ferrograd_unfused")
              if os.path.exists(f"{d}/{n}.json")]
print(f"\nMonster Walk {f['copies']} copies x {f['epochs']} epochs on {f['device']}")
print(f"{'run':<34}{'time s':>9}{'samples/s':>14}{'entries/s':>11}{'final loss':>12}{'vs graph':>10}")
g = t["variants"].get("graph", {}).get("training_time_s")
def label(r):
    p = r.get("precision")
    return "ferrograd " + r["step_kind"] + (f" {p.split()[0]}" if p else "")
for r in runs:
    sp = f"{g / r['training_time_s']:.1f}x" if g else ""
    print(f"{label(r):<34}{r['training_time_s']:>9.3f}{r['samples_per_s']:>14.0f}{r['entries_per_s']:>11.2e}"
          f"{r['final_loss']:>12.6f}{sp:>10}")
for k, v in t["variants"].items():
    print(f"{'pytorch ' + k:<34}{v['training_time_s']:>9.3f}{v['samples_per_s']:>14.0f}"
          f"{v['samples_per_s'] * 71:>11.2e}{v['final_loss']:>12.6f}")
print(f"{'the seed estimate':<34}{0.71:>9.3f}{40443943 / 0.71:>14.0f}{4.04e9:>11.2e}")
for k, v in t["variants"].items():
    rel = abs(f["final_loss"] - v["final_loss"]) / abs(v["final_loss"])
    print(f"final loss vs pytorch {k}: {100 * rel:.3f}% apart")
if f.get("phases"):
    p = f["phases"]
    print(f"persistent kernel: {p['grid']} blocks x {p['block']} threads, {p['smem_bytes'] // 1024} KiB shared "
          f"memory each; per step (us, mean / slowest block):")
    for ph in p["phases"]:
        print(f"  {ph['name']:<28}{ph['mean_us']:>8.2f}{ph['max_us']:>8.2f}")
f20 = json.load(open(f"{d}/f20.json")); t20 = json.load(open(f"{d}/t20.json"))["variants"]["eager"]
print(f"after 20 steps: ferrograd {f20['final_loss']:.8f} pytorch {t20['final_loss']:.8f} "
      f"({abs(f20['final_loss'] - t20['final_loss']) / t20['final_loss']:.2e} relative)")
PY
