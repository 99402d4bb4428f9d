#!/usr/bin/env bash
# Rebuild the prebuilt kernel modules the binary ships (crates/ferrograd-kernels/prebuilt/), for
# every shipped architecture, with NVRTC from PyPI (.ci/nvrtc.sh: the same pinned NVRTC the CI
# compile tests use). Run it after changing any .cu file, shared header or define:
# crates/ferrograd-cli/tests/cli_suite/prebuilt.rs fails until then. Needs no GPU; ~30 s per architecture
# on two cores with a cold kernel cache.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
# shellcheck source=../.ci/nvrtc.sh
source .ci/nvrtc.sh
setup_nvrtc
unset FERROGRAD_NVRTC_OPTIONS FERROGRAD_KERNEL_DIR
cargo build -q --bin ferrograd
for arch in sm_80 sm_90; do
    target/debug/ferrograd kernels --write-prebuilt crates/ferrograd-kernels/prebuilt --arch "$arch" | tail -1
done
# The binary that embeds them must be rebuilt to ship the new files; the test says whether they
# are current.
cargo test -q -p ferrograd-cli --test cli_suite prebuilt::
