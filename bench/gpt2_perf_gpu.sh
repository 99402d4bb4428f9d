#!/usr/bin/env bash
# gptperf2 GPU run: GPT CUDA tests, per-kernel profile (eager), eager and graph tok/s, classifier bench + twin.
set -u
G=.gpu-gptperf2; D=$G/data/shakespeare; F=(bash $G/run bin ferrograd)
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; which ncu || echo "no ncu"
bash $G/run tests gpt_cuda > $OUT/tests_gpt.txt 2>&1; grep -E "^test .*(ok|FAILED)|panicked|FAILED" $OUT/tests_gpt.txt | sort -u | head -20
bash $G/run tests cuda_matches_the_cpu > $OUT/tests_cl.txt 2>&1; grep -E "^test .*(ok|FAILED)|panicked" $OUT/tests_cl.txt | sort -u | head -12
"${F[@]}" kernels --precompile 2>&1 | tail -1
common=(--model gpt2 --batch 16 --context 1024 --precision bf16 --val-every 0 --val-batches 0 --log-every 10 --progress lines)
echo "== profile (eager, 8 steps)"
FERROGRAD_PROFILE=1 "${F[@]}" gpt train --data $D --out /tmp/p "${common[@]}" --steps 8 --no-graph > $OUT/profile_out.txt 2> $OUT/profile.txt; tail -1 $OUT/profile_out.txt
echo "== eager 30"; "${F[@]}" gpt train --data $D --out /tmp/e "${common[@]}" --steps 30 --no-graph 2>&1 | tail -1
echo "== graph 40"; "${F[@]}" gpt train --data $D --out /tmp/g "${common[@]}" --steps 40 2>&1 | tail -1
echo "== bench fused"; "${F[@]}" bench fused --shapes 16384x768 --classifier 8192x50257 --json $OUT/fused.json 2>&1 | tail -6
echo "== torch fused"; timeout 120 python3 $G/py/torch_fused.py --no-compile --shapes 16384x768 --classifier 8192x50257 --json $OUT/torch_fused.json 2>&1 | tail -5
echo "== profile top"; head -32 $OUT/profile.txt
