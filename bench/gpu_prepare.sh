#!/usr/bin/env bash
# Gathers, on a machine with a network, what bench/gpu_check.sh needs on the GPU machine (Python 3.12,
# no network): the wheels and .deb files listed in bench/gpu_carry.txt, into one folder to carry
# (the carry limit is 64 MiB; this prints the folder's size).
#
#   bash bench/gpu_prepare.sh [DEST]      DEST defaults to .gpu_carry/ in the repository (git ignores it)
#
# Wheels: `pip download --no-deps --only-binary=:all:` for CPython 3.12 on manylinux x86-64, each at
# the version installed here (what this machine's tests ran against), else the newest.
set -euo pipefail
cd "$(dirname "$0")/.."
DEST=${1:-.gpu_carry}
PY=${PYTHON:-python3}
mkdir -p "$DEST/wheels" "$DEST/debs"
DEST=$(cd "$DEST" && pwd)

platforms=""
for p in manylinux_2_39_x86_64 manylinux_2_35_x86_64 manylinux_2_34_x86_64 manylinux_2_28_x86_64 \
         manylinux_2_27_x86_64 manylinux_2_24_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux1_x86_64; do
  platforms="$platforms --platform $p"
done

specs=""
for name in $(sed -n 's/^python: *//p' bench/gpu_carry.txt); do
  version=$("$PY" -c "import importlib.metadata as m, sys
try: print(m.version(sys.argv[1]))
except m.PackageNotFoundError: pass" "$name")
  specs="$specs $name${version:+==$version}"
done
# shellcheck disable=SC2086  # word splitting of the lists is wanted
"$PY" -m pip download -q --disable-pip-version-check --no-deps --only-binary=:all: --python-version 3.12 \
  --implementation cp $platforms -d "$DEST/wheels" $specs

debs=$(sed -n 's/^deb: *//p' bench/gpu_carry.txt)
# apt-get download writes into the current folder; it needs the package lists, read once if missing.
# shellcheck disable=SC2086
(cd "$DEST/debs" && { apt-get download -qq $debs 2>/dev/null || { apt-get update -qq && apt-get download -qq $debs; }; })

echo "gpu_prepare: $(du -sb "$DEST" | cut -f1) bytes in $DEST ($(ls "$DEST/wheels" | wc -l) wheels, $(ls "$DEST/debs" | wc -l) .deb files)"
