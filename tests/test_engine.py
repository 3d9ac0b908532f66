"""The Engine API: requests in, events out, driven from another thread; cancel reaches a running prefill;
a multi-turn prompt reuses the previous state; limits are checked before any work."""

import json
import subprocess
import sys
import threading

import pytest

from appliance.api import ChatRequest, Done, Error, Progress, Request, Started
from appliance.engine import Engine
from appliance.errors import MemoryPlanError
from appliance.options import RunOptions


@pytest.fixture(scope="module")
def engine():
    e = Engine.load(RunOptions(chunk=16))
    yield e
    e.close()


def ids_of(events):
    return [i for e in events for i in getattr(e, "ids", [])]


def test_engine_greedy_output_equals_appliance_generate(engine, tmp_path):
    prompt = list(range(20, 60))
    (tmp_path / "ids.json").write_text(json.dumps(prompt))
    p = subprocess.run([sys.executable, "-m", "appliance", "generate", "--ids", str(tmp_path / "ids.json"),
                        "--max-tokens", "12", "--ignore-eos", "--json"], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    events = list(engine.generate(Request(id="a", input_ids=prompt, max_tokens=12, ignore_eos=True)))
    assert isinstance(events[0], Started) and isinstance(events[-1], Done)
    assert ids_of(events) == json.loads(p.stdout)["ids"]


def test_generate_from_another_thread_streams_events_without_blocking_the_caller(engine):
    seen, done, gate = [], threading.Event(), threading.Event()

    def emit(event):
        gate.wait(30)  # the engine thread is held here until the caller has its answer back
        seen.append(event)
        if isinstance(event, (Done, Error)):
            done.set()

    engine.wait_idle()  # a request before this one may still be filing its conversation in the prefix cache
    engine.submit(Request(id="b", input_ids=[5] * 30, max_tokens=6, ignore_eos=True), emit)
    assert not seen  # submit came back while the request's events were still held: it did not run them
    gate.set()
    assert done.wait(60)
    assert isinstance(seen[-1], Done) and len(ids_of(seen)) == 6


def test_cancel_during_a_long_prefill_stops_within_one_chunk_and_the_next_request_works(engine):
    cancel = threading.Event()
    prompt = [7] * 2000  # 125 chunks of 16
    events = []
    for event in engine.generate(Request(id="long", input_ids=prompt, max_tokens=4), cancel):
        events.append(event)
        if isinstance(event, Progress) and event.processed >= 64:
            cancel.set()
    progress = [e.processed for e in events if isinstance(e, Progress)]
    assert events[-1].finish_reason == "cancelled" and events[-1].usage["completion_tokens"] == 0
    assert max(progress) <= 64 + 16  # at most one more chunk ran after the cancel
    after = list(engine.generate(Request(id="next", input_ids=[9, 8, 7, 6], max_tokens=5, ignore_eos=True)))
    cold = Engine.load(RunOptions(chunk=16), warmup=False)
    try:
        want = list(cold.generate(Request(id="cold", input_ids=[9, 8, 7, 6], max_tokens=5, ignore_eos=True)))
    finally:
        cold.close()
    assert ids_of(after) == ids_of(want)


def test_a_multi_turn_prompt_reuses_the_state_and_matches_a_cold_run(engine):
    first = list(range(100, 140))
    turn1 = list(engine.generate(Request(id="t1", input_ids=first, max_tokens=8, ignore_eos=True)))
    second = first + ids_of(turn1) + list(range(200, 210))
    turn2 = list(engine.generate(Request(id="t2", input_ids=second, max_tokens=8, ignore_eos=True)))
    started = turn2[0]
    assert started.cached_tokens >= len(first) + 7  # everything but the last generated token was kept
    assert turn2[-1].usage["cached_tokens"] == started.cached_tokens
    cold = Engine.load(RunOptions(chunk=16), warmup=False)
    try:
        want = list(cold.generate(Request(id="c", input_ids=second, max_tokens=8, ignore_eos=True)))
    finally:
        cold.close()
    assert want[0].cached_tokens == 0 and ids_of(turn2) == ids_of(want)


def test_a_request_over_the_context_limit_is_refused_before_any_work(engine):
    limit = engine.info.max_context
    events = list(engine.generate(Request(id="big", input_ids=[3] * (limit - 10), max_tokens=20)))
    assert len(events) == 1 and isinstance(events[0], Error)
    assert events[0].code == "context_length_exceeded" and "max_tokens" in events[0].message


def test_a_memory_plan_that_cannot_fit_names_the_part_and_the_shortfall():
    with pytest.raises(MemoryPlanError) as e:
        Engine.load(RunOptions(context=4000), warmup=False, memory_budget=10_000)
    assert "decode_state" in str(e.value) and "short by" in str(e.value)


def test_a_prompt_that_is_not_unicode_is_invalid_request_and_keeps_the_cached_prefix(engine):
    text = "Zebras and yaks walked over the quiet hills"
    list(engine.generate(Request(id="u1", prompt=text, max_tokens=2)))
    for bad in (Request(id="u2", prompt=text + "\ud800", max_tokens=2),
                Request(id="u3", chat=ChatRequest([{"role": "user", "content": "\udfff"}]), max_tokens=2)):
        events = list(engine.generate(bad))
        assert len(events) == 1 and isinstance(events[0], Error) and events[0].code == "invalid_request", events
        assert events[0].param in ("prompt", "messages[0].content")
    again = list(engine.generate(Request(id="u4", prompt=text + " at dawn", max_tokens=2)))
    assert isinstance(again[0], Started) and again[0].cached_tokens > 0  # an engine fault would have reset it
