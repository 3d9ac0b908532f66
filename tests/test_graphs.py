"""Graph runners: the eager runner runs the cycle step itself; on CUDA (skipped without a GPU) the captured
graphs give the same tokens as the eager runner and replaying them allocates nothing. Without a GPU, replay
semantics are checked by tests/test_graph_replay.py and capturability by tests/test_gpu_dry_run.py."""

import dataclasses

import pytest
import torch

from appliance.api import Request, Sampling
from appliance.decode.cycle import reach_for, reaches
from appliance.decode.generate import Generator, graph_blockers
from appliance.loader import load_model
from graphs.runner import CudaGraphRunner, EagerRunner, make_runner

from .conftest import requires_cuda


def test_the_eager_runner_calls_the_step_and_returns_its_buffers():
    buf = torch.zeros(3)
    calls = []

    def step():
        calls.append(1)
        buf.add_(1)
        return {"out": buf}

    runner = make_runner(step, torch.device("cpu"))
    assert isinstance(runner, EagerRunner)
    assert runner.run()["out"] is buf and runner.run()["out"].tolist() == [2.0, 2.0, 2.0] and len(calls) == 2


def test_on_cpu_generation_replays_one_cycle_step_per_verify_width(tiny_dirs):
    lm = load_model(tiny_dirs["deepseek_v41"], load_drafter=True, notice=None)
    gen = Generator(lm, capacity=256, draft="auto", draft_tokens=2)
    list(gen.run(Request(input_ids=[5, 6, 7], max_tokens=6, ignore_eos=True)))
    assert set(gen.runners) == {("fixed", 2, 256)} and all(r.kind == "eager" for r in gen.runners.values())


def test_what_stops_a_capture_is_named_before_any_is_tried(tiny_dirs):
    fast = load_model(tiny_dirs["deepseek_v41"], path="fast", notice=None)
    assert graph_blockers(fast) == []  # the tiny Engram tables live with the model
    ref = load_model(tiny_dirs["deepseek_v41"], path="reference", notice=None)
    assert any("reference ops" in why for why in graph_blockers(ref))
    # the real tables stay in host memory: a model whose device is elsewhere than its Engram table
    away = dataclasses.replace(fast, runtime=dataclasses.replace(fast.runtime, device=torch.device("meta")))
    why = graph_blockers(away)
    assert len(why) == len(fast.cfg.engram.layer_ids) and all("Engram table stays in host memory" in w for w in why)
    fast.model.layers[0].ffn.reduce = lambda outputs, shared: (outputs, shared)  # what shard_moe installs
    assert any("expert-parallel MoE" in w for w in graph_blockers(fast))


def test_reaches_double_from_the_floor_to_the_capacity():
    assert reaches(256, 16) == [16, 32, 64, 128, 256]
    assert reaches(300, 64) == [64, 128, 256, 300]
    assert reaches(100, 4096) == [100]
    assert reach_for([16, 32, 64], 16) == 16 and reach_for([16, 32, 64], 17) == 32
    with pytest.raises(ValueError, match="largest reach 64"):
        reach_for([16, 32, 64], 65)


@pytest.mark.parametrize("family", ["deepseek_v41", "deepseek_v4"])
@pytest.mark.parametrize("draft", ["none", "auto"])
def test_cycles_that_read_only_their_reach_give_the_tokens_of_full_capacity_cycles(tiny_dirs, family, draft):
    """Decoding across four reaches (16 .. 128) equals decoding with the whole capacity visible."""
    lm = load_model(tiny_dirs[family], load_drafter=draft != "none", notice=None)
    prompt = torch.randint(0, lm.cfg.vocab_size, (9,)).tolist()
    reached = Generator(lm, capacity=256, draft=draft, draft_tokens=3, reach_floor=16)
    whole = Generator(lm, capacity=256, draft=draft, draft_tokens=3, reach_floor=256)
    req = Request(input_ids=prompt, max_tokens=100, ignore_eos=True)
    tokens = [[t for e in g.run(req) for t in getattr(e, "ids", [])] for g in (reached, whole)]
    assert len(tokens[0]) == 100 and tokens[0] == tokens[1]
    assert {key[2] for key in reached.runners if key[2] is not None} == {16, 32, 64, 128}
    assert {key[2] for key in whole.runners if key[2] is not None} == {256}


def _tokens(gen, prompt, sampling):
    out = []
    for event in gen.run(Request(input_ids=prompt, max_tokens=24, ignore_eos=True, sampling=sampling)):
        out += getattr(event, "ids", [])
    return out


@requires_cuda
class TestCudaGraphs:
    @pytest.mark.parametrize("family", ["deepseek_v41", "deepseek_v4", "deepseek_v4_0731"])
    @pytest.mark.parametrize("draft", ["none", "auto"])
    def test_captured_graphs_give_the_same_tokens_as_the_eager_runner(self, tiny_dirs, family, draft):
        lm = load_model(tiny_dirs[family], device="cuda", load_drafter=draft != "none", notice=None)
        prompt = torch.randint(0, lm.cfg.vocab_size, (20,)).tolist()
        for sampling in (Sampling(), Sampling(temperature=0.8, top_p=0.9, seed=7)):
            graphs = Generator(lm, capacity=256, draft=draft, draft_tokens=3, graphs=True)  # captures at init
            eager = Generator(lm, capacity=256, draft=draft, draft_tokens=3, graphs=False)
            assert all(isinstance(r, CudaGraphRunner) for r in graphs.runners.values())
            assert _tokens(graphs, prompt, sampling) == _tokens(eager, prompt, sampling)

    def test_replay_allocates_no_memory(self, tiny_dirs):
        lm = load_model(tiny_dirs["deepseek_v41"], device="cuda", load_drafter=True, notice=None)
        gen = Generator(lm, capacity=256, draft="auto", draft_tokens=3, graphs=True)  # captures at init
        gen.prefill([1, 2, 3, 4, 5])
        gen.start_sampling(Sampling(), 0)
        token = 6
        token = gen.cycle(token)[-1]  # first replay
        torch.cuda.synchronize()
        before = torch.cuda.memory_stats()["allocation.all.allocated"]
        for _ in range(10):
            token = gen.cycle(token)[-1]
        torch.cuda.synchronize()
        assert torch.cuda.memory_stats()["allocation.all.allocated"] == before
