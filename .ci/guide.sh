#!/usr/bin/env bash
# ferrograd CI: render the user guide (docs/guide, an mdBook) and check its links.
# - mdbook comes from crates.io, pinned, without default features (no live server, no search
#   index: only `build`), into target/mdbook (git-ignored), so a second run only renders. It
#   takes a few minutes to compile on two cores once; a machine with mdbook on PATH skips that.
# - book.toml sets create-missing = false, so a chapter named in SUMMARY.md but missing fails the
#   build instead of being created empty; every chapter must come out as an HTML page.
# - The guide's Rust samples are doctests (examples/common.rs), run by `cargo test` in .ci/run.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
FERROGRAD_MDBOOK_VERSION=${FERROGRAD_MDBOOK_VERSION:-0.4.52}
mdbook=$(command -v mdbook || true)
if [ -z "$mdbook" ]; then
    mdbook=target/mdbook/bin/mdbook
    if [ ! -x "$mdbook" ] || ! "$mdbook" --version | grep -q "v$FERROGRAD_MDBOOK_VERSION"; then
        t0=$SECONDS
        cargo install mdbook --locked --no-default-features --version "=$FERROGRAD_MDBOOK_VERSION" \
            --root target/mdbook --quiet
        echo "mdbook $FERROGRAD_MDBOOK_VERSION installed into target/mdbook in $((SECONDS - t0)) s"
    fi
fi
out=$PWD/target/guide
rm -rf "$out"
"$mdbook" build docs/guide -d "$out"
missing=0
for page in $(grep -oE '\]\([^)#]+\.md\)' docs/guide/src/SUMMARY.md | sed -E 's/^\]\((.*)\.md\)$/\1/'); do
    [ -s "$out/$page.html" ] || { echo "guide: chapter $page.md did not render to $out/$page.html" >&2; missing=1; }
done
[ "$missing" = 0 ] || exit 1
echo "guide: $(ls "$out"/*.html | wc -l) pages rendered into target/guide"
python3 .ci/guide_links.py docs/guide/src
