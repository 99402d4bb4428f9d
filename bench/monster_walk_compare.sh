#!/usr/bin/env bash
# One command on a GPU machine: Monster Walk in ferrograd and in PyTorch (eager and CUDA graph),
# from the same init weights and data, then the ratios.
#   bash bench/monster_walk_compare.sh [COPIES] [EPOCHS] [OUTDIR]
set -euo pipefail
copies=${1:-113}; epochs=${2:-71}; out=${3:-${OUT:-/tmp}/monster-walk}
fg=${FERROGRAD:-.gpu/bin/ferrograd}; [ -x "$fg" ] || fg=target/release/ferrograd
mkdir -p "$out"
export PYTHONUNBUFFERED=1
python3 bench/monster_walk_torch.py --write-init "$out/init.safetensors" --seed 0
n=$(( copies < 95 ? copies : 95 ))   # copies repeat every 95
"$fg" monster-walk export --values-of "$n" --out "$out/values.safetensors"
"$fg" monster-walk --device cuda --copies "$copies" --epochs "$epochs" --init "$out/init.safetensors" \
  --report "$out/ferrograd.json"
"$fg" monster-walk --device cuda --copies "$copies" --epochs "$epochs" --init "$out/init.safetensors" \
  --unfused --report "$out/ferrograd_unfused.json" | tail -3
python3 bench/monster_walk_torch.py --init "$out/init.safetensors" --values "$out/values.safetensors" \
  --copies "$copies" --epochs "$epochs" --json "$out/torch.json"
# Early agreement (20 steps): both sides should match to rounding before chaos sets in.
"$fg" monster-walk --device cuda --copies 2 --epochs 10 --init "$out/init.safetensors" --report "$out/f20.json" >/dev/null
python3 bench/monster_walk_torch.py --init "$out/init.safetensors" --values "$out/values.safetensors" \
  --copies 2 --epochs 10 --variants eager --json "$out/t20.json" >/dev/null
python3 - "$out" <<'PY'
import json, sys
d = sys.argv[1]
f = json.load(open(f"{d}/ferrograd.json")); t = json.load(open(f"{d}/torch.json"))
u = json.load(open(f"{d}/ferrograd_unfused.json"))
print(f"\nMonster Walk {f['copies']} copies x {f['epochs']} epochs on {f['device']}")
print(f"{'run':<22}{'time s':>10}{'samples/s':>14}{'final loss':>14}{'ferrograd speedup':>20}")
print(f"{'ferrograd ' + f['step_kind']:<22}{f['training_time_s']:>10.3f}{f['samples_per_s']:>14.0f}{f['final_loss']:>14.6f}{'':>20}")
print(f"{'ferrograd ' + u['step_kind']:<22}{u['training_time_s']:>10.3f}{u['samples_per_s']:>14.0f}{u['final_loss']:>14.6f}{'':>20}")
for k, v in t["variants"].items():
    sp = v["training_time_s"] / f["training_time_s"]
    print(f"{'pytorch ' + k:<22}{v['training_time_s']:>10.3f}{v['samples_per_s']:>14.0f}{v['final_loss']:>14.6f}{sp:>19.2f}x")
for k, v in t["variants"].items():
    rel = abs(f["final_loss"] - v["final_loss"]) / abs(v["final_loss"])
    print(f"final loss vs pytorch {k}: {100 * rel:.3f}% apart")
f20 = json.load(open(f"{d}/f20.json")); t20 = json.load(open(f"{d}/t20.json"))["variants"]["eager"]
print(f"after 20 steps: ferrograd {f20['final_loss']:.8f} pytorch {t20['final_loss']:.8f} "
      f"({abs(f20['final_loss'] - t20['final_loss']) / t20['final_loss']:.2e} relative)")
PY
