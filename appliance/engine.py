"""The Engine API: the one narrow waist between the server (or CLI) and the model.

    engine = Engine.load(RunOptions(model_dir=..., devices="0,1,2,3", draft="dspark"))
    for event in engine.generate(Request(...), cancel):   # Started, Progress*, Tokens*, Done | Error
        ...

One engine thread owns the device and all decode state; requests reach it through a queue, and events
come back through a callback or the iterator `generate` returns. Neither call blocks the caller's thread
on device work: `submit` returns at once, and `generate` only waits on its own event queue. Only one
request runs at a time (one user per box); `submit` while busy is refused with `busy` unless queueing is
asked for.

Cancellation: `cancel.set()` stops a prefill between chunks and a decode between cycles; the request
then ends with `Done(finish_reason="cancelled")` and the engine is free for the next request.
"""

import queue
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from appliance.decode.loop import RequestLoop
from appliance.decode.session import DecodeSession
from appliance.measure.memory import plan_context
from appliance.parallel.world import start

from .api import Done, Error, Progress, Request, Started, Tokens
from .errors import ApplianceError
from .loader import load_model
from .options import RunOptions

HEARTBEAT_IDLE_S = 1.0  # an idle engine thread still advances `heartbeat` this often


@dataclass
class EngineInfo:
    """What the server tells clients about the model (no tensors)."""

    model: str
    family: str
    max_context: int
    vocab_size: int
    draft: str
    device: str


@dataclass
class _Job:
    request: Request
    cancel: threading.Event
    emit: Callable
    submitted: float = field(default_factory=time.perf_counter)


class Engine:
    def __init__(self, loop: RequestLoop, info: EngineInfo, warmup: bool = True):
        self.loop = loop
        self.session = loop.session
        self.info = info
        self._inbox: queue.Queue[_Job | None] = queue.Queue()
        self._running: _Job | None = None
        self.heartbeat = time.monotonic()  # advanced by the engine thread whenever it makes progress
        self.ready = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="engine", daemon=True)
        self._thread.start()
        if warmup:
            self._warmup()
        self.ready.set()

    # --- construction --------------------------------------------------------------------------------

    @classmethod
    def load(cls, options: RunOptions, warmup: bool = True, status: Callable[[str], None] | None = None,
             memory_budget: int | None = None) -> "Engine | None":
        """Read config and weights, check the memory plan (against `memory_budget` bytes when given, else
        the device's memory), build the decode state, capture the cycle, warm up. `status` hears progress.
        On ranks 1..n-1 of a split model there is no engine: the rank runs rank 0's jobs until rank 0
        closes its engine, then returns None (its command is done)."""
        say = status or (lambda m: None)
        world = start(options.devices)
        say("loading weights" + (f" (rank {world.rank} of {world.size})" if world.distributed else ""))
        lm = load_model(options, notice=say, world=world)
        capacity = plan_context(lm, options.context, memory_budget)
        say(f"allocating decode state for {capacity} tokens")
        session = DecodeSession(lm, options, capacity=capacity, notice=say)
        info = EngineInfo(model=Path(lm.model_dir).name, family=lm.cfg.family, max_context=capacity,
                          vocab_size=lm.cfg.vocab_size, draft=options.draft, device=options.devices)
        if not world.main:
            session.follow()  # the other ranks run rank 0's jobs in lockstep until it stops
            return None
        say("warming up")
        return cls(RequestLoop(session, lm.tokenizer, lm.model_dir), info, warmup=warmup)

    def _warmup(self) -> None:
        """One real generation end to end (readiness means a request has gone through); as a job that leaves
        nothing behind on any rank (not filed in the prefix cache, the state reset at its end)."""
        req = Request(id="warmup", input_ids=[self.session.cfg.bos_token_id] * 4, max_tokens=2, ignore_eos=True)
        events = queue.Queue()
        with self.session.warming():  # read by the engine thread when the job starts, before its Done
            self._inbox.put(_Job(req, threading.Event(), events.put))
            while not isinstance(event := events.get(), Done | Error):
                pass
            self.wait_idle()  # the engine thread ends the job after its Done
        if not isinstance(event, Done):
            raise ApplianceError(f"warm-up generation failed: {event}", code="internal")

    # --- requests ------------------------------------------------------------------------------------

    @property
    def busy(self) -> bool:
        return self._running is not None or not self._inbox.empty()

    def wait_idle(self, timeout: float = 60.0) -> None:
        """Until the engine thread has finished its requests (after a Done it still files the conversation in
        the prefix cache): for callers that touch the session directly (warm-up, tests, benchmarks)."""
        deadline = time.monotonic() + timeout
        while self.busy and time.monotonic() < deadline:
            time.sleep(0.001)

    def submit(self, request: Request, emit: Callable, cancel: threading.Event | None = None,
               wait: bool = False) -> threading.Event:
        """Queue a request; `emit(event)` is called from the engine thread for each event. Returns the
        cancel event. Without `wait`, a busy engine answers at once with Error(code="busy")."""
        cancel = cancel or threading.Event()
        if not wait and self.busy:
            emit(Error(request.id, "busy", "another generation is running on this box", retryable=True))
            return cancel
        self._inbox.put(_Job(request, cancel, emit))
        return cancel

    def generate(self, request: Request, cancel: threading.Event | None = None, wait: bool = True) -> Iterator:
        """Blocking iterator over the request's events (for the CLI, tests and benchmarks)."""
        events: queue.Queue = queue.Queue()
        self.submit(request, events.put, cancel, wait=wait)
        while True:
            event = events.get()
            yield event
            if isinstance(event, (Done, Error)):
                return

    def stats(self) -> dict:
        """Counters the server exports (no tensors): the prefix cache's disk tier failures by operation."""
        return {"prefix_cache_disk_errors": getattr(self.session, "disk_errors", {})}

    def count_tokens(self, request: Request) -> int:
        """The prompt's length in tokens as a run would encode it, without running it: on the caller's thread
        (only the tokenizer and the chat encoder). Raises ApplianceError naming the field."""
        request.validate()
        return len(self.loop.encode(request)[0])

    def close(self) -> None:
        if self._running is not None:
            self._running.cancel.set()
        self._inbox.put(None)
        self._thread.join(timeout=30)
        world = self.session.world
        if world is not None and world.distributed:
            world.publish(None)  # the other ranks' `follow` ends
            world.stop()

    # --- the engine thread ---------------------------------------------------------------------------

    def _loop(self) -> None:
        while True:
            try:
                job = self._inbox.get(timeout=HEARTBEAT_IDLE_S)
            except queue.Empty:  # idle and responsive: the heartbeat (systemd's watchdog) keeps advancing
                self.heartbeat = time.monotonic()
                continue
            if job is None:
                return
            self._running = job
            try:
                self._serve(job)
            finally:
                self._running = None
                self.heartbeat = time.monotonic()

    def _serve(self, job: _Job) -> None:
        queue_ms = (time.perf_counter() - job.submitted) * 1e3
        ended = False
        try:
            for event in self.loop.run(job.request, job.cancel):
                self.heartbeat = time.monotonic()
                if isinstance(event, Done):
                    event.timings["queue_ms"] = queue_ms
                ended = ended or isinstance(event, Done | Error)
                job.emit(event)
        except Exception as e:  # an engine fault must still end the request with exactly one Error
            self.session.reset()
            fault = f"engine fault: {type(e).__name__}: {e}"
            if ended:  # the request had its one terminal event: the fault is the log's
                self.session.notice(f"after request {job.request.id!r} ended: {fault}")
            else:
                job.emit(Error(job.request.id, "internal", fault))


__all__ = ["Engine", "EngineInfo", "RunOptions", "Request", "Started", "Progress", "Tokens", "Done", "Error"]
