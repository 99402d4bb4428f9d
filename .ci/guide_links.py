#!/usr/bin/env python3
"""Check the user guide's links as a reader on GitHub follows them: every relative link names a
file or folder that exists, and every `#anchor` names a heading of its target (GitHub's slug
rule: lower case, punctuation other than '-' and '_' dropped, spaces to '-'). mdbook renders
the book but does not check links; a renamed chapter or heading would otherwise rot silently.

    python3 .ci/guide_links.py [docs/guide/src]
"""
import re
import sys
from pathlib import Path

LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
HEADING = re.compile(r"^#{1,6}\s+(.*?)\s*#*\s*$")
FENCE = re.compile(r"^\s*(```|~~~)")


def slug(text):
    text = re.sub(r"`|\*|_(?=\w)|(?<=\w)_", "", text.strip().lower())
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def prose_lines(path):
    inside = False
    for line in path.read_text(encoding="utf-8").splitlines():
        if FENCE.match(line):
            inside = not inside
            continue
        if not inside:
            yield line


def anchors(path):
    return {slug(m.group(1)) for line in prose_lines(path) if (m := HEADING.match(line))}


def main():
    src = Path(sys.argv[1] if len(sys.argv) > 1 else "docs/guide/src")
    pages = sorted(src.glob("*.md"))
    if not pages:
        print(f"guide_links: no chapters under {src}", file=sys.stderr)
        return 1
    bad, seen = [], 0
    for page in pages:
        for line in prose_lines(page):
            for target in LINK.findall(line):
                if re.match(r"^[a-z]+:", target):
                    continue  # http(s), mailto: not checked offline
                seen += 1
                path, _, anchor = target.partition("#")
                dest = (page.parent / path).resolve() if path else page
                if not dest.exists():
                    bad.append(f"{page}: link to {target}: {dest} does not exist")
                elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
                    bad.append(f"{page}: link to {target}: no heading '#{anchor}' in {dest.name}")
    for b in bad:
        print(b, file=sys.stderr)
    print(f"guide_links: {seen} relative links in {len(pages)} chapters, {len(bad)} broken")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
