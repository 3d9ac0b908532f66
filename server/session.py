"""One websocket connection (`Session`), on aiohttp's WebSocketResponse; the box it may hold is
server/box.py's.

Each connection has three tasks: a reader (client frames -> engine calls; it reads from the start, so a
connection queued for the box is seen leaving, and what it sent meanwhile is handled once the box is its
own), a writer (the only place frames are sent: engine events and server frames from one queue, in order,
with `seq` stamped at encoding) and a timer (prefill keepalive, idle timeout). The engine calls `emit` on its
own thread; `loop.call_soon_threadsafe` moves each event into the writer's queue, so the decode loop never
waits on a socket. When the client reads slowly, `send` blocks, events pile up in the queue and the writer sends
them as one merged `delta` (exact per-token `t_ms` kept, nothing dropped). A client that stops reading cannot
hold the box: once one send has waited --send-deadline seconds the timer drops the connection (its request is
cancelled, the box passes on), whatever the writer is doing; and while the writer is behind by more than
MAX_PENDING frames the reader stops reading, so a client that sends (pings) without reading fills its own
socket, not the server's memory.

What cancel does, by stage (`cancel` frame or a dropped connection alike):
- queued in the engine behind another request: the engine starts it, sees the flag before the first
  prefill chunk and answers `started` then `done{cancelled}` with zero output;
- tokenising/validating the prompt: not interruptible (short); the flag is seen right after;
- prefill: the generator checks the flag between chunks, so the engine is free within one chunk;
- decode: checked between cycles, so at most one more token (or one speculative block) arrives;
- after `done`: nothing to cancel; a late cancel for a finished id is ignored.
In every case the request ends with exactly one `done` (finish_reason `cancelled`, partial usage) or
`error`; after a disconnect the writer still consumes that terminal event (metrics), sending nothing.

No client message can end a task: the reader answers a message it cannot handle with an error frame, and the
writer answers a frame it cannot encode with an `internal` error for that request (it cancels the request
and sends the error in place of its terminal frame: still exactly one). Whatever ends the connection, `_end`
runs: the request is cancelled, the box passes on, the timer stops, and the connections gauge goes down (even
when the writer never ends: `abort` is SIGTERM's last resort for a client that does not read, or an engine
that hangs).
"""

import asyncio
import collections
import logging
import threading
import time

from aiohttp import WSMsgType

from appliance.api import Done, Error, Progress, Started, Tokens

from . import protocol as proto
from .box import Running


class _Close:
    def __init__(self, code: int, reason: str):
        self.code = code
        self.reason = reason


_STOP = object()
MAX_PENDING = 256  # frames queued for the writer beyond which the reader waits (what a client sends is answered)
log = logging.getLogger("server.session")


class Session:
    """One websocket connection. `app` is the server (server/app.py's App, passed in rather than imported:
    the app makes sessions) for its state, limits, metrics, engine and the box."""

    def __init__(self, app, ws, transport=None):
        """`ws`: a prepared aiohttp WebSocketResponse; `transport`: its TCP transport (for `abort`)."""
        self.app = app
        self.ws = ws
        self.transport = transport
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
        self.failed: tuple[str, dict] | None = None  # (id, error to send as its terminal frame): see _fail
        self.writer: asyncio.Task | None = None
        self.timer: asyncio.Task | None = None
        self.reader: asyncio.Task | None = None
        self.admitted: bool | None = None  # None while deciding (or queued): what arrives is kept in `early`
        self.closing_bad = False  # a text frame was not UTF-8: closing with 1007, nothing more is read
        self.early: list = []
        self.finished = asyncio.Event()  # set once `_end` has run to the end
        self.sending_since: float | None = None  # when the send in progress began (the timer's deadline)
        self.drained = asyncio.Event()  # the writer has emptied its queue (the reader waits on it when behind)

    # --- lifecycle ---

    async def run(self) -> None:
        app = self.app
        app.sessions.add(self)
        app.metrics.connections.inc()
        try:
            self.writer = asyncio.create_task(self.write_loop())
            self.reader = asyncio.create_task(self.read_loop())
            self.admitted = await self.admit()
            if self.admitted:
                self.timer = asyncio.create_task(self.timer_loop())
                for message in self.early:  # sent while the box was not yet ours
                    self.handle(message)
            self.early.clear()
            await asyncio.wait([self.reader])  # until the connection closes (a refused one: our close)
        finally:
            await self._end()

    async def _end(self) -> None:
        """The connection's cleanup, whatever ended it (a close, a failed task, a cancel of the handler)."""
        app = self.app
        try:
            self.ending = True
            if self.running is not None:  # a dropped connection cancels, prefill included
                self.running.cancel.set()
            else:
                self.out.put_nowait(_STOP)
            app.box.leave(self)
            if self.timer is not None:
                self.timer.cancel()
            if self.reader is not None:
                self.reader.cancel()
            if self.writer is not None:  # ends after the running request's terminal event, if any
                await asyncio.wait([self.writer])  # never raises, even if the writer failed or was cancelled
                if not self.writer.cancelled() and self.writer.exception() is not None:
                    log.error("connection writer failed: %r", self.writer.exception())
        finally:
            app.sessions.discard(self)
            app.metrics.connections.dec()
            self.finished.set()

    def abort(self) -> None:
        """SIGTERM's last resort for a connection that did not end after its close: a writer blocked on a
        client that does not read, or waiting for an engine that never ends the request. Drops the TCP
        connection and stops the writer, so `_end` completes."""
        if self.writer is not None:
            self.writer.cancel()
        if self.transport is not None:
            self.transport.abort()

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
                                        retry_after_ms=app.box.retry_after_ms()))
            self.close(proto.CLOSE_TRY_AGAIN, "busy: one user per box")
            return False
        if len(app.box.waiting) >= app.config.queue_max:
            app.metrics.busy.inc()
            self.send(proto.error_frame("busy", f"{len(app.box.waiting)} connections already wait for this box "
                                        "(--queue-max); retry later", retry_after_ms=app.box.retry_after_ms()))
            self.close(proto.CLOSE_TRY_AGAIN, "busy: the line is full")
            return False
        app.metrics.queued.inc()
        try:
            turn = app.box.wait_for(self)
            await asyncio.wait([turn, self.reader], timeout=app.config.queue_wait_s,
                               return_when=asyncio.FIRST_COMPLETED)  # reader: it left
        finally:
            app.metrics.queued.dec()
        if not turn.done() and not self.reader.done() and app.state == "ready":
            app.box.leave(self)
            app.metrics.busy.inc()
            self.send(proto.error_frame("busy", f"waited {app.config.queue_wait_s:g} s for the box (--queue-wait); "
                                        "retry later", retry_after_ms=app.box.retry_after_ms()))
            self.close(proto.CLOSE_TRY_AGAIN, "busy: waited too long")
            return False
        if not turn.done() or app.state != "ready":
            return False
        self.last_activity = time.monotonic()
        self.send(proto.queued(0))
        return True

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
        """Sends until `_STOP`. One item's failure is logged and the loop goes on: a writer that died would
        leave every later frame (terminal ones, the idle close, SIGTERM's 1012) unsent."""
        while True:
            if self.out.empty():
                self.drained.set()
            items = [await self.out.get()]
            self.drained.clear()
            while not self.out.empty():
                items.append(self.out.get_nowait())
            for item in self._frames(items):
                if item is _STOP:
                    return
                try:
                    if isinstance(item, _Close):
                        await self._close(item)
                    else:
                        await self._send(item)
                except Exception:  # a bug, never a client's doing: log it and keep the connection's order
                    log.exception("connection writer: could not send %s", type(item).__name__)

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
                frames = self._event_frames(events, timings, terminal)
                for frame in frames:
                    frame = self._unless_failed(frame)  # read when sent (lazily): _send may just have failed
                    if frame is not None:
                        yield frame
                events = []
                if terminal and self.ending:
                    yield _STOP
                    return
            if item is not None and not self._stale_keepalive(item):
                yield item

    def _stale_keepalive(self, item) -> bool:
        """A keepalive the timer queued behind its request's terminal event: sent, it would follow `done`."""
        return isinstance(item, dict) and item.get("type") == "progress" and (
            self.running is None or self.running.id != item.get("id"))

    def _event_frames(self, events: list, timings: str, terminal: bool) -> list[dict]:
        try:
            return proto.event_frames(events, timings)
        except Exception as e:  # events the protocol cannot render: the request still ends with one frame
            log.exception("connection writer: could not convert engine events")
            error = proto.error_frame("internal", f"the server could not convert engine events ({type(e).__name__}"
                                      f": {e}); this request is ended: retry it", request_id=events[0].id)
            if terminal:
                return [error]
            self._fail(events[0].id, error)
            return []

    def _fail(self, rid: str, error: dict) -> None:
        """A frame of request `rid` could not be sent: cancel it, drop its later frames, and send `error` in
        place of its terminal frame, so the client hears one terminal frame, when the connection is free for
        its next request (an error sent at once would come while the request still held the connection)."""
        self.failed = (rid, error)
        r = self.running
        if r is not None and r.id == rid:
            r.cancel.set()

    def _unless_failed(self, frame: dict) -> dict | None:
        if self.failed is None or frame.get("id") != self.failed[0]:
            return frame
        if frame["type"] in ("done", "error"):
            error, self.failed = self.failed[1], None
            return error
        return None

    def _account(self, events: list) -> bool:
        r = self.running
        terminal = False
        for ev in events:
            if r is None:
                break
            if isinstance(ev, Started):
                self.failed = None  # a new request: nothing of an earlier one is left to drop
            if r.observe(ev, self.app.metrics):
                self.recent.append(r.id)
                self.running = None
                self.idle.set()
                self.last_activity = time.monotonic()
                terminal = True
        return terminal

    async def _send(self, frame: dict) -> None:
        text, why = self.frames.try_encode(frame)
        if text is not None and frame["type"] == "error":  # every error frame is counted here, engine errors too
            self.app.metrics.errors.labels(frame["error"]["code"]).inc()
        if text is None:
            log.error("connection writer: a %s frame could not be encoded (%s); the request gets an internal "
                      "error instead", frame.get("type"), why)
            error = proto.unencodable(frame, why)
            if frame.get("id") is not None and frame.get("type") not in ("done", "error"):
                self._fail(frame["id"], error)  # sent (and counted) in place of the request's terminal frame
                return
            self.app.metrics.errors.labels("internal").inc()
            text = self.frames.encode(error)
        if self.gone:
            return
        self.sending_since = time.monotonic()
        try:
            await self.ws.send_str(text)
        except (ConnectionError, RuntimeError):  # the connection is closing or gone (or dropped: `stalled`)
            self.gone = True
        finally:
            self.sending_since = None
        self.last_sent = time.monotonic()

    def stalled(self) -> None:
        """The client has not taken a frame for --send-deadline seconds: drop it (a close frame would wait
        behind the frames it does not read), cancel its request; the writer goes on consuming events until
        the request's terminal one, sending nothing."""
        self.app.slow_reader(f"a websocket client took no frame for {self.app.config.send_deadline_s:g} s")
        self.gone = True
        if self.running is not None:
            self.running.cancel.set()
        if self.transport is not None:
            self.transport.abort()

    async def _close(self, c: _Close) -> None:
        """Send the close frame and wait (at most CLOSE_GRACE_S) for the client's before dropping TCP. The
        reader is stopped first: aiohttp's close, called while another task waits in `receive`, drops the
        connection at once, and a client still sending would then lose the close frame to a TCP reset."""
        if self.gone:
            return
        if self.reader is not None and not self.reader.done():
            self.reader.cancel()  # safe: what it had not read yet stays in aiohttp's queue, and close reads it
            await asyncio.wait([self.reader])
        try:
            await self.ws.close(code=c.code, message=c.reason.encode())
        except (ConnectionError, RuntimeError):
            pass
        self.gone = True

    # --- incoming ---

    async def read_loop(self) -> None:
        """Until the connection closes. aiohttp answers what breaks the websocket protocol itself (close 1002,
        1009 beyond its memory bound) and ends the iteration. Text frames come as bytes (decode_text=False):
        one that is not UTF-8 is closed with 1007 here, through the writer, whose close waits for the client's
        (aiohttp's own 1007 would drop the connection at once, and a client still sending could lose the
        close frame to a TCP reset)."""
        try:
            async for msg in self.ws:
                if msg.type not in (WSMsgType.TEXT, WSMsgType.BINARY):
                    break  # ERROR: the library has closed the connection with its code
                while self.out.qsize() > MAX_PENDING and not self.gone:  # the client does not read its answers
                    self.drained.clear()
                    await self.drained.wait()
                self.last_activity = time.monotonic()
                data = msg.data
                if self.closing_bad:
                    continue
                if msg.type == WSMsgType.TEXT:
                    try:
                        data = data.decode("utf-8")
                    except UnicodeDecodeError as e:
                        self.closing_bad = True
                        self.close(proto.CLOSE_INVALID_DATA, f"a text frame that is not UTF-8 (byte {e.start})")
                        continue
                if self.admitted is None:
                    self.early.append(data)
                elif self.admitted:
                    self.handle(data)
        except (ConnectionError, RuntimeError):
            pass

    def handle(self, message) -> None:
        """One client message. Never raises: a message this code fails on (a bug) is still answered, with
        an `internal` error, and the connection goes on."""
        try:
            self._handle(message)
        except Exception as e:
            log.exception("connection reader: could not handle a message")
            self.send(proto.error_frame("internal", f"the server failed on this message ({type(e).__name__}); "
                                        f"it was not run"))

    def _handle(self, message) -> None:
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
                                        retry_after_ms=app.box.retry_after_ms()))
            return
        if app.state != "ready":
            self.send(proto.error_frame("not_ready", f"the server is {app.state}", request_id=req.id or None,
                                        retry_after_ms=1000))
            return
        self.n_requests += 1
        req.id = req.id or f"req-{self.n_requests}"
        self.running = Running(req.id, req.timings, req.max_tokens, threading.Event())
        self.idle.clear()
        app.metrics.running.inc()
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
            if self.sending_since is not None and now - self.sending_since >= cfg.send_deadline_s and not self.gone:
                self.stalled()
                return
            r = self.running
            if r is not None and r.first_t is None and now - self.last_sent >= cfg.keepalive_s:
                self.send(proto.keepalive(r.id, r.processed, r.total, (now - r.submitted) * 1e3))
                self.last_sent = now  # one keepalive per interval even if the writer is blocked
            elif r is None and cfg.idle_timeout_s and now - self.last_activity >= cfg.idle_timeout_s:
                self.close(proto.CLOSE_IDLE, f"idle for {cfg.idle_timeout_s:g} s")
                return
