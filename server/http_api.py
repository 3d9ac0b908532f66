"""The HTTP API's asyncio layer: one call of the OpenAI- or Anthropic-compatible API (server/openai_api.py,
server/anthropic_api.py and server/responses_api.py build the bodies; this module only moves them).

A call, in order: the method (405 with Allow), the browser origin (server/gate.py: 403, or 400 for one
sent twice), auth (as the websocket: Bearer token, or `x-api-key`; 401), a JSON Content-Type for a body
(415), readiness, the body (read by orjson with decode.v1's JSON policy, at most
`limits.max_message_bytes`, within --body-timeout: 408), the request it asks for (a 400 naming the
parameter otherwise), the box (one user: a place in line with `--on-busy queue`, the default, at most
--queue-max waiting and for --queue-wait seconds; or 429 with Retry-After while another holds it), then the
engine. Its first event decides the status: an error before any output (a field the chat encoder refuses,
a prompt over the context) is a 4xx in the API's own error shape; otherwise 200, with the whole body at the
end or, streaming, server-sent events as tokens come (the events queued while a slow client read are sent
in one write: merged, never dropped). Every error, 404 and 405 included, is in the API's error shape
(Anthropic's under /v1/messages, OpenAI's elsewhere).

A stream never goes quiet for long: while a prompt prefills, or between tokens, after --sse-keepalive
seconds without a byte it gets an SSE comment (OpenAI) or a `ping` event (Anthropic), so proxies with idle
timeouts keep it. A client that stops reading is dropped once a write has waited --send-deadline seconds,
and its request is cancelled: it cannot hold the box.

Cancel: a client that disconnects (aiohttp cancels the handler, or a write fails) cancels its request: the
engine stops between two prefill chunks or decode cycles. The call still reads its request's terminal
event (for the metrics; shielded, so a second cancel of the handler cannot skip it) before the box passes
on. SIGTERM lets a running call finish for `--drain` seconds, then cancels it: the client gets the API's
error (503, or an error event in a stream).
"""

import asyncio
import logging
import math
import threading

from aiohttp import web

from appliance.api import Done, Error, Progress, Started
from appliance.errors import ApplianceError, RequestError

from . import anthropic_api, gate, openai_api, responses_api, strict_json
from .box import Running
from .protocol import token_runs

STATUS = {"invalid_request": 400, "context_length_exceeded": 400, "unauthorized": 401, "forbidden": 403,
          "not_found": 404, "method_not_allowed": 405, "timeout": 408, "too_large": 413,
          "unsupported_media_type": 415, "busy": 429, "not_ready": 503, "cancelled": 503, "internal": 500}
VERDICT_CODES = {400: "invalid_request", 401: "unauthorized", 403: "forbidden", 405: "method_not_allowed",
                 415: "unsupported_media_type"}
SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
log = logging.getLogger("server.http_api")


class ApiFailure(Exception):
    """An answer in the API's error shape instead of the reply."""

    def __init__(self, code: str, message: str, param: str | None = None, retry_after_ms: int | None = None,
                 allow: tuple[str, ...] = ()):
        super().__init__(message)
        self.code, self.message, self.param, self.retry_after_ms, self.allow = code, message, param, \
            retry_after_ms, allow

    @classmethod
    def of(cls, verdict: gate.Verdict) -> "ApiFailure":
        return cls(VERDICT_CODES.get(verdict.status, "invalid_request"), verdict.text.strip(), allow=verdict.allow)


class _Api:
    """What differs between the APIs: body -> ApiRequest, the reply builder, the error shape, SSE framing and its
    keepalive."""

    def __init__(self, module, parse, reply, named_events: bool, keepalive: str = ": keep-alive\n\n"):
        self.module, self.parse, self.reply, self.named_events = module, parse, reply, named_events
        self.keepalive = keepalive.encode()

    def error(self, code: str, message: str, param: str | None) -> dict:
        return self.module.error_body(code, message, param)


ANTHROPIC_PING = 'event: ping\ndata: {"type": "ping"}\n\n'
APIS = {
    "/v1/chat/completions": _Api(openai_api, openai_api.chat_call, openai_api.ChatReply, False),
    "/v1/completions": _Api(openai_api, openai_api.completion_call, openai_api.CompletionReply, False),
    "/v1/responses": _Api(responses_api, responses_api.responses_call, responses_api.ResponsesReply, True),
    "/v1/messages": _Api(anthropic_api, anthropic_api.messages_call, anthropic_api.MessagesReply, True,
                         ANTHROPIC_PING),
    "/v1/messages/count_tokens": _Api(anthropic_api, anthropic_api.count_call, None, True),
    "/v1/models": _Api(openai_api, None, None, False),
    "/v1/models/{id}": _Api(openai_api, None, None, False),
}


def api_of(path: str) -> _Api:
    """The API whose error shape answers `path` (any path under /v1/, routes or not)."""
    route = gate.api_route(path)
    if route is not None:
        return APIS[route]
    return APIS["/v1/messages" if path.startswith("/v1/messages") else "/v1/chat/completions"]


def _json(status: int, body: dict, headers: dict | None = None) -> web.Response:
    return web.Response(status=status, body=strict_json.dumps(body).encode(),
                        headers={"Content-Type": "application/json", **(headers or {})})


def _sse(item, named: bool) -> str:
    if named:
        event, data = item
        return f"event: {event}\ndata: {strict_json.dumps(data)}\n\n"
    return f"data: {strict_json.dumps(item)}\n\n"


async def handle(app, request: web.BaseRequest, path: str) -> web.StreamResponse:
    """Any request for a path under /v1/ (the websocket's aside)."""
    api = api_of(path)
    try:
        return await _handle(app, request, path, api)
    except ApiFailure as f:
        app.metrics.errors.labels(f.code if f.code in STATUS else "internal").inc()
        headers = {}
        if f.retry_after_ms is not None:
            headers["Retry-After"] = str(max(1, math.ceil(f.retry_after_ms / 1000)))
        if f.code == "unauthorized":
            headers["WWW-Authenticate"] = 'Bearer realm="decode-appliance"'
        if f.allow:
            headers["Allow"] = ", ".join(f.allow)
        return _json(STATUS.get(f.code, 500), api.error(f.code, f.message, f.param), headers)


async def _handle(app, request, path: str, api: _Api) -> web.StreamResponse:
    route = gate.api_route(path)
    if route is None:
        raise ApiFailure("not_found", f"no such route {path[:200]}: the API has {', '.join(gate.API_ROUTES)}")
    if request.method == "OPTIONS":  # a browser's CORS preflight
        verdict = gate.preflight(request.headers, route, app.config.origins)
        if verdict.status != 204:
            raise ApiFailure.of(verdict)
        return app.respond(verdict)
    for verdict in (gate.check_method(request.method, path), gate.check_origin(request.headers, app.config.origins),
                    gate.token_in_url(gate.split_target(request.raw_path)[1]),
                    gate.check_token(request.headers, app.config.token)):
        if verdict.status is not None:
            raise ApiFailure.of(verdict)
    if request.method == "POST" and (verdict := gate.check_content_type(request.headers)).status is not None:
        raise ApiFailure.of(verdict)
    if app.state != "ready":
        raise ApiFailure("not_ready", f"the server is {app.state} ({app.status}); retry when /readyz answers 200",
                         retry_after_ms=1000)
    if route == "/v1/models":
        info = app.engine.info
        return _json(200, openai_api.models_body(app.model_name, info.max_context, int(app.started_at)))
    if route == "/v1/models/{id}":
        model = path[len("/v1/models/"):]
        if model != app.model_name:
            raise ApiFailure("not_found", f"the model {model[:200]!r} does not exist: this box serves "
                                          f"{app.model_name!r}", "model")
        return _json(200, openai_api.model_body(app.model_name, app.engine.info.max_context, int(app.started_at)))
    try:
        body = await asyncio.wait_for(_read_body(request, app.limits.max_message_bytes), app.config.body_timeout_s)
    except TimeoutError:
        app.slow_body(f"a {request.method} {route} body did not arrive within {app.config.body_timeout_s:g} s")
        raise ApiFailure("timeout", f"the request body did not arrive within {app.config.body_timeout_s:g} s") from None
    try:
        doc = strict_json.loads(body)
        call = api.parse(doc, app.responses) if route == "/v1/responses" else api.parse(doc)
    except RequestError as e:
        raise ApiFailure(e.code, e.message, e.field) from None
    if api.reply is None:  # count_tokens: the prompt's length, no generation
        return await _count(app, call)
    return await ApiCall(app, api, call).serve(request)


async def _count(app, call) -> web.Response:
    try:
        n = await asyncio.get_running_loop().run_in_executor(None, app.engine.count_tokens, call.request)
    except ApplianceError as e:
        raise ApiFailure(e.code, e.message, e.field) from None
    return _json(200, {"input_tokens": n})


async def _read_body(request, limit: int) -> str:
    if request.content_length is not None and request.content_length > limit:
        raise ApiFailure("too_large", f"a body of {request.content_length} bytes: must be at most {limit} (a prompt "
                         "that fills the context)")
    data = bytearray()
    async for chunk in request.content.iter_chunked(65536):
        data += chunk
        if len(data) > limit:
            raise ApiFailure("too_large", f"the body is over {limit} bytes (a prompt that fills the context)")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ApiFailure("invalid_request", f"the body is not UTF-8 (byte {e.start})", "body") from None


class ApiCall:
    """One call while it waits for or holds the box (a holder, as server/box.py expects)."""

    def __init__(self, app, api: _Api, call):
        self.app, self.api, self.call = app, api, call
        self.running: Running | None = None
        self.idle = asyncio.Event()
        self.idle.set()
        self.events: asyncio.Queue = asyncio.Queue()
        self.loop = asyncio.get_running_loop()
        self.written = self.loop.time()  # when the stream last sent something (keepalive)
        self.failed = False  # an event could not be encoded: the client has its error, nothing more is sent

    def tell_position(self, position: int) -> None:
        pass  # an HTTP client just waits; its turn is when its answer starts

    def emit(self, event) -> None:
        """Called by the engine thread."""
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, event)
        except RuntimeError:  # the loop is gone (process exiting)
            pass

    async def serve(self, request) -> web.StreamResponse:
        app = self.app
        app.calls.add(self)
        try:
            await self._take_box()
            return await self._run(request)
        finally:
            app.box.leave(self)
            app.calls.discard(self)

    async def _take_box(self) -> None:
        app = self.app
        if app.box.try_take(self):
            return
        if app.config.on_busy != "queue":
            app.metrics.busy.inc()
            raise ApiFailure("busy", "another user holds this box (one user per box); retry later",
                             retry_after_ms=app.box.retry_after_ms())
        if len(app.box.waiting) >= app.config.queue_max:
            app.metrics.busy.inc()
            raise ApiFailure("busy", f"{len(app.box.waiting)} requests already wait for this box (--queue-max); "
                             "retry later", retry_after_ms=app.box.retry_after_ms())
        app.metrics.queued.inc()
        try:
            turn = app.box.wait_for(self)
            await asyncio.wait([turn, app.stopping], timeout=app.config.queue_wait_s,
                               return_when=asyncio.FIRST_COMPLETED)
        finally:
            app.metrics.queued.dec()
        if not turn.done():
            app.box.leave(self)
            if app.state == "ready":
                app.metrics.busy.inc()
                raise ApiFailure("busy", f"waited {app.config.queue_wait_s:g} s for the box (--queue-wait); retry "
                                 "later", retry_after_ms=app.box.retry_after_ms())
        if not turn.done() or app.state != "ready":
            raise ApiFailure("not_ready", "the server is stopping (SIGTERM)", retry_after_ms=1000)

    async def _run(self, request) -> web.StreamResponse:
        app, req = self.app, self.call.request
        limit = req.max_tokens or app.limits.max_tokens
        self.running = Running(req.id, "final", limit, threading.Event())
        self.idle.clear()
        app.metrics.running.inc()
        app.engine.submit(req, self.emit, self.running.cancel, wait=True)
        reply = self.api.reply(self.call, app.model_name)
        try:
            first = await self._next()
            while isinstance(first, Progress):
                first = await self._next()
            if isinstance(first, Error):
                raise ApiFailure(first.code, first.message, first.param)
            if self.call.stream:
                return await self._stream(request, reply, first)
            return await self._whole(reply, first)
        finally:
            if self.running is not None:  # cancelled (a disconnect) or failed: stop the engine, read its end
                self.running.cancel.set()
                settle = asyncio.ensure_future(self._settle())  # shielded: a second cancel cannot skip it
                app.settling.add(settle)
                settle.add_done_callback(app.settling.discard)
                await asyncio.shield(settle)

    async def _next(self):
        ev = await self.events.get()
        if self.running is not None and self.running.observe(ev, self.app.metrics):
            self.running = None
            self.idle.set()
        return ev

    async def _next_within(self, seconds: float):
        """The next event, or None when none comes within `seconds` (a cancelled get loses no event)."""
        try:
            return await asyncio.wait_for(self._next(), seconds)
        except TimeoutError:
            return None

    async def _settle(self) -> None:
        """Read up to the terminal event (the engine's answer to the cancel: within a chunk or a cycle)."""
        while self.running is not None:
            await self._next()

    async def _whole(self, reply, first: Started) -> web.Response:
        reply.started(first)
        events = [await self._next()]
        while not isinstance(events[-1], Done | Error):
            events.append(await self._next())
        for ev in token_runs(events):
            if isinstance(ev, list):
                reply.tokens(ev)
            elif isinstance(ev, Done):
                if ev.finish_reason == "cancelled":
                    raise ApiFailure("cancelled", "the request was cancelled: the server is stopping (SIGTERM)")
                reply.done(ev)
                return _json(200, reply.body())
            elif isinstance(ev, Error):
                raise ApiFailure(ev.code, ev.message, ev.param)

    async def _stream(self, request, reply, first: Started) -> web.StreamResponse:
        resp = web.StreamResponse(status=200, headers=SSE_HEADERS)
        named = self.api.named_events
        quiet = self.app.config.sse_keepalive_s
        try:
            await resp.prepare(request)
            await self._write(resp, request, self._encode(reply.started(first)))
            ended = False
            while not ended:
                ev = await self._next_within(max(0.0, quiet - (self.loop.time() - self.written)))
                if ev is None:  # nothing to send for a while (a long prefill, a slow step): keep the stream alive
                    await self._write(resp, request, self.api.keepalive)
                    continue
                batch = [ev]
                while not self.events.empty():
                    batch.append(await self._next())
                items, ended = self._items(reply, batch)
                if ended and not named:
                    items.append("data: [DONE]\n\n")
                if not self.failed and items:
                    await self._write(resp, request, self._encode(items))
            await resp.write_eof()
        except ConnectionError:  # the client left (or stopped reading): `_run` cancels the request
            pass
        return resp

    async def _write(self, resp, request, data: bytes) -> None:
        """Send `data`; a client that has not taken it within --send-deadline is dropped (ConnectionError)."""
        try:
            await asyncio.wait_for(resp.write(data), self.app.config.send_deadline_s)
        except TimeoutError:
            self.app.slow_reader(f"an API stream's client took no data for {self.app.config.send_deadline_s:g} s")
            if request.transport is not None:
                request.transport.abort()
            raise ConnectionError("the client stopped reading") from None
        self.written = self.loop.time()

    def _encode(self, items: list) -> bytes:
        """SSE text of `items`. A value orjson cannot write (never from a client: an engine's odd text) ends
        the request with an internal error in its place, as a decode.v1 frame that cannot be encoded does."""
        named = self.api.named_events
        try:
            return "".join(i if isinstance(i, str) else _sse(i, named) for i in items).encode()
        except (TypeError, ValueError) as e:
            log.error("API writer: an event could not be encoded (%s); the request gets an internal error", e)
            self.failed = True
            if self.running is not None:
                self.running.cancel.set()
            self.app.metrics.errors.labels("internal").inc()
            error = self.api.module.error_body("internal", f"the server could not encode an event ({type(e).__name__}"
                                               f"); this request is ended: retry it")
            return (_sse(("error", error), True) if named else _sse(error, False) + "data: [DONE]\n\n").encode()

    def _items(self, reply, batch: list) -> tuple[list, bool]:
        """SSE items for a batch of events (runs of tokens merged); True once the terminal one is in."""
        items = []
        for ev in token_runs(batch):
            if isinstance(ev, list):
                items += reply.tokens(ev)
            elif isinstance(ev, Done) and ev.finish_reason != "cancelled":
                return items + reply.done(ev), True
            elif isinstance(ev, Done | Error):
                error = ev if isinstance(ev, Error) else Error(ev.id, "cancelled", "the request was cancelled: "
                                                               "the server is stopping (SIGTERM)")
                self.app.metrics.errors.labels(error.code if error.code in STATUS else "internal").inc()
                data = reply.stream_error(error)
                return items + [("error", data) if self.api.named_events else data], True
        return items, False

