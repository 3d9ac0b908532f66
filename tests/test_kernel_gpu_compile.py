"""Every Triton kernel compiles for the GPUs this project runs on, on a machine without one.

The interpreter that runs the kernel tests on the CPU accepts programs the GPU compiler rejects; this
compiles each kernel, with the specializations the benchmark cases and the tiny models' fast path launch,
for sm_90 (H100/H200, where the device checks run) and sm_103 (B300, the target). See tests/gpu_compile.py.
"""

import json
import subprocess
import sys
from pathlib import Path


def test_every_kernel_compiles_for_hopper_and_blackwell():
    root = Path(__file__).resolve().parent.parent
    run = subprocess.run([sys.executable, "-m", "tests.gpu_compile", "--arch", "90,103"], cwd=root,
                         capture_output=True, text=True, timeout=1200)
    assert run.stdout, run.stderr[-3000:]
    report = json.loads(run.stdout)
    for f in report["failures"]:
        print(f.get("kernel") or f.get("case"), f.get("arch"), f["error"], sep="\n", end="\n-----\n")
    assert not report["failures"], f"{len(report['failures'])} failures (printed above)"
    assert not report["never_launched"], f"kernels no case reaches: {report['never_launched']}"
    assert set(report["compiled"]) == {"90", "103"}
    assert run.returncode == 0
