#!/usr/bin/env bash
# The checks that need a GPU, as one short run (device time is scarce: prepare here, run once there).
#   scripts/device-check.sh OUTDIR
# Runs the CUDA-only tests, writes a one-slice V4.1-Flash checkpoint at full width (4 layers, random weights),
# captures its decode cycle as CUDA graphs and prints the forward / end-to-end / roofline table and prefill
# tokens/s at 32K; every section's JSON and log is packed into OUTDIR/device-check.tgz. Sections are
# independent: a failing one is reported and the next runs. Meant to finish in under 8 minutes on one
# H100/H200.
#
# The device machine has its own torch and triton and most of our dependencies; the project runs from the
# tree (PYTHONPATH), nothing is installed. Wheels it lacks can be carried in .whl/ (installed to /tmp/site).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-${OUT:-/tmp/device-check}}
mkdir -p "$OUT"
# Sections write into $RES; after each one it is packed into $OUT/device-check.tgz (and the summary copied),
# so $OUT holds two files however many sections ran (a device run returns a few files only, even when cut
# off by its time limit).
RES=$(mktemp -d)
pack() { tar czf "$OUT/device-check.tgz" -C "$RES" . 2>/dev/null; [ -f "$RES/summary.txt" ] && cp "$RES/summary.txt" "$OUT/"; true; }
if [ -x .venv/bin/python ] && .venv/bin/python -c 'import torch; assert torch.cuda.is_available()' 2>/dev/null; then
    PY=.venv/bin/python
else
    PY=${PY:-python3}
fi
if compgen -G ".whl/*.whl" >/dev/null; then
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
    export PYTHONPATH=/tmp/site
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
APPLIANCE="$PY -m appliance"
status=0
section() { pack; echo; echo "=== $1 ($(date +%T))"; }
check() { "$@" || { echo "!!! failed ($?): $*"; status=1; }; }

section "device"
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.memory --format=csv | tee "$RES/gpu.txt"
git rev-parse HEAD 2>/dev/null | tee "$RES/commit.txt"
$PY -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)' | tee -a "$RES/gpu.txt"

# --- kernels (issue 7): each kernel vs its reference (odd small shapes, then V4.1 shapes in the *OnCuda
# classes), then the roofline benchmark
section "kernel tests"
check $PY -m pytest tests/test_kernel_*.py -q -p no:cacheprovider --durations=10 \
    --ignore=tests/test_kernel_gpu_compile.py 2>&1 | tee "$RES/kernel-tests.txt"
section "bench kernels"
check $APPLIANCE bench kernels --json --iters 50 > "$RES/bench-kernels.json"
$PY - "$RES/bench-kernels.json" <<'PYEOF' | tee "$RES/bench-kernels.txt"
import json, sys
from kernels.bench import Result, table
doc = json.load(open(sys.argv[1]))
print("\n".join(doc["notes"]))
print(table([Result(**r) for r in doc["results"]]))
PYEOF

# --- graphs (issue 4): captured cycles give the eager tokens, replay allocates nothing
section "graph tests"
check $PY -m pytest tests/test_graphs.py -q -p no:cacheprovider 2>&1 | tee "$RES/graph-tests.txt"

# --- one slice of V4.1-Flash at full width: decode with graphs, context sweep, prefill at 32K
SLICE=/tmp/v41-slice
section "slice checkpoint"
[ -f "$SLICE/config.json" ] || check $APPLIANCE tiny "$SLICE" --family deepseek_v41 --shape slice
check $APPLIANCE info --model "$SLICE" --json > "$RES/slice-info.json"
section "bench decode (graphs, DSpark beside none)"
check $APPLIANCE bench decode --model "$SLICE" --devices cuda --dtype bfloat16 --context 1K,32K --tokens 64 \
    --draft auto --draft-tokens 3 --json > "$RES/bench-decode.json"
check $APPLIANCE bench decode --model "$SLICE" --devices cuda --dtype bfloat16 --context 1K --tokens 64 \
    --draft auto --draft-tokens 5 --force-accept 5 --json > "$RES/bench-decode-forced.json"
section "bench forward"
check $APPLIANCE bench forward --model "$SLICE" --devices cuda --dtype bfloat16 --context 1K,32K --width 1 \
    --json > "$RES/bench-forward-1.json"
check $APPLIANCE bench forward --model "$SLICE" --devices cuda --dtype bfloat16 --context 1K,32K --width 6 \
    --json > "$RES/bench-forward-6.json"
section "bench prefill (32K)"
check $APPLIANCE bench prefill --model "$SLICE" --devices cuda --dtype bfloat16 --tokens 32768 --chunk 2048 \
    --json > "$RES/bench-prefill.json"

section "summary"
$PY - "$RES" <<'PYEOF' | tee "$RES/summary.txt"
import json, pathlib, sys
out = pathlib.Path(sys.argv[1])
def load(name):
    p = out / name
    try:
        return json.loads(p.read_text())
    except Exception as e:
        print(f"{name}: missing ({e})")
for name in ("bench-decode.json", "bench-decode-forced.json"):
    doc = load(name)
    for r in (doc or {}).get("runs", []):
        bw = r.get("fraction_of_bandwidth")
        print(f"{name:<26} {r['draft']:<10} ctx {r['context']:>6}: {r['tokens_per_s']:8.1f} tok/s, device "
              f"{r['device_ms_per_cycle']:.2f} ms/cycle, host {r['host_ms_per_cycle']:.2f} ms, "
              f"{r['bytes_per_step']['total'] / 1e9:.2f} GB/step" + (f", {bw:.1%} of copy BW" if bw else ""))
for name in ("bench-forward-1.json", "bench-forward-6.json"):
    doc = load(name)
    for r in (doc or {}).get("runs", []):
        bw = r.get("fraction_of_bandwidth")
        print(f"{name:<26} width {r['width']} ctx {r['context']:>6}: {r['forward_ms']['median']:.3f} ms"
              + (f", {bw:.1%} of copy BW" if bw else ""))
doc = load("bench-prefill.json")
if doc:
    print(f"prefill {doc['tokens']} tokens: {doc['tokens_per_s']:.0f} tokens/s")
PYEOF
pack
exit $status
