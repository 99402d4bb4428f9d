#!/usr/bin/env bash
# GPT-2 int8 (issue 18), one GPU call: train GPT-2 124M on the Shakespeare shards, evaluate it in
# f32/bf16/int8 W8A16/int8 W8A8 over the whole val split, quantize it (int8 file + sizes), fine-tune
# it briefly with QAT (and, as the control, in float with the same steps and schedule), quantize and
# evaluate those, time greedy decoding per token (bf16 vs int8), and print the table for
# BENCHMARKS.md. Usage (repository root on the GPU machine):
#   G=.gpu-NAME D=.gpu-NAME/shk STEPS=300 FT=100 bash bench/gpt_quant.sh
# G holds the bundle (`$G/run bin ferrograd`), D the shards (train_*.bin, val_*.bin).
set -u
G=${G:-.gpu}; D=${D:-$G/shk}; STEPS=${STEPS:-300}; FT=${FT:-100}; W=${W:-/tmp/gq}
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT" "$W"
F=(bash "$G/run" bin ferrograd)
common=(--batch 16 --context 1024 --precision bf16 --val-every 0 --val-batches 10 --log-every 50 --progress lines)
evalargs=(--data "$D" --batch 8 --context 1024)
t0=$(date +%s)
echo "== train $STEPS steps"
"${F[@]}" gpt train --data "$D" --out "$W/base" --model gpt2 "${common[@]}" --steps "$STEPS" > "$OUT/train.txt" 2>&1 || { tail -20 "$OUT/train.txt"; exit 1; }
tail -2 "$OUT/train.txt"
base=$W/base/checkpoint.safetensors
echo "== eval base"; "${F[@]}" gpt eval --checkpoint "$base" "${evalargs[@]}" | tee "$OUT/eval_base.txt"
echo "== quantize"; "${F[@]}" gpt quantize "$base" --out "$W/base_int8.safetensors" | tee "$OUT/quantize.txt"
echo "== eval the int8 file"; "${F[@]}" gpt eval --checkpoint "$W/base_int8.safetensors" "${evalargs[@]}" | tee "$OUT/eval_file.txt"
# --init takes the model's shape from the checkpoint (--model would be refused).
ft=(--init "$base" "${common[@]}" --steps "$FT" --lr 6e-5 --warmup 10 --min-lr-ratio 0.1)
echo "== QAT fine-tune $FT steps"
"${F[@]}" gpt train --data "$D" --out "$W/qat" "${ft[@]}" --qat --no-graph > "$OUT/qat.txt" 2>&1 || { tail -20 "$OUT/qat.txt"; exit 1; }
tail -1 "$OUT/qat.txt"
echo "== float fine-tune $FT steps (control)"
"${F[@]}" gpt train --data "$D" --out "$W/ctl" "${ft[@]}" > "$OUT/ctl.txt" 2>&1 || { tail -20 "$OUT/ctl.txt"; exit 1; }
tail -1 "$OUT/ctl.txt"
echo "== eval QAT"; "${F[@]}" gpt eval --checkpoint "$W/qat/checkpoint.safetensors" "${evalargs[@]}" --modes bf16,w8a16,w8a8 | tee "$OUT/eval_qat.txt"
echo "== eval control"; "${F[@]}" gpt eval --checkpoint "$W/ctl/checkpoint.safetensors" "${evalargs[@]}" --modes bf16,w8a16,w8a8 | tee "$OUT/eval_ctl.txt"
echo "== decode latency (greedy, 256 tokens, bf16 activations)"
"${F[@]}" gpt quantize "$W/qat/checkpoint.safetensors" --out "$W/qat_int8.safetensors" > /dev/null
for spec in "bf16:$base:" "w8a16:$W/base_int8.safetensors:w8a16" "w8a8:$W/base_int8.safetensors:w8a8"; do
  IFS=: read -r name ck mode <<< "$spec"
  extra=(); [ -n "$mode" ] && extra=(--int8 "$mode")
  "${F[@]}" gpt sample --checkpoint "$ck" --prompt "ROMEO:" --tokens 256 --temperature 0 --ignore-eot --bf16 "${extra[@]}" \
    > "$OUT/sample_$name.txt" 2> "$OUT/sample_$name.err"
  echo "$name $(grep -o '[0-9.]* ms/token' "$OUT/sample_$name.err" | head -1)" | tee -a "$OUT/decode.txt"
done
# ---- the table -------------------------------------------------------------------------------
ppl() { grep "^$2 " "$1" | sed -E 's/.*perplexity ([0-9.]+).*/\1/' | head -1; }
loss() { grep "^$2 " "$1" | sed -E 's/.*val loss ([0-9.]+).*/\1/' | head -1; }
ms() { grep "^$1 " "$OUT/decode.txt" | awk '{print $2}'; }
size() { stat -c %s "$1" 2>/dev/null || echo 0; }
fsize=$(size "$W/base/model/model.safetensors")
qsize=$(size "$W/base_int8.safetensors")
b=$(ppl "$OUT/eval_base.txt" bf16); p16=$(ppl "$OUT/eval_base.txt" "int8 w8a16"); p8=$(ppl "$OUT/eval_base.txt" "int8 w8a8")
c=$(ppl "$OUT/eval_ctl.txt" bf16); c16=$(ppl "$OUT/eval_ctl.txt" "int8 w8a16"); c8=$(ppl "$OUT/eval_ctl.txt" "int8 w8a8")
q=$(ppl "$OUT/eval_qat.txt" bf16); q16=$(ppl "$OUT/eval_qat.txt" "int8 w8a16"); q8=$(ppl "$OUT/eval_qat.txt" "int8 w8a8")
gap() { python3 -c "import sys; a,b=float(sys.argv[1]),float(sys.argv[2]); print(f'{100*(a/b-1):+.2f}%')" "$1" "$2" 2>/dev/null || echo "?"; }
echo
echo "GPT-2 124M, $STEPS steps of 16 x 1024 on Shakespeare; perplexity over the whole val split (8 x 1024 windows)"
echo "$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1); $(( $(date +%s) - t0 )) s"
echo
echo "| model | f32 | bf16 | int8 W8A16 | int8 W8A8 | W8A16 vs bf16 | W8A8 vs bf16 |"
echo "|---|---|---|---|---|---|---|"
echo "| trained ($STEPS steps) | $(ppl "$OUT/eval_base.txt" f32) | $b | $p16 | $p8 | $(gap "$p16" "$b") | $(gap "$p8" "$b") |"
echo "| + $FT steps float (control) | - | $c | $c16 | $c8 | $(gap "$c16" "$c") | $(gap "$c8" "$c") |"
echo "| + $FT steps QAT | - | $q | $q16 | $q8 | $(gap "$q16" "$c") (vs control bf16) | $(gap "$q8" "$c") (vs control bf16) |"
echo
echo "| decode, ms/token (greedy, 256 tokens, batch 1) | bf16 | int8 W8A16 | int8 W8A8 |"
echo "|---|---|---|---|"
echo "| GPT-2 124M | $(ms bf16) | $(ms w8a16) | $(ms w8a8) |"
echo
echo "checkpoint: float weights $fsize bytes (model/model.safetensors, f32) -> int8 file $qsize bytes"
grep -E "projection weights|all weights" "$OUT/quantize.txt"
