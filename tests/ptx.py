"""What a compiled kernel's PTX says about its order against the kernels around it: a kernel launched with
programmatic dependent launch (kernels/_triton.py `pdl`) may start before the one ahead of it in the stream
has finished, so nothing it does to global memory may come before its `griddepcontrol.wait`
(kernels/_triton.py `dependent_launch`). The compile check (tests/gpu_dry_run.py) holds every kernel to it."""

import re

# an instruction on global memory (what an earlier kernel may have written, or the next may read): loads,
# stores, atomics and reductions in the global state space, asynchronous copies (cp.async, bulk and tensor)
_GLOBAL_MEMORY = re.compile(r"^\s*(@!?%\w+\s+)?((ld|ldu|st|atom|red|multimem)\.[\w.]*global|cp\.(reduce\.)?async)")


def pdl_order(ptx: str) -> str | None:
    """Why a kernel launched with programmatic dependent launch could touch memory before the kernel ahead of
    it finished (None: it cannot): no `griddepcontrol.wait`, a global memory instruction before it in the
    PTX, or no `griddepcontrol.launch_dependents` (the next kernel would wait for this one's end to launch)."""
    lines = ptx.splitlines()
    wait = next((i for i, line in enumerate(lines) if "griddepcontrol.wait" in line), None)
    if wait is None:
        return "no griddepcontrol.wait"
    early = next((line.strip() for line in lines[:wait] if _GLOBAL_MEMORY.match(line)), None)
    if early:
        return f"{early!r} before griddepcontrol.wait"
    if not any("griddepcontrol.launch_dependents" in line for line in lines):
        return "no griddepcontrol.launch_dependents"
    return None
