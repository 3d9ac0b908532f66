"""The graph policy of a decode session: a keyed set of runners, one per cycle step (its kind, width and
reach), sharing one memory pool.

Captured largest first: a graph's private pool keeps the most memory its capture needed, and the smaller
graphs captured after it reuse those blocks instead of growing the pool (they replay one after another on
one stream, so they never need the memory at the same time; what one leaves for the next lives in buffers
made outside any capture). A timing hook sees every run, so a benchmark times the steps without touching
the runners.
"""

from collections.abc import Callable, Hashable

import torch

from . import runner as runners

Timer = Callable[[Hashable, Callable[[], runners.Outputs]], runners.Outputs]


class GraphSet:
    def __init__(self, device: torch.device, graphs: bool = True, check_inputs: bool = False):
        """`graphs`: capture CUDA graphs on a CUDA device (elsewhere, or off, every step runs eagerly).
        `check_inputs`: verify at every run that a step's named inputs still live where they were captured."""
        self.device = device
        self.capturing = graphs and device.type == "cuda"
        self.check_inputs = check_inputs
        self.pool = torch.cuda.graph_pool_handle() if self.capturing else None
        self.runners: dict[Hashable, object] = {}
        self.timer: Timer | None = None  # timer(key, run) -> outputs, around every run when set

    def build(self, steps: dict[Hashable, Callable[[], runners.Outputs]], size: Callable[[Hashable], int]) -> None:
        """Make (on CUDA: warm up and capture) a runner for every step, in decreasing `size`."""
        for key in sorted(steps, key=size, reverse=True):
            self.runners[key] = runners.make_runner(steps[key], self.device, self.capturing, pool=self.pool,
                                                    check_inputs=self.check_inputs)

    def run(self, key: Hashable) -> runners.Outputs:
        run = self.runners[key].run
        return run() if self.timer is None else self.timer(key, run)

    @property
    def kinds(self) -> set[str]:
        return {r.kind for r in self.runners.values()}
