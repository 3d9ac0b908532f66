"""Runners for a step function over static buffers: capture once, replay many times.

A step is a callable that reads its inputs from tensors it holds (static addresses, written in place by
the caller before each run) and writes its outputs to tensors it returns. This module knows buffers and a
callable, not the model.

- `EagerRunner` calls the step each time (CPU, and `--no-graphs`).
- `CudaGraphRunner` warms the step up on a side stream, captures one CUDA graph, and replays it: one
  launch per run, no host work in between, no allocation (the graph owns a private memory pool).
Both return the same output tensors from `run()`, so a caller cannot tell them apart except by speed.
"""

from collections.abc import Callable

import torch

Outputs = dict[str, torch.Tensor]


class EagerRunner:
    kind = "eager"

    def __init__(self, step: Callable[[], Outputs]):
        self.step = step

    def run(self) -> Outputs:
        return self.step()


class CudaGraphRunner:
    kind = "cuda-graph"

    def __init__(self, step: Callable[[], Outputs], warmup: int = 2, pool=None):
        if not torch.cuda.is_available():
            raise RuntimeError("CudaGraphRunner needs a CUDA device; use EagerRunner on CPU")
        self.step = step
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):  # warm-up: lazy initialization and autotuning happen here, not in capture
            for _ in range(warmup):
                step()
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, pool=pool):
            self.outputs = step()
        torch.cuda.synchronize()

    @property
    def pool(self):
        return self.graph.pool()

    def run(self) -> Outputs:
        self.graph.replay()
        return self.outputs


def make_runner(step: Callable[[], Outputs], device: torch.device, graphs: bool = True, pool=None):
    """A CUDA-graph runner on a CUDA device (unless `graphs` is off), an eager runner elsewhere."""
    if graphs and device.type == "cuda":
        return CudaGraphRunner(step, pool=pool)
    return EagerRunner(step)
