"""Runners for a step function over static buffers: capture once, replay many times.

A step is a callable that reads its inputs from tensors it holds (static addresses, written in place by
the caller before each run) and writes its outputs to tensors it returns. This module knows buffers and a
callable, not the model.

- `EagerRunner` calls the step each time (CPU, and `--no-graphs`).
- `CudaGraphRunner` warms the step up on a side stream, captures one CUDA graph, and replays it: one
  launch per run, no host work in between, no allocation (the graph owns a private memory pool).
Both return the same output tensors from `run()`, so a caller cannot tell them apart except by speed.

A replayed graph reads its inputs at the addresses they had at capture. A step may name those inputs
(`inputs()`: name -> tensor); with `check_inputs` every run verifies that each still lives where it was
captured and raises naming the one that moved (a debug check: a caller that rebinds a buffer instead of
writing into it would otherwise replay on stale memory, silently).
"""

from collections.abc import Callable

import torch

Outputs = dict[str, torch.Tensor]


def _addresses(step) -> dict[str, int]:
    inputs = getattr(step, "inputs", None)
    return {} if inputs is None else {name: t.data_ptr() for name, t in inputs().items()}


class _Runner:
    def __init__(self, step: Callable[[], Outputs], check_inputs: bool):
        self.step = step
        self.check_inputs = check_inputs
        self.captured_at = _addresses(step) if check_inputs else {}

    def _check(self) -> None:
        if not self.check_inputs:
            return
        now = _addresses(self.step)
        moved = [n for n, p in self.captured_at.items() if now.get(n) != p]
        if moved:
            raise RuntimeError(f"{type(self.step).__name__}: input {moved[0]} moved since capture "
                               f"({len(moved)} moved); write into the captured buffers instead of rebinding them")


class EagerRunner(_Runner):
    kind = "eager"

    def __init__(self, step: Callable[[], Outputs], check_inputs: bool = False):
        super().__init__(step, check_inputs)

    def run(self) -> Outputs:
        self._check()
        return self.step()


class CudaGraphRunner(_Runner):
    kind = "cuda-graph"

    def __init__(self, step: Callable[[], Outputs], warmup: int = 2, pool=None, check_inputs: bool = False):
        if not torch.cuda.is_available():
            raise RuntimeError("CudaGraphRunner needs a CUDA device; use EagerRunner on CPU")
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):  # warm-up: lazy initialization and autotuning happen here, not in capture
            for _ in range(warmup):
                step()
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()
        super().__init__(step, check_inputs)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, pool=pool):
            self.outputs = step()
        torch.cuda.synchronize()

    @property
    def pool(self):
        return self.graph.pool()

    def run(self) -> Outputs:
        self._check()
        self.graph.replay()
        return self.outputs


def make_runner(step: Callable[[], Outputs], device: torch.device, graphs: bool = True, pool=None,
                check_inputs: bool = False):
    """A CUDA-graph runner on a CUDA device (unless `graphs` is off), an eager runner elsewhere."""
    if graphs and device.type == "cuda":
        return CudaGraphRunner(step, pool=pool, check_inputs=check_inputs)
    return EagerRunner(step, check_inputs=check_inputs)
