#!/usr/bin/env bash
# The checks that need a GPU, as one short run on one H100/H200 (device time is scarce: prepared and
# dry-run here, run once there):
#   scripts/device-check.sh [OUTDIR]          on a machine with CUDA
#   scripts/device-check.sh --dry [OUTDIR]    on the CPU: every section that can run without a GPU
# Sections run in order of value, each under a time limit taken from one budget (BUDGET seconds, default
# 450, under the device run's 8 minutes), and each writes its JSON as soon as it is done:
#   1. device: the GPU, torch/triton versions, the copy bandwidth and the latency of one launch inside a
#      CUDA graph (the cost model's two hardware terms, measured), with and without dependent launch, and
#      of a dependent step inside one launch (kernels/phases.py)
#   2. bench kernels: every kernel at V4.1-Flash decode shapes, M = 1 and 6, against the copy bandwidth,
#      and the Engram lookup from pinned host tables beside device tables (what the host link costs a step)
#      (dry: toy shapes under the Triton interpreter)
#   3. slice: 4 layers of V4.1-Flash at full width, written on the GPU (about 5 GB), then its decode cycle
#      captured as CUDA graphs: forward time, launches, host syncs, bytes read against the ideal and the
#      fraction of the copy bandwidth, at 1K and 32K plain and a DSpark k=3 cycle at 1K; what the load
#      allocated against the memory plan (dry: the embedded tiny model on the CPU fast path)
#   4. the CUDA tests (kernels at V4.1 shapes, graph capture and replay; dry: collected, all skip)
#   5. (dry only) the cost model of released V4.1-Flash on 4 x B300 and its memory plan at 855K tokens
# Everything is packed after each section into OUTDIR/device-check.tgz, with summary.txt beside it: two
# files come back however far the run got. A failing or timed-out section is reported; the next runs.
#
# The device machine has its own torch and triton (the project supports torch >= 2.11, triton >= 3.6
# there) and runs the tree from PYTHONPATH; nothing is installed. Wheels it lacks can be carried in .whl/.
set -uo pipefail
cd "$(dirname "$0")/.."
DRY=0
if [ "${1:-}" = "--dry" ]; then DRY=1; shift; fi
OUT=${1:-${OUT:-/tmp/device-check}}
BUDGET=${BUDGET:-$([ $DRY = 1 ] && echo 1800 || echo 450)}  # the CPU's interpreter is slow: more in dry mode
mkdir -p "$OUT"
START=$(date +%s)
RES=$(mktemp -d)
pack() { tar czf "$OUT/device-check.tgz" -C "$RES" . 2>/dev/null; [ -f "$RES/summary.txt" ] && cp "$RES/summary.txt" "$OUT/"; true; }
if [ -x .venv/bin/python ] && { [ $DRY = 1 ] || .venv/bin/python -c 'import torch; assert torch.cuda.is_available()' 2>/dev/null; }; then
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
if [ $DRY = 0 ] && ! $PY -c 'import torch; assert torch.cuda.is_available()' 2>/dev/null; then
    echo "no CUDA device here: run with --dry for the CPU part" >&2
    exit 2
fi
status=0
section() { pack; echo; echo "=== $1 ($(( $(date +%s) - START )) s)"; }
# run CAP CMD...: under the smaller of CAP and what the budget has left; skipped when under 20 s are left
run() {
    local cap=$1; shift
    local left=$(( BUDGET - ($(date +%s) - START) ))
    [ $left -lt $cap ] && cap=$left
    if [ $cap -lt 20 ]; then echo "!!! skipped (budget spent): $*"; status=1; return; fi
    timeout -k 5 $cap "$@"
    local rc=$?
    [ $rc -ne 0 ] && { echo "!!! failed ($rc$([ $rc = 124 ] && echo ': timed out')): $*"; status=1; }
    return 0
}

section "1. device"
if [ $DRY = 0 ]; then
    nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.memory --format=csv | tee "$RES/gpu.txt"
fi
git rev-parse HEAD 2>/dev/null | tee "$RES/commit.txt"
run 60 $PY - "$RES/device.json" <<'PYEOF'
import json, sys, torch, triton
from appliance.measure import bench
dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
doc = {"torch": torch.__version__, "triton": triton.__version__, "device": str(dev),
       "name": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
       "copy_bandwidth_GBps": (bench.copy_bandwidth(dev) or 0) / 1e9,
       "launch_us_in_graph": bench.measure_launch_latency(dev),
       "dependent_launch_us_in_graph": bench.measure_dependent_launch(dev),
       "phase_wait_us_in_graph": bench.measure_phase_wait(dev)}
json.dump(doc, open(sys.argv[1], "w"), indent=1)
print(json.dumps(doc))
PYEOF

section "2. bench kernels"
if [ $DRY = 0 ]; then
    run 150 $APPLIANCE bench kernels --json --iters 30 > "$RES/bench-kernels.json"
else
    run 150 $APPLIANCE bench kernels --json --iters 2 --tiny > "$RES/bench-kernels.json"
fi
run 30 $PY - "$RES/bench-kernels.json" <<'PYEOF' | tee "$RES/bench-kernels.txt"
import json, sys
from kernels.bench import Result, table
doc = json.load(open(sys.argv[1]))
print("\n".join(doc["notes"]))
print(table([Result(**r) for r in doc["results"]]))
PYEOF

if [ $DRY = 0 ]; then
    section "3. slice: checkpoint (written on the GPU)"
    SLICE=/tmp/v41-slice
    [ -f "$SLICE/config.json" ] || run 150 $APPLIANCE tiny "$SLICE" --family deepseek_v41 --shape slice
    MODEL=(--model "$SLICE" --devices cuda --dtype bfloat16 --path fast)
    section "3. slice: plain cycle with graphs at 1K and 32K"
    run 170 $APPLIANCE bench forward "${MODEL[@]}" --context 1K,32K --width 1 --repeats 20 --memory --json \
        > "$RES/forward-1.json"
    section "3. slice: DSpark k=3 cycle with graphs at 1K"
    run 120 $APPLIANCE bench forward "${MODEL[@]}" --context 1K --width 4 --repeats 20 --json > "$RES/forward-4.json"
    section "3. slice: prefill of 8K and 32K in 8192-token chunks, each chunk beside its count and price"
    for n in 8192 32768; do
        run 90 $APPLIANCE bench prefill "${MODEL[@]}" --chunk 8192 --tokens $n --json > "$RES/prefill-$n.json"
    done
else
    MODEL=(--path fast --dtype bfloat16)
    section "3. embedded model (dry): plain cycle and a DSpark k=3 cycle, counted"
    run 240 $APPLIANCE bench forward "${MODEL[@]}" --context 16 --width 1 --repeats 1 --memory --json \
        > "$RES/forward-1.json"
    run 240 $APPLIANCE bench forward "${MODEL[@]}" --context 16 --width 4 --repeats 1 --json > "$RES/forward-4.json"
fi

section "4. CUDA tests"
run 150 $PY -m pytest tests/test_kernel_*.py tests/test_graphs.py -k Cuda -q -p no:cacheprovider -p no:xdist \
    --durations=5 2>&1 | tee "$RES/cuda-tests.txt"

if [ $DRY = 1 ]; then
    section "5. cost model and memory plan of released V4.1-Flash (config only)"
    V41=$(mktemp -d)
    cp tests/data/deepseek-v41-flash-config.json "$V41/config.json"
    run 240 $APPLIANCE bench model --model "$V41" --devices 4 --gpu b300 --draft-tokens 3 --accepted 2.5 \
        --context 32768 --json > "$RES/bench-model.json"
    run 120 $APPLIANCE info --model "$V41" --devices 4 --gpu-memory 288GB --context 855000 --dtype bfloat16 --json \
        > "$RES/info-plan.json"
fi

section "summary"
$PY - "$RES" <<'PYEOF' | tee "$RES/summary.txt"
import json, pathlib, sys
out = pathlib.Path(sys.argv[1])
def load(name):
    try:
        return json.loads((out / name).read_text())
    except Exception as e:
        print(f"{name}: missing ({type(e).__name__})")
doc = load("device.json")
if doc:
    lat = doc["launch_us_in_graph"]
    dep = doc.get("dependent_launch_us_in_graph")
    print(f"{doc['name']}: torch {doc['torch']}, triton {doc['triton']}, copy {doc['copy_bandwidth_GBps']:.0f} GB/s"
          + (f", {lat:.2f} us per launch in a graph" if lat else "")
          + (f"; a Triton kernel {dep['pdl']:.2f} us with dependent launch, {dep['no_pdl']:.2f} without" if dep
             else ""))
doc = load("bench-kernels.json")
for r in (doc or {}).get("results", []):
    f = r.get("fraction")
    print(f"kernel {r.get('op', '?'):<24} M={r.get('m', '?')}: {r.get('gbps', 0):8.1f} GB/s"
          + (f", {f:.1%} of copy" if f else ""))
for name in ("forward-1.json", "forward-4.json"):
    doc = load(name)
    for r in (doc or {}).get("runs", []):
        b = r.get("bytes_per_step", {})
        bw = r.get("fraction_of_bandwidth")
        print(f"{name:<15} {r.get('cycle', '?'):<12} ctx {r['context']:>6}: {r['forward_ms']['median']:.3f} ms"
              f" (graphs {r.get('graphs')}), {r.get('launches_per_cycle')} launches, {r.get('launches_per_layer')} "
              f"per layer, {r.get('host_syncs_per_cycle')} host syncs, {b.get('total', 0) / 1e9:.3f} GB read = "
              f"{b.get('ratio', 0):.2f}x ideal" + (f", {bw:.1%} of copy bandwidth" if bw else ""))
    m = (doc or {}).get("memory")
    if m:
        print(f"{name:<15} memory after load: {m['allocated'] / 1e9:.3f} GB, plan {m['plan'] / 1e9:.3f} GB "
              f"({m['ratio']:.3f}x)")
for n in (8192, 32768):
    doc = load(f"prefill-{n}.json") if (out / f"prefill-{n}.json").exists() else None
    for c in (doc or {}).get("counted", []):
        modeled = f", modeled on {doc['gpu']} {c['modeled_ms']:.1f} ms" if c.get("modeled_ms") else ""
        print(f"prefill {n}: {doc['tokens_per_s']:.0f} tok/s; chunk at {c['start']} ({c['rows']} rows): measured "
              f"{c['measured_ms']:.1f} ms, {c['launches']} launches, {c['bytes_read'] / 1e9:.2f} GB read{modeled}")
doc = load("bench-model.json") if (out / "bench-model.json").exists() else None
for c in (doc or {}).get("cycles", []):
    p = c["prediction"]["counted"]
    print(f"bench model k={c['draft_tokens']}: {p['cycle_s'] * 1e3:.2f} ms/cycle, {p['tokens_per_s']:.0f} tok/s "
          f"(dominant: {p['dominant']})")
doc = load("info-plan.json") if (out / "info-plan.json").exists() else None
if doc:
    plan = doc["plan"]
    print(f"plan 4 x 288 GB at {plan['context']}: fits {plan['fits']}, {plan['total_per_rank'] / 1e9:.1f} GB per rank")
PYEOF
pack
echo "done in $(( $(date +%s) - START )) s; results in $OUT/device-check.tgz"
exit $status
