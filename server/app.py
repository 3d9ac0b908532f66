"""The asyncio layer, on aiohttp: one port for the decode.v1 websocket, the OpenAI- and Anthropic-compatible
HTTP API (JSON and SSE) and the health and metrics routes. It moves bytes between clients and the Engine
API, and nothing more. Parsing, limits and error frames are `server.protocol`; auth and routes are
`server.gate`; one websocket connection is a `server.session.Session`; one API call is `server.http_api`.

Why aiohttp: the `websockets` library, which served decode.v1 alone, cannot read a request body, so it
cannot take a POST. aiohttp (aio-libs, maintained since 2013) has the HTTP server, the websocket server and
the streaming client (the probe's `--api openai`) in one library on plain asyncio: decode.v1 keeps its
frames byte for byte, its close codes and its one-writer-per-connection design, and no ASGI layer sits
between a token and its socket (ASGI would add a message dict and a task switch per frame).

One user per box: the connection (or the API call) that holds the box may generate; another connection
gets `hello{state: busy}`, `error{busy}` and close 1013, another API call HTTP 429 with Retry-After (or,
with `--on-busy queue`, either waits in line; a connection hears `queued{position}` until position 0
means the box is its own). The box passes on when its holder disconnects or its call ends, so one user's
session (and the prefix of its last request kept in the engine's state) is never interleaved with
another's.

Lifecycle: bind the port first (so /healthz answers and /readyz says 503 during the load), load the engine
on a thread, then READY=1; SIGTERM drains (see `App._stop`), and the process exits within `drain_s +
STOP_BOUND_S` whatever its connections and its engine do.
"""

import asyncio
import logging
import signal
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from aiohttp import web

from . import gate, http_api, notify
from . import protocol as proto
from .box import Box
from .gpu import GpuSampler
from .incidents import Incidents
from .metrics import CONTENT_TYPE, Metrics
from .responses_api import ResponseStore
from .session import Session


@dataclass
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 8765
    token: str | None = None
    origins: tuple[str, ...] = ()
    on_busy: str = "queue"  # queue | reject: one user's agent sends side requests while a turn streams
    queue_max: int = 16  # --on-busy queue: the most requests waiting in line (then busy)
    queue_wait_s: float = 600.0  # --on-busy queue: the longest a request waits for its turn (then busy)
    idle_timeout_s: float = 300.0  # a box holder that sends nothing for this long is closed with 4408
    keepalive_s: float = 1.0  # progress keepalive when a prefill has sent nothing for this long (< 2 s)
    sse_keepalive_s: float = 5.0  # an SSE stream silent this long gets a comment (OpenAI) or a ping (Anthropic)
    send_deadline_s: float = 30.0  # a client whose socket takes a write no sooner is dropped, its request cancelled
    header_timeout_s: float = 30.0  # a connection sends a whole request's headers within this, or is closed
    body_timeout_s: float = 30.0  # a request's body arrives within this after its headers, or 408
    max_connections: int = 256  # open connections at once (one user; more are refused with 503)
    drain_s: float = 5.0  # SIGTERM: let the running request finish this long, then cancel it
    nvml: bool = True
    metrics_auth: bool = True  # with a token configured, /metrics asks for it too (--no-metrics-auth: open)
    model_name: str | None = None  # the model id the HTTP API answers with (default: the model directory's name)


# SIGTERM's bounds after the drain (seconds): the engine sees a cancel within one prefill chunk or decode
# cycle; a client answers a close handshake at once; a connection that does neither is dropped.
CANCEL_GRACE_S = 5.0
CLOSE_GRACE_S = 2.0
ABORT_GRACE_S = 1.0
ENGINE_CLOSE_S = 5.0
STOP_BOUND_S = CANCEL_GRACE_S + CLOSE_GRACE_S + 2 * ABORT_GRACE_S + ENGINE_CLOSE_S
log = logging.getLogger("server.app")


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("decode-appliance")
    except PackageNotFoundError:
        return "0+unknown"


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
        self.calls: set = set()  # HTTP API calls in progress (http_api.ApiCall), for the drain
        self.settling: set = set()  # API calls' reads of a cancelled request's end, past their handler
        self.responses = ResponseStore()  # /v1/responses kept for previous_response_id
        self.slow_body = Incidents(self.metrics, "slow_body", "request bodies that did not arrive in time (408)")
        self.slow_reader = Incidents(self.metrics, "slow_reader", "dropped clients that stopped reading (their "
                                     "requests cancelled)")
        self.engine = None
        self.state = "loading"  # loading | ready | draining | failed
        self.status = "starting"
        self.limits = proto.Limits.for_engine(1, 1)
        self.model_name = ""
        self.version = _version()
        self.started_at = time.time()
        self.runner: web.AppRunner | None = None
        self.port: int | None = None
        self.stopping = None
        self.gpu: GpuSampler | None = None
        self.load_error: BaseException | None = None

    # --- HTTP ---

    async def dispatch(self, request: web.BaseRequest) -> web.StreamResponse:
        """Every request: the API (every path under /v1/ but the websocket's, answered in the API's shape),
        then the method check, the health routes, or the websocket upgrade."""
        path = gate.split_target(request.raw_path)[0]
        if path.startswith(gate.API_PREFIX) and path != proto.PATH:
            return await http_api.handle(self, request, path)
        verdict = gate.check_method(request.method, path)
        if verdict.status is None:
            verdict = self._route(path, request)
        if verdict.status is None:
            return await self._websocket(request)
        if verdict.status == 401:
            self.metrics.errors.labels("unauthorized").inc()
        return self.respond(verdict)

    def _route(self, path: str, request) -> gate.Verdict:
        if path == "/healthz":  # 200 while the process lives, SIGTERM's drain included
            return gate.Verdict(200, "ok\n")
        if path == "/readyz":
            return gate.Verdict(200, "ready\n") if self.state == "ready" else gate.Verdict(
                503, f"{self.state}: {self.status}\n")
        if path == "/metrics":
            if self.config.metrics_auth:
                verdict = gate.check_token(request.headers, self.config.token)
                if verdict.status is not None:
                    return verdict
            if self.engine is not None:
                self.metrics.heartbeat_age.set(max(0.0, time.monotonic() - self.engine.heartbeat))
                self.metrics.engine_stats(self.engine.stats())
            return gate.Verdict(200, self.metrics.exposition().decode(), content_type=CONTENT_TYPE)
        verdict = gate.check_upgrade(request.raw_path, request.headers, self.config.token, self.config.origins)
        if verdict.status is None and self.state == "draining":
            return gate.Verdict(503, "the server is stopping (SIGTERM): connect again when /readyz answers 200\n")
        return verdict

    async def _websocket(self, request) -> web.StreamResponse:
        # A message over limits.max_message_bytes (a prompt that fills the context) is refused by the protocol
        # with an error frame and a close 1009 that waits for the client's close. aiohttp's own limit, far
        # above, only bounds memory: it closes at once, and a client still sending may then lose the close
        # frame to a TCP reset.
        ws = web.WebSocketResponse(protocols=(proto.PROTOCOL,), max_msg_size=4 * self.limits.max_message_bytes,
                                   compress=False, timeout=CLOSE_GRACE_S, decode_text=False)
        if not ws.can_prepare(request).ok:
            resp = self.respond(gate.Verdict(426, f"{proto.PATH} is a websocket (subprotocol {proto.PROTOCOL}): "
                                                  f"send an upgrade request\n"))
            resp.headers["Upgrade"] = "websocket"
            return resp
        await ws.prepare(request)
        await Session(self, ws, request.transport).run()
        return ws

    @staticmethod
    def respond(verdict: gate.Verdict) -> web.Response:
        """A Verdict as an HTTP answer (HEAD: aiohttp sends its headers, Content-Length included, no body)."""
        # backslashreplace: a header value echoed in the text may hold what UTF-8 cannot encode
        body = verdict.text.encode("utf-8", "backslashreplace")
        resp = web.Response(status=verdict.status, body=body,
                            headers={"Content-Type": verdict.content_type or "text/plain; charset=utf-8"})
        if verdict.www_authenticate:
            resp.headers["WWW-Authenticate"] = 'Bearer realm="decode-appliance"'
        if verdict.allow:
            resp.headers["Allow"] = ", ".join(verdict.allow)
        resp.headers.update(verdict.headers)
        return resp

    async def _server_header(self, request, response) -> None:
        """On every reply: the Server header; on the API's, the CORS headers of an allowed browser origin."""
        response.headers["Server"] = f"decode-appliance/{self.version}"
        if request.path.startswith(gate.API_PREFIX) and "Access-Control-Allow-Origin" not in response.headers:
            response.headers.update(gate.cors(request.headers, self.config.origins))

    # --- lifecycle ---

    async def main(self) -> int:
        loop = asyncio.get_running_loop()
        self.stopping = loop.create_future()
        if self.handle_signals:
            for sig in (signal.SIGTERM, signal.SIGINT):
                loop.add_signal_handler(sig, self.request_stop)
        cfg = self.config
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", self.dispatch)
        app.on_response_prepare.append(self._server_header)
        # handler_cancellation: a client that disconnects cancels its handler at once, which cancels its
        # request (between two prefill chunks or decode cycles), as a dropped websocket does.
        # keepalive_timeout: a connection closes when it has sent no whole request's headers for this long (a
        # silent socket, headers at a byte a second) or stayed idle as long after its last reply
        self.runner = web.AppRunner(app, handle_signals=False, handler_cancellation=True, access_log=None,
                                    shutdown_timeout=ABORT_GRACE_S / 2, keepalive_timeout=cfg.header_timeout_s)
        await self.runner.setup()
        await CappedSite(self.runner, cfg.host, cfg.port, cfg.max_connections,
                         Incidents(self.metrics, "over_cap", "refusing connections over --max-connections")).start()
        self.port = self.runner.addresses[0][1]
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
            """The engine's progress while it loads (readiness text, systemd STATUS) and its notices ever
            after (the prefix cache's files and disk tier): each one a line in the log."""
            self.say(message)
            if self.state == "loading":
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
        self.model_name = self.config.model_name or info.model
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
        """SIGTERM: refuse new websocket connections and API calls (HTTP 503; /healthz still answers 200 and
        /readyz 503), let the running request finish for `drain_s` then cancel it, close every connection with
        1012, stop listening, release the engine. Each step after the drain is bounded (STOP_BOUND_S in all), so a
        client that does not read or an engine that hangs cannot hold the process. Returns the exit code."""
        failed = self.state == "failed"
        self.state, self.status = ("failed" if failed else "draining"), ("load failed" if failed else "draining")
        self.metrics.ready.set(0)
        notify.notify("STOPPING=1", f"STATUS={self.status}",
                      f"EXTEND_TIMEOUT_USEC={int((self.config.drain_s + STOP_BOUND_S + 30) * 1e6)}")
        self.say("stopping: no new connections; draining the running request")
        await self._drain()
        await self._close_sessions()
        if not await _within(self.runner.cleanup(), ABORT_GRACE_S):
            log.warning("stopping: the listener did not close within %g s", ABORT_GRACE_S)
        if self.engine is not None and not await _in_thread(self.engine.close, ENGINE_CLOSE_S):
            log.warning("stopping: the engine did not close within %g s; exiting without it", ENGINE_CLOSE_S)
        if self.gpu is not None:
            self.gpu.stop()
        self.say("stopped")
        return code

    async def _drain(self) -> None:
        """Let running requests finish for `drain_s`, then cancel them and wait CANCEL_GRACE_S more."""
        busy = [s for s in (*self.sessions, *self.calls) if s.running is not None]
        if not busy or await _within(_all(s.idle.wait() for s in busy), self.config.drain_s):
            return
        for s in busy:
            if s.running is not None:
                s.running.cancel.set()
        if not await _within(_all(s.idle.wait() for s in busy), CANCEL_GRACE_S):
            log.warning("stopping: the engine did not end a cancelled request within %g s", CANCEL_GRACE_S)

    async def _close_sessions(self) -> None:
        """Close every connection with 1012; abort those that have not ended CLOSE_GRACE_S later."""
        sessions = list(self.sessions)
        for s in sessions:
            s.close(proto.CLOSE_RESTART, "server restart")
        if await _within(_all(s.finished.wait() for s in sessions), CLOSE_GRACE_S):
            return
        stuck = [s for s in sessions if not s.finished.is_set()]
        log.warning("stopping: %d connection(s) did not close within %g s; dropping them", len(stuck),
                    CLOSE_GRACE_S)
        for s in stuck:
            s.abort()
        await _within(_all(s.finished.wait() for s in stuck), ABORT_GRACE_S)


async def _all(awaitables) -> None:
    aws = [asyncio.ensure_future(a) for a in awaitables]
    try:
        if aws:
            await asyncio.wait(aws)
    finally:  # timed out: leave no waiter behind
        for a in aws:
            a.cancel()


async def _within(awaitable, timeout_s: float) -> bool:
    """Await for at most `timeout_s`; False (and the awaitable cancelled) when it took longer."""
    try:
        await asyncio.wait_for(awaitable, timeout_s)
        return True
    except TimeoutError:
        return False


async def _in_thread(fn: Callable, timeout_s: float) -> bool:
    """Run `fn` on a daemon thread, waiting at most `timeout_s` (an executor thread would hold up the exit of
    `asyncio.run` if `fn` hangs). False when it did not return in time."""
    loop = asyncio.get_running_loop()
    done = loop.create_future()

    def work():
        try:
            fn()
        except BaseException as e:  # reported, never lost with the thread
            log.warning("stopping: %r failed: %r", fn, e)
        try:
            loop.call_soon_threadsafe(lambda: done.done() or done.set_result(None))
        except RuntimeError:  # the loop closed while we ran: nobody waits any more
            pass

    threading.Thread(target=work, name="engine-close", daemon=True).start()
    return await _within(done, timeout_s)


class CappedSite(web.TCPSite):
    """The TCP listener, taking at most `cap` connections at once: one more is answered 503 (Retry-After)
    and closed at accept, before it holds anything, and reported as an incident (server/incidents.py).
    Without the cap, 20,000 silent sockets ran the process out of file descriptors (/healthz stopped
    answering) and asyncio logged a traceback for every refused accept. Connections are counted from the
    accept (`_Counted`): asyncio makes the protocols of a burst of accepts before any of them is connected,
    so aiohttp's own list of connections lags behind."""

    def __init__(self, runner: web.AppRunner, host: str, port: int, cap: int, refused: Incidents):
        super().__init__(runner, host, port)
        self.cap, self.refused = cap, refused
        self.open = 0

    async def start(self) -> None:
        await web.BaseSite.start(self)  # registers the site with its runner
        server = self._runner.server

        def protocol() -> asyncio.Protocol:
            if self.open < self.cap:
                return _Counted(server(), self)
            self.refused(f"{self.open} connections are open (the cap)")
            return _Refused()

        self._server = await asyncio.get_running_loop().create_server(protocol, self._host, self._port,
                                                                      backlog=self._backlog,
                                                                      reuse_address=self._reuse_address)


class _Counted(asyncio.Protocol):
    """An accepted connection's protocol (aiohttp's handler, every call passed on), counted by its site from
    the accept to the connection's end."""

    def __init__(self, handler, site: CappedSite):
        self.handler, self.site = handler, site
        site.open += 1

    def connection_made(self, transport) -> None:
        self.handler.connection_made(transport)

    def data_received(self, data: bytes) -> None:
        self.handler.data_received(data)

    def eof_received(self):
        return self.handler.eof_received()

    def pause_writing(self) -> None:
        self.handler.pause_writing()

    def resume_writing(self) -> None:
        self.handler.resume_writing()

    def connection_lost(self, exc) -> None:
        self.site.open -= 1
        self.handler.connection_lost(exc)


class _Refused(asyncio.Protocol):
    """A connection over the cap: one 503 and the close, whatever it sends."""

    ANSWER = (b"HTTP/1.1 503 Service Unavailable\r\nRetry-After: 1\r\nConnection: close\r\nContent-Type: text/plain"
              b"\r\nContent-Length: 53\r\n\r\ntoo many open connections (--max-connections): retry\n")

    def connection_made(self, transport) -> None:
        transport.write(self.ANSWER)
        transport.close()


def _room_for(connections: int) -> None:
    """Raise the soft limit of open files to the hard one when the cap needs more (each connection is one;
    the model's files, NCCL and the prefix cache take their own)."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < connections + 256 and (hard == resource.RLIM_INFINITY or hard > soft):
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


def run(config: ServerConfig, load_engine: Callable) -> int:
    """Serve until SIGTERM/SIGINT; the exit code (0 after a clean drain)."""
    logging.basicConfig(level=logging.WARNING, format="appliance: %(name)s: %(message)s", stream=sys.stderr)
    _room_for(config.max_connections)
    app = App(config, load_engine)
    code = asyncio.run(app.main())
    if app.load_error is not None:
        raise app.load_error
    return code
