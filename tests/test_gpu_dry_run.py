"""The GPU path, checked without a GPU (tests/gpu_dry_run.py, in its own process): every Triton kernel
compiles for sm_90 (H100/H200, where the device checks run) and sm_103 (B300, the target), within the shared
memory a block may have; every decode-cycle step of every tiny family and drafter mode can be captured in a
CUDA graph (no host reads of device values, no value-dependent shapes, no tensors from host data)."""

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
