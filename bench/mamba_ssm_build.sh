#!/usr/bin/env bash
# GPU machine, from the repository root, one call: build mamba_ssm's selective-scan CUDA extension
# from the source bench/fetch_mamba_ssm.sh put in DIR (sm_90 only, mamba's nvcc flags, the
# fp32/bf16 real-weight kernels of the flags our bench sets: about a minute on 16 cores), check
# it against the sdist's selective_scan_ref, then time it with bench/torch_selective_scan.py
# beside ferrograd's `bench selective-scan` (when a binary is given) and print the paired table.
#
#   [DIR=.gpu-extra/mamba_ssm] [G=.gpu] [SEQS=1024] [DTYPES="bf16 f32"] [FORMS=mamba_ssm] [ALL_FLAGS=1]
#   bash bench/mamba_ssm_build.sh
#
# G: the bundle of ../shared/gpu/bundle (unpacked here when $G/bin is missing); F (default
# $G/bin/ferrograd): the binary (none: mamba_ssm rows only). FORMS: the twin's --forms (add
# eager,compiled for the plain-PyTorch rows; they take a minute or more). ALL_FLAGS=1 compiles
# every flag combination of mamba's kernels (no cut; a longer build). Logs and JSON go to $OUT
# (default /tmp/mamba-ssm).
set -uo pipefail
DIR=${DIR:-.gpu-extra/mamba_ssm}
G=${G:-.gpu}
F=${F:-$G/bin/ferrograd}
SEQS=${SEQS:-1024}
DTYPES=${DTYPES:-bf16 f32}
FORMS=${FORMS:-mamba_ssm}
OUT=${OUT:-/tmp/mamba-ssm}
mkdir -p "$OUT"
# The toolkit: CUDA_HOME, else /usr/local/cuda, else the one whose nvcc is on PATH.
if [ -z "${CUDA_HOME:-}" ]; then
  if [ -x /usr/local/cuda/bin/nvcc ]; then CUDA_HOME=/usr/local/cuda
  elif command -v nvcc >/dev/null; then CUDA_HOME=$(dirname "$(dirname "$(command -v nvcc)")")
  else echo "no nvcc: set CUDA_HOME"; exit 2; fi
fi
export CUDA_HOME MAX_JOBS=${MAX_JOBS:-16} PATH="$CUDA_HOME/bin:$PATH" PYTHONUNBUFFERED=1
for d in /usr/local/nvidia/lib64 "$CUDA_HOME/lib64"; do [ -d "$d" ] && export LD_LIBRARY_PATH="$d:${LD_LIBRARY_PATH:-}"; done
export FERROGRAD_CACHE_DIR=${FERROGRAD_CACHE_DIR:-/tmp/ferrograd-cache}
t0=$SECONDS
lap() { echo "## [$((SECONDS - t0)) s] $*"; }
nvcc --version | tail -2
python3 -c 'import torch, einops; print("torch", torch.__version__, torch.cuda.get_device_name())' || exit 2

[ -x "$F" ] || [ ! -f "$G/run" ] || bash "$G/run" unpack >/dev/null || echo "note: could not unpack $G"
[ -x "$F" ] || echo "note: no ferrograd binary at $F: mamba_ssm rows only"
lap "build (log: $OUT/build.log)"
flags=(); [ "${ALL_FLAGS:-0}" = 1 ] && flags=(--all-flags)
timeout 420 python3 bench/mamba_ssm_ext.py build "$DIR" ${flags[@]+"${flags[@]}"} >"$OUT/build.log" 2>&1
rc=$?
# The kernels' registers and spills (ptxas -v), then the build's closing lines (the check's).
python3 bench/mamba_ssm_ext.py ptxas "$OUT/build.log" | sort -u | head -24
tail -n 6 "$OUT/build.log"
[ $rc -eq 0 ] || { echo "build failed (rc=$rc): see $OUT/build.log"; tail -n 40 "$OUT/build.log"; exit $rc; }

for dt in $DTYPES; do
  if [ -x "$F" ]; then
    lap "ferrograd bench selective-scan --dtype $dt --seqs $SEQS"
    timeout 300 "$F" bench selective-scan --dtype "$dt" --seqs "$SEQS" --json "$OUT/ferrograd_$dt.json" 2>&1 | tail -n 8
  fi
  lap "twin --dtype $dt --forms $FORMS"
  timeout 400 python3 bench/torch_selective_scan.py --dtype "$dt" --seqs "$SEQS" --forms "$FORMS" \
    --mamba-ssm "$DIR" --json "$OUT/twin_$dt.json" 2>&1 | tail -n 12
  if [ -f "$OUT/ferrograd_$dt.json" ] && [ -f "$OUT/twin_$dt.json" ]; then
    python3 bench/mamba_ssm_ext.py compare "$OUT/ferrograd_$dt.json" "$OUT/twin_$dt.json" | tee "$OUT/pair_$dt.md"
  fi
done
lap end
