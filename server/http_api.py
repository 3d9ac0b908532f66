"""The HTTP API's asyncio layer: one call of the OpenAI- or Anthropic-compatible API (server/openai_api.py,
server/anthropic_api.py build the bodies; this module only moves them).

A call, in order: auth (as the websocket: Bearer token, or `x-api-key`), readiness, the body (read by
orjson with decode.v1's JSON policy, at most `limits.max_message_bytes`), the request it asks for (a 400
naming the parameter otherwise), the box (one user: 429 with Retry-After while another holds it, or a
place in line with `--on-busy queue`), then the engine. Its first event decides the status: an error
before any output (a field the chat encoder refuses, a prompt over the context) is a 4xx in the API's own
error shape; otherwise 200, with the whole body at the end or, streaming, server-sent events as tokens
come (the events queued while a slow client read are sent in one write: merged, never dropped).

Cancel: a client that disconnects (aiohttp cancels the handler, or a write fails) cancels its request: the
engine stops between two prefill chunks or decode cycles. The call still reads its request's terminal
event (for the metrics) before the box passes on. SIGTERM lets a running call finish for `--drain`
seconds, then cancels it: the client gets the API's error (503, or an error event in a stream).
"""

import asyncio
import logging
import math
import threading

from aiohttp import web

from appliance.api import Done, Error, Progress, Started, Tokens
from appliance.errors import RequestError

from . import anthropic_api, gate, openai_api, strict_json
from .box import Running

STATUS = {"invalid_request": 400, "context_length_exceeded": 400, "unauthorized": 401, "not_found": 404,
          "too_large": 413, "busy": 429, "not_ready": 503, "cancelled": 503, "internal": 500}
SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
log = logging.getLogger("server.http_api")


class ApiFailure(Exception):
    """An answer in the API's error shape instead of the reply."""

    def __init__(self, code: str, message: str, param: str | None = None, retry_after_ms: int | None = None):
        super().__init__(message)
        self.code, self.message, self.param, self.retry_after_ms = code, message, param, retry_after_ms


class _Api:
    """What differs between the two APIs: body -> Call, the reply builder, the error shape, SSE framing."""

    def __init__(self, module, parse, reply, named_events: bool):
        self.module, self.parse, self.reply, self.named_events = module, parse, reply, named_events

    def error(self, code: str, message: str, param: str | None) -> dict:
        return self.module.error_body(code, message, param)


APIS = {
    "/v1/chat/completions": _Api(openai_api, openai_api.chat_call, openai_api.ChatReply, False),
    "/v1/completions": _Api(openai_api, openai_api.completion_call, openai_api.CompletionReply, False),
    "/v1/messages": _Api(anthropic_api, anthropic_api.messages_call, anthropic_api.MessagesReply, True),
    "/v1/models": _Api(openai_api, None, None, False),
}


def _json(status: int, body: dict, headers: dict | None = None) -> web.Response:
    return web.Response(status=status, body=strict_json.dumps(body).encode(),
                        headers={"Content-Type": "application/json", **(headers or {})})


def _sse(item, named: bool) -> str:
    if named:
        event, data = item
        return f"event: {event}\ndata: {strict_json.dumps(data)}\n\n"
    return f"data: {strict_json.dumps(item)}\n\n"


async def handle(app, request: web.BaseRequest, path: str) -> web.StreamResponse:
    api = APIS[path]
    try:
        return await _handle(app, request, path, api)
    except ApiFailure as f:
        app.metrics.errors.labels(f.code if f.code in STATUS else "internal").inc()
        headers = {}
        if f.retry_after_ms is not None:
            headers["Retry-After"] = str(max(1, math.ceil(f.retry_after_ms / 1000)))
        if f.code == "unauthorized":
            headers["WWW-Authenticate"] = 'Bearer realm="decode-appliance"'
        return _json(STATUS.get(f.code, 500), api.error(f.code, f.message, f.param), headers)


async def _handle(app, request, path: str, api: _Api) -> web.StreamResponse:
    for verdict in (gate.token_in_url(gate.split_target(request.raw_path)[1]),
                    gate.check_token(request.headers, app.config.token)):
        if verdict.status is not None:
            raise ApiFailure("unauthorized" if verdict.status == 401 else "invalid_request", verdict.text.strip())
    if app.state != "ready":
        raise ApiFailure("not_ready", f"the server is {app.state} ({app.status}); retry when /readyz answers 200",
                         retry_after_ms=1000)
    if api.parse is None:  # /v1/models
        info = app.engine.info
        return _json(200, openai_api.models_body(app.model_name, info.max_context, int(app.started_at)))
    body = await _read_body(request, app.limits.max_message_bytes)
    try:
        call = api.parse(strict_json.loads(body))
    except RequestError as e:
        raise ApiFailure(e.code, e.message, e.field) from None
    return await ApiCall(app, api, call).serve(request)


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
        app.metrics.queued.inc()
        try:
            turn = app.box.wait_for(self)
            await asyncio.wait([turn, app.stopping], return_when=asyncio.FIRST_COMPLETED)
        finally:
            app.metrics.queued.dec()
        if not turn.done() or app.state != "ready":
            raise ApiFailure("not_ready", "the server is stopping (SIGTERM)", retry_after_ms=1000)

    async def _run(self, request) -> web.StreamResponse:
        app, req = self.app, self.call.request
        limit = req.max_tokens or app.limits.max_tokens
        self.running = Running(req.id, "final", limit, threading.Event())
        self.idle.clear()
        app.metrics.running.set(1)
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
                await self._settle()

    async def _next(self):
        ev = await self.events.get()
        if self.running is not None and self.running.observe(ev, self.app.metrics):
            self.running = None
            self.idle.set()
        return ev

    async def _settle(self) -> None:
        """Read up to the terminal event (the engine's answer to the cancel: within a chunk or a cycle)."""
        while self.running is not None:
            await self._next()

    async def _whole(self, reply, first: Started) -> web.Response:
        reply.started(first)
        run: list[Tokens] = []
        while True:
            ev = await self._next()
            if isinstance(ev, Tokens):
                run.append(ev)
                continue
            if run:
                reply.tokens(run)
                run = []
            if isinstance(ev, Done):
                if ev.finish_reason == "cancelled":
                    raise ApiFailure("cancelled", "the request was cancelled: the server is stopping (SIGTERM)")
                reply.done(ev)
                return _json(200, reply.body())
            if isinstance(ev, Error):
                raise ApiFailure(ev.code, ev.message, ev.param)

    async def _stream(self, request, reply, first: Started) -> web.StreamResponse:
        resp = web.StreamResponse(status=200, headers=SSE_HEADERS)
        named = self.api.named_events
        try:
            await resp.prepare(request)
            await resp.write(self._encode(reply.started(first)))
            ended = False
            while not ended:
                batch = [await self._next()]
                while not self.events.empty():
                    batch.append(await self._next())
                items, ended = self._items(reply, batch)
                if ended and not named:
                    items.append("data: [DONE]\n\n")
                if not self.failed:
                    await resp.write(self._encode(items))
            await resp.write_eof()
        except ConnectionError:  # the client left: `_run` cancels the request
            pass
        return resp

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
        items, run = [], []
        for ev in batch + [None]:
            if isinstance(ev, Tokens):
                run.append(ev)
                continue
            if run:
                items += reply.tokens(run)
                run = []
            if isinstance(ev, Done) and ev.finish_reason != "cancelled":
                return items + reply.done(ev), True
            if isinstance(ev, Done | Error):
                error = ev if isinstance(ev, Error) else Error(ev.id, "cancelled", "the request was cancelled: "
                                                               "the server is stopping (SIGTERM)")
                self.app.metrics.errors.labels(error.code if error.code in STATUS else "internal").inc()
                data = self.api.module.stream_error(error)
                return items + [("error", data) if self.api.named_events else data], True
        return items, False

