# ferrograd CI: NVRTC and the CUDA headers from PyPI, so that the kernel compile tests
# (every kernel, sm_80 and sm_90) run for real on a CI machine without CUDA or a GPU.
#
# Source it from .ci/run (it exports variables into the caller's shell), then run cargo test:
#     source .ci/nvrtc.sh && setup_nvrtc
# or paste the function into .ci/run itself; the repository root is taken as the parent of the
# directory holding the sourced file, or $FERROGRAD_ROOT when set.
#
# Why these pieces:
# - cudarc opens libnvrtc by bare name (libnvrtc.so.13 is one of its candidates), and libnvrtc opens
#   libnvrtc-builtins.so.13.0 by bare name too; neither has a RUNPATH, so the wheel's lib folder
#   must be on LD_LIBRARY_PATH before the test process starts.
# - nvidia-cuda-runtime is installed only for its headers (cuda_fp16.h, cuda_bf16.h); the
#   library finds them next to the loaded libnvrtc anyway, FERROGRAD_CUDA_INCLUDE makes it explicit.
# - FERROGRAD_REQUIRE_NVRTC=1 turns "skipping: libnvrtc not found" into a test failure, so a
#   broken setup cannot pass CI with the compile tests silently skipped.
# - Idempotent: the venv lives in target/ (git-ignored) with a stamp naming the pinned versions;
#   a second run only re-exports. Changing a pin rebuilds the venv.

FERROGRAD_NVRTC_PIN=${FERROGRAD_NVRTC_PIN:-nvidia-cuda-nvrtc==13.0.88}
FERROGRAD_CUDART_PIN=${FERROGRAD_CUDART_PIN:-nvidia-cuda-runtime==13.0.96}

setup_nvrtc() {
    local root venv stamp want site cu13 t0
    root=${FERROGRAD_ROOT:-$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)}
    venv="$root/target/nvrtc-venv"
    stamp="$venv/.ferrograd-pins"
    want="$FERROGRAD_NVRTC_PIN $FERROGRAD_CUDART_PIN"

    if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
        t0=$SECONDS
        rm -rf "$venv"
        if ! ${PYTHON:-python3} -m venv "$venv"; then
            echo "setup_nvrtc: '${PYTHON:-python3} -m venv' failed (python3-venv missing?)" >&2
            return 1
        fi
        # shellcheck disable=SC2086  # two pins, split on purpose
        if ! "$venv/bin/pip" install --quiet --disable-pip-version-check $want; then
            echo "setup_nvrtc: pip install $want failed" >&2
            return 1
        fi
        echo "$want" >"$stamp"
        echo "setup_nvrtc: installed $want into $venv in $((SECONDS - t0)) s"
    fi

    site=$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])') || return 1
    cu13="$site/nvidia/cu13"
    if [ ! -e "$cu13/lib/libnvrtc.so.13" ] || [ ! -e "$cu13/include/cuda_bf16.h" ]; then
        echo "setup_nvrtc: $cu13 lacks lib/libnvrtc.so.13 or include/cuda_bf16.h; wheel layout changed?" >&2
        return 1
    fi
    export LD_LIBRARY_PATH="$cu13/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
    export FERROGRAD_CUDA_INCLUDE="$cu13/include"
    export FERROGRAD_REQUIRE_NVRTC=1
    echo "setup_nvrtc: NVRTC from $cu13/lib, headers from $FERROGRAD_CUDA_INCLUDE"
}
