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
    # a decode step's experts: gate and up, then down, as phases of the MoE's one launch (moe._step_kernel)
    measured = {"linear._kernel fp4 official", "linear._kernel fp8 official", "moe._step_kernel fp4 official"}
    for arch in ("90", "103"):
        assert measured <= set(report["issue"][arch]), f"sm_{arch}: issue measured only for {report['issue'][arch]}"
        # the official numerics' products take rows staged once per program, and their staging is measured
        unstaged = [k for k in measured if not report["issue"][arch][k]["staging_per_element"] > 0]
        assert not unstaged, f"sm_{arch}: no staging loop found for {unstaged}"
    # every kernel launched dependent on the one ahead, waiting for it before it touches global memory
    for arch, kernels in report["kernels"].items():
        late = {k: r for k, r in kernels.items() if r["pdl"] != r["specializations"]}
        assert not late, f"sm_{arch}: specializations without an ordered dependent launch: {late}"


def test_the_wait_ordering_rule_finds_global_memory_before_the_grid_dependency_wait():
    """tests/ptx.py `pdl_order` on PTX bodies made here: the wait first (then any instruction) passes; a global
    load, store, atomic or asynchronous copy before it fails, naming the instruction; shared-memory and
    parameter loads before it are fine; no wait, or no launch of the dependents, fails."""
    import random

    from tests.ptx import pdl_order

    rng = random.Random()
    seed = rng.randrange(1 << 30)
    rng.seed(seed)
    harmless = ["mov.u32 \t%r1, %tid.x;", "ld.param.u64 \t%rd1, [k_param_0];", "ld.shared.b32 \t%r2, [global_smem];",
                "bar.sync \t0;", "@%p1 tcgen05.alloc.cta_group::1.sync.aligned.shared::cta.b32 [%r59], 32;"]
    touching = ["ld.global.b32 \t%r3, [%rd1];", "@%p2 st.global.v4.b32 \t[%rd2], {%r1, %r2, %r3, %r4};",
                "atom.global.acq_rel.gpu.add.u32 \t%r5, [%rd3], 1;", "cp.async.cg.shared.global [%r6], [%rd4], 16;",
                "red.global.add.f32 \t[%rd5], %f1;", "ld.global.nc.v2.b32 \t{%r7, %r8}, [%rd6];"]
    wait, launch = "griddepcontrol.wait ;", "griddepcontrol.launch_dependents ;"

    def ptx(lines):
        return "\n".join("\t" + line for line in lines)

    before = rng.sample(harmless, rng.randint(0, len(harmless)))
    after = rng.sample(harmless + touching, rng.randint(1, 8))
    assert pdl_order(ptx(before + [wait, launch] + after)) is None, seed
    bad = rng.choice(touching)
    mixed = before[:]
    mixed.insert(rng.randint(0, len(mixed)), bad)
    why = pdl_order(ptx(mixed + [wait, launch] + after))
    opcode = next(t for t in bad.split() if not t.startswith("@"))
    assert why and opcode in why and why.endswith("before griddepcontrol.wait"), (seed, why)
    assert pdl_order(ptx(before + after)) == "no griddepcontrol.wait", seed
    assert pdl_order(ptx(before + [wait] + after)) == "no griddepcontrol.launch_dependents", seed
