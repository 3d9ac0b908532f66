#!/usr/bin/env bash
# The checks that need a GPU, as one short run (device time is scarce: prepare here, run once there).
# Each section writes its results under $OUT; sections are independent, append new ones at the end.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
OUT=${OUT:-/tmp/device-check}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,clocks.max.memory --format=csv > "$OUT/gpu.txt" 2>&1 || true

# --- kernels (issue 7): each kernel vs its reference (odd small shapes, then V4.1 shapes in the *OnCuda
# classes), then the roofline benchmark
$PY -m pytest tests/test_kernel_*.py -q -p no:cacheprovider --durations=10 2>&1 | tee "$OUT/kernel-tests.txt"
$PY -m appliance bench kernels --json --iters 50 > "$OUT/bench-kernels.json"
$PY - "$OUT/bench-kernels.json" <<'PYEOF' | tee "$OUT/bench-kernels.txt"
import json, sys
from kernels.bench import Result, table
doc = json.load(open(sys.argv[1]))
print("\n".join(doc["notes"]))
print(table([Result(**r) for r in doc["results"]]))
PYEOF
