"""The memory plan tells the truth: what a load of the fast path holds is what the plan, computed from
config.json alone, says it holds (weights in their stored format, float copies, caches, decode states), and
a long prefill in chunks needs no more than the plan's prefill scratch on top."""

import contextlib
import random

import pytest
import torch

from appliance.decode.session import DecodeSession
from appliance.loader import default_model_dir, load_model
from appliance.measure.memory import fast_path_plan
from appliance.measure.recorder import LiveBytes, Recorder
from appliance.measure.shapes import live_bytes, live_spans
from appliance.model.config import load_config
from appliance.options import RunOptions
from appliance.parallel.world import World

from .ranks import call


@pytest.mark.parametrize("world,rank", [(1, 0), (4, 0), (4, 3)])
def test_a_loaded_fast_path_holds_what_its_plan_says_within_five_percent(world, rank):
    """One rank, and two of four (the split needs no collective to load: each rank keeps its slices)."""
    options = RunOptions(draft="dspark", path="fast", dtype="bfloat16")
    cfg = load_config(default_model_dir())
    plan = fast_path_plan(cfg, 1024, world=world, dtype="bfloat16", drafter=True, graphs=False)
    baseline = live_spans("cpu")
    lm = load_model(options, notice=None, world=World(rank, world, "cpu") if world > 1 else None)
    session = DecodeSession(lm, options, capacity=1024)
    allocated = live_bytes("cpu", baseline)
    assert abs(allocated - plan.total) <= 0.05 * plan.total, (allocated, plan.parts)
    assert plan.parts["float_copies_and_caches"] > 0  # the copies the fast path still holds are counted
    per_token = plan.details["state_bytes_per_token"]
    held = session.state.nbytes + session.spec.state.nbytes
    assert per_token * 1024 <= held <= per_token * 1024 + plan.details["state_constant"] + 1024 * 8
    del lm, session


def test_the_released_v41_plan_on_four_b300_fits_855k_tokens_and_names_the_state_as_stored(tmp_path):
    import shutil
    from pathlib import Path

    shutil.copy(Path(__file__).parent / "data" / "deepseek-v41-flash-config.json", tmp_path / "config.json")
    plan = fast_path_plan(load_config(tmp_path), 855000, int(288e9), world=4, dtype="bfloat16", drafter=False)
    assert plan.fits
    assert plan.details["state_bytes_per_token"] > 890  # bf16 rows as stored, not the packed format
    # the fast path reads packed weights as stored: what it adds is norm vectors and kernel caches (MBs)
    assert plan.parts["weights"] > 70e9 and plan.parts["float_copies_and_caches"] < 1e-3 * plan.parts["weights"]



def test_the_plan_holds_a_prefill_chunks_scratch_and_855k_tokens_fit_b300_and_h200_in_the_default_chunks(tmp_path):
    """The scratch of a prompt's last prefill chunk (the default, MAX_CHUNK rows), counted on the meta build:
    at least the MoE's float32 outputs of every pair, less than the indexer's scores of this rank's quarter
    of the queries over every index key of the context (selected by block maxima, they are never held;
    issue 31 counted ~88 GB a rank at 4096 rows with the ranks' partial scores gathered); 32x smaller
    chunks need far less; the released V4.1 on 4 ranks at 855K fits a B300 (288 GB) and an H200."""
    import shutil
    from pathlib import Path

    from appliance.options import MAX_CHUNK

    assert RunOptions().chunk == MAX_CHUNK
    shutil.copy(Path(__file__).parent / "data" / "deepseek-v41-flash-config.json", tmp_path / "config.json")
    cfg = load_config(tmp_path)
    b300 = fast_path_plan(cfg, 855000, int(288e9), world=4, dtype="bfloat16", drafter=False, chunk=MAX_CHUNK)
    scratch = b300.parts["prefill_scratch"]
    keys = 855000 // min(r for r in cfg.compress_ratios if r)  # the indexer's rows at the last chunk
    pairs = MAX_CHUNK * (cfg.n_activated_experts + 1) * cfg.dim * 4  # the MoE's float32 outputs a pair
    # the selection by block maxima never holds a rank's share of the queries' scores over all the keys
    assert pairs <= scratch < MAX_CHUNK // 4 * keys * 4, scratch
    assert b300.fits
    h200 = fast_path_plan(cfg, 855000, int(141e9), world=4, dtype="bfloat16", drafter=False, chunk=MAX_CHUNK)
    assert h200.fits and h200.parts["prefill_scratch"] == pytest.approx(scratch, rel=1e-3)
    small = fast_path_plan(cfg, 855000, int(141e9), world=4, dtype="bfloat16", drafter=False, chunk=256)
    assert small.parts["prefill_scratch"] < scratch / 16


@contextlib.contextmanager
def arithmetic_skipped():
    """Kernel launches that compute nothing: each zeroes its integer tensors (experts' ids, positions, rows
    selected, which torch operations index with) and returns. What the fast path allocates never depends on
    a value (its shapes are fixed by the call, as a graph's capture needs), so a load's and a prefill's bytes
    are the same without the arithmetic (on the default model, a 96-token prefill in chunks of 48: 363,968
    bytes at most either way; the CPU it saves: BENCHMARKS.md); the kernels' values are the other tests'.
    Under the interpreter only (every CPU run)."""
    from triton.runtime import interpreter

    launch = interpreter.GridExecutor.__call__

    def zero_integers(self, *args, **kwargs):
        for a in (*args, *kwargs.values()):
            if isinstance(a, torch.Tensor) and a.dtype in (torch.int32, torch.int64):
                a.zero_()

    interpreter.GridExecutor.__call__ = zero_integers
    try:
        yield
    finally:
        interpreter.GridExecutor.__call__ = launch


def prefill_footprint(world, context: int, chunk: int, seed: int) -> dict:
    """Every rank (or the one, `world` None): load the fast path, prefill a `context`-token prompt in chunks
    of `chunk` (no checkpoints: their copies live in host memory, outside a device's plan) and return the
    bytes the load holds, the most the prefill's own tensors held at once (the chunk's scratch and what a
    chunk leaves for the next: the journal's last positions, the last logits) and the plan's figures; the
    kernels' arithmetic skipped (`arithmetic_skipped`)."""
    with arithmetic_skipped():
        return _prefill_footprint(world, context, chunk, seed)


def _prefill_footprint(world, context: int, chunk: int, seed: int) -> dict:
    size = world.size if world else 1
    options = RunOptions(path="fast", dtype="bfloat16", draft="none", chunk=chunk, checkpoint_stride=0,
                         devices=f"cpu:{size}" if world else "cpu")
    plan = fast_path_plan(load_config(default_model_dir()), context, world=size, dtype="bfloat16", drafter=False,
                          graphs=False, chunk=chunk)
    baseline = live_spans("cpu")
    lm = load_model(options, notice=None, world=world)
    session = DecodeSession(lm, options, capacity=context)
    loaded = live_bytes("cpu", baseline)
    rng = random.Random(seed)  # the same prompt on every rank
    ids = [lm.cfg.bos_token_id] + [rng.randrange(8, lm.cfg.vocab_size) for _ in range(context - 1)]
    recorder = Recorder(recording=False)
    recorder.memory = LiveBytes()
    with recorder:
        for _ in session.prefill(ids, chunk=chunk):
            pass
    return {"loaded": loaded, "prefill": recorder.memory.peak, "plan": plan.total,
            "scratch": plan.parts["prefill_scratch"]}


def _holds_its_plan(rank: dict) -> None:
    held = rank["loaded"] + rank["prefill"]
    assert abs(held - rank["plan"]) <= 0.05 * rank["plan"], rank
    # not vacuous: without its scratch the plan would miss by more than 5%
    assert rank["scratch"] > 0.1 * rank["plan"] and rank["prefill"] >= 0.9 * rank["scratch"], rank


@pytest.mark.slow
def test_a_load_and_a_long_prefill_hold_what_the_plan_with_its_chunk_says_within_five_percent():
    """One rank, a 96-token prompt in chunks of 48 (the last chunk's indexer scores the widest)."""
    _holds_its_plan(prefill_footprint(None, 96, 48, random.randrange(1 << 30)))


@pytest.mark.slow
def test_four_cpu_ranks_each_hold_their_plan_through_a_long_prefill(tmp_path):
    """Four gloo ranks in lockstep, a 96-token prompt in chunks of 48: each rank's load and prefill against
    its own plan (a quarter of the experts' and heads' weights, its share of the indexer's queries and of
    the residual streams' rows)."""
    for rank in call("tests.test_memory_plan:prefill_footprint", tmp_path, world=4, timeout=600, context=96,
                     chunk=48, seed=random.randrange(1 << 30)):
        _holds_its_plan(rank)
