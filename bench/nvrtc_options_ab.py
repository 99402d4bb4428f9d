#!/usr/bin/env python3
"""What an NVRTC flag costs at run time and saves at compile time, measured on one GPU in one call.

    python3 bench/nvrtc_options_ab.py --ferrograd BIN --options=--Ofast-compile=min [--reps 2]
                                      [--only elementwise,fused,...] [--gpt SHARDS_DIR] [--out DIR]

Side A runs with the modules' own options, side B with FERROGRAD_NVRTC_OPTIONS=<options> (added to
every module and to the kernel cache's key, so the two sides never share a CUBIN). For each side:

1. the cold precompile (`ferrograd kernels --precompile` into an empty cache), `--reps` times,
   alternating A, B, A, B so that a machine whose clock drifts is seen by both sides alike;
2. every bench whose kernels NVRTC compiles (`ferrograd bench NAME --json`), the Monster Walk run in
   each of its steps and precisions (`monster-walk --report`), and with `--gpt` a short GPT-2 run
   (`gpt train`, tokens/s after its warm-up steps, from summary.json), alternating A, B likewise;
   each row keeps its best figure per side.

The table pairs the rows by name: `B/A` above 1 means B did better (higher figures or shorter
times). Its run of `--Ofast-compile=min` (BENCHMARKS.md, 2026-11-24) is why no module uses that
flag (docs/architecture.md, "Where the time goes").
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

BENCHES = {
    "elementwise": [],
    "fused": [],
    "fused_f32": ["--dtype", "f32"],
    "linear": ["--dtype", "bf16,f32"],
    "attention": ["--backend", "flash", "--seqs", "1024,4096"],
    "attention_f32": ["--backend", "flash", "--seqs", "1024", "--dtype", "f32"],
    "optim": [],
    "selective-scan": [],
    "selective-scan_f32": ["--dtype", "f32"],
    "conv1d": [],
}
MONSTER = {
    "mw persistent f32": ["--step", "persistent", "--precision", "f32"],
    "mw persistent tf32": ["--step", "persistent", "--precision", "tf32"],
    "mw persistent bf16": ["--step", "persistent", "--precision", "bf16"],
    "mw fused": ["--step", "fused"],
    "mw unfused graph": ["--step", "unfused"],
}


def run(cmd: list[str], env: dict, timeout: int = 300) -> str:
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    if p.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} exited {p.returncode}: {(p.stdout + p.stderr)[-600:]}")
    return p.stdout + p.stderr


def side_env(base: dict, options: str | None, cache: Path) -> dict:
    env = dict(base)
    env["FERROGRAD_CACHE_DIR"] = str(cache)
    # Both sides from NVRTC: the binary's prebuilt CUBINs would serve side A (no options) alone.
    env["FERROGRAD_PREBUILT"] = "0"
    env.pop("FERROGRAD_NVRTC_OPTIONS", None)
    if options:
        env["FERROGRAD_NVRTC_OPTIONS"] = options
    return env


def precompile(fg: str, env: dict) -> tuple[float, float, str]:
    """Cold precompile into an empty cache: (wall s, NVRTC s summed over modules, longest module).
    CUDA_CACHE_DISABLE=1: a toolkit's NVRTC also keeps its output in the driver's compute cache,
    which would serve every run after the first (`ferrograd kernels` says when that happened)."""
    cold = Path(tempfile.mkdtemp(prefix="fg-cold-"))
    try:
        out = run([fg, "kernels", "--precompile"], {**env, "FERROGRAD_CACHE_DIR": str(cold), "CUDA_CACHE_DISABLE": "1"})
    finally:
        shutil.rmtree(cold, ignore_errors=True)
    m = re.search(r"in ([\d.]+) s on \d+ threads; a start now skips ([\d.]+) s of NVRTC; longest (\S+ [\d.]+ m?s)", out)
    if not m:
        raise RuntimeError(f"precompile printed no summary: {out[-400:]}")
    return float(m.group(1)), float(m.group(2)), m.group(3)


def bench_rows(fg: str, env: dict, name: str, args: list[str], tmp: Path) -> dict[str, tuple[float, bool]]:
    """One bench's rows: name -> (value, higher is better)."""
    out = tmp / f"{name}.json"
    run([fg, "bench", name.split("_")[0], "--json", str(out), *args], env)
    rows = json.loads(out.read_text())["rows"]
    return {f"{name}: {r['name']}": (float(r["value"]), bool(r["higher_is_better"])) for r in rows}


def monster_rows(fg: str, env: dict, tmp: Path) -> dict[str, tuple[float, bool]]:
    rows = {}
    for name, args in MONSTER.items():
        rep = tmp / "mw.json"
        run([fg, "monster-walk", "--device", "cuda", "--report", str(rep), *args], env)
        d = json.loads(rep.read_text())
        rows[f"{name}: training s"] = (float(d["training_time_s"]), False)
    return rows


def gpt_rows(fg: str, env: dict, data: str, tmp: Path) -> dict[str, tuple[float, bool]]:
    """A short GPT-2 124M run: tokens/s after the warm-up steps, from its summary.json."""
    out = tmp / "gpt"
    run([fg, "gpt", "train", "--data", data, "--model", "gpt2", "--batch", "16", "--context", "1024",
         "--precision", "bf16", "--steps", "20", "--val-every", "0", "--progress", "quiet", "--out", str(out)],
        env, timeout=400)
    summary = json.loads((out / "summary.json").read_text())
    return {"gpt2 bf16 16x1024, 20 steps: tok/s": (float(summary["tokens_per_s"]), True)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ferrograd", required=True)
    ap.add_argument("--options", required=True, help="side B's FERROGRAD_NVRTC_OPTIONS")
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--only", help="comma-separated subset of " + ",".join([*BENCHES, "monster", "precompile"]))
    ap.add_argument("--gpt", metavar="SHARDS", help="also time gpt train on these token shards")
    ap.add_argument("--out", default=None, help="write ab.json here")
    a = ap.parse_args()
    only = set(a.only.split(",")) if a.only else None
    want = lambda n: only is None or n in only  # noqa: E731
    tmp = Path(tempfile.mkdtemp(prefix="fg-ab-"))
    sides = {"A": side_env(os.environ, None, tmp / "cache"), "B": side_env(os.environ, a.options, tmp / "cache")}
    best: dict[str, dict[str, tuple[float, bool]]] = {"A": {}, "B": {}}

    def keep(side: str, rows: dict[str, tuple[float, bool]]) -> None:
        for k, (v, hib) in rows.items():
            old = best[side].get(k)
            if old is None or (v > old[0] if hib else v < old[0]):
                best[side][k] = (v, hib)

    t0 = time.monotonic()
    failed = False
    for rep in range(a.reps):
        for side, env in sides.items():
            if want("precompile"):
                wall, total, longest = precompile(a.ferrograd, env)
                print(f"[{time.monotonic() - t0:.0f} s] {side}{rep}: cold precompile {wall:.2f} s, {total:.2f} s of NVRTC,"
                      f" longest {longest}", flush=True)
                keep(side, {"cold precompile: wall s": (wall, False), "cold precompile: NVRTC s": (total, False)})
            run([a.ferrograd, "kernels", "--precompile"], env)  # warm: no bench pays NVRTC
            steps = [(n, lambda n=n, g=g: bench_rows(a.ferrograd, env, n, g, tmp)) for n, g in BENCHES.items() if want(n)]
            if want("monster"):
                steps.append(("monster", lambda: monster_rows(a.ferrograd, env, tmp)))
            if a.gpt:
                steps.append(("gpt", lambda: gpt_rows(a.ferrograd, env, a.gpt, tmp)))
            for name, step in steps:
                try:
                    keep(side, step())
                except (RuntimeError, subprocess.TimeoutExpired, OSError, ValueError, KeyError) as e:
                    failed = True
                    print(f"{side}{rep} {name} FAILED: {e}", flush=True)
            print(f"[{time.monotonic() - t0:.0f} s] {side}{rep}: benches done", flush=True)

    print(f"\n| row | A (default) | B ({a.options}) | B/A |\n|---|---|---|---|")
    table = []
    for k in best["A"]:
        if k not in best["B"]:
            continue
        (va, hib), (vb, _) = best["A"][k], best["B"][k]
        ratio = vb / va if hib else va / vb
        table.append({"row": k, "a": va, "b": vb, "b_over_a": ratio})
        print(f"| {k} | {va:.4g} | {vb:.4g} | {ratio:.3f} |")
    if a.out:
        Path(a.out).write_text(json.dumps({"options": a.options, "rows": table}, indent=1))
    shutil.rmtree(tmp, ignore_errors=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
