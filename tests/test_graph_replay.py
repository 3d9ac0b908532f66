"""What CUDA graphs change, checked on the CPU with a stand-in for capture and replay (tests/graph_replay.py):
every decode-cycle step replayed from its capture gives the tokens of the step called each time, for every
tiny family and drafter mode, on the fast path (the ops a GPU captures); with drafting, the tokens of
greedy decoding without it."""

import os
import random

import pytest
import torch

import graphs.runner
from appliance.api import Request
from appliance.decode.speculator import Speculator

from .conftest import load, open_loop
from .graph_replay import ReplayRunner, one_reach


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


# each family's drafters: the cycle step kinds are draft + verify in one step (DSpark on V4.1 and V4-0731, and
# adaptive's trimmed drafts) and a chained drafter (V4's MTP); V4.1 also replays its plain cycle
DRAFTS = {"deepseek_v41": ("dspark", "adaptive"), "deepseek_v4": ("mtp",), "deepseek_v4_0731": ("dspark",)}
# greedy tokens per run: 3 in the suite (the interpreter costs seconds a forward of a tiny model); the long
# check (BENCHMARKS.md) sets APPLIANCE_REPLAY_TOKENS=128, and a longer run than the suite's takes every
# drafter of a family
SUITE_TOKENS = 3
GENERATE = int(os.environ.get("APPLIANCE_REPLAY_TOKENS", SUITE_TOKENS))
PROMPT = 14  # the window ring (16) wraps inside the first verify block (positions 14..17 at k = 3)
CAPACITY = one_reach(PROMPT, GENERATE)


def _greedy(lm, prompt: list[int], draft: str, replayed: bool, monkeypatch) -> tuple[list[int], object]:
    if replayed:  # one warm-up call (a GPU's two only repeat it): the capture is not a step's first call
        monkeypatch.setattr(graphs.runner, "make_runner", lambda step, device, graphs=True, pool=None,
                            check_inputs=False: ReplayRunner(step, warmup=1))
    gen = open_loop(lm, capacity=CAPACITY, reach_floor=CAPACITY, draft=draft, draft_tokens=3)
    ids = []
    for event in gen.run(Request(input_ids=prompt, max_tokens=GENERATE, ignore_eos=True)):
        ids += getattr(event, "ids", [])
    monkeypatch.setattr(graphs.runner, "make_runner", graphs.runner.make_runner)
    return ids, gen.session.stats


@pytest.mark.slow
@pytest.mark.parametrize("family", DRAFTS)
def test_replayed_cycles_with_and_without_drafting_give_the_eager_tokens_without(tiny_dirs, family, monkeypatch):
    """Greedy decoding on the fast path (the ops a GPU captures), eager plain cycles against cycles replayed
    from their captures: with the family's drafter (V4.1: one of its two modes, drawn per run), and plain on
    V4.1. Both hold at once: the replay reproduces the eager steps, and a verify of k + 1 rows the k + 1
    single steps, token for token (one eager run fewer per family than checking each alone; the drafting
    alone over 128 tokens on the reference path: tests/test_speculative.py)."""
    # adaptive trims drafts by a verify-cost table it measures at load; the interpreter's timings mean
    # nothing, so the table is set (longer verifies cost a little more)
    monkeypatch.setattr(Speculator, "calibrate", lambda self, model, repeats=5: setattr(
        self, "step_cost", [0.0] + [1.0 + 0.1 * w for w in range(self.drafter.cfg.dspark.block_size + 1)]))
    lm = load(tiny_dirs[family], path="fast", draft="auto")
    seed = random.randrange(1 << 30)
    prompt = torch.randint(0, lm.cfg.vocab_size, (PROMPT,), generator=torch.Generator().manual_seed(seed)).tolist()
    want, _ = _greedy(lm, prompt, "none", False, monkeypatch)
    assert len(want) == GENERATE
    # in the suite one drafter, drawn per run (a run of each costs minutes under the interpreter)
    drafters = DRAFTS[family] if GENERATE > SUITE_TOKENS else (random.Random(seed).choice(DRAFTS[family]),)
    for draft in ("none", *drafters) if family == "deepseek_v41" else drafters:
        got, stats = _greedy(lm, prompt, draft, True, monkeypatch)
        assert got == want, f"{family} --draft {draft}, replayed (seed {seed}): {got} != {want}"
        assert draft == "none" or (stats.cycles > 0 and stats.drafted >= stats.cycles)
