#!/usr/bin/env python3
"""The house rule of issue 10: no source file over 600 lines without a reason at its top.

Every tracked .rs / .cu / .cuh file under crates/ and examples/ longer than 600 lines must say why in
its leading comment block, with a phrase such as "(About 700 lines: ...)" or "Over 600 lines on
purpose: ...". An "about N lines" must stay within 15% of the file's length (a reason written for a
shorter file does not cover what was added since). Prints the offenders and exits 1 if there are any.
"""
import re
import subprocess
import sys

LIMIT = 600
REASON = re.compile(r"\b(about|over)\s+[\d,]+\s+lines", re.IGNORECASE)


def leading_comments(lines):
    out = []
    for line in lines:
        s = line.strip()
        if s == "" or s.startswith("//") or s.startswith("/*") or s.startswith("*"):
            out.append(s)
        else:
            break
    return " ".join(out)


def main():
    files = subprocess.run(["git", "ls-files", "crates", "examples"], capture_output=True, text=True,
                           check=True).stdout.split()
    bad = []
    for f in files:
        if not f.endswith((".rs", ".cu", ".cuh")):
            continue
        with open(f, encoding="utf-8") as fh:
            lines = fh.read().split("\n")
        if len(lines) <= LIMIT:
            continue
        m = REASON.search(leading_comments(lines))
        if not m:
            bad.append(f"{f}: {len(lines)} lines, no reason at its top")
        elif m.group(1).lower() == "about":
            said = int(re.sub(r"\D", "", m.group(0)))
            if abs(said - len(lines)) > 0.15 * len(lines):
                bad.append(f"{f}: {len(lines)} lines, its top says about {said}")
    for b in bad:
        print(b)
    print(f"long_files: {len(bad)} file(s) over {LIMIT} lines without a reason")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
