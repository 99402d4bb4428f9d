#!/usr/bin/env bash
# Issue 16 (pipeline parallelism) on a 2-GPU machine in one device call (kind nvidia-h200-x2;
# about 5 minutes), from the repository root, with the bundle folder made by ../shared/gpu/bundle:
#
#   bash bench/pipeline_gpu.sh [BUNDLE]        BUNDLE: default .gpu (e.g. .gpu-pipe16)
#
# 1. the pipeline tests: crates/ferrograd-cli/tests/cli_suite/pipeline_gpu.rs (monster-walk --pipeline 4 on
#    2 GPUs over NCCL = on 1 GPU for the same micro-batches, GPipe = 1F1B, a failing stage stopping
#    every rank; a run past 90 s is a hang and fails) and ferrograd-dist's pipeline tests (the
#    single-process pipeline over peer copies on 2 GPUs; the CPU ones under NCCL's semantics);
# 2. Monster Walk, the design document's four stage groups, COPIES copies x EPOCHS epochs:
#    --pipeline 4 on 1 GPU (all groups one stage), on 2 GPUs (two groups per GPU) under GPipe and
#    1F1B, a micro-batch sweep of both (bubble against (p-1)/(m+p-1)), data parallel on 2 GPUs
#    (fused step) and the 1-GPU default (persistent kernel): samples/s, bubble measured and
#    theoretical, step memory per stage (1F1B holds fewer micro-batches than GPipe);
# 3. the twin, bench/monster_walk_pipeline_torch.py under torchrun (torch.distributed.pipelining,
#    the same four groups on 2 GPUs, GPipe and 1F1B, same rows and steps): samples/s;
# 4. GPT (DATA: token shards, default $G/data/shakespeare; GPT_MODEL, default gpt2-medium):
#    `gpt train --pipeline 2` on 2 GPUs over NCCL (GPipe and 1F1B, GPT_MICRO micro-batches of
#    GPT_BATCH x 1024, f32), the same in one process over peer copies, data parallel on the same
#    2 GPUs and one GPU with the same tokens per step (f32): tokens/s side by side.
#
# Full logs and JSON go to $OUT (else /tmp/pipeline_gpu); the summary table is printed last. A step
# that fails is reported in the summary and the others still run; the exit status is 1 if any failed.
set -uo pipefail
G=${1:-.gpu}
PY_DIR=${PY_DIR:-$(cd "$(dirname "$0")" && pwd)}
COPIES=${COPIES:-113}
EPOCHS=${EPOCHS:-8}
MICRO=${MICRO:-8}
DATA=${DATA:-$G/data/shakespeare}
GPT_MODEL=${GPT_MODEL:-gpt2-medium}
GPT_MICRO=${GPT_MICRO:-8}
GPT_BATCH=${GPT_BATCH:-4}
GPT_STEPS=${GPT_STEPS:-6}
out=${OUT:-/tmp/pipeline_gpu}
BUDGET_S=${BUDGET_S:-330}
# The bundle, ferro, launch2, run_tests and step (shared with dist_gpu.sh).
source "$(dirname "$0")/lib/gpu2.sh"

{ nvidia-smi -L; nvidia-smi topo -m; } > "$out/gpus.log" 2>&1
step precompile 90 ferro kernels --precompile
step tests 150 bash -c 'run_tests pipeline_gpu:: cli_suite-test && run_tests pipeline:: dist_suite-test'
W="--copies $COPIES --epochs $EPOCHS"
mw() { # mw NAME PORT|1 ARGS...: monster-walk --pipeline 4 on 2 ranks (PORT) or cuda:0 (1)
  local name=$1 where=$2; shift 2
  if [ "$where" = 1 ]; then
    step "$name" 60 ferro monster-walk --pipeline 4 --device cuda:0 $W "$@" --report "$out/$name.json"
  else
    step "$name" 60 launch2 "$where" monster-walk --pipeline 4 $W "$@" --report "$out/$name.json"
  fi
}
mw pipe1_1f1b 1 --micro-batches "$MICRO" --schedule 1f1b
mw pipe2_gpipe 29611 --micro-batches "$MICRO" --schedule gpipe
mw pipe2_1f1b 29613 --micro-batches "$MICRO" --schedule 1f1b
step dp2_fused 60 launch2 29661 monster-walk --step fused $W --report "$out/dp2_fused.json"
step one_default 60 ferro monster-walk --device cuda:0 $W --report "$out/one_default.json"
for s in gpipe 1f1b; do
  step "torch_pipe2_$s" 90 torchrun --nproc-per-node 2 --master-port $((29670 + ${#s})) "$PY_DIR/monster_walk_pipeline_torch.py" \
    --copies "$COPIES" --epochs "$EPOCHS" --micro-batches "$MICRO" --schedule "$s" --json "$out/torch_pipe2_$s.json"
done

# GPT: the same tokens per step (GPT_MICRO x GPT_BATCH x 1024) everywhere, f32.
GT="--model $GPT_MODEL --data $DATA --context 1024 --steps $GPT_STEPS --precision f32 --progress lines"
TOK=$((GPT_MICRO * GPT_BATCH * 1024))
for s in gpipe 1f1b; do
  step "gpt_pipe2_$s" 120 launch2 $((29680 + ${#s})) gpt train $GT --batch "$GPT_BATCH" --pipeline 2 \
    --micro-batches "$GPT_MICRO" --schedule "$s" --out "$out/gpt_pipe2_$s"
done
step gpt_local2 120 ferro gpt train $GT --batch "$GPT_BATCH" --pipeline 2 --micro-batches "$GPT_MICRO" --out "$out/gpt_local2"
step gpt_dp2 120 launch2 29690 gpt train $GT --batch "$GPT_BATCH" --total-batch "$TOK" --val-every 0 --val-batches 1 \
  --out "$out/gpt_dp2"
step gpt_one 120 ferro gpt train $GT --device cuda:0 --batch "$GPT_BATCH" --total-batch "$TOK" --val-every 0 \
  --val-batches 1 --out "$out/gpt_one"

# Last (skipped first when the budget runs out): the micro-batch sweep.
for m in 2 4 16; do
  mw "pipe2_gpipe_m$m" $((29620 + m)) --micro-batches "$m" --schedule gpipe
  mw "pipe2_1f1b_m$m" $((29640 + m)) --micro-batches "$m" --schedule 1f1b
done

python3 - "$out" <<'PY' | tee "$out/summary.txt"
import json, os, re, sys
d = sys.argv[1]
def load(name):
    try:
        return json.load(open(os.path.join(d, name)))
    except (OSError, ValueError):
        return None
mib = lambda v: ", ".join(f"{x / 2**20:.1f}" for x in v) if v else "-"
pct = lambda v: f"{100 * v:.1f}%" if v is not None else "-"
print("Monster Walk, --pipeline 4 (samples/s; bubble measured vs (p-1)/(m+p-1); step memory per stage, MiB)")
base = {k: (load(k + ".json") or {}).get("samples_per_s") for k in ["pipe1_1f1b", "dp2_fused", "one_default"]}
print(f"{'run':<18}{'samples/s':>11}{'x 1 stage':>10}{'x DP':>7}{'bubble':>8}{'theory':>8}{'|diff|':>8}  {'MiB/stage':<14}{'held':<8}{'loss':>10}")
names = ["pipe1_1f1b", "pipe2_gpipe", "pipe2_1f1b"] + [f"pipe2_{s}_m{m}" for m in (2, 4, 16) for s in ("gpipe", "1f1b")]
for name in names + ["dp2_fused", "one_default", "torch_pipe2_gpipe", "torch_pipe2_1f1b"]:
    r = load(name + ".json")
    if not r:
        print(f"{name:<18}  (no report: see {name}.log)"); continue
    sps = r["samples_per_s"]
    rel = lambda k: f"{sps / base[k]:.3f}" if base.get(k) else "-"
    b, t = r.get("bubble_measured"), r.get("bubble_theory")
    diff = f"{100 * abs(b - t):.1f}" if b is not None and t is not None else "-"
    held = ",".join(str(x) for x in r.get("peak_held", [])) or "-"
    print(f"{name:<18}{sps:>11.0f}{rel('pipe1_1f1b'):>10}{rel('dp2_fused'):>7}{pct(b):>8}{pct(t):>8}{diff:>8}  "
          f"{mib(r.get('step_memory_bytes')):<14}{held:<8}{r.get('final_loss', float('nan')):>10.6f}")
print(f"GPT (f32, same tokens per step; tokens/s after the first step)")
def done_line(name):
    try:
        t = open(os.path.join(d, name + ".log"), errors="replace").read()
    except OSError:
        return None
    m = re.search(r"done: .*?\| ([\d.]+)([KM]?) tok/s", t)
    if not m:
        return None
    return float(m.group(1)) * {"": 1, "K": 1e3, "M": 1e6}[m.group(2)]
dp = (load("gpt_dp2/summary.json") or {}).get("tokens_per_s") or done_line("gpt_dp2")
one = (load("gpt_one/summary.json") or {}).get("tokens_per_s") or done_line("gpt_one")
print(f"{'run':<18}{'tokens/s':>11}{'x DP':>7}{'x 1 GPU':>9}{'bubble':>8}{'theory':>8}  {'MiB/stage':<20}{'loss':>16}")
for name in ["gpt_pipe2_gpipe", "gpt_pipe2_1f1b", "gpt_local2"]:
    r = load(name + "/pipeline.json")
    if not r:
        print(f"{name:<18}  (no report: see {name}.log)"); continue
    tps = r["tokens_per_s"]
    print(f"{name:<18}{tps:>11.0f}{(f'{tps / dp:.3f}' if dp else '-'):>7}{(f'{tps / one:.3f}' if one else '-'):>9}"
          f"{pct(r.get('bubble_measured')):>8}{pct(r.get('bubble_theory')):>8}  {mib(r.get('step_memory_bytes')):<20}"
          f"{r['first_loss']:>7.3f} -> {r['final_loss']:.3f}")
for name, v in [("gpt_dp2", dp), ("gpt_one", one)]:
    print(f"{name:<18}{(f'{v:>11.0f}' if v else '  (no result)'):>11}")
PY
echo "=== status"
cat "$out/status.txt"
grep -qv " rc=0 " "$out/status.txt" && exit 1
exit 0
