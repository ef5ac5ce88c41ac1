#!/usr/bin/env bash
# Every benchmark's GPU leg, one after another, on a machine with one CUDA GPU:
#   bash benchmarks/gpu_legs.sh OUTDIR [LEG ...]
# LEG is a benchmark name (default: all of them); each writes OUTDIR/NAME.gpu.json and its log
# OUTDIR/NAME.gpu.log. A leg that fails (or runs past LEG_TIMEOUT_S, default 300 s) makes the script
# exit 1 after the others have run.
set -uo pipefail
out=${1:?usage: bash benchmarks/gpu_legs.sh OUTDIR [LEG ...]}
shift
mkdir -p "$out"
legs=("$@")
[ ${#legs[@]} -gt 0 ] || legs=(scale delta sharding moe_families compile float8)
status=0
for leg in "${legs[@]}"; do
  echo "== $leg: python -m benchmarks.$leg --device cuda"
  timeout "${LEG_TIMEOUT_S:-300}" "${PYTHON:-python3}" -m "benchmarks.$leg" --device cuda --out "$out/$leg.gpu.json" \
    2>&1 | tee "$out/$leg.gpu.log"
  code=${PIPESTATUS[0]}
  if [ "$code" -ne 0 ]; then
    echo "== $leg FAILED (exit $code)"
    status=1
  fi
done
exit $status
