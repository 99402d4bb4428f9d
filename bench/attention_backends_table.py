"""The attention backends side by side: ferrograd --backend cudnn and flash against PyTorch SDPA
(its default, and forced to cuDNN), from the JSON files bench/attention_cudnn_gpu.sh writes.

    python3 bench/attention_backends_table.py OUT_DIR
"""
import json, sys
from pathlib import Path
d = Path(sys.argv[1])
def rows(n):
    p = d / n
    if not p.exists(): return {}
    return {r["name"]: r for r in json.loads(p.read_text())["rows"]}
c, f, t = rows("fg_cudnn.json"), rows("fg_flash.json"), rows("torch.json")
names = [n for n in t if n.startswith(("fwd ", "fwd+bwd ")) and "[" not in n]
print("| mode | d | mask | T | ours cuDNN | ran | ours flash | PyTorch SDPA | PyTorch forced cuDNN | cuDNN / SDPA | flash / SDPA |")
print("|---|---|---|---:|---:|---|---:|---:|---:|---:|---:|")
for n in names:
    mode, dt, dd, mask, T = n.split()
    v = lambda m, k=n: m.get(k, {}).get("value")
    tc = v(t, n + " [torch cudnn backend]")
    fmt = lambda x: f"{x:.1f}" if isinstance(x, (int, float)) else "-"
    r = lambda a, b: f"{a / b:.3f}" if a and b else "-"
    print(f"| {mode} | {dd[2:]} | {mask} | {T[2:]} | {fmt(v(c))} | {c.get(n, {}).get('backend', '-')} | {fmt(v(f))} | {fmt(v(t))} | {fmt(tc)} | {r(v(c), v(t))} | {r(v(f), v(t))} |")
