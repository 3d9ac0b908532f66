"""decode.v1 without I/O: client frames in, server frames out. The specification is server/PROTOCOL.md, beside
this module (tests/test_protocol_doc.py checks that it documents every frame type, error code and close code
defined here).

This module parses and validates client messages, numbers server frames, maps Engine API events and
every error to frames, merges token events under backpressure and derives the limits from the engine's
context. It holds no socket and no event loop, so tests drive it by feeding frames; the asyncio layer
(`server.app`) only moves what this module produces.

Call order per connection: `Frames()` once; `hello(...)` first; then for each client message `parse()`,
which returns a `Generate`, `Cancel` or `Ping` or raises `ProtocolError`; engine events go through
`event_frames()`; every frame goes out through `Frames.encode()`, which stamps `seq` and never raises.

JSON: messages are read by orjson, the library that writes the frames (server/strict_json.py), so no value
a client sends can make a frame unwritable; a frame that still cannot be written becomes an `internal` error.
"""

import math
from dataclasses import dataclass

from appliance.api import ChatRequest, Done, Error, Progress, Request, Sampling, Started, Tokens
from appliance.errors import ApplianceError, RequestError, shown

from . import strict_json

PROTOCOL = "decode.v1"
PATH = "/v1/stream"

# Frame types (PROTOCOL.md).
CLIENT_FRAME_TYPES = ("generate", "cancel", "ping")
SERVER_FRAME_TYPES = ("hello", "queued", "started", "progress", "delta", "done", "error", "pong")

# Close codes (PROTOCOL.md). 1002, 1007 and 1009 (oversize frames) come from the websocket layer itself.
CLOSE_NORMAL = 1000
CLOSE_GOING_AWAY = 1001
CLOSE_PROTOCOL_ERROR = 1002
CLOSE_INVALID_DATA = 1007
CLOSE_POLICY = 1008
CLOSE_TOO_BIG = 1009
CLOSE_ENGINE_FAULT = 1011
CLOSE_RESTART = 1012
CLOSE_TRY_AGAIN = 1013
CLOSE_BAD_FRAME = 4400
CLOSE_IDLE = 4408

# Error code -> error type. Codes the engine may raise that are not protocol codes become `internal`.
ERROR_TYPES = {
    "invalid_request": "invalid_request_error",
    "context_length_exceeded": "invalid_request_error",
    "unauthorized": "authentication_error",
    "busy": "unavailable_error",
    "not_ready": "unavailable_error",
    "internal": "server_error",
}
RETRYABLE = {"busy", "not_ready"}

GENERATE_FIELDS = ("type", "id", "prompt", "messages", "input_ids", "max_tokens", "sampling", "stop",
                   "ignore_eos", "timings", "tools", "tool_choice", "thinking", "reasoning_effort", "response_format")
CHAT_FIELDS = ("tools", "tool_choice", "thinking", "reasoning_effort", "response_format")
SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "seed")
MAX_ID_CHARS = 128


class ProtocolError(ApplianceError):
    """A client message this protocol refuses. `field` names the offending field; `close_code`, when set,
    means the connection must close with that code after the error frame (oversize messages)."""

    code = "invalid_request"

    def __init__(self, message: str, *, field: str | None = None, value=None, code: str | None = None,
                 request_id: str | None = None, close_code: int | None = None):
        super().__init__(message, field=field, value=value, code=code)
        self.request_id = request_id
        self.close_code = close_code


# --- limits ------------------------------------------------------------------------------------------


def max_message_bytes(max_context: int) -> int:
    """The largest client message worth reading: a prompt filling the whole context. A token is at most
    ~8 bytes as an id in `input_ids` ("129279, ") but can be longer as JSON-escaped text, so allow 32 bytes
    per token of context, plus 64 KiB for the other fields."""
    return 32 * max_context + 65536


@dataclass(frozen=True)
class Limits:
    max_context: int
    max_tokens: int
    max_message_bytes: int
    vocab_size: int

    @classmethod
    def for_engine(cls, max_context: int, vocab_size: int) -> "Limits":
        return cls(max_context, max(1, max_context - 1), max_message_bytes(max_context), vocab_size)

    def as_dict(self) -> dict:
        return {"max_context": self.max_context, "max_tokens": self.max_tokens,
                "max_message_bytes": self.max_message_bytes, "vocab_size": self.vocab_size}


# --- client -> server --------------------------------------------------------------------------------


@dataclass
class Generate:
    request: Request


@dataclass
class Cancel:
    """Cancel the running request (`id` None: whichever is running)."""

    id: str | None


@dataclass
class Ping:
    t: float | int | None


def _loads(data: str):
    try:
        return strict_json.loads(data)
    except strict_json.UnrepresentableValue as e:  # answer for the generate's id when it has a good one
        doc = e.document
        rid = doc.get("id") if isinstance(doc, dict) and doc.get("type") == "generate" else None
        rid = rid if isinstance(rid, str) and strict_json.first_fault(rid) is None else None
        raise ProtocolError(e.message, field=e.field, request_id=rid) from None
    except RequestError as e:
        raise ProtocolError(e.message, field=e.field) from None


def _type_name(value) -> str:
    return {bool: "boolean", int: "integer", float: "number", str: "string", list: "array", dict: "object",
            type(None): "null"}.get(type(value), type(value).__name__)


def parse(data: str | bytes, limits: Limits) -> Generate | Cancel | Ping:
    """One client message -> a command. Raises ProtocolError naming the field and the fix."""
    if isinstance(data, bytes | bytearray | memoryview):
        raise ProtocolError("binary frame: decode.v1 messages are JSON text frames", field="message")
    if len(data) > limits.max_message_bytes:
        raise ProtocolError(f"message of {len(data)} bytes: must be at most {limits.max_message_bytes}",
                            field="message", value=len(data), close_code=CLOSE_TOO_BIG)
    msg = _loads(data)
    if not isinstance(msg, dict):
        raise ProtocolError(f"message is a JSON {_type_name(msg)}: must be an object with a `type`",
                            field="message")
    kind = msg.get("type")
    if kind == "generate":
        return Generate(_generate(msg, limits))
    if kind == "cancel":
        _only(msg, ("type", "id"), "cancel")
        rid = msg.get("id")
        if rid is not None and not isinstance(rid, str):
            raise ProtocolError(f"id={shown(rid)}: must be a string (the id of the generate to cancel)",
                                field="id", value=rid)
        return Cancel(rid)
    if kind == "ping":
        _only(msg, ("type", "t"), "ping")
        t = msg.get("t")
        if t is not None and (not isinstance(t, int | float) or isinstance(t, bool)):
            raise ProtocolError(f"t={shown(t)}: must be a number (echoed in pong)", field="t", value=t)
        if isinstance(t, float) and not (math.isfinite(t) and abs(t) < 2.0**64):
            # orjson reads an integer beyond 64 bits as a double: refused, since pong could not echo it as sent
            raise ProtocolError(f"t={shown(t)}: beyond 64 bits; must be a number of magnitude below 2^64 (echoed "
                                f"in pong)", field="t", value=t)
        return Ping(t)
    raise ProtocolError(f"type={shown(kind)}: must be one of {', '.join(CLIENT_FRAME_TYPES)}", field="type",
                        value=kind)


def _only(msg: dict, known: tuple, kind: str, request_id: str | None = None, prefix: str = "") -> None:
    for key in msg:
        if key not in known:
            name = prefix + (key if len(key) <= MAX_ID_CHARS else key[:MAX_ID_CHARS] + "...")
            raise ProtocolError(f"unknown field {shown(prefix + key)} in {kind}: known fields are "
                                f"{', '.join(known)}", field=name, request_id=request_id)


def _generate(msg: dict, limits: Limits) -> Request:
    rid = msg.get("id")
    if rid is not None and (not isinstance(rid, str) or not 0 < len(rid) <= MAX_ID_CHARS):
        raise ProtocolError(f"id={shown(rid)}: must be a string of 1..{MAX_ID_CHARS} characters", field="id",
                            value=rid)
    _only(msg, GENERATE_FIELDS, "generate", rid)
    sampling = msg.get("sampling", {})
    if not isinstance(sampling, dict):
        raise ProtocolError(f"sampling is a {_type_name(sampling)}: must be an object with "
                            f"{', '.join(SAMPLING_FIELDS)}", field="sampling", request_id=rid)
    _only(sampling, SAMPLING_FIELDS, "sampling", rid, prefix="sampling.")
    kw = {k: msg[k] for k in ("input_ids", "prompt", "max_tokens", "stop", "ignore_eos", "timings") if k in msg}
    chat = {k: msg[k] for k in CHAT_FIELDS if k in msg}
    if msg.get("messages") is not None or chat:  # chat fields without messages: refused by validate, named
        kw["chat"] = ChatRequest(msg.get("messages"), **chat)
    if "messages" in msg:  # a chat request samples as the checkpoint recommends unless told otherwise
        sampling = {"temperature": None, "top_p": None, **sampling}
    req = Request(id=rid or "", sampling=Sampling(**sampling), **kw)
    n = req.max_tokens
    if "max_tokens" in msg and (n is None or isinstance(n, int) and not isinstance(n, bool)
                                and not 1 <= n <= limits.max_tokens):
        raise ProtocolError(f"max_tokens={shown(n)}: must be an integer in 1..{limits.max_tokens}", field="max_tokens",
                            value=n, request_id=rid)
    try:
        req.validate()
        _check_input_ids(req, limits)
    except ApplianceError as e:
        raise ProtocolError(e.message, field=e.field, value=e.value, code=e.code, request_id=rid) from None
    return req


def _check_input_ids(req: Request, limits: Limits) -> None:
    if req.input_ids is None:
        return
    bad = next((i for i in req.input_ids if not 0 <= i < limits.vocab_size), None)
    if bad is not None:
        raise ProtocolError(f"input_ids: id {bad} outside the vocabulary 0..{limits.vocab_size - 1}",
                            field="input_ids", value=bad)
    if len(req.input_ids) >= limits.max_context:
        raise ProtocolError(f"input_ids: {len(req.input_ids)} tokens leave no room in the context limit "
                            f"{limits.max_context}: send at most {limits.max_context - 1}",
                            field="input_ids", value=len(req.input_ids), code="context_length_exceeded")


# --- server -> client --------------------------------------------------------------------------------


class Frames:
    """Numbers one connection's server frames: `seq` starts at 1 and increases by one per frame, in the
    order frames are encoded (which is the order they are sent: one writer per connection)."""

    def __init__(self):
        self.seq = 0

    def encode(self, frame: dict) -> str:
        return self.encode_checked(frame)[0]

    def encode_checked(self, frame: dict) -> tuple[str, str | None]:
        """(text, None), or, when orjson cannot write the frame (a value no client message can produce, e.g.
        an engine's odd type), (the text of `unencodable(frame, why)`, why). Never raises: the connection's
        writer must outlive any one frame."""
        text, why = self.try_encode(frame)
        if text is None:
            text = self.try_encode(unencodable(frame, why))[0]
        if text is None:  # unreachable: that error holds plain strings only; still never raise
            text = self.try_encode(error_frame("internal", "the server could not encode a frame"))[0]
        return text, why

    def try_encode(self, frame: dict) -> tuple[str | None, str | None]:
        """(text, None), taking the next `seq`; or (None, why) when orjson cannot write the frame, taking no
        `seq` (the caller may send something else in its place, or nothing)."""
        try:
            text = strict_json.dumps({"type": frame["type"], "seq": self.seq + 1, **frame})
        except (TypeError, ValueError, KeyError) as e:  # orjson.JSONEncodeError is a TypeError
            return None, f"{type(e).__name__}: {e}"
        self.seq += 1
        return text, None


def unencodable(frame, why: str) -> dict:
    """The `internal` error that stands for a frame the server could not encode (for its request, if any)."""
    kind = _printable(frame.get("type")) if isinstance(frame, dict) else type(frame).__name__
    rid = _printable(frame.get("id")) if isinstance(frame, dict) and frame.get("id") is not None else None
    return error_frame("internal", f"the server could not encode a {kind} frame ({why}); this request is ended: "
                       f"retry it", request_id=rid)


def _printable(value, limit: int = MAX_ID_CHARS) -> str:
    """`value` as text orjson can always write: lone surrogates escaped, cut at `limit` characters."""
    text = value if isinstance(value, str) else shown(value)
    return strict_json.shown_key(text)[:limit]


def hello(state: str, model: str, server_version: str, limits: Limits) -> dict:
    return {"type": "hello", "protocol": PROTOCOL, "server_version": server_version, "model": model,
            "state": state, "limits": limits.as_dict()}


def queued(position: int) -> dict:
    """`--on-busy queue`: `position` connections are ahead of this one; 0 means this connection now holds
    the box and may send `generate`."""
    return {"type": "queued", "position": position}


def pong(t, server_t_ms: float) -> dict:
    return {"type": "pong", "t": t, "server_t": server_t_ms}


def keepalive(request_id: str, processed: int, total: int | None, ms: float) -> dict:
    """A progress frame the server sends on its own when the engine has been quiet (one long prefill
    chunk): the last known position again, with the time since the request was accepted."""
    return {"type": "progress", "id": request_id, "processed": processed, "total": total, "ms": round(ms, 3)}


def error_frame(code: str, message: str, *, request_id: str | None = None, param: str | None = None,
                retry_after_ms: int | None = None) -> dict:
    """The one place where an error becomes a frame (engine errors, protocol errors, busy, not ready)."""
    if code not in ERROR_TYPES:  # an engine code the protocol does not define: still an error, never a crash
        message = f"{code}: {message}"
        code = "internal"
    err = {"type": ERROR_TYPES[code], "code": code, "message": message}
    if param is not None:
        err["param"] = param
    frame = {"type": "error"}
    if request_id:
        frame["id"] = request_id
    frame["error"] = err
    frame["retryable"] = code in RETRYABLE
    if retry_after_ms is not None:
        frame["retry_after_ms"] = int(retry_after_ms)
    return frame


def error_for(exc: ApplianceError, request_id: str | None = None) -> dict:
    rid = request_id or getattr(exc, "request_id", None)
    return error_frame(exc.code, exc.message, request_id=rid, param=exc.field)


def event_frames(events: list, timings: str = "final") -> list[dict]:
    """Engine events (in order) -> frames. Runs of Tokens events become one `delta` each: this is how a
    client that reads slowly gets fewer, larger frames with every token in them (never a dropped one);
    `index` is the first token's index and `t_ms` (timings=per_token) keeps each token's own time."""
    return [delta(ev, timings) if isinstance(ev, list) else _frame(ev, timings) for ev in token_runs(events)]


def token_runs(events):
    """The events in order, each run of consecutive Tokens events as one list (what a reader that fell
    behind gets in one piece, here and in the HTTP APIs)."""
    run: list[Tokens] = []
    for ev in events:
        if isinstance(ev, Tokens):
            run.append(ev)
            continue
        if run:
            yield run
            run = []
        yield ev
    if run:
        yield run


def delta(run: list[Tokens], timings: str) -> dict:
    """A chat request's delta also carries `reasoning` and `tool_calls` when its tokens made some (`text` is
    the answer alone); a prompt or input_ids request's delta never has them."""
    frame = {"type": "delta", "id": run[0].id, "index": run[0].index, "text": "".join(t.text for t in run),
             "token_ids": [i for t in run for i in t.ids]}
    reasoning = "".join(t.reasoning for t in run)
    if reasoning:
        frame["reasoning"] = reasoning
    calls = [c for t in run for c in t.tool_calls]
    if calls:
        frame["tool_calls"] = calls
    if timings == "per_token":
        frame["t_ms"] = [round(x, 3) for t in run for x in t.t_ms]
    return frame


def _frame(ev, timings: str) -> dict:
    if isinstance(ev, Started):
        return {"type": "started", "id": ev.id, "prompt_tokens": ev.prompt_tokens, "cached_tokens": ev.cached_tokens}
    if isinstance(ev, Progress):
        return {"type": "progress", "id": ev.id, "processed": ev.processed, "total": ev.total, "ms": round(ev.ms, 3)}
    if isinstance(ev, Done):
        frame = {"type": "done", "id": ev.id, "finish_reason": ev.finish_reason, "usage": ev.usage}
        if timings != "none":
            frame["timings"] = {k: (round(v, 3) if isinstance(v, float) else v) for k, v in ev.timings.items()}
        if ev.speculative is not None:
            frame["speculative"] = ev.speculative
        return frame
    if isinstance(ev, Error):
        return error_frame(ev.code, ev.message, request_id=ev.id, param=ev.param)
    raise TypeError(f"not an Engine API event: {ev!r}")
