"""Graph runners: the eager runner runs the cycle step itself; on CUDA (skipped without a GPU) the captured
graphs give the same tokens as the eager runner and replaying them allocates nothing. The graph set builds
steps largest first, times runs through its hook, and (debug) refuses a step whose input moved. Without a GPU, replay
semantics are checked by tests/test_graph_replay.py and capturability by tests/test_gpu_dry_run.py."""

import pytest
import torch

from appliance.api import Request, Sampling
from appliance.decode.cycle import reach_for, reaches
from appliance.parallel import placement
from graphs.graph_set import GraphSet
from graphs.runner import CudaGraphRunner, EagerRunner, make_runner

from .conftest import load, open_loop, requires_cuda


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


def test_on_cpu_a_session_runs_one_eager_cycle_step_per_verify_width(tiny_dirs):
    lm = load(tiny_dirs["deepseek_v41"], draft="auto")
    loop = open_loop(lm, capacity=256, draft="auto", draft_tokens=2)
    list(loop.run(Request(input_ids=[5, 6, 7], max_tokens=6, ignore_eos=True)))
    graphs = loop.session.graphs
    assert set(graphs.runners) == {("fixed", 2, 256)} and graphs.kinds == {"eager"}


class _Step:
    """A step over one input buffer, named for the address check."""

    def __init__(self):
        self.buf = torch.zeros(2)

    def inputs(self):
        return {"buf": self.buf}

    def __call__(self):
        self.buf.add_(1)
        return {"out": self.buf}


def test_the_graph_set_makes_steps_largest_first_and_times_every_run():
    made, timed = [], []
    steps = {("verify", w, 64): _Step() for w in (2, 4, 3)}
    graphs = GraphSet(torch.device("cpu"))
    graphs.build(steps, size=lambda key: key[1])
    made = [key[1] for key in graphs.runners]
    graphs.timer = lambda key, run: timed.append(key) or run()
    graphs.run(("verify", 3, 64))
    assert made == [4, 3, 2] and timed == [("verify", 3, 64)]


def test_a_step_input_that_moved_since_capture_fails_the_debug_check():
    step = _Step()
    runner = make_runner(step, torch.device("cpu"), check_inputs=True)
    runner.run()
    step.buf = torch.zeros(2)  # rebinding instead of writing in place: a replay would read stale memory
    with pytest.raises(RuntimeError, match="input buf moved since capture"):
        runner.run()
    assert make_runner(_Step(), torch.device("cpu")).run()["out"].tolist() == [1.0, 1.0]  # off by default


def test_what_stops_a_capture_is_published_by_the_loader_and_host_tables_stay_where_they_are(tiny_dirs,
                                                                                             monkeypatch):
    assert load(tiny_dirs["deepseek_v41"], path="fast").capture_blockers == []
    ref = load(tiny_dirs["deepseek_v41"], path="reference")
    assert any("reference ops" in why for why in ref.capture_blockers)
    # the real Engram tables (~100 GB) stay in host memory when the model moves to its device
    fast = load(tiny_dirs["deepseek_v41"], path="fast")
    monkeypatch.setattr(placement, "HOST_TABLE_BYTES", 0)
    kept = []
    placement.place((fast.model, None), torch.device("meta"), kept=kept)
    layers = fast.cfg.engram.layer_ids
    assert sorted(name for name, _ in kept) == sorted(f"Engram.{t} of layer {L}" for L in layers
                                                      for t in ("table", "table_scale"))
    for (_, table), layer in zip(kept, [fast.model.layers[L].engram for L in layers for _ in range(2)]):
        assert table.device.type == "cpu" and table.data_ptr() in (layer.table.data_ptr(), layer.table_scale.data_ptr())


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
    lm = load(tiny_dirs[family], draft=draft)
    prompt = torch.randint(0, lm.cfg.vocab_size, (9,)).tolist()
    reached = open_loop(lm, capacity=256, draft=draft, draft_tokens=3, reach_floor=16)
    whole = open_loop(lm, capacity=256, draft=draft, draft_tokens=3, reach_floor=256)
    used = [set(), set()]
    for loop, seen in zip((reached, whole), used):
        loop.session.graphs.timer = lambda key, run, seen=seen: seen.add(key[2]) or run()
    req = Request(input_ids=prompt, max_tokens=100, ignore_eos=True)
    tokens = [[t for e in g.run(req) for t in getattr(e, "ids", [])] for g in (reached, whole)]
    assert len(tokens[0]) == 100 and tokens[0] == tokens[1]
    assert used[0] - {None} == {16, 32, 64, 128} and used[1] - {None} == {256}


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
        lm = load(tiny_dirs[family], devices="cuda", draft=draft)
        prompt = torch.randint(0, lm.cfg.vocab_size, (20,)).tolist()
        for sampling in (Sampling(), Sampling(temperature=0.8, top_p=0.9, seed=7)):
            graphs = open_loop(lm, capacity=256, draft=draft, draft_tokens=3, graphs=True)  # captures at init
            eager = open_loop(lm, capacity=256, draft=draft, draft_tokens=3, graphs=False)
            assert all(isinstance(r, CudaGraphRunner) for r in graphs.session.graphs.runners.values())
            assert _tokens(graphs, prompt, sampling) == _tokens(eager, prompt, sampling)

    def test_replay_allocates_no_memory(self, tiny_dirs):
        lm = load(tiny_dirs["deepseek_v41"], devices="cuda", draft="auto")
        gen = open_loop(lm, capacity=256, draft="auto", draft_tokens=3, graphs=True).session  # captures at init
        gen.prefill_all([1, 2, 3, 4, 5])
        gen.start_sampling(Sampling(), 0)
        token = 6
        token = gen.cycle(token)[-1]  # first replay
        torch.cuda.synchronize()
        before = torch.cuda.memory_stats()["allocation.all.allocated"]
        for _ in range(10):
            token = gen.cycle(token)[-1]
        torch.cuda.synchronize()
        assert torch.cuda.memory_stats()["allocation.all.allocated"] == before
