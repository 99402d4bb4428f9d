#!/usr/bin/env python3
"""PyTorch twin of `ferrograd bench selective-scan`: the selective scan of Mamba in plain PyTorch,
forward and forward + backward time and peak memory.

The reference is mamba_ssm's `selective_scan_ref` (mamba_ssm is not installed on the lent GPU, so
it is written out here): dt = softplus(delta + delta_bias), deltaA = exp(dt A) and deltaB_u =
dt B u for all steps at once, then the sequential recurrence x = deltaA_l x + deltaB_u_l,
y_l = C_l . x in a Python loop, out = (y + D u) * silu(z), in f32 (inputs upcast, as the
reference does; the output cast back). Two forms: eager, and the loop's step under
torch.compile (rows marked `[torch compiled step]`): compiling the whole loop would unroll
thousands of steps.

Same work as ours: batch 4, d_inner 1536, state 16, one group, lengths 256, 1024, 4096; u, z, B,
C, dout N(0, 1), delta N(0, 1) / 2, A[d, n] = -(n + 1), D = 1, delta_bias = -3. The backward is
`torch.autograd.grad(out, inputs, dout)`. Checks: both forms against a float64 run of the same
code on a slice of channels, before timing. Timing: CUDA events, median (benchlib.time_device,
with fewer repetitions: one call takes up to seconds).

With `--mamba-ssm DIR` (a folder that bench/mamba_ssm_ext.py fetched and built: see
bench/mamba_ssm_build.sh), mamba_ssm's own fused CUDA kernel joins (rows marked `[mamba_ssm]`):
its `selective_scan_fn` on the same tensors, checked first (out and eight gradients) against the
sdist's `selective_scan_ref` on a small problem and (forward) against the float64 run above, then
timed with the plan ferrograd's bench uses (benchlib.GPU_PLAN, timing.rs DevicePlan::GPU).
`--forms` picks the rows: eager, compiled, mamba_ssm (default: eager and compiled, and mamba_ssm
when --mamba-ssm is given).

    python3 bench/torch_selective_scan.py [--dtype bf16] [--seqs 256,1024,4096] [--json FILE]
                                          [--mamba-ssm DIR] [--forms eager,compiled,mamba_ssm]
"""

import argparse
from pathlib import Path

import benchlib as bl
import mamba_ssm_ext as mx

TOL = {"f32": 1e-4, "bf16": 2e-2}
SLOW_PLAN = bl.DevicePlan(warmup=1, min_reps=3, max_reps=10, budget_s=1.0)


def row_name(mode: str, dtype: str, b: int, d: int, n: int, l: int) -> str:
    return f"{mode} {dtype} B={b} D={d} N={n} L={l}"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    bl.common_args(p)
    bl.seq_op_args(p, "state", 16)
    p.add_argument("--no-compile", dest="compile", action="store_false", help="skip the compiled-step rows")
    p.add_argument("--mamba-ssm", metavar="DIR", type=Path,
                   help="add mamba_ssm's CUDA kernel, built in DIR by bench/mamba_ssm_ext.py")
    p.add_argument("--forms", type=lambda s: [f for f in s.split(",") if f],
                   help="comma-separated rows to run: eager, compiled, mamba_ssm")
    a = p.parse_args()
    forms_asked = a.forms or (["eager"] + (["compiled"] if a.compile else []) + (["mamba_ssm"] if a.mamba_ssm else []))
    if bad := [f for f in forms_asked if f not in ("eager", "compiled", "mamba_ssm")]:
        bl.fail(f"--forms: unknown {', '.join(bad)} (eager, compiled, mamba_ssm)")
    if "mamba_ssm" in forms_asked and not a.mamba_ssm:
        bl.fail("--forms mamba_ssm needs --mamba-ssm DIR (bench/mamba_ssm_build.sh builds it)")

    torch = bl.import_torch()
    import torch.nn.functional as F  # noqa: PLC0415

    mamba_fn = mamba_ref = None
    if "mamba_ssm" in forms_asked:
        try:
            mamba_fn, mamba_ref = mx.load(a.mamba_ssm)
        except mx.NotBuilt as e:
            bl.log(f"mamba_ssm not built, its rows skipped: {e}")
            if forms_asked == ["mamba_ssm"]:
                bl.fail(f"nothing to run: {e}")

    dev = bl.cuda_device(torch, a.device, "selective-scan")
    dt = {"f32": torch.float32, "bf16": torch.bfloat16}[a.dtype]
    torch.manual_seed(a.seed)
    Bn, Dn, N = a.batch, a.dim, a.state

    def step(x, da, dbu, c):
        x = da * x + dbu
        return x, torch.einsum("bdn,bn->bd", x, c)

    compiled_step = torch.compile(step, fullgraph=True, dynamic=False) if "compiled" in forms_asked else None
    if mamba_fn:
        mx.check(torch, mamba_fn, mamba_ref, dev, seqlen=min(a.seqs), state=N)

    def scan_ref(u, delta, A, B, C, D, z, delta_bias, stepf, acc=torch.float32):
        """mamba_ssm selective_scan_ref: real A, variable B / C of one group, D, z, softplus."""
        out_dtype = u.dtype
        u, delta, B, C, z = (t.to(acc) for t in (u, delta, B, C, z))
        delta = F.softplus(delta + delta_bias.to(acc)[..., None])
        B, C = B[:, 0], C[:, 0]  # [batch, state, len]
        delta_a = torch.exp(torch.einsum("bdl,dn->bdln", delta, A.to(acc)))
        delta_b_u = torch.einsum("bdl,bnl,bdl->bdln", delta, B, u)
        x = u.new_zeros(u.shape[0], u.shape[1], A.shape[1])
        ys = []
        for i in range(u.shape[2]):
            x, y = stepf(x, delta_a[:, :, i], delta_b_u[:, :, i], C[:, :, i])
            ys.append(y)
        out = torch.stack(ys, dim=2) + u * D.to(acc)[:, None]
        return (out * F.silu(z)).to(out_dtype)

    bl.log(f"selective scan (mamba selective_scan_ref, plain PyTorch), {a.dtype}, B={Bn} D={Dn} N={N}, on {dev} "
           f"({torch.cuda.get_device_name(dev)}), torch {torch.__version__}")
    bl.log("D, z, delta_bias, softplus; one group of B/C; f32 inside; CUDA events, median")
    bl.log("")
    head = f"{'what':44} | {'fwd ms':>10} | {'f+b ms':>10} | {'peak MiB':>9} | {'rel err':>9}"
    bl.log(head)
    bl.log("-" * len(head))
    rows = []
    forms = ([("", step)] if "eager" in forms_asked else []) + \
        ([(" [torch compiled step]", compiled_step)] if compiled_step else []) + \
        ([(mx.TAG, None)] if mamba_fn else [])
    for L in a.seqs:
        u = torch.randn(Bn, Dn, L, device=dev, dtype=dt)
        delta = (torch.randn(Bn, Dn, L, device=dev) * 0.5).to(dt)
        A = -(torch.arange(N, device=dev, dtype=torch.float32) + 1).repeat(Dn, 1)
        Bm = torch.randn(Bn, 1, N, L, device=dev, dtype=dt)
        Cm = torch.randn(Bn, 1, N, L, device=dev, dtype=dt)
        D = torch.ones(Dn, device=dev)
        z = torch.randn(Bn, Dn, L, device=dev, dtype=dt)
        bias = torch.full((Dn,), -3.0, device=dev)
        dout = torch.randn(Bn, Dn, L, device=dev, dtype=dt)
        inputs = [u, delta, A, Bm, Cm, D, z, bias]
        # float64 reference on 8 channels of the first batch row.
        sl = [u[:1, :8], delta[:1, :8], A[:8], Bm[:1], Cm[:1], D[:8], z[:1, :8], bias[:8]]
        want = scan_ref(*[t.double() for t in sl], step, acc=torch.float64)
        for tag, stepf in list(forms):
            if tag == mx.TAG:
                tf, tb, peak, err = time_mamba(torch, mamba_fn, sl, want, inputs, dout, a.dtype, L)
                label = row_name("", a.dtype, Bn, Dn, N, L).strip() + tag
                bl.log(f"{label:44} | {tf['median_s'] * 1e3:>10.3f} | {tb['median_s'] * 1e3:>10.3f} | {peak:>9.1f} | "
                       f"{err:>9.2e}")
                rows += bl.seq_op_rows(lambda mode, L=L: row_name(mode, a.dtype, Bn, Dn, N, L) + mx.TAG, tf, tb,
                                       peak, err)
                continue
            try:
                with torch.no_grad():
                    got = scan_ref(*sl, stepf)
                if tag:
                    # Compile the backward too before timing (and fail here, not mid-table).
                    sg = [t.detach().requires_grad_() for t in sl]
                    torch.autograd.grad(scan_ref(*sg, stepf), sg, torch.ones_like(got))
            except Exception as e:  # noqa: BLE001 (torch.compile needs triton and a C compiler)
                if not tag:
                    raise
                bl.log(f"compiled step unavailable, its rows skipped: {type(e).__name__}: {e}")
                forms.remove((tag, stepf))
                continue
            err = bl.rel_err(torch, got, want)
            what = row_name("fwd", a.dtype, Bn, Dn, N, L) + tag
            bl.require(what, err, TOL[a.dtype])
            leaves = [t.detach().requires_grad_() for t in inputs]

            def fwd(stepf=stepf):
                with torch.no_grad():
                    return scan_ref(*inputs, stepf)

            def fwd_bwd(stepf=stepf, leaves=leaves):
                out = scan_ref(*leaves, stepf)
                return torch.autograd.grad(out, leaves, dout)

            tf, tb, peak = bl.seq_op_measure(torch, dev, fwd, fwd_bwd, plan=SLOW_PLAN)
            label = row_name("", a.dtype, Bn, Dn, N, L).strip() + tag
            bl.log(f"{label:44} | {tf['median_s'] * 1e3:>10.3f} | {tb['median_s'] * 1e3:>10.3f} | {peak:>9.1f} | "
                   f"{err:>9.2e}")
            rows += bl.seq_op_rows(lambda mode, L=L, tag=tag: row_name(mode, a.dtype, Bn, Dn, N, L) + tag, tf, tb,
                                   peak, err)
        del u, delta, Bm, Cm, z, dout, inputs
    notes = [f"B={Bn} D={Dn} N={N}, one group; mamba_ssm selective_scan_ref in plain PyTorch (f32 inside); "
             "backward = autograd.grad; compiled rows: torch.compile(fullgraph) of one recurrence step"]
    if mamba_fn:
        notes.append(f"[mamba_ssm] rows: mamba_ssm {mx.VERSION} selective_scan_fn (its fused CUDA kernel, built from the "
                     "sdist for sm_90 by bench/mamba_ssm_ext.py, mamba's nvcc flags), same tensors, "
                     "timed with benchlib.GPU_PLAN as ferrograd's bench")
    for n in notes:
        bl.log(n)
    bl.finish(bl.report(torch, "selective_scan", dev, "CUDA events; warm-up, batches, median per call", rows, notes),
              a.json)


def time_mamba(torch, fn, sl, want, inputs, dout, dtype, L):
    """mamba_ssm's selective_scan_fn on the twin's tensors: the forward of the 8-channel slice
    against the float64 reference, then forward and forward + backward (all eight gradients, as
    ours) timed with the plan of ferrograd's bench. (fwd timing, fwd+bwd timing, peak MiB, error)."""
    def call(x):
        return fn(*x[:6], z=x[6], delta_bias=x[7], delta_softplus=True)

    with torch.no_grad():
        err = bl.rel_err(torch, call(sl), want)
    bl.require(row_name("fwd", dtype, 1, 8, sl[2].shape[1], L) + mx.TAG, err, TOL[dtype])
    leaves = [t.detach().requires_grad_() for t in inputs]

    def fwd():
        with torch.no_grad():
            return call(inputs)

    def fwd_bwd():
        return torch.autograd.grad(call(leaves), leaves, dout)

    tf, tb, peak = bl.seq_op_measure(torch, inputs[0].device, fwd, fwd_bwd)
    return tf, tb, peak, err


if __name__ == "__main__":
    main()
