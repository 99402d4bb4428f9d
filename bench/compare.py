#!/usr/bin/env python3
"""Run ferrograd's GPU benchmarks and their PyTorch twins side by side and print the ratios.

    python3 bench/compare.py [--ferrograd PATH]
                             [--only matmul,transfer,alloc,elementwise,launch,optim,attention,linear,fused]
                             [--out DIR] [--device cuda:0] [--python PY] [--quick]

For each bench, in one invocation on one GPU: `ferrograd bench NAME --device cuda --json ...`, then
`bench/torch_NAME.py --json ...` (same work, same timing, same JSON schema: see benchlib.py), then
a table pairing the rows by name:

    ratio = ours / PyTorch       for figures where higher is better (TFLOP/s, GB/s, ops/s)
    ratio = PyTorch / ours       for times (µs)
    so a ratio above 1 always means ferrograd did better.

Before the benches, `ferrograd kernels --precompile` fills the kernel cache (so no bench's warm-up
pays NVRTC) and `ferrograd info` names the device. Everything lands in --out (default
bench/out/<date-time>): each side's JSON and log, compare.json (all of it, with the ratios) and
compare.md (the tables for BENCHMARKS.md). A bench that fails on one side is reported and the
others still run; the exit status is 1 if anything failed.

The binary: --ferrograd, else .gpu/bin/ferrograd (what ../shared/gpu/bundle gathers), else
target/release/ferrograd. The whole default run takes about two minutes on an H100/H200.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import math
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
BENCHES = ["matmul", "transfer", "alloc", "elementwise", "launch", "optim", "attention", "linear", "fused"]
STEP_TIMEOUT_S = 300

# --quick: the same benches at sizes that finish in seconds (a smoke test, not for BENCHMARKS.md).
QUICK = {
    "matmul": ["--sizes", "256,1024"],
    "transfer": ["--mib", "32"],
    "alloc": [],
    "elementwise": ["--shapes", "2048x2048"],
    "launch": ["--ops", "2000"],
    "optim": ["--tensors", "20"],
    "attention": ["--seqs", "512,1024", "--head-dims", "64"],
    "linear": ["--rows", "2048"],
    "fused": ["--shapes", "4096x768", "--classifier", "1024x50257"],
}


def log(*a) -> None:
    print(*a, flush=True)


def die(msg: str) -> None:
    print(f"error: {msg}", file=sys.stderr, flush=True)
    sys.exit(2)


def find_binary(arg: str | None) -> Path:
    if arg:
        p = Path(arg)
        if not (p.is_file() and os.access(p, os.X_OK)):
            die(f"--ferrograd {arg}: not an executable file")
        return p.resolve()
    bundled, built = ROOT / ".gpu" / "bin" / "ferrograd", ROOT / "target" / "release" / "ferrograd"
    for p in (bundled, built):
        if p.is_file() and os.access(p, os.X_OK):
            if p == bundled and built.is_file() and built.stat().st_mtime > bundled.stat().st_mtime:
                log(f"note: {built} is newer than {bundled}; using the bundled one (pass --ferrograd to choose)")
            return p
    die("no ferrograd binary: looked for .gpu/bin/ferrograd and target/release/ferrograd under "
        f"{ROOT}; build it (cargo build --release -p ferrograd-cli, or ../shared/gpu/bundle) or pass --ferrograd PATH")
    raise AssertionError


def check_binary(binary: Path, benches: list[str], env: dict) -> None:
    """Refuse a binary that predates the benches asked for (a stale .gpu/bin, say)."""
    try:
        p = subprocess.run([str(binary), "bench", "--help"], capture_output=True, text=True, env=env, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as e:
        die(f"cannot run {binary}: {e}")
    missing = [b for b in benches if not any(ln.split()[:1] == [b] for ln in p.stdout.splitlines())]
    if p.returncode != 0 or missing:
        die(f"{binary} has no `bench {'`, `bench '.join(missing) or '...'}` (built before these benches?); "
            "rebuild it (../shared/gpu/bundle or cargo build --release -p ferrograd-cli) or pass --ferrograd PATH")


def ours_env() -> dict:
    """As .gpu/run sets it up: the driver and toolkit libraries, headers, a kernel cache."""
    env = dict(os.environ)
    libs = [d for d in ("/usr/local/nvidia/lib64", "/usr/local/cuda/lib64", "/usr/local/cuda/targets/x86_64-linux/lib")
            if os.path.isdir(d)]
    if libs:
        env["LD_LIBRARY_PATH"] = ":".join(libs + ([env["LD_LIBRARY_PATH"]] if env.get("LD_LIBRARY_PATH") else []))
    if os.path.isdir("/usr/local/cuda") and "CUDA_HOME" not in env:
        env["CUDA_HOME"] = "/usr/local/cuda"
    env.setdefault("FERROGRAD_CACHE_DIR", "/tmp/ferrograd-cache")
    return env


def run_step(cmd: list[str], log_path: Path, env: dict | None = None, timeout: int = STEP_TIMEOUT_S) -> tuple[int, str]:
    """Run cmd, echo its output indented as it comes, save it to log_path; (exit status, output)."""
    log(f"$ {' '.join(str(c) for c in cmd)}")
    t0 = time.monotonic()
    lines: list[str] = []
    try:
        proc = subprocess.Popen([str(c) for c in cmd], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                env=env, cwd=ROOT, bufsize=1, errors="replace")
    except OSError as e:
        msg = f"cannot start {cmd[0]}: {e}"
        log_path.write_text(msg + "\n")
        log(f"  {msg}")
        return 127, msg
    assert proc.stdout is not None
    killed = threading.Event()

    def kill() -> None:
        killed.set()
        proc.kill()

    watchdog = threading.Timer(timeout, kill)
    watchdog.start()
    try:
        for line in proc.stdout:
            lines.append(line)
            log("  " + line.rstrip("\n"))
        rc = proc.wait()
    finally:
        watchdog.cancel()
    if killed.is_set():
        lines.append(f"[compare.py: killed after {timeout} s]\n")
        log(f"  [killed after {timeout} s]")
    out = "".join(lines)
    log_path.write_text(out)
    log(f"  ({time.monotonic() - t0:.1f} s, exit {rc})")
    return rc, out


def load_report(path: Path) -> tuple[dict | None, str | None]:
    """The JSON if it exists and follows the schema, else (None, why not)."""
    if not path.is_file():
        return None, "no JSON written"
    try:
        rep = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        return None, f"unreadable JSON ({e})"
    if rep.get("schema") != "ferrograd-bench/1" or not isinstance(rep.get("rows"), list):
        return None, f"unexpected schema {rep.get('schema')!r}"
    for r in rep["rows"]:
        if not all(k in r for k in ("name", "value", "unit", "higher_is_better")):
            return None, f"row without name/value/unit/higher_is_better: {r}"
    return rep, None


def num(r: dict | None) -> float | None:
    """The row's value when it is a positive finite number (JSON null, NaN and 0 are not figures)."""
    v = r.get("value") if r else None
    return float(v) if isinstance(v, (int, float)) and math.isfinite(v) and v > 0 else None


def pair_rows(ours: dict | None, torch: dict | None) -> list[dict]:
    """Rows of both sides by name (ours' order first, then PyTorch-only rows), with the ratio."""
    o = {r["name"]: r for r in (ours or {}).get("rows", [])}
    t = {r["name"]: r for r in (torch or {}).get("rows", [])}
    names = list(o) + [n for n in t if n not in o]
    out = []
    for n in names:
        a, b = o.get(n), t.get(n)
        unit = (a or b)["unit"]
        hib = (a or b)["higher_is_better"]
        va, vb = num(a), num(b)
        ratio = None
        if va and vb and a["unit"] == b["unit"]:
            ratio = va / vb if hib else vb / va
        row = {"name": n, "unit": unit, "higher_is_better": hib, "ferrograd": va, "pytorch": vb, "ratio": ratio}
        for side, r in (("ferrograd", a), ("pytorch", b)):
            if r and isinstance(r.get("pct_of_copy"), (int, float)):
                row[f"{side}_pct_of_copy"] = r["pct_of_copy"]
        out.append(row)
    return out


def fmt(v: float | None) -> str:
    if v is None:
        return "—"
    a = abs(v)
    if a >= 1e5:
        return f"{v:.0f}"
    if a >= 100:
        return f"{v:.1f}"
    if a >= 1:
        return f"{v:.2f}"
    return f"{v:.4f}"


def fmt_ratio(r: float | None) -> str:
    return "—" if r is None else f"{r:.2f}x"


def text_table(rows: list[dict]) -> str:
    pct = any("ferrograd_pct_of_copy" in r or "pytorch_pct_of_copy" in r for r in rows)
    w = max([4] + [len(r["name"]) for r in rows])
    head = f"{'what':{w}} | {'ferrograd':>11} | {'PyTorch':>11} | {'unit':<8} | {'ratio':>7}"
    if pct:
        head += " | % of copy (ours / torch)"
    lines = [head, "-" * len(head)]
    for r in rows:
        line = (f"{r['name']:{w}} | {fmt(r['ferrograd']):>11} | {fmt(r['pytorch']):>11} | {r['unit']:<8} | "
                f"{fmt_ratio(r['ratio']):>7}")
        if pct:
            a, b = r.get("ferrograd_pct_of_copy"), r.get("pytorch_pct_of_copy")
            line += f" | {('—' if a is None else f'{a:.0f}%'):>5} / {('—' if b is None else f'{b:.0f}%')}"
        lines.append(line)
    return "\n".join(lines)


def md_table(rows: list[dict]) -> str:
    pct = any("ferrograd_pct_of_copy" in r for r in rows)
    head = "| what | ferrograd | PyTorch | unit | ours vs PyTorch |" + (" % of copy (ours / PyTorch) |" if pct else "")
    sep = "|---|---:|---:|---|---:|" + ("---:|" if pct else "")
    lines = [head, sep]
    for r in rows:
        line = f"| {r['name']} | {fmt(r['ferrograd'])} | {fmt(r['pytorch'])} | {r['unit']} | {fmt_ratio(r['ratio'])} |"
        if pct:
            a, b = r.get("ferrograd_pct_of_copy"), r.get("pytorch_pct_of_copy")
            line += f" {'—' if a is None else f'{a:.0f}%'} / {'—' if b is None else f'{b:.0f}%'} |"
        lines.append(line)
    return "\n".join(lines)


def git_commit() -> str:
    if env := os.environ.get("FERROGRAD_COMMIT"):
        return env
    if not shutil.which("git") or not (ROOT / ".git").exists():
        return "unknown (no git checkout; set FERROGRAD_COMMIT)"
    try:
        head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(ROOT), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, check=True).stdout.strip()
        return head + (" + uncommitted changes" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def torch_probe(python: str) -> tuple[str | None, str | None]:
    """(PyTorch version, None) when the twins can run, else (None, why not)."""
    code = ("import torch, sys\n"
            "ok = torch.cuda.is_available()\n"
            "print(torch.__version__, torch.cuda.get_device_name(0) if ok else '-', sep='|')\n"
            "sys.exit(0 if ok else 3)\n")
    try:
        p = subprocess.run([python, "-c", code], capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired) as e:
        return None, f"cannot run {python}: {e}"
    if p.returncode == 3:
        return None, f"PyTorch {p.stdout.split('|')[0]} in {python} sees no CUDA device"
    if p.returncode != 0:
        last = (p.stderr.strip().splitlines() or ["?"])[-1]
        return None, f"`import torch` failed in {python}: {last}"
    return p.stdout.strip().split("|")[0], None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--ferrograd", metavar="PATH", help="the ferrograd binary (default .gpu/bin or target/release)")
    ap.add_argument("--only", help=f"comma-separated subset of {','.join(BENCHES)} (default: all)")
    ap.add_argument("--out", metavar="DIR", help="where JSON, logs and tables go (default bench/out/<date-time>)")
    ap.add_argument("--device", default="cuda:0", help="cuda or cuda:N (default cuda:0)")
    ap.add_argument("--python", default=sys.executable, help="the Python with PyTorch for the twins")
    ap.add_argument("--quick", action="store_true", help="small sizes: a smoke test, not for BENCHMARKS.md")
    ap.add_argument("--no-precompile", action="store_true", help="skip `ferrograd kernels --precompile`")
    a = ap.parse_args()

    benches = BENCHES
    if a.only:
        benches = [b.strip() for b in a.only.split(",") if b.strip()]
        unknown = [b for b in benches if b not in BENCHES]
        if unknown:
            die(f"--only: unknown bench(es) {', '.join(unknown)}; choose from {', '.join(BENCHES)}")
    if not a.device.startswith("cuda"):
        die(f"--device {a.device}: compare.py compares GPU benches; use cuda or cuda:N")

    binary = find_binary(a.ferrograd)
    env = ours_env()
    check_binary(binary, benches, env)
    stamp = dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    out = Path(a.out) if a.out else HERE / "out" / stamp
    out.mkdir(parents=True, exist_ok=True)
    t_start = time.monotonic()

    log(f"ferrograd binary: {binary}")
    log(f"results: {out}")
    torch_version, why_no_torch = torch_probe(a.python)
    if why_no_torch:
        log(f"WARNING: the PyTorch twins cannot run: {why_no_torch}. Running ferrograd's side only.")
    else:
        log(f"PyTorch {torch_version} ({a.python})")

    log("\n== ferrograd info")
    _, info = run_step([binary, "info"], out / "ferrograd_info.log", env, timeout=60)
    version = next((ln.split()[1] for ln in info.splitlines() if ln.startswith("ferrograd ")), "?")
    cuda_line = next((ln for ln in info.splitlines() if ln.startswith("cuda: ")), "cuda: (no line)")
    if "device(s)" not in cuda_line:
        die(f"ferrograd sees no CUDA device ({cuda_line.strip()}); nothing to compare")

    failures: list[str] = []
    if not a.no_precompile:
        log("\n== ferrograd kernels --precompile")
        rc, _ = run_step([binary, "kernels", "--precompile", "--device", a.device], out / "ferrograd_kernels.log", env)
        if rc != 0:
            failures.append("kernels --precompile")

    results = {}
    for b in benches:
        log(f"\n== {b}")
        extra = QUICK[b] if a.quick else []
        oj, tj = out / f"ferrograd_{b}.json", out / f"pytorch_{b}.json"
        for p in (oj, tj):
            p.unlink(missing_ok=True)
        rc_o, _ = run_step([binary, "bench", b, "--device", a.device, "--json", oj, *extra],
                           out / f"ferrograd_{b}.log", env)
        ours, why_o = load_report(oj)
        if rc_o != 0 or ours is None:
            failures.append(f"ferrograd {b}")
        torch_rep, why_t = None, why_no_torch
        if not why_no_torch:
            rc_t, _ = run_step([a.python, "-u", HERE / f"torch_{b}.py", "--device", a.device, "--json", tj, *extra],
                               out / f"pytorch_{b}.log", dict(os.environ, PYTHONUNBUFFERED="1"))
            torch_rep, why_t = load_report(tj)
            if rc_t != 0 or torch_rep is None:
                failures.append(f"pytorch {b}")
        rows = pair_rows(ours, torch_rep)
        results[b] = {"ferrograd": ours, "pytorch": torch_rep, "rows": rows,
                      "ferrograd_error": None if ours else why_o, "pytorch_error": None if torch_rep else why_t}
        log(f"\n-- {b}: ratio > 1 means ferrograd is better")
        if rows:
            log(text_table(rows))
        for side, why in (("ferrograd", results[b]["ferrograd_error"]), ("pytorch", results[b]["pytorch_error"])):
            if why:
                logfile = out / f"{side}_{b}.log"
                log(f"   ({side}: {why}" + (f"; see {logfile})" if logfile.exists() else ")"))

    device_name = next((r["device_name"] for res in results.values() for r in (res["ferrograd"], res["pytorch"]) if r),
                       "?")
    meta = {
        "date": dt.datetime.now().astimezone().isoformat(timespec="seconds"),
        "device": a.device, "device_name": device_name, "commit": git_commit(), "ferrograd_version": version,
        "ferrograd_binary": str(binary), "pytorch_version": torch_version, "python": a.python,
        "quick": a.quick, "command": " ".join(["python3", "bench/compare.py", *sys.argv[1:]]),
        "elapsed_s": round(time.monotonic() - t_start, 1), "failures": failures,
    }
    (out / "compare.json").write_text(json.dumps({"meta": meta, "benches": results}, indent=2, ensure_ascii=False) + "\n")

    md = [f"### {device_name}, {meta['date'][:10]}", "",
          f"- Command: `{meta['command']}` ({meta['elapsed_s']} s in all{', --quick sizes' if a.quick else ''})",
          f"- ferrograd {version}, commit {meta['commit']}; PyTorch {torch_version or 'not run'}",
          "- Ratio: ours / PyTorch for rates, PyTorch / ours for times: above 1 means ferrograd is faster.", ""]
    for b, res in results.items():
        md += [f"#### {b}", ""]
        if res["rows"]:
            md += [md_table(res["rows"]), ""]
        for side in ("ferrograd", "pytorch"):
            if res[f"{side}_error"]:
                md += [f"{side}: {res[f'{side}_error']}", ""]
        notes = [n for side in ("ferrograd", "pytorch") if res[side] for n in res[side].get("notes", [])]
        md += [f"- {n}" for n in notes] + ([""] if notes else [])
    (out / "compare.md").write_text("\n".join(md))

    log(f"\nwrote {out / 'compare.json'} and {out / 'compare.md'} ({meta['elapsed_s']} s in all)")
    if failures:
        log(f"FAILED: {', '.join(failures)}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
