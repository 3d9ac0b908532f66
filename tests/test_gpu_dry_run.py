"""The GPU path, checked without a GPU (tests/gpu_dry_run.py, in its own process): every Triton kernel
compiles for sm_90 (H100/H200, where the device checks run) and sm_103 (B300, the target), within the shared
memory a block may have; every decode-cycle step of every tiny family and drafter mode can be captured in a
CUDA graph (no host reads of device values, no value-dependent shapes, no tensors from host data); the
weight products' main loops issue within their budget per weight element (tests/gpu_dry_run.py ISSUE_BUDGET),
every weight-streaming kernel measured on both targets, with the loop that stages its quantized rows."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

# minutes of compiling: one test (two tests sharing a fixture ran it twice, once on each worker: 285 s)
pytestmark = pytest.mark.slow


def test_every_kernel_compiles_for_hopper_and_blackwell_and_every_cycle_step_can_be_captured():
    root = Path(__file__).resolve().parent.parent
    run = subprocess.run([sys.executable, "-m", "tests.gpu_dry_run", "--arch", "90,103"], cwd=root,
                         capture_output=True, text=True, timeout=1500)
    assert run.stdout, run.stderr[-3000:]
    report = json.loads(run.stdout)
    for f in report["failures"]:
        print(f.get("kernel") or f.get("case"), f.get("arch"), f["error"], sep="\n", end="\n-----\n")
    assert not report["failures"], f"{len(report['failures'])} failures (printed above)"
    assert not report["never_launched"], f"kernels no case reaches: {report['never_launched']}"
    assert set(report["kernels"]) == {"90", "103"}
    assert not report["capture_violations"], json.dumps(report["capture_violations"], indent=1)
    measured = {"linear._kernel fp4 official", "linear._kernel fp8 official", "moe._gate_up_kernel fp4 official",
                "moe._down_kernel fp4 official"}
    for arch in ("90", "103"):
        assert measured <= set(report["issue"][arch]), f"sm_{arch}: issue measured only for {report['issue'][arch]}"
        # the official numerics' products take rows staged once per program, and their staging is measured
        unstaged = [k for k in measured if not report["issue"][arch][k]["staging_per_element"] > 0]
        assert not unstaged, f"sm_{arch}: no staging loop found for {unstaged}"
