"""Shared helpers of the PyTorch twins: the JSON schema, the timing procedure, tables, errors.

Every twin does the same work as its `ferrograd bench ...` counterpart, timed the same way, and
writes the same JSON schema, so `bench/compare.py` can pair the rows by name:

    {"schema": "ferrograd-bench/1", "bench": "transfer", "impl": "pytorch", "device": "cuda:0",
     "device_name": "NVIDIA H200", "version": "2.11.0", "timing": "...", "environment": {...},
     "rows": [{"name": "h2d pinned 256 MiB", "value": 55.1, "unit": "GB/s",
               "higher_is_better": true, "median_s": 0.0049, "reps": 10}],
     "notes": ["..."]}

`name`, `value` (positive, finite), `unit` and `higher_is_better` are required in every row; other
row keys (`median_s`, `reps`, `inner`, `pct_of_copy`, `rel_err`, ...) are optional facts.

The timing procedure mirrors crates/ferrograd-cli/src/timing.rs (`measure_device`,
`measure_self_timed`); change both together.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sys
import time

SCHEMA = "ferrograd-bench/1"


def log(*args) -> None:
    """print() that reaches a pipe at once (the twins run under compare.py)."""
    print(*args, flush=True)


def fail(msg: str, code: int = 1) -> None:
    """One `error: ...` line on stderr and a non-zero exit, like the ferrograd binary."""
    print(f"error: {msg}", file=sys.stderr, flush=True)
    sys.exit(code)


def import_torch():
    try:
        import torch  # noqa: PLC0415
    except ImportError as e:
        fail(f"PyTorch is not importable from {sys.executable} ({e}); install it (pip install torch) "
             "or run this script with a Python that has it")
    return torch


def cuda_device(torch, spec: str, bench: str):
    """torch.device for `cuda` / `cuda:N`, or one clear line saying why there is none."""
    if not spec.startswith("cuda"):
        fail(f"{bench} measures a CUDA device; --device {spec} is not meaningful here")
    if not torch.cuda.is_available():
        fail(f"{bench} needs a CUDA device but torch.cuda.is_available() is False "
             f"(torch {torch.__version__}, built for CUDA {torch.version.cuda})")
    dev = torch.device(spec)
    idx = 0 if dev.index is None else dev.index
    if idx >= torch.cuda.device_count():
        fail(f"CUDA device {idx} not found: {torch.cuda.device_count()} device(s) visible")
    torch.cuda.set_device(idx)
    return torch.device("cuda", idx)


def any_device(torch, spec: str, bench: str):
    return torch.device("cpu") if spec == "cpu" else cuda_device(torch, spec, bench)


def common_args(p: argparse.ArgumentParser, device_default: str | None = "cuda") -> None:
    if device_default is not None:
        p.add_argument("--device", default=device_default, help="cpu, cuda or cuda:N")
    p.add_argument("--json", metavar="FILE", help="also write the results as JSON to this file")
    p.add_argument("--seed", type=int, default=42, help="torch.manual_seed for the inputs")


def csv_ints(s: str) -> list[int]:
    try:
        v = [int(x) for x in s.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"`{s}`: expected comma-separated integers") from None
    if not v or any(x <= 0 for x in v):
        raise argparse.ArgumentTypeError(f"`{s}`: expected positive integers")
    return v


def csv_shapes(s: str) -> list[tuple[int, int]]:
    out = []
    for part in s.split(","):
        try:
            r, c = part.lower().split("x")
            r, c = int(r), int(c)
        except ValueError:
            raise argparse.ArgumentTypeError(f"`{part}` is not a shape: expected ROWSxCOLS, e.g. 8192x8192") from None
        if r <= 0 or c <= 0:
            raise argparse.ArgumentTypeError(f"`{part}`: both dimensions must be at least 1")
        out.append((r, c))
    return out


# ---------------------------------------------------------------------------------------------
# Timing (mirrors timing.rs)
# ---------------------------------------------------------------------------------------------

def median(xs) -> float:
    v = sorted(x for x in xs if math.isfinite(x))
    if not v:
        return float("nan")
    n = len(v)
    return v[n // 2] if n % 2 else (v[n // 2 - 1] + v[n // 2]) / 2


class DevicePlan:
    def __init__(self, warmup=3, min_reps=10, max_reps=200, budget_s=0.3, target_batch_s=1e-3, max_inner=1000):
        self.warmup, self.min_reps, self.max_reps = warmup, min_reps, max_reps
        self.budget_s, self.target_batch_s, self.max_inner = budget_s, target_batch_s, max_inner


GPU_PLAN = DevicePlan()


def _timed_calls(torch, fn, calls: int, cuda: bool) -> float:
    """Seconds that `calls` runs of fn take: CUDA events on the current stream, else the host clock."""
    if cuda:
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(calls):
            fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3
    t = time.perf_counter()
    for _ in range(calls):
        fn()
    return time.perf_counter() - t


def time_device(torch, fn, cuda: bool, plan: DevicePlan = GPU_PLAN) -> dict:
    """Warm-up; one timed call sets the batch length `inner` (batch ~ target_batch_s); batches
    until min_reps and budget_s are reached (or max_reps); median of per-call times over batches."""
    for _ in range(plan.warmup):
        fn()
    if cuda:
        torch.cuda.synchronize()
    one = _timed_calls(torch, fn, 1, cuda)
    inner = plan.max_inner if one <= 0 else math.ceil(plan.target_batch_s / one)
    inner = max(1, min(inner, max(1, plan.max_inner)))
    max_reps = max(plan.max_reps, plan.min_reps, 1)
    per_call, spent = [], 0.0
    while len(per_call) < max_reps and (len(per_call) < max(plan.min_reps, 1) or spent < plan.budget_s):
        t = _timed_calls(torch, fn, inner, cuda)
        spent += t
        per_call.append(t / inner)
    return {"median_s": median(per_call), "min_s": min(per_call), "reps": len(per_call), "inner": inner}


def measure_self_timed(fn, warmup: int, min_reps: int, max_reps: int, budget_s: float) -> dict:
    """fn() times itself and returns seconds; median over repetitions after warm-up."""
    for _ in range(warmup):
        fn()
    runs, start = [], time.perf_counter()
    max_reps = max(max_reps, min_reps, 1)
    while len(runs) < max_reps and (len(runs) < max(min_reps, 1) or time.perf_counter() - start < budget_s):
        runs.append(fn())
    return {"median_s": median(runs), "min_s": min(runs), "reps": len(runs)}


def seq_op_args(p: argparse.ArgumentParser, extra: str, extra_default: int) -> None:
    """The flags of the sequence-op twins (torch_conv1d.py, torch_selective_scan.py), as
    seq_op.rs's benches take them: Mamba's batch 4, d_inner 1536, lengths 256 .. 4096."""
    p.add_argument("--dtype", default="bf16", choices=["bf16", "f32"])
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--dim", type=int, default=1536)
    p.add_argument(f"--{extra}", type=int, default=extra_default)
    p.add_argument("--seqs", type=csv_ints, default=[256, 1024, 4096])


def seq_op_measure(torch, dev, fwd, fwd_bwd, plan: DevicePlan = GPU_PLAN):
    """What seq_op.rs measures per length: forward and forward + backward (CUDA events, median),
    then the allocator's peak (MiB) over one more forward + backward, inputs included."""
    tf = time_device(torch, fwd, cuda=True, plan=plan)
    tb = time_device(torch, fwd_bwd, cuda=True, plan=plan)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats(dev)
    grads = fwd_bwd()
    del grads
    torch.cuda.synchronize()
    return tf, tb, torch.cuda.max_memory_allocated(dev) / 2**20


def seq_op_rows(name, tf, tb, peak: float, err: float) -> list:
    """The three report rows of one length; `name(mode)` gives a row's name."""
    return [
        row(name("fwd"), tf["median_s"] * 1e3, "ms", False, median_s=tf["median_s"], reps=tf["reps"],
            rel_err_small=err),
        row(name("fwd+bwd"), tb["median_s"] * 1e3, "ms", False, median_s=tb["median_s"], reps=tb["reps"]),
        row(name("peak fwd+bwd"), peak, "MiB", False),
    ]


# ---------------------------------------------------------------------------------------------
# Correctness
# ---------------------------------------------------------------------------------------------

def rel_err(torch, got, want) -> float:
    """‖got − want‖ / ‖want‖ in float64; inf when anything is not finite."""
    got, want = got.double(), want.double()
    if not (torch.isfinite(got).all() and torch.isfinite(want).all()):
        return float("inf")
    num = torch.linalg.vector_norm(got - want).item()
    den = torch.linalg.vector_norm(want).item()
    if num == 0.0:
        return 0.0
    return float("inf") if den == 0.0 else num / den


def require(what: str, err: float, tol: float) -> None:
    if not (math.isfinite(err) and err <= tol):
        fail(f"{what}: result disagrees with the float64 reference (relative error {err:.3e} > {tol:.0e}); "
             "not timing a wrong result")


def sample_rows(n: int, all_up_to: int, extra: int, gen) -> list[int]:
    """All rows up to all_up_to, else the first, the last and `extra` random ones (sorted, distinct)."""
    if n <= all_up_to:
        return list(range(n))
    rows = {0, n - 1}
    rows.update(int(r) for r in gen(extra, n))
    return sorted(rows)


# ---------------------------------------------------------------------------------------------
# Report and table
# ---------------------------------------------------------------------------------------------

def row(name: str, value: float, unit: str, higher_is_better: bool, **extra) -> dict:
    if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
        fail(f"row {name!r}: measured value {value!r} is not a positive finite number")
    r = {"name": name, "value": float(value), "unit": unit, "higher_is_better": bool(higher_is_better)}
    r.update(extra)
    return r


def environment(torch, device) -> dict:
    env = {
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "python": platform.python_version(),
        "cpu": _cpu_model(),
        "torch_threads": torch.get_num_threads(),
        "os": platform.system().lower(),
        "arch": platform.machine(),
    }
    if device.type == "cuda":
        p = torch.cuda.get_device_properties(device)
        env["gpu"] = f"{p.name}, {p.total_memory / 2**30:.1f} GiB, sm_{p.major}{p.minor}, {p.multi_processor_count} SMs"
        env["allow_tf32"] = torch.backends.cuda.matmul.allow_tf32
        env["allow_bf16_reduced_precision_reduction"] = torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction
        env["PYTORCH_CUDA_ALLOC_CONF"] = os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "")
    return env


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.machine()


def report(torch, bench: str, device, timing: str, rows: list, notes: list | None = None) -> dict:
    env = environment(torch, device)
    name = env["gpu"].split(",")[0] if "gpu" in env else env["cpu"]
    dev = "cpu" if device.type == "cpu" else f"cuda:{device.index or 0}"
    return {
        "schema": SCHEMA, "bench": bench, "impl": "pytorch", "device": dev, "device_name": name,
        "version": torch.__version__, "timing": timing, "environment": env, "rows": rows, "notes": notes or [],
    }


def fmt_value(v: float) -> str:
    a = abs(v)
    if a >= 1e5:
        return f"{v:.0f}"
    if a >= 100:
        return f"{v:.1f}"
    if a >= 1:
        return f"{v:.2f}"
    return f"{v:.4f}"


def fmt_secs(s: float) -> str:
    return f"{s * 1e6:.2f} µs" if s < 1e-3 else f"{s * 1e3:.3f} ms"


def print_rows(rows: list, extra: tuple[str, str] | None = None) -> None:
    w = max([4] + [len(r["name"]) for r in rows])
    head = f"{'what':{w}} | {'value':>12} {'unit':<8} | {'median':>11} | {'reps':>5}"
    if extra:
        head += f" | {extra[0]:>10}"
    log(head)
    log("-" * len(head))
    for r in rows:
        med = fmt_secs(r["median_s"]) if "median_s" in r else "-"
        reps = str(r["reps"]) if "reps" in r else "-"
        line = f"{r['name']:{w}} | {fmt_value(r['value']):>12} {r['unit']:<8} | {med:>11} | {reps:>5}"
        if extra:
            v = r.get(extra[1])
            line += f" | {(f'{v:.1f}%' if extra[1].startswith('pct') else fmt_value(v)) if v is not None else '-':>10}"
        log(line)


def finish(rep: dict, path: str | None) -> None:
    if path:
        try:
            with open(path, "w") as f:
                json.dump(rep, f, indent=2, ensure_ascii=False)
                f.write("\n")
        except OSError as e:
            fail(f"cannot write {path}: {e}")
        log(f"\nwrote {path}")
