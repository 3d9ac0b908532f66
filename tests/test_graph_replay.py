"""What CUDA graphs change, checked on the CPU with a stand-in for capture and replay (tests/graph_replay.py):
every decode-cycle step replayed from its capture gives the tokens of the step called each time, for every
tiny family and drafter mode, on the fast path (the ops a GPU captures)."""

import pytest
import torch

import graphs.runner
from appliance.api import Request

from .conftest import load, open_loop
from .graph_replay import ReplayRunner


def test_a_replay_repeats_device_work_and_keeps_host_values_from_the_capture():
    count, seen, total = [0], torch.zeros(1), torch.zeros(1)

    def step():
        count[0] += 1
        seen.fill_(count[0])  # a host value: baked in at capture
        total.add_(1)  # device work: done again on every replay
        return {"seen": seen, "total": total}

    runner = ReplayRunner(step)  # two warm-up calls and the capture: count 3
    outs = [runner.run() for _ in range(2)]
    assert outs[-1]["seen"].item() == 3 and outs[-1]["total"].item() == 5


def _tokens(lm, draft: str, runner_factory, monkeypatch) -> list[int]:
    if runner_factory is not None:
        monkeypatch.setattr(graphs.runner, "make_runner", runner_factory)
    gen = open_loop(lm, capacity=128, draft=draft, draft_tokens=2, reach_floor=128)  # makes every step now
    ids = []
    for event in gen.run(Request(input_ids=list(range(5, 17)), max_tokens=4, ignore_eos=True)):
        ids += getattr(event, "ids", [])
    monkeypatch.undo()
    return ids


# the cycle step kinds: plain (V4.1), draft + verify in one step (DSpark on V4.1), a chained drafter (V4's MTP)
@pytest.mark.slow
@pytest.mark.parametrize("family, draft", [("deepseek_v41", "none"), ("deepseek_v41", "dspark"),
                                           ("deepseek_v4", "mtp")])
def test_replayed_cycle_steps_give_the_tokens_of_eager_steps(tiny_dirs, family, draft, monkeypatch):
    lm = load(tiny_dirs[family], path="fast", draft=draft)
    want = _tokens(lm, draft, None, monkeypatch)
    # one warm-up call (a GPU's two only repeat it): what matters is that the capture is not a step's first call
    replay = lambda step, device, graphs=True, pool=None, check_inputs=False: ReplayRunner(step, warmup=1)  # noqa: E731
    got = _tokens(lm, draft, replay, monkeypatch)
    assert got == want and len(want) == 4
