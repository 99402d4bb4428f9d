#!/usr/bin/env bash
# Dev machine (it reaches the package index): fetch mamba_ssm's sdist (pinned version and sha256,
# through pip's configured index), unpack it into DIR (default .gpu-extra/mamba_ssm) and apply the
# documented edits of bench/mamba_ssm_ext.py (fp32/bf16 real-weight kernels only, the bench's
# flags fixed). DIR is third-party source: keep it out of commits (git-ignore it) and carry it to
# the GPU machine, where bench/mamba_ssm_build.sh builds and times it.
#
#   bash bench/fetch_mamba_ssm.sh [DIR]
set -euo pipefail
cd "$(dirname "$0")/.."
python3 bench/mamba_ssm_ext.py fetch "${1:-.gpu-extra/mamba_ssm}"
