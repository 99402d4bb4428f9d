#!/usr/bin/env bash
# How far do correct Monster Walk runs drift apart? For each seed: ferrograd (the default step:
# the persistent kernel on a GPU that has it) and PyTorch (fused Adam, graph replay, and foreach
# Adam: another rounding order) from the same init.
#   bash bench/monster_walk_seeds.sh "0 1 2" [COPIES] [EPOCHS] [OUTDIR]
set -euo pipefail
seeds=${1:-"0 1 2"}; copies=${2:-113}; epochs=${3:-71}; out=${4:-${OUT:-/tmp}/mw-seeds}
fg=${FERROGRAD:-.gpu/bin/ferrograd}; [ -x "$fg" ] || fg=target/release/ferrograd
mkdir -p "$out"; export PYTHONUNBUFFERED=1
n=$(( copies < 95 ? copies : 95 ))
"$fg" monster-walk export --values-of "$n" --out "$out/values.safetensors" >/dev/null
for s in $seeds; do
  python3 bench/monster_walk_torch.py --write-init "$out/init$s.safetensors" --seed "$s" >/dev/null
  "$fg" monster-walk --device cuda --copies "$copies" --epochs "$epochs" --init "$out/init$s.safetensors" \
    --report "$out/f$s.json" >/dev/null
  python3 bench/monster_walk_torch.py --init "$out/init$s.safetensors" --values "$out/values.safetensors" \
    --copies "$copies" --epochs "$epochs" --variants graph,eager-foreach --json "$out/t$s.json" 2>/dev/null >/dev/null
done
python3 - "$out" $seeds <<'PY'
import json, sys
d, seeds = sys.argv[1], sys.argv[2:]
print(f"{'seed':>4} {'ferrograd':>10} {'torch fused':>12} {'torch foreach':>14} {'fg vs fused':>12} {'foreach vs fused':>17}")
for s in seeds:
    f = json.load(open(f"{d}/f{s}.json"))["final_loss"]
    t = json.load(open(f"{d}/t{s}.json"))["variants"]
    g, e = t["graph"]["final_loss"], t["eager-foreach"]["final_loss"]
    print(f"{s:>4} {f:>10.6f} {g:>12.6f} {e:>14.6f} {100*abs(f-g)/g:>11.2f}% {100*abs(e-g)/g:>16.2f}%")
PY
