#!/usr/bin/env bash
# The one-shot GPU check (issue 39; bench/README.md "GPU check"): run from the repository root,
#
#   bash bench/gpu_check.sh            on a CUDA machine: every step, under 8 minutes on one H100/H200
#   bash bench/gpu_check.sh --smoke    on a CPU: the same steps, tiny shapes, Triton interpreter
#
# Everything lands in $OUT (a fresh temporary folder when OUT is unset): one log per step,
# results.json and summary.md, the table that is also printed last. The GPU machine has no network:
# the packages it lacks come in a carry folder made beforehand by bench/gpu_prepare.sh on a machine
# with one (GPU_CARRY, default .gpu_carry/ in the repository), installed here with --no-index.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
OUT=${OUT:-$(mktemp -d -t streamer-gpu-check.XXXXXX)}
CARRY=${GPU_CARRY:-$ROOT/.gpu_carry}
mkdir -p "$OUT"
PY=${PYTHON:-python3}

# The kernels import as `streamer_kernels` (pyproject's package-dir), which only an install provides:
# a folder with that name pointing at kernels/ does the same without installing anything.
SITE=$(mktemp -d -t streamer-gpu-site.XXXXXX)
ln -s "$ROOT/kernels" "$SITE/streamer_kernels"
if [ -d "$CARRY/wheels" ] && compgen -G "$CARRY/wheels/*.whl" >/dev/null; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --disable-pip-version-check \
    --target "$SITE" "$CARRY"/wheels/*.whl > "$OUT/carry-install.log" 2>&1 \
    || echo "gpu_check: installing the carried wheels failed (see $OUT/carry-install.log)" >&2
fi
export PYTHONPATH="$SITE:$ROOT${PYTHONPATH:+:$PYTHONPATH}"

# redis-server: the one on PATH, else the carried .deb files unpacked (no dpkg database needed),
# their libraries found through LD_LIBRARY_PATH.
if ! command -v redis-server >/dev/null && compgen -G "$CARRY/debs/*.deb" >/dev/null; then
  for deb in "$CARRY"/debs/*.deb; do dpkg-deb -x "$deb" "$SITE/root"; done
  export PATH="$SITE/root/usr/bin:$PATH"
  export LD_LIBRARY_PATH="$SITE/root/usr/lib/x86_64-linux-gnu:$SITE/root/lib/x86_64-linux-gnu${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
fi

status=0
"$PY" -m bench.gpu_check --out "$OUT" "$@" || status=$?
rm -rf "$SITE"
echo "gpu_check: logs and results in $OUT"
exit $status
