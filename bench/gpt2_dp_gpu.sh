#!/usr/bin/env bash
# One 2-GPU call (kind nvidia-h200-x2, ~5 min), `bash bench/gpt2_dp_gpu.sh [BUNDLE]`: the 2-GPU tests (cli_suite-test dist_gpu::, incl. gpt train 2 GPUs = 1), the CPU
# GPT data-parallel tests, then bench/gpt2_dp_compare.sh (ferrograd 1/2 GPUs, PyTorch 1 GPU/DDP 2).
set -uo pipefail
G=${1:-.gpu}   # the bundle folder (copy gpt2_dp_compare.sh and gpt2_torch.py into $G/py, shards into $G/data/shakespeare)
out=${OUT:-/tmp/out}/gptdp; mkdir -p "$out"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
bash $G/run unpack >/dev/null 2>&1 || bash $G/run bin ferrograd info > /dev/null 2>&1
for d in /usr/local/nvidia/lib64 /usr/local/cuda/lib64 /usr/local/cuda/targets/x86_64-linux/lib; do
  [ -d "$d" ] && export LD_LIBRARY_PATH="$d:${LD_LIBRARY_PATH:-}"
done
export FERROGRAD_CACHE_DIR=/tmp/ferrograd-cache FERROGRAD_BIN=$(pwd)/$G/bin/ferrograd
{ nvidia-smi -L; python3 -c "import torch; print('torch', torch.__version__)"; } > "$out/gpus.log" 2>&1
t0=$SECONDS
timeout 90 $G/bin/ferrograd kernels --precompile > "$out/precompile.log" 2>&1; echo "precompile rc=$? $((SECONDS-t0))s" >> "$out/status.txt"
t0=$SECONDS
timeout 200 $G/tests/cli_suite-test --test-threads=1 --nocapture dist_gpu:: > "$out/tests_2gpu.log" 2>&1; echo "tests_2gpu rc=$? $((SECONDS-t0))s" >> "$out/status.txt"
timeout 60 $G/tests/cli_suite-test --nocapture gpt_dp:: > "$out/tests_gpt_dp_cpu.log" 2>&1; echo "tests_gpt_dp_cpu rc=$?" >> "$out/status.txt"
t0=$SECONDS
PRECOMPILE=0 BUNDLE=$G DATA=$G/data/shakespeare PY_DIR=$G/py timeout 300 bash $G/py/gpt2_dp_compare.sh 30 "$out/gpt2dp" > "$out/compare.log" 2>&1
echo "compare rc=$? $((SECONDS-t0))s" >> "$out/status.txt"
tar czf "${OUT:-/tmp/out}/gptdp_logs.tgz" -C "$out" . 2>/dev/null
echo "==== status"; cat "$out/status.txt"
echo "==== 2-GPU tests"; grep -E "^test |test result|skipped|max rel|2 GPUs vs 1|saved on 2|stopped in|two launches" "$out/tests_2gpu.log" | tail -20
grep -E "test result|max rel" "$out/tests_gpt_dp_cpu.log"
echo "==== compare"; grep -E "^== |rc=|error|Error" "$out/compare.log" | tail -14
cat "$out/gpt2dp/summary.txt" 2>/dev/null
