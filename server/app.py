"""The asyncio layer: it moves decode.v1 frames between websockets and the Engine API, and nothing more.
Parsing, limits and error frames are `server.protocol`; auth and routes are `server.gate`.

One user per box: the connection that holds the box may generate; another connection gets
`hello{state: busy}`, `error{busy}` and close 1013 (or, with `--on-busy queue`, waits in line and hears
`queued{position}` until position 0 means the box is its own). The box passes on when its holder
disconnects, so one user's session (and the prefix of its last request kept in the engine's state) is
never interleaved with another's.

Each connection has three tasks: a reader (client frames -> engine calls), a writer (the only place
frames are sent: engine events and server frames from one queue, in order, with `seq` stamped at
encoding) and a timer (prefill keepalive, idle timeout). The engine calls `emit` on its own thread;
`loop.call_soon_threadsafe` moves each event into the writer's queue, so the decode loop never waits on
a socket. When the client reads slowly, `send` blocks, events pile up in the queue and the writer sends
them as one merged `delta` (exact per-token `t_ms` kept, nothing dropped).

What cancel does, by stage (`cancel` frame or a dropped connection alike):
- queued in the engine behind another request: the engine starts it, sees the flag before the first
  prefill chunk and answers `started` then `done{cancelled}` with zero output;
- tokenising/validating the prompt: not interruptible (short); the flag is seen right after;
- prefill: the generator checks the flag between chunks, so the engine is free within one chunk;
- decode: checked between cycles, so at most one more token (or one speculative block) arrives;
- after `done`: nothing to cancel; a late cancel for a finished id is ignored.
In every case the request ends with exactly one `done` (finish_reason `cancelled`, partial usage) or
`error`; after a disconnect the writer still consumes that terminal event (metrics), sending nothing.
"""

import asyncio
import collections
import logging
import signal
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from websockets.asyncio.server import serve
from websockets.exceptions import ConnectionClosed

from appliance.api import Done, Error, Progress, Started, Tokens

from . import gate, notify
from . import protocol as proto
from .gpu import GpuSampler
from .metrics import CONTENT_TYPE, Metrics

log = logging.getLogger("appliance.server")


@dataclass
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 8765
    token: str | None = None
    origins: tuple[str, ...] = ()
    on_busy: str = "reject"  # reject | queue
    idle_timeout_s: float = 300.0  # a box holder that sends nothing for this long is closed with 4408
    keepalive_s: float = 1.0  # progress keepalive when a prefill has sent nothing for this long (< 2 s)
    drain_s: float = 5.0  # SIGTERM: let the running request finish this long, then cancel it
    nvml: bool = True


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("decode-appliance")
    except PackageNotFoundError:
        return "0+unknown"


# --- one user per box --------------------------------------------------------------------------------


class Box:
    """Who holds the box, and (queue mode) who waits for it, first come first served."""

    def __init__(self):
        self.owner: Session | None = None
        self.waiting: list[tuple[Session, asyncio.Future]] = []

    def try_take(self, s: "Session") -> bool:
        if self.owner is None and not self.waiting:
            self.owner = s
            return True
        return False

    def wait_for(self, s: "Session") -> asyncio.Future:
        fut = asyncio.get_running_loop().create_future()
        self.waiting.append((s, fut))
        s.tell_position(len(self.waiting))
        return fut

    def leave(self, s: "Session") -> None:
        if self.owner is s:
            self.owner = None
        self.waiting = [(w, f) for w, f in self.waiting if w is not s]
        while self.owner is None and self.waiting:
            w, fut = self.waiting.pop(0)
            if not fut.done():
                self.owner = w
                fut.set_result(True)
        for i, (w, _) in enumerate(self.waiting):
            w.tell_position(i + 1)


# --- one connection ----------------------------------------------------------------------------------


@dataclass
class Running:
    id: str
    timings: str
    max_tokens: int
    cancel: threading.Event
    submitted: float
    processed: int = 0
    total: int | None = None
    produced: int = 0
    first_t: float | None = None  # t_ms of the first token
    last_t: float | None = None  # t_ms of the latest token
    gaps: list[float] = field(default_factory=list)


@dataclass
class _Close:
    code: int
    reason: str


_STOP = object()


class Session:
    def __init__(self, app: "App", ws):
        self.app = app
        self.ws = ws
        self.loop = asyncio.get_running_loop()
        self.frames = proto.Frames()
        self.out: asyncio.Queue = asyncio.Queue()
        self.running: Running | None = None
        self.idle = asyncio.Event()
        self.idle.set()
        self.recent: collections.deque[str] = collections.deque(maxlen=16)  # finished ids
        self.last_sent = self.last_activity = time.monotonic()
        self.ending = False
        self.gone = False
        self.position = None
        self.n_requests = 0

    # --- lifecycle ---

    async def run(self) -> None:
        app = self.app
        app.sessions.add(self)
        app.metrics.connections.inc()
        writer = asyncio.create_task(self.write_loop())
        timer = None
        try:
            if await self.admit():
                timer = asyncio.create_task(self.timer_loop())
                await self.read_loop()
            else:
                await self._drain_reads()
        finally:
            self.ending = True
            if self.running is not None:  # a dropped connection cancels, prefill included
                self.running.cancel.set()
            else:
                self.out.put_nowait(_STOP)
            app.box.leave(self)
            if timer is not None:
                timer.cancel()
            await writer  # returns after the running request's terminal event, if any
            app.sessions.discard(self)
            app.metrics.connections.dec()

    async def admit(self) -> bool:
        app = self.app
        if app.state != "ready":
            self.send(proto.hello("loading" if app.state == "loading" else "busy", app.model_name,
                                  app.version, app.limits))
            self.send(proto.error_frame("not_ready", f"the server is {app.state} ({app.status}); retry "
                                        f"when /readyz answers 200", retry_after_ms=1000))
            self.close(proto.CLOSE_TRY_AGAIN, f"not ready: {app.state}")
            return False
        if app.box.try_take(self):
            self.send(proto.hello("ready", app.model_name, app.version, app.limits))
            return True
        self.send(proto.hello("busy", app.model_name, app.version, app.limits))
        if app.config.on_busy != "queue":
            app.metrics.busy.inc()
            self.send(proto.error_frame("busy", "another user holds this box (one user per box); retry later",
                                        retry_after_ms=app.retry_after_ms()))
            self.close(proto.CLOSE_TRY_AGAIN, "busy: one user per box")
            return False
        app.metrics.queued.inc()
        try:
            turn = app.box.wait_for(self)
            closed = asyncio.ensure_future(self.ws.wait_closed())
            await asyncio.wait([turn, closed], return_when=asyncio.FIRST_COMPLETED)
            closed.cancel()
        finally:
            app.metrics.queued.dec()
        if not turn.done() or app.state != "ready":
            return False
        self.last_activity = time.monotonic()
        self.send(proto.queued(0))
        return True

    async def _drain_reads(self) -> None:
        """A refused connection: read until our close completes (the client may still be sending)."""
        try:
            async for _ in self.ws:
                pass
        except ConnectionClosed:
            pass

    # --- outgoing ---

    def send(self, frame: dict) -> None:
        self.out.put_nowait(frame)

    def close(self, code: int, reason: str) -> None:
        self.out.put_nowait(_Close(code, reason))

    def tell_position(self, position: int) -> None:
        if position != self.position:
            self.position = position
            self.send(proto.queued(position))

    def emit(self, event) -> None:
        """Called by the engine thread for each event of this connection's request."""
        try:
            self.loop.call_soon_threadsafe(self.out.put_nowait, event)
        except RuntimeError:  # the loop is gone (process exiting): nobody to tell
            pass

    async def write_loop(self) -> None:
        while True:
            items = [await self.out.get()]
            while not self.out.empty():
                items.append(self.out.get_nowait())
            for item in self._frames(items):
                if item is _STOP:
                    return
                if isinstance(item, _Close):
                    await self._close(item)
                else:
                    await self._send(item)

    def _frames(self, items: list):
        """Server frames pass as they are; each run of engine events is accounted for, then converted
        (adjacent Tokens merged into one delta). A terminal event while the session ends stops the writer."""
        events: list = []
        for item in items + [None]:
            if isinstance(item, Started | Progress | Tokens | Done | Error):
                events.append(item)
                continue
            if events:
                timings = self.running.timings if self.running is not None else "final"
                terminal = self._account(events)
                yield from proto.event_frames(events, timings)
                events = []
                if terminal and self.ending:
                    yield _STOP
                    return
            if item is not None:
                yield item

    def _account(self, events: list) -> bool:
        r = self.running
        terminal = False
        for ev in events:
            if r is None:
                break
            if isinstance(ev, Started):
                r.total, r.processed = ev.prompt_tokens, ev.cached_tokens
            elif isinstance(ev, Progress):
                r.processed, r.total = ev.processed, ev.total
            elif isinstance(ev, Tokens):
                for t in ev.t_ms:
                    if r.last_t is not None:
                        r.gaps.append(t - r.last_t)
                    if r.first_t is None:
                        r.first_t = t
                    r.last_t = t
                r.produced += len(ev.ids)
                self.app.metrics.observe_tokens(r.gaps)
                r.gaps.clear()
            elif isinstance(ev, Done | Error):
                self.app.metrics.observe_end(ev)
                self.app.metrics.running.set(0)
                self.recent.append(r.id)
                self.running = None
                self.idle.set()
                self.last_activity = time.monotonic()
                terminal = True
        return terminal

    async def _send(self, frame: dict) -> None:
        if frame["type"] == "error":  # every error frame is counted here, engine errors included
            self.app.metrics.errors.labels(frame["error"]["code"]).inc()
        text = self.frames.encode(frame)
        if self.gone:
            return
        try:
            await self.ws.send(text)
        except ConnectionClosed:
            self.gone = True
        self.last_sent = time.monotonic()

    async def _close(self, c: _Close) -> None:
        if self.gone:
            return
        try:
            await self.ws.close(c.code, c.reason)
        except ConnectionClosed:
            pass
        self.gone = True

    # --- incoming ---

    async def read_loop(self) -> None:
        try:
            async for message in self.ws:
                self.last_activity = time.monotonic()
                self.handle(message)
        except ConnectionClosed:
            pass

    def handle(self, message) -> None:
        app = self.app
        try:
            cmd = proto.parse(message, app.limits)
        except proto.ProtocolError as e:
            self.send(proto.error_for(e))
            if e.close_code is not None:
                self.close(e.close_code, e.message[:120])
            return
        if isinstance(cmd, proto.Generate):
            self.start(cmd.request)
        elif isinstance(cmd, proto.Cancel):
            self.cancel(cmd.id)
        else:
            self.send(proto.pong(cmd.t, round(time.time() * 1e3, 3)))

    def start(self, req) -> None:
        app = self.app
        if self.running is not None:
            app.metrics.busy.inc()
            self.send(proto.error_frame("busy", f"request {self.running.id!r} is still running on this "
                                        f"connection: wait for its done, or cancel it", request_id=req.id or None,
                                        retry_after_ms=app.retry_after_ms()))
            return
        if app.state != "ready":
            self.send(proto.error_frame("not_ready", f"the server is {app.state}", request_id=req.id or None,
                                        retry_after_ms=1000))
            return
        self.n_requests += 1
        req.id = req.id or f"req-{self.n_requests}"
        self.running = Running(req.id, req.timings, req.max_tokens, threading.Event(), time.monotonic())
        self.idle.clear()
        app.metrics.running.set(1)
        # wait=True: the box is ours, so the engine can only be finishing a cancelled request of the
        # previous holder (within one chunk); this request queues behind it instead of failing.
        app.engine.submit(req, self.emit, self.running.cancel, wait=True)

    def cancel(self, rid: str | None) -> None:
        r = self.running
        if r is not None and rid in (None, r.id):
            r.cancel.set()
        elif rid is not None and rid not in self.recent:
            now = f"running: {r.id!r}" if r else "nothing is running"
            self.send(proto.error_frame("invalid_request", f"cancel id={rid!r}: no such request ({now})",
                                        param="id"))

    # --- timers ---

    async def timer_loop(self) -> None:
        cfg = self.app.config
        tick = min(0.25, cfg.keepalive_s / 4)
        while True:
            await asyncio.sleep(tick)
            now = time.monotonic()
            r = self.running
            if r is not None and r.first_t is None and now - self.last_sent >= cfg.keepalive_s:
                self.send(proto.keepalive(r.id, r.processed, r.total, (now - r.submitted) * 1e3))
                self.last_sent = now  # one keepalive per interval even if the writer is blocked
            elif r is None and cfg.idle_timeout_s and now - self.last_activity >= cfg.idle_timeout_s:
                self.close(proto.CLOSE_IDLE, f"idle for {cfg.idle_timeout_s:g} s")
                return


# --- the server --------------------------------------------------------------------------------------


class App:
    """The process: HTTP routes, sessions, the engine once loaded, readiness, systemd notify, SIGTERM."""

    def __init__(self, config: ServerConfig, load_engine: Callable, say: Callable[[str], None] | None = None,
                 handle_signals: bool = True):
        self.config = config
        self.handle_signals = handle_signals  # off when embedded (tests): signals belong to the main thread
        self.load_engine = load_engine  # (status callback) -> Engine; runs on a thread
        self.say = say or (lambda m: print(f"appliance: {m}", file=sys.stderr, flush=True))
        self.metrics = Metrics()
        self.box = Box()
        self.sessions: set[Session] = set()
        self.engine = None
        self.state = "loading"  # loading | ready | draining | failed
        self.status = "starting"
        self.limits = proto.Limits.for_engine(1, 1)
        self.model_name = ""
        self.version = _version()
        self.server = None
        self.port: int | None = None
        self.stopping = None
        self.gpu: GpuSampler | None = None
        self.load_error: BaseException | None = None

    # --- HTTP ---

    def process_request(self, connection, request):
        path = request.path.split("?", 1)[0]
        if path == "/healthz":
            return connection.respond(200, "ok\n")
        if path == "/readyz":
            if self.state == "ready":
                return connection.respond(200, "ready\n")
            return connection.respond(503, f"{self.state}: {self.status}\n")
        if path == "/metrics":
            if self.engine is not None:
                self.metrics.heartbeat_age.set(max(0.0, time.monotonic() - self.engine.heartbeat))
            resp = connection.respond(200, self.metrics.exposition().decode())
            del resp.headers["Content-Type"]
            resp.headers["Content-Type"] = CONTENT_TYPE
            return resp
        verdict = gate.check_upgrade(request.path, request.headers, self.config.token, self.config.origins)
        if verdict.status is not None:
            if verdict.status == 401:
                self.metrics.errors.labels("unauthorized").inc()
            resp = connection.respond(verdict.status, verdict.text)
            if verdict.www_authenticate:
                resp.headers["WWW-Authenticate"] = 'Bearer realm="decode-appliance"'
            return resp
        # Read no message longer than a prompt that fills the context (close 1009 beyond).
        connection.protocol.max_message_size = self.limits.max_message_bytes
        return None

    @staticmethod
    def select_subprotocol(connection, offered):
        return gate.select_subprotocol(offered)

    async def handle(self, ws) -> None:
        await Session(self, ws).run()

    def retry_after_ms(self) -> int:
        owner = self.box.owner
        r = owner.running if owner is not None else None
        if r is not None and r.produced >= 2 and r.first_t is not None and r.last_t is not None:
            per_token = (r.last_t - r.first_t) / (r.produced - 1)
            return int(min(60000, max(100, (r.max_tokens - r.produced) * per_token + 100)))
        return 1000

    # --- lifecycle ---

    async def main(self) -> int:
        loop = asyncio.get_running_loop()
        self.stopping = loop.create_future()
        if self.handle_signals:
            for sig in (signal.SIGTERM, signal.SIGINT):
                loop.add_signal_handler(sig, self.request_stop)
        cfg = self.config
        self.server = await serve(self.handle, cfg.host, cfg.port, process_request=self.process_request,
                                  select_subprotocol=self.select_subprotocol, compression=None,
                                  max_size=self.limits.max_message_bytes, server_header=f"decode-appliance/"
                                  f"{self.version}")
        self.port = self.server.sockets[0].getsockname()[1]
        self.say(f"listening on ws://{cfg.host}:{self.port}{proto.PATH} (loading the model; /readyz is 503 "
                 f"until it is ready)")
        if cfg.nvml:
            self.gpu = GpuSampler(self.metrics.registry)
            if not self.gpu.start():
                self.gpu = None
        wd = notify.watchdog_interval_s()
        if not await self._load(loop, wd is not None):
            return await self._stop(1 if self.state == "failed" else 0)
        self.state, self.status = "ready", "ready"
        self.metrics.ready.set(1)
        info = self.engine.info
        notify.notify("READY=1", f"STATUS=ready: {info.model} on {info.device}, max context {info.max_context}")
        self.say(f"ready: {info.model} ({info.family}) on {info.device}, max context {info.max_context}, "
                 f"draft {info.draft}")
        pinger = asyncio.create_task(self._watchdog(wd)) if wd else None
        await self.stopping
        code = await self._stop(0)
        if pinger is not None:
            pinger.cancel()
        return code

    async def _load(self, loop, watchdog: bool) -> bool:
        watch = notify.LoadWatch(watchdog=watchdog).start()

        def status(message: str) -> None:
            self.status = message
            watch.update(message)

        result: asyncio.Future = loop.create_future()

        def settle(engine, error):
            if not result.done():
                result.set_exception(error) if error is not None else result.set_result(engine)

        def work():
            try:
                engine = self.load_engine(status)
            except BaseException as e:  # reported on the loop; the thread must not die silently
                loop.call_soon_threadsafe(settle, None, e)
                return
            loop.call_soon_threadsafe(settle, engine, None)

        # A daemon thread, not an executor: SIGTERM during a long load must not wait for it.
        threading.Thread(target=work, name="engine-load", daemon=True).start()
        try:
            await asyncio.wait([result, self.stopping], return_when=asyncio.FIRST_COMPLETED)
        finally:
            watch.stop()
        if not result.done():
            return False
        if result.exception() is not None:
            self.state, self.status = "failed", f"load failed: {result.exception()}"
            self.load_error = result.exception()
            return False
        self.engine = result.result()
        info = self.engine.info
        self.model_name = info.model
        self.limits = proto.Limits.for_engine(info.max_context, info.vocab_size)
        return True

    async def _watchdog(self, interval_s: float) -> None:
        dog = notify.Watchdog(interval_s)
        while True:
            notify.notify(*dog.tick(self.engine.heartbeat))
            await asyncio.sleep(dog.period_s)

    def request_stop(self) -> None:
        if self.stopping is not None and not self.stopping.done():
            self.stopping.set_result(None)

    async def _stop(self, code: int) -> int:
        """SIGTERM: stop accepting, let the running request finish for `drain_s` then cancel it, close every
        connection with 1012, release the engine. Returns the exit code."""
        failed = self.state == "failed"
        self.state, self.status = ("failed" if failed else "draining"), ("load failed" if failed else "draining")
        self.metrics.ready.set(0)
        notify.notify("STOPPING=1", f"STATUS={self.status}",
                      f"EXTEND_TIMEOUT_USEC={int((self.config.drain_s + 30) * 1e6)}")
        self.say("stopping: no new connections; draining the running request")
        self.server.close(close_connections=False)
        owner = self.box.owner
        if owner is not None and owner.running is not None:
            try:
                await asyncio.wait_for(owner.idle.wait(), self.config.drain_s)
            except TimeoutError:
                if owner.running is not None:
                    owner.running.cancel.set()
                await owner.idle.wait()
        for s in list(self.sessions):
            s.close(proto.CLOSE_RESTART, "server restart")
        await self.server.wait_closed()
        if self.engine is not None:
            await asyncio.get_running_loop().run_in_executor(None, self.engine.close)
        if self.gpu is not None:
            self.gpu.stop()
        self.say("stopped")
        return code


def run(config: ServerConfig, load_engine: Callable) -> int:
    """Serve until SIGTERM/SIGINT; the exit code (0 after a clean drain)."""
    logging.basicConfig(level=logging.WARNING, format="appliance: %(name)s: %(message)s", stream=sys.stderr)
    app = App(config, load_engine)
    code = asyncio.run(app.main())
    if app.load_error is not None:
        raise app.load_error
    return code
