#!/usr/bin/env python3
"""mamba_ssm's fused selective-scan CUDA kernel, built from its source, to time beside ours (issue 19).

mamba_ssm is not installed on the lent GPU machines and they reach no registry, so its source
travels there: `fetch` (on the dev machine) downloads the pinned sdist through pip's configured
index, checks its sha256, unpacks it and applies a few documented edits (PATCHES below); `build`
(on the GPU machine) compiles `csrc/selective_scan` for sm_90 only with mamba's own nvcc flags
through torch.utils.cpp_extension.load; `load` imports the result together with the sdist's own
`selective_scan_fn` / `selective_scan_ref` (mamba_ssm/ops/selective_scan_interface.py, without
running the package's __init__). The third-party source is never committed: it lives in DIR,
a git-ignored folder (default .gpu-extra/mamba_ssm) that the lead carries to the GPU machine.

    python3 bench/mamba_ssm_ext.py fetch [DIR]     # dev machine: download, verify, unpack, patch
    python3 bench/mamba_ssm_ext.py build [DIR]     # GPU machine: compile (MAX_JOBS=16), then check
    python3 bench/mamba_ssm_ext.py ptxas BUILD_LOG               # registers and spills per kernel
    python3 bench/mamba_ssm_ext.py compare OURS.json TWIN.json   # ferrograd vs mamba_ssm rows

The edits only cut what gets compiled, never what the kept kernels do: the dispatch of
selective_scan.cpp keeps fp32 and bf16 inputs with real (fp32) weights, so the fp16 and complex
translation units are not needed; the forward's complex instantiations go; and the kernels'
BOOL_SWITCHes for the flags our bench always sets (variable B and C, z, delta_softplus, and
a length that fills whole blocks, true for every power of two from 128) are fixed at true, which
leaves 5 forward and 5 backward kernels per input type instead of 80 and 160. A call that would
need a cut kernel stops with a TORCH_CHECK naming it (nothing runs the wrong kernel);
`build --all-flags` compiles every flag combination again (a longer build, into the same DIR/build).
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import io
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import time
import types
import urllib.parse
import urllib.request
from pathlib import Path

VERSION = "2.3.2.post1"
SDIST = f"mamba_ssm-{VERSION}.tar.gz"
SHA256 = "104cc47e9101e5401a675fa2b784f2952b9b037f3b1dd83b5ac544394e95d028"
DEFAULT_DIR = ".gpu-extra/mamba_ssm"
STAMP = "PATCHED"
BUILT = "BUILT"  # in DIR/build: the file name of the module the last build made
CSRC = "csrc/selective_scan"
# What the build compiles: the pybind module and the fp32 / bf16, real-weight kernels.
SOURCES = ["selective_scan.cpp", "selective_scan_fwd_fp32.cu", "selective_scan_fwd_bf16.cu",
           "selective_scan_bwd_fp32_real.cu", "selective_scan_bwd_bf16_real.cu"]
# mamba_ssm 2.3.2.post1 setup.py's flags for CUDA, less its -gencode list (sm_90 only here).
NVCC_FLAGS = ["-O3", "-std=c++17", "-U__CUDA_NO_HALF_OPERATORS__", "-U__CUDA_NO_HALF_CONVERSIONS__",
              "-U__CUDA_NO_BFLOAT16_OPERATORS__", "-U__CUDA_NO_BFLOAT16_CONVERSIONS__",
              "-U__CUDA_NO_BFLOAT162_OPERATORS__", "-U__CUDA_NO_BFLOAT162_CONVERSIONS__",
              "--expt-relaxed-constexpr", "--expt-extended-lambda", "--use_fast_math", "--ptxas-options=-v",
              "-lineinfo", "--threads", "4", "-gencode", "arch=compute_90,code=sm_90"]
CXX_FLAGS = ["-O3", "-std=c++17"]

_DISPATCH = """
// ferrograd bench build (bench/mamba_ssm_ext.py): fp32 and bf16 inputs, fp32 (real) weights only,
// so that the fp16 and complex translation units need not be compiled.
#define FG_DISPATCH_ITYPE_FLOAT_AND_BF16(ITYPE, NAME, ...)                          \\
    if (ITYPE == at::ScalarType::BFloat16) {                                        \\
        using input_t = at::BFloat16;                                               \\
        __VA_ARGS__();                                                              \\
    } else if (ITYPE == at::ScalarType::Float) {                                    \\
        using input_t = float;                                                      \\
        __VA_ARGS__();                                                              \\
    } else {                                                                        \\
        AT_ERROR(#NAME, " not built for input type '", toString(ITYPE), "' (ferrograd bench build)"); \\
    }
#define FG_DISPATCH_WTYPE_FLOAT(WTYPE, NAME, ...)                                   \\
    if (WTYPE == at::ScalarType::Float) {                                           \\
        using weight_t = float;                                                     \\
        __VA_ARGS__();                                                              \\
    } else {                                                                        \\
        AT_ERROR(#NAME, " not built for weight type '", toString(WTYPE), "' (ferrograd bench build)"); \\
    }
"""

_SWITCH = """
// ferrograd bench build (bench/mamba_ssm_ext.py): a flag the bench always sets is fixed at true
// (one kernel instead of two per flag); a call with it false stops here. -DFG_ALL_FLAGS restores
// BOOL_SWITCH.
#include <c10/util/Exception.h>
#ifdef FG_ALL_FLAGS
#define FG_TRUE_ONLY(COND, CONST_NAME, ...) BOOL_SWITCH(COND, CONST_NAME, __VA_ARGS__)
#else
#define FG_TRUE_ONLY(COND, CONST_NAME, ...)                                          \\
    [&] {                                                                            \\
        TORCH_CHECK((COND), "selective_scan_cuda was built with " #CONST_NAME        \\
                    " = true only (ferrograd bench build; rebuild with --all-flags)"); \\
        constexpr bool CONST_NAME = true;                                            \\
        return __VA_ARGS__();                                                        \\
    }()
#endif
"""

_FLAGS_FWD = ["params.seqlen % (kNThreads * kNItems) == 0, kIsEvenLen", "params.is_variable_B, kIsVariableB",
              "params.is_variable_C, kIsVariableC", "params.z_ptr != nullptr , kHasZ"]
_FLAGS_BWD = _FLAGS_FWD[:3] + ["params.delta_softplus, kDeltaSoftplus", _FLAGS_FWD[3]]

# (file, old text, new text, how many times old must occur). Each edit must match exactly.
PATCHES = [
    ("selective_scan.cpp", '#include "selective_scan.h"\n', '#include "selective_scan.h"\n' + _DISPATCH, 1),
    ("selective_scan.cpp", "DISPATCH_ITYPE_FLOAT_AND_HALF_AND_BF16(u.scalar_type(),",
     "FG_DISPATCH_ITYPE_FLOAT_AND_BF16(u.scalar_type(),", 2),
    ("selective_scan.cpp", "DISPATCH_WTYPE_FLOAT_AND_COMPLEX(A.scalar_type(),", "FG_DISPATCH_WTYPE_FLOAT(A.scalar_type(),", 2),
    ("selective_scan_fwd_fp32.cu",
     "template void selective_scan_fwd_cuda<float, complex_t>(SSMParamsBase &params, cudaStream_t stream);", "", 1),
    ("selective_scan_fwd_bf16.cu",
     "template void selective_scan_fwd_cuda<at::BFloat16, complex_t>(SSMParamsBase &params, cudaStream_t stream);", "", 1),
    ("static_switch.h", "#pragma once\n", "#pragma once\n" + _SWITCH, 1),
] + [("selective_scan_fwd_kernel.cuh", f"BOOL_SWITCH({f},", f"FG_TRUE_ONLY({f},", 1) for f in _FLAGS_FWD] \
  + [("selective_scan_bwd_kernel.cuh", f"BOOL_SWITCH({f},", f"FG_TRUE_ONLY({f},", 1) for f in _FLAGS_BWD]


class NotBuilt(Exception):
    """DIR holds no usable mamba_ssm build; the message says what to run."""


def log(*a) -> None:
    print(*a, flush=True)


# ---------------------------------------------------------------------------------------------
# fetch and patch (dev machine)
# ---------------------------------------------------------------------------------------------

def index_url() -> str:
    """pip's index, as pip itself would use it (PIP_INDEX_URL, pip config, else pip's default)."""
    url = os.environ.get("PIP_INDEX_URL", "")
    if not url:
        r = subprocess.run([sys.executable, "-m", "pip", "config", "get", "global.index-url"],
                           capture_output=True, text=True, check=False)
        url = r.stdout.strip() if r.returncode == 0 else ""
    if not url:
        from pip._internal.models.index import PyPI  # noqa: PLC0415 (pip's own default index)
        url = PyPI.simple_url
    return url.rstrip("/")


def sdist_url(index: str) -> str:
    """The pinned sdist's link on the index's project page (PEP 691 JSON, else PEP 503 HTML)."""
    req = urllib.request.Request(f"{index}/mamba-ssm/", headers={
        "Accept": "application/vnd.pypi.simple.v1+json, text/html;q=0.1"})
    with urllib.request.urlopen(req, timeout=60) as r:
        ctype, body = r.headers.get("Content-Type", ""), r.read().decode()
        base = r.geturl()
    if "json" in ctype:
        links = [f["url"] for f in json.loads(body).get("files", []) if f.get("filename") == SDIST]
    else:
        links = [h for h in re.findall(r'href="([^"]+)"', body) if h.split("#")[0].endswith("/" + SDIST)]
    if not links:
        raise SystemExit(f"error: {SDIST} not listed at {index}/mamba-ssm/")
    return urllib.parse.urljoin(base, links[0].split("#")[0])


def apply_patches(csrc: Path) -> list[str]:
    """Apply PATCHES to csrc in place; refuse (before writing anything) if any edit does not match."""
    texts = {}
    for name, old, new, count in PATCHES:
        t = texts.setdefault(name, (csrc / name).read_text())
        found = t.count(old)
        if found != count:
            raise SystemExit(f"error: patch of {name}: expected {count} occurrence(s) of {old!r}, found {found} "
                             f"(not mamba_ssm {VERSION}?)")
        texts[name] = t.replace(old, new)
    for name, t in texts.items():
        (csrc / name).write_text(t)
    return [f"{name}: {old.strip()[:60]!r} x{count}" for name, old, _new, count in PATCHES]


def fetch(dest: Path) -> None:
    if (dest / STAMP).is_file():
        log(f"{dest} already holds patched mamba_ssm {VERSION} ({dest / STAMP}); remove it to fetch again")
        return
    url = sdist_url(index_url())
    log(f"downloading {SDIST} ...")
    with urllib.request.urlopen(url, timeout=300) as r:
        data = r.read()
    got = hashlib.sha256(data).hexdigest()
    if got != SHA256:
        raise SystemExit(f"error: {SDIST}: sha256 {got}, expected {SHA256}")
    src = dest / "src"
    if src.exists():
        shutil.rmtree(src)
    src.mkdir(parents=True)
    top = f"mamba_ssm-{VERSION}/"
    with tarfile.open(fileobj=io.BytesIO(data), mode="r:gz") as tar:
        members = [m for m in tar.getmembers() if m.name.startswith(top) and (m.isfile() or m.isdir())]
        for m in members:
            m.name = m.name[len(top):]
        tar.extractall(src, members=[m for m in members if m.name], filter="data")
    edits = apply_patches(src / CSRC)
    (dest / STAMP).write_text(f"mamba_ssm {VERSION} sha256 {SHA256}\n" + "\n".join(edits) + "\n")
    log(f"unpacked and patched into {src} ({len(edits)} edits, listed in {dest / STAMP})")


# ---------------------------------------------------------------------------------------------
# build and load (GPU machine)
# ---------------------------------------------------------------------------------------------

def _require_fetched(dest: Path) -> Path:
    src = dest / "src"
    if not (dest / STAMP).is_file() or not (src / CSRC / SOURCES[0]).is_file():
        raise NotBuilt(f"no patched mamba_ssm source in {dest}: run `bash bench/fetch_mamba_ssm.sh {dest}` on the "
                       "dev machine and carry that folder to the GPU machine")
    return src


def build(dest: Path, jobs: int = 16, all_flags: bool = False, verbose: bool = True):
    """Compile the extension into DIR/build (ninja reuses it when nothing changed); the module."""
    src = _require_fetched(dest)
    import torch  # noqa: PLC0415
    from torch.utils import cpp_extension  # noqa: PLC0415
    os.environ.setdefault("MAX_JOBS", str(jobs))
    os.environ["TORCH_CUDA_ARCH_LIST"] = "9.0"
    build_dir = dest / "build"
    build_dir.mkdir(parents=True, exist_ok=True)
    cu = src / CSRC
    t0 = time.monotonic()
    log(f"building selective_scan_cuda (mamba_ssm {VERSION}) for sm_90 in {build_dir}: torch {torch.__version__}, "
        f"CUDA_HOME {cpp_extension.CUDA_HOME}, MAX_JOBS {os.environ['MAX_JOBS']}")
    mod = cpp_extension.load(
        name="selective_scan_cuda", sources=[str(cu / s) for s in SOURCES], extra_include_paths=[str(cu)],
        extra_cflags=CXX_FLAGS, extra_cuda_cflags=NVCC_FLAGS + (["-DFG_ALL_FLAGS"] if all_flags else []),
        build_directory=str(build_dir), verbose=verbose)
    # The JIT loader names a rebuild with other flags selective_scan_cuda_v1 and so on: record which.
    (build_dir / BUILT).write_text(Path(mod.__file__).name + "\n")
    log(f"built {Path(mod.__file__).name} in {time.monotonic() - t0:.1f} s")
    return mod


def load(dest: Path, ext=None):
    """(selective_scan_fn, selective_scan_ref) of the sdist, over the built extension in DIR.

    The interface module is loaded from its file: the package's __init__ would import the whole of
    mamba_ssm (Triton kernels, transformers). Its import of the Triton layer norm (unused by the
    scan) is stubbed; einops must be importable (it is on the lent machines). `ext`: the module
    `build` returned, in the process that built it."""
    src = _require_fetched(dest)
    built = dest / "build" / BUILT
    so = dest / "build" / (built.read_text().strip() if built.is_file() else "-")
    if not so.is_file():
        raise NotBuilt(f"no built extension in {dest / 'build'}: run `python3 bench/mamba_ssm_ext.py build {dest}` "
                       "on the GPU machine (or bash bench/mamba_ssm_build.sh)")
    import torch  # noqa: F401, PLC0415 (the extension links against libtorch)
    if ext is None:
        spec = importlib.util.spec_from_file_location(so.name.split(".")[0], so)
        ext = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(ext)
    sys.modules["selective_scan_cuda"] = ext
    pkg = src / "mamba_ssm"
    for name, path in (("mamba_ssm", pkg), ("mamba_ssm.ops", pkg / "ops"), ("mamba_ssm.utils", pkg / "utils"),
                       ("mamba_ssm.ops.triton", pkg / "ops" / "triton")):
        if name not in sys.modules:
            m = types.ModuleType(name)
            m.__path__ = [str(path)]
            sys.modules[name] = m
    stub = types.ModuleType("mamba_ssm.ops.triton.layer_norm")

    def _layer_norm_fwd(*_a, **_k):
        raise RuntimeError("stub: the Triton layer norm is not loaded by bench/mamba_ssm_ext.py")

    stub._layer_norm_fwd = _layer_norm_fwd
    sys.modules.setdefault("mamba_ssm.ops.triton.layer_norm", stub)
    iface = importlib.import_module("mamba_ssm.ops.selective_scan_interface")
    return iface.selective_scan_fn, iface.selective_scan_ref


def inputs(torch, dev, dtype, b: int, d: int, n: int, seqlen: int, gen=None) -> list:
    """Our bench's inputs (crates/ferrograd-core/src/fused/selective_scan/bench.rs): u, delta / 2, z,
    B, C N(0, 1) in dtype; A[d, n] = -(n + 1), D = 1, delta_bias = -3 in fp32."""
    r = lambda *s, std=1.0: (torch.randn(*s, device=dev, generator=gen) * std).to(dtype)  # noqa: E731
    u, delta = r(b, d, seqlen), r(b, d, seqlen, std=0.5)
    A = -(torch.arange(n, device=dev, dtype=torch.float32) + 1).repeat(d, 1)
    B, C = r(b, 1, n, seqlen), r(b, 1, n, seqlen)
    D = torch.ones(d, device=dev)
    z = r(b, d, seqlen)
    bias = torch.full((d,), -3.0, device=dev)
    return [u, delta, A, B, C, D, z, bias]


def check(torch, fn, ref, dev, seqlen: int = 1024, state: int = 16) -> float:
    """The largest relative error of fn's output and eight gradients against ref (the sdist's
    selective_scan_ref, sequential, in fp32 as it computes anyway) on the same inputs, a small
    problem: batch 2, 8 channels, fp32 and bf16 inputs. The gradients are autograd's through ref."""
    g = torch.Generator(device=dev).manual_seed(7)
    worst = 0.0
    for dtype in (torch.float32, torch.bfloat16):
        xs = [t.requires_grad_() for t in inputs(torch, dev, dtype, 2, 8, state, seqlen, g)]
        xr = [t.detach().float().requires_grad_() for t in xs]
        dout = torch.randn(2, 8, seqlen, device=dev, generator=g).to(dtype)
        out = fn(*xs[:6], z=xs[6], delta_bias=xs[7], delta_softplus=True)
        want = ref(*xr[:6], z=xr[6], delta_bias=xr[7], delta_softplus=True)
        gs = torch.autograd.grad(out, xs, dout)
        gr = torch.autograd.grad(want, xr, dout.float())
        errs = [_rel(torch, out, want)] + [_rel(torch, a, b) for a, b in zip(gs, gr)]
        tol = 1e-3 if dtype == torch.float32 else 3e-2
        log(f"check {str(dtype)[6:]} L={seqlen}: out and 8 gradients vs selective_scan_ref (fp32), worst "
            f"relative error {max(errs):.2e} (tolerance {tol:.0e})")
        if not max(errs) <= tol:
            raise SystemExit(f"error: mamba_ssm's selective_scan_fn disagrees with selective_scan_ref: "
                             f"{['%.2e' % e for e in errs]} (out, du, ddelta, dA, dB, dC, dD, dz, ddelta_bias)")
        worst = max(worst, max(errs))
    return worst


def _rel(torch, got, want) -> float:
    got, want = got.double(), want.double()
    if not (torch.isfinite(got).all() and torch.isfinite(want).all()):
        return float("inf")
    den = torch.linalg.vector_norm(want).item()
    num = torch.linalg.vector_norm(got - want).item()
    return 0.0 if num == 0 else (float("inf") if den == 0 else num / den)


def ptxas_summary(log_path: Path) -> None:
    """One line per kernel of a build log (nvcc --ptxas-options=-v): its configuration, registers, spills."""
    name = None
    for line in log_path.read_text(errors="replace").splitlines():
        m = re.search(r"Compiling entry function '(\S+)'", line)
        if m:
            k = re.search(r"selective_scan_(fwd|bwd)_kernel.*?traitsILi(\d+)ELi(\d+)", m.group(1))
            name = (f"{k.group(1)} {'bf16' if 'BFloat16' in m.group(1) else 'f32 '} threads={k.group(2):>3} "
                    f"items={k.group(3):>2}") if k else None
        elif name and "spill stores" in line:
            spills = line.strip()
        elif name and "Used" in line and "registers" in line:
            regs = re.search(r"Used (\d+) registers", line)
            log(f"{name}: {regs.group(1) if regs else '?'} registers; {spills}")
            name = None


# ---------------------------------------------------------------------------------------------
# compare (anywhere)
# ---------------------------------------------------------------------------------------------

TAG = " [mamba_ssm]"


def compare(ours_path: Path, twin_path: Path) -> None:
    """Markdown table of ferrograd's rows beside the twin's mamba_ssm rows of the same name."""
    ours = {r["name"]: r for r in json.loads(ours_path.read_text())["rows"]}
    mamba = {r["name"][:-len(TAG)]: r for r in json.loads(twin_path.read_text())["rows"] if r["name"].endswith(TAG)}
    if not mamba:
        raise SystemExit(f"error: {twin_path} has no `...{TAG}` rows (run the twin with --mamba-ssm DIR)")
    log("| what | ferrograd | mamba_ssm | unit | mamba_ssm / ferrograd |")
    log("|---|---:|---:|---|---:|")
    for name, m in mamba.items():
        o = ours.get(name)
        ratio = f"{m['value'] / o['value']:.2f}x" if o and o["unit"] == m["unit"] else "—"
        log(f"| {name} | {o['value']:.3f} | {m['value']:.3f} | {m['unit']} | {ratio} |" if o else
            f"| {name} | — | {m['value']:.3f} | {m['unit']} | — |")
    log("\n(time rows: a ratio above 1 means ferrograd is faster)")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    for c in ("fetch", "build"):
        s = sub.add_parser(c)
        s.add_argument("dir", nargs="?", default=DEFAULT_DIR, type=Path)
        if c == "build":
            s.add_argument("--jobs", type=int, default=16)
            s.add_argument("--all-flags", action="store_true", help="compile every flag combination (longer)")
            s.add_argument("--no-check", dest="check", action="store_false")
    s = sub.add_parser("ptxas")
    s.add_argument("log", type=Path)
    s = sub.add_parser("compare")
    s.add_argument("ours", type=Path)
    s.add_argument("twin", type=Path)
    a = p.parse_args()
    if a.cmd == "fetch":
        fetch(a.dir)
    elif a.cmd == "ptxas":
        ptxas_summary(a.log)
    elif a.cmd == "compare":
        compare(a.ours, a.twin)
    else:
        try:
            ext = build(a.dir, a.jobs, a.all_flags)
            if a.check:
                import torch  # noqa: PLC0415
                fn, ref = load(a.dir, ext)
                check(torch, fn, ref, torch.device("cuda"))
        except NotBuilt as e:
            raise SystemExit(f"error: {e}") from None


if __name__ == "__main__":
    main()
