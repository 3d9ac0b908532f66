"""A CPU stand-in for CUDA-graph capture and replay, to test what graphs change without a GPU.

A captured graph replays the device work its step issued at capture and nothing else: no Python runs, so
host values read at capture (a position as an int, a list's length, a cached decision) stay as they were,
and only writes to tensors happen again. `ReplayRunner` does the same on the CPU: after the warm-up calls
a capture makes, it runs the step once while recording every tensor operation and every Triton kernel
launch (the fast path, under the interpreter) with the very tensors they used, and `run()` replays that
record: operations that write their arguments run again on them, operations that made a new tensor run
again and write into the tensor they made at capture, views are already in place, and collectives (c10d
operations, which CUDA graphs capture with NCCL) are issued again on the same tensors and waited for, so
the ranks of a group replay their cycles in lockstep. A step that depends on
host state between calls gives different results here than called eagerly, as it would on a GPU.
"""

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from kernels import _triton  # noqa: F401  (before Triton: it chooses the interpreter without a GPU)


def one_reach(prompt: int, tokens: int) -> int:
    """A capacity that is also the reach floor for a run of `prompt` + `tokens` ids (and a verify block past
    them): every cycle step of the run is made, warmed up and captured once, at one reach."""
    return max(64, 1 << (prompt + tokens + 8).bit_length())


class _Recorder(TorchDispatchMode):
    def __init__(self, tape: list):
        super().__init__()
        self.tape = tape
        self.paused = 0  # > 0 while a kernel runs: the interpreter's own tensor work is not the step's

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if not self.paused:
            self.tape.append(("op", func, args, kwargs, out, _replay_mode(func, args, kwargs, out)))
        return out


def _storages(tree) -> set[int]:
    return {t.untyped_storage().data_ptr() for t in tree_flatten(tree)[0] if isinstance(t, torch.Tensor)}


def _replay_mode(func, args, kwargs, out) -> str:
    """"write": the op writes its arguments (run it again); "view": its output shares an argument's storage
    (nothing to redo: the view exists); "compute": a new tensor (run again, copy into the captured one);
    "collective": a c10d operation (run it again and wait for it: its schema marks no write, yet it fills
    its output). Views are told by storage, not by the schema: `reshape` may copy."""
    if func.namespace == "c10d":
        return "collective"
    if any(a.alias_info is not None and a.alias_info.is_write for a in func._schema.arguments):
        return "write"
    outs = _storages(out)
    return "view" if outs and outs <= _storages((args, kwargs)) else "compute"


class ReplayRunner:
    kind = "replay"

    def __init__(self, step, warmup: int = 2):
        self.step = step
        for _ in range(warmup):
            step()
        from triton.runtime.interpreter import InterpretedFunction

        self.tape: list = []
        recorder = _Recorder(self.tape)
        launch = InterpretedFunction.run

        def recorded_launch(fn, *args, **kwargs):
            self.tape.append(("kernel", fn, args, kwargs, None, "launch"))
            recorder.paused += 1
            try:
                return launch(fn, *args, **kwargs)
            finally:
                recorder.paused -= 1

        InterpretedFunction.run = recorded_launch
        try:
            with recorder:
                self.outputs = step()
        finally:
            InterpretedFunction.run = launch

    def run(self) -> dict[str, torch.Tensor]:
        from triton.runtime.interpreter import InterpretedFunction

        for kind, func, args, kwargs, out, mode in self.tape:
            if kind == "kernel":
                InterpretedFunction.run(func, *args, **kwargs)
            elif mode == "write":
                func(*args, **kwargs)
            elif mode == "collective":
                for work in tree_flatten(func(*args, **kwargs))[0]:
                    if hasattr(work, "wait") and not isinstance(work, torch.Tensor):
                        work.wait()
            elif mode == "compute":
                new = func(*args, **kwargs)
                for dst, src in zip(tree_flatten(out)[0], tree_flatten(new)[0]):
                    if isinstance(dst, torch.Tensor):
                        dst.copy_(src)
        return self.outputs
