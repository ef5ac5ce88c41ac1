#!/usr/bin/env bash
# Every single-GPU check, on a machine with one CUDA GPU, in about 10 minutes:
#   bash benchmarks/gpu_check.sh OUTDIR
# 1. OUTDIR/device.json: the device, torch and CUDA versions the checks ran on;
# 2. the `gpu`-marked tests (only the test files that carry the marker are collected, so a package the GPU
#    machine lacks for other tests does not stop them): OUTDIR/gpu_tests.xml (JUnit) and OUTDIR/gpu_tests.log;
# 3. every benchmark's GPU leg (benchmarks/gpu_legs.sh): OUTDIR/NAME.gpu.json and OUTDIR/NAME.gpu.log.
# PYTHON (default python3) runs everything, with this checkout first on its path (no install needed).
# Time: TESTS_TIMEOUT_S (default 120) plus LEG_TIMEOUT_S (default 110) per leg. Exits 3 without a CUDA device,
# 1 when a test or a leg failed (after running the rest), 0 otherwise. The test suite never needs this.
set -uo pipefail
out=${1:?usage: bash benchmarks/gpu_check.sh OUTDIR}
mkdir -p "$out"
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root" || exit 2
export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
py=${PYTHON:-python3}
"$py" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 3)" 2>/dev/null
case $? in
  0) ;;
  3) echo "gpu_check: no CUDA device here (torch.cuda.is_available() is False); nothing was run"; exit 3 ;;
  *) echo "gpu_check: $py cannot import torch; set PYTHON to an interpreter that has it"; exit 2 ;;
esac
"$py" - "$out/device.json" <<'PY'
import json, sys, torch
props = torch.cuda.get_device_properties(0)
json.dump({"device": props.name, "memory_gib": round(props.total_memory / 2**30, 1), "torch": torch.__version__,
           "cuda": torch.version.cuda, "capability": list(torch.cuda.get_device_capability(0))},
          open(sys.argv[1], "w"), indent=2)
PY
status=0
mapfile -t marked < <(grep -l "pytest.mark.gpu" tests/test_*.py)
if [ ${#marked[@]} -eq 0 ]; then  # an empty list would make pytest collect the whole suite
  echo "== gpu-marked tests FAILED: no test file carries the gpu marker"
  status=1
else
  echo "== gpu-marked tests: ${marked[*]}"
  timeout "${TESTS_TIMEOUT_S:-120}" "$py" -m pytest -q -m gpu -p no:cacheprovider --junitxml "$out/gpu_tests.xml" \
    "${marked[@]}" 2>&1 | tee "$out/gpu_tests.log"
  code=${PIPESTATUS[0]}
  if [ "$code" -ne 0 ]; then  # 5 (no test ran) is a failure too: the marked tests were expected to run
    echo "== gpu-marked tests FAILED (exit $code)"
    status=1
  fi
fi
PYTHON="$py" LEG_TIMEOUT_S="${LEG_TIMEOUT_S:-110}" bash benchmarks/gpu_legs.sh "$out" || status=1
exit $status
