"""A property-based fuzz of a live server (the tiny model). On decode.v1, hypothesis writes client messages (random JSON
values, strings with lone surrogates and control characters, huge numbers, deep nesting, a wrong value in
each field of generate/cancel/ping, text that is not JSON, binary and invalid-UTF-8 frames, an oversize
message) and each example sends them on a fresh connection, one at a time (or, in about half the examples,
back to back). The invariants:

- every message is answered before a ping sent after it comes back (an `error` or `pong`; a generate may
  answer later, with its first frame), or closes the connection with a close code PROTOCOL.md documents
  (1011, the server failing on a connection, is not an answer);
  a cancel that names nothing unknown may go unanswered (the spec says so);
- `seq` starts at 1 and increases by one per frame;
- every generate gets either one `error`, or `started`, progress and deltas, then exactly one `done` or
  `error`, and nothing after it;
- no error is `internal`: nothing a client sends is an engine or server fault;
- the server logs no traceback.
After the examples: a greedy request returns the tokens it returned before them, the connections gauge is
back to 0, and SIGTERM exits 0 within --drain plus STOP_BOUND_S.

On the HTTP API, it writes bodies for every POST route (chat completions, completions, responses, messages,
count_tokens): valid ones with a wrong value at a random place (a message's field, a tool's schema, a
tool call's arguments, a response format, a responses input item), wild values in known fields, and
whole random JSON. The invariants: no 5xx but 503/429 (nothing a client sends is a server fault), every
error in the route's own JSON shape, a stream that ends with its terminal event, and no traceback.

Reproducible and bounded: derandomize (a fixed sequence of examples), no example database, at most
MAX_EXAMPLES examples and BUDGET_S seconds (examples past the budget do nothing).
"""

import http.client
import json
import re
import time

import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from websockets.exceptions import ConnectionClosed

from server import protocol as proto
from tests.server_harness import ServerProcess, generate, metric, open_ws, prompt, recv, token_ids

MAX_EXAMPLES = 300
BUDGET_S = 50.0
CONTEXT = 256
DRAIN_S = 1.0
DOCUMENTED_CLOSE_CODES = {v for k, v in vars(proto).items() if k.startswith("CLOSE_")}
ASSIGNED_ID = re.compile(r"^req-\d+$")  # the server's id for a generate without one
STARTED = [0]  # generates the server started, over the whole run (reported)

pytestmark = pytest.mark.slow


# --- what a client may send -------------------------------------------------------------------------------


class Raw:
    """JSON text placed as it is (nesting deeper than any parser's limit cannot be built as a value)."""

    def __init__(self, text: str):
        self.text = text


def to_json(value) -> str:
    """The text a sloppy client writes: surrogates as \\u escapes, NaN/Infinity literals, any integer."""
    raws: list[str] = []

    def mark(v):
        if isinstance(v, Raw):
            raws.append(v.text)
            return f"@@raw{len(raws) - 1}@@"
        if isinstance(v, list):
            return [mark(x) for x in v]
        if isinstance(v, dict):
            return {k: mark(x) for k, x in v.items()}
        return v

    text = json.dumps(mark(value), ensure_ascii=True, allow_nan=True)
    for i, raw in enumerate(raws):
        text = text.replace(f'"@@raw{i}@@"', raw)
    return text


chars = st.one_of(st.characters(exclude_categories=()),  # every code point, lone surrogates included
                  st.characters(min_codepoint=0xD800, max_codepoint=0xDFFF),
                  st.characters(max_codepoint=0x1F))
texts = st.text(alphabet=chars, max_size=12)
huge_ints = st.one_of(st.integers(), st.integers(min_value=-(10**400), max_value=10**400),
                      st.sampled_from([2**63 - 1, 2**63, 2**64 - 1, 2**64, -(2**63), -(2**63) - 1]))
scalars = st.one_of(st.none(), st.booleans(), huge_ints, st.floats(allow_nan=True, allow_infinity=True), texts)
deep = st.integers(min_value=900, max_value=1100).map(lambda d: Raw("[" * d + "]" * d))
json_values = st.one_of(deep, st.recursive(scalars, lambda kids: st.lists(kids, max_size=3)
                                           | st.dictionaries(texts, kids, max_size=3), max_leaves=8))


clean_chars = st.characters(exclude_categories=("Cs",))  # every code point but surrogates: control chars too
clean_ids = st.text(alphabet=clean_chars, min_size=1, max_size=10)
clean_texts = st.text(alphabet=clean_chars, min_size=1, max_size=24)
sampling = st.fixed_dictionaries({}, optional={
    "temperature": st.floats(0, 2), "top_p": st.floats(0.01, 1), "top_k": st.integers(0, 50),
    "seed": st.integers(0, 2**63 - 1)})
valid_generates = st.builds(lambda a, b: {"type": "generate", **a, **b}, st.one_of(
    st.fixed_dictionaries({"input_ids": st.lists(st.integers(0, 511), min_size=1, max_size=6)}),
    st.fixed_dictionaries({"prompt": clean_texts}),
    st.fixed_dictionaries({"messages": st.lists(st.fixed_dictionaries(
        {"role": st.sampled_from(["system", "user", "assistant"]), "content": clean_texts}), min_size=1,
        max_size=2)})), st.fixed_dictionaries({}, optional={
            "id": clean_ids, "max_tokens": st.integers(1, 2), "sampling": sampling,
            "stop": st.lists(clean_texts, max_size=2), "ignore_eos": st.booleans(),
            "timings": st.sampled_from(["none", "final", "per_token"])}))
GENERATE_FIELDS = ["type", "id", "prompt", "messages", "input_ids", "max_tokens", "sampling", "stop", "ignore_eos",
                   "timings", "unknown"]


def with_bad(frame: dict, path: str, value) -> dict:
    """`frame` with `value` at `path` (`max_tokens`, `sampling.seed`, `messages.0.content`, `stop.0`)."""
    frame = dict(frame)
    head, _, rest = path.partition(".")
    if head == "sampling":
        frame["sampling"] = {**frame.get("sampling", {}), rest: value}
    elif head == "messages" and rest:
        first = (frame.get("messages") or [{"role": "user", "content": "hi"}])[0]
        frame = {k: v for k, v in frame.items() if k not in ("prompt", "input_ids")}
        frame["messages"] = [{**first, rest.split(".")[1]: value}]
    elif head == "stop" and rest:
        frame["stop"] = [value]
    else:
        frame[path] = value
    return frame


class Whole:
    """Any JSON value as a whole message."""

    def __init__(self, value):
        self.value = value


bad_paths = st.sampled_from(GENERATE_FIELDS + ["sampling.temperature", "sampling.top_p", "sampling.top_k",
                                               "sampling.seed", "messages.0.content", "messages.0.role", "stop.0"])
# A wrong value in one field (every field in turn), or in many at once.
mutated_generates = st.builds(with_bad, valid_generates, bad_paths, json_values)
# Text that is not valid Unicode or holds control characters, in each text field.
nasty_generates = st.builds(with_bad, valid_generates, st.sampled_from(["id", "prompt", "messages.0.content",
                                                                       "stop.0"]), texts.filter(bool))
wild_generates = st.builds(lambda g, bad: {**g, **bad}, valid_generates,
                           st.dictionaries(st.sampled_from(GENERATE_FIELDS[1:]), json_values, max_size=4))
cancels = st.one_of(st.just({"type": "cancel"}), st.just({"type": "cancel", "id": "@previous"}),
                    st.fixed_dictionaries({"type": st.just("cancel")}, optional={"id": json_values,
                                                                                "why": json_values}))
pings = st.one_of(st.fixed_dictionaries({"type": st.just("ping")}, optional={
    "t": st.one_of(st.integers(-(2**63), 2**64 - 1), st.floats(allow_nan=False, allow_infinity=False))}),
    st.fixed_dictionaries({"type": st.just("ping"), "t": st.one_of(huge_ints, st.floats())}),
    st.fixed_dictionaries({"type": st.just("ping")}, optional={"t": json_values, "x": json_values}))
messages = st.one_of(
    valid_generates, valid_generates, valid_generates, mutated_generates, mutated_generates, nasty_generates,
    wild_generates, cancels, cancels, pings, pings,
    st.fixed_dictionaries({"type": json_values}), json_values.map(Whole),
    st.text(alphabet=clean_chars, max_size=30),  # not JSON (but encodable text)
    st.binary(max_size=16),  # a binary frame
    st.binary(min_size=1, max_size=8).map(lambda b: ("invalid-utf8", b"\xff" + b)),  # a text frame, not UTF-8
    st.just("oversize"))


def wire(batch: list) -> list:
    """Generated messages as sent: JSON objects as text, each generate's string id made unique in its example
    (so frames can be told apart; a duplicate id is the client's own confusion), a cancel of `@previous`
    naming the latest generate."""
    out, previous = [], "none"
    for i, m in enumerate(batch):
        if isinstance(m, dict):
            if m.get("type") == "generate" and isinstance(m.get("id"), str):
                m = {**m, "id": f"{m['id']}~{i}"}
                previous = m["id"]
            elif m.get("id") == "@previous":
                m = {**m, "id": previous}
            m = to_json(m)
        elif isinstance(m, Whole):
            m = to_json(m.value)
        out.append(m)
    return out


# --- one example --------------------------------------------------------------------------------------------


def possibly_silent(text) -> bool:
    """A cancel that names nothing or a string id: ignored when that id is not running (PROTOCOL.md)."""
    try:
        msg = json.loads(text) if isinstance(text, str) else None
    except ValueError:
        return False
    return (isinstance(msg, dict) and msg.get("type") == "cancel" and set(msg) <= {"type", "id"}
            and isinstance(msg.get("id"), str | None))


def own_id(text) -> str | None:
    try:
        msg = json.loads(text) if isinstance(text, str) else None
    except ValueError:
        return None
    rid = msg.get("id") if isinstance(msg, dict) else None
    return rid if isinstance(rid, str) else None


class Connection:
    """One client connection and what it has heard: every frame, and the frames of each request id."""

    def __init__(self, server, limit: int):
        self.ws = open_ws(server, token=None)
        self.ws.__enter__()
        self.frames = [recv(self.ws)]
        self.by_id: dict[str, list[dict]] = {}
        self.limit = limit
        self.closed: int | None = None

    def send(self, message) -> None:
        if message == "oversize":
            self.ws.send('{"type": "ping", "pad": "' + "x" * self.limit + '"}')
        elif isinstance(message, tuple):
            self.ws.send(message[1], text=True)
        else:
            self.ws.send(message)

    def read(self) -> dict | None:
        try:
            f = recv(self.ws, timeout=30)
        except ConnectionClosed as e:
            self.closed = e.rcvd.code if e.rcvd is not None else -1
            return None
        self.frames.append(f)
        STARTED[0] += f["type"] == "started"
        if "id" in f:
            self.by_id.setdefault(f["id"], []).append(f)
        return f

    def heard_of(self, rid: str | None, known: set[str]) -> bool:
        """A frame of request `rid` (None: of a request the server named) that was not in `known`."""
        new = set(self.by_id) - known
        return rid in new if rid is not None else any(ASSIGNED_ID.match(r) for r in new)

    def ended(self, rid: str) -> bool:
        return any(f["type"] in ("done", "error") for f in self.by_id.get(rid, []))

    def close(self) -> None:
        self.ws.__exit__(None, None, None)


def check_request_frames(rid: str, frames: list[dict]) -> None:
    kinds = [f["type"] for f in frames]
    assert not [f for f in frames if f["type"] == "error" and f["error"]["code"] == "internal"], (rid, frames)
    if kinds == ["error"]:
        return
    assert kinds[0] == "started" and kinds[-1] in ("done", "error"), (rid, kinds)
    assert set(kinds[1:-1]) <= {"progress", "delta"}, (rid, kinds)


def run_example(server, limit: int, batch: list) -> None:
    conn = Connection(server, limit)
    try:
        for i, message in enumerate(batch):
            sentinel = -777_000_000 - i
            seen, known = len(conn.frames), set(conn.by_id)
            conn.send(message)
            if conn.closed is None:
                try:
                    conn.ws.send(json.dumps({"type": "ping", "t": sentinel}))
                except ConnectionClosed:
                    pass
            while conn.closed is None:
                f = conn.read()
                if f is not None and f["type"] == "pong" and f["t"] == sentinel:
                    break
            if conn.closed is not None:
                assert conn.closed in DOCUMENTED_CLOSE_CODES - {proto.CLOSE_ENGINE_FAULT}, (message, conn.closed)
                check_connection(conn)
                conn = Connection(server, limit)  # requests of the closed connection were cancelled with it
                continue
            heard = conn.frames[seen:-1]
            if possibly_silent(message) or any(f["type"] == "pong" or (f["type"] == "error" and "id" not in f)
                                               for f in heard):
                continue
            rid = own_id(message)  # a generate the server accepted answers once the engine starts it
            while not conn.heard_of(rid, known) and conn.read() is not None:
                pass
            assert conn.closed is None, (message, heard)
        end_requests(conn)
        assert conn.closed is None, conn.closed
        check_connection(conn)
    finally:
        conn.close()


def run_pipelined(server, limit: int, batch: list) -> None:
    """The messages back to back (a cancel lands in a prefill, a generate behind a running one): the same
    invariants except the one-by-one answer check."""
    conn = Connection(server, limit)
    try:
        try:
            for message in batch + [json.dumps({"type": "ping", "t": -1})]:
                conn.send(message)
        except ConnectionClosed:
            pass
        while conn.closed is None:
            f = conn.read()
            if f is not None and f["type"] == "pong" and f["t"] == -1:
                break
        end_requests(conn)
        assert conn.closed in (None, *DOCUMENTED_CLOSE_CODES - {proto.CLOSE_ENGINE_FAULT}), (batch, conn.closed)
        check_connection(conn)
    finally:
        conn.close()


def end_requests(conn: Connection) -> None:
    """Cancel what still runs (a default max_tokens is long) and read until every request has ended."""
    if conn.closed is None and any(not conn.ended(r) for r in conn.by_id):
        conn.ws.send('{"type": "cancel"}')
    while conn.closed is None and any(not conn.ended(r) for r in conn.by_id) and conn.read() is not None:
        pass


def check_connection(conn: Connection) -> None:
    assert [f["seq"] for f in conn.frames] == list(range(1, len(conn.frames) + 1))
    internal = [f for f in conn.frames if f["type"] == "error" and f["error"]["code"] == "internal"]
    assert not internal, internal  # a client's message is never an engine or server fault
    for rid, frames in conn.by_id.items():
        if conn.closed is None or conn.ended(rid):
            check_request_frames(rid, frames)


# --- the test -------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def server():
    s = ServerProcess("--chunk", "64", "--context", str(CONTEXT), "--drain", str(DRAIN_S))
    yield s
    s.kill()


def test_no_generated_message_breaks_a_connection_an_invariant_or_the_server(server):
    from server.app import STOP_BOUND_S

    reference = prompt(63, 8)
    with open_ws(server, token=None) as ws:
        recv(ws)
        limit = None
        before = token_ids(generate(ws, "before", reference, 4))
    limit = proto.max_message_bytes(CONTEXT)
    deadline = time.monotonic() + BUDGET_S
    ran = []

    @settings(max_examples=MAX_EXAMPLES, deadline=None, derandomize=True, database=None,
              phases=(Phase.explicit, Phase.generate, Phase.shrink),
              suppress_health_check=list(HealthCheck))
    @given(st.lists(messages, min_size=1, max_size=6).map(wire), st.booleans())
    def example(batch, pipelined):
        if time.monotonic() > deadline:
            return  # the time budget is spent: the remaining examples do nothing
        ran.append(len(batch))
        (run_pipelined if pipelined else run_example)(server, limit, batch)

    example()
    with open_ws(server, token=None) as ws:
        recv(ws)
        after = token_ids(generate(ws, "after", reference, 4))
    assert after == before
    wait_until = time.monotonic() + 10
    while metric(server, "decode_connections") != 0 and time.monotonic() < wait_until:
        time.sleep(0.05)
    assert metric(server, "decode_connections") == 0
    log = "".join(server.lines)
    assert "Traceback" not in log and "connection handler failed" not in log, log[-3000:]
    t0 = time.monotonic()
    assert server.stop(timeout=DRAIN_S + STOP_BOUND_S + 10) == 0
    assert time.monotonic() - t0 < DRAIN_S + STOP_BOUND_S
    assert len(ran) >= 20, f"only {len(ran)} examples ran within {BUDGET_S} s"
    print(f"fuzz: {len(ran)} examples, {sum(ran)} messages, {STARTED[0]} generates started")


# --- the HTTP API's bodies -------------------------------------------------------------------------------------

API_BUDGET_S = 45.0
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
    "a": {"type": "string"}}}}}
CALL = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"a": "x"}'}}
API_BODIES = {  # route -> a valid body the mutations start from
    "/v1/chat/completions": {"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "q"},
                                          {"role": "assistant", "content": "", "tool_calls": [CALL]},
                                          {"role": "tool", "tool_call_id": "c1", "content": "r"}],
                             "tools": [TOOL], "tool_choice": "auto", "max_tokens": 2,
                             "response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": {}}}},
    "/v1/completions": {"prompt": "hello", "max_tokens": 2},
    "/v1/responses": {"input": [{"role": "user", "content": "q"}, {"type": "function_call", "call_id": "c1",
                                                                    "name": "f", "arguments": "{}"},
                                {"type": "function_call_output", "call_id": "c1", "output": "r"}],
                      "instructions": "i", "tools": [{"type": "function", "name": "f", "parameters": {}}],
                      "max_output_tokens": 2, "text": {"format": {"type": "text"}}},
    "/v1/messages": {"max_tokens": 2, "system": "s", "messages": [
        {"role": "user", "content": "q"}, {"role": "assistant", "content": [
            {"type": "tool_use", "id": "t1", "name": "f", "input": {"a": "x"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "r"}]}],
        "tools": [{"name": "f", "input_schema": {"type": "object"}}], "tool_choice": {"type": "auto"}},
    "/v1/messages/count_tokens": {"messages": [{"role": "user", "content": "q"}]},
}
API_PATHS = {  # route -> where a wrong value goes (nested paths reach the tool schemas and call arguments)
    "/v1/chat/completions": ["messages", "messages.0", "messages.1.content", "messages.2.tool_calls",
                             "messages.2.tool_calls.0.function", "messages.2.tool_calls.0.function.arguments",
                             "messages.3.content", "tools", "tools.0.function", "tools.0.function.parameters",
                             "tools.0.function.parameters.properties", "tool_choice", "tool_choice.function",
                             "response_format", "response_format.json_schema.schema", "max_tokens", "stream",
                             "thinking", "reasoning_effort", "stop", "seed", "n", "temperature"],
    "/v1/completions": ["prompt", "max_tokens", "stream", "stop", "temperature", "echo", "best_of"],
    "/v1/responses": ["input", "input.0", "input.0.content", "input.1", "input.1.arguments", "input.2.output",
                      "instructions", "tools", "tools.0.parameters", "tool_choice", "text", "text.format",
                      "reasoning", "max_output_tokens", "stream", "previous_response_id"],
    "/v1/messages": ["messages", "messages.0.content", "messages.1.content.0", "messages.1.content.0.input",
                     "messages.2.content.0.content", "system", "tools", "tools.0.input_schema",
                     "tools.0.input_schema.properties", "tool_choice", "thinking", "max_tokens", "stream",
                     "stop_sequences"],
    "/v1/messages/count_tokens": ["messages", "messages.0.content", "system", "tools", "thinking"],
}


def put(doc, path: str, value):
    """`doc` with `value` at the dotted `path` (list indices as numbers), where the path exists."""
    doc = json.loads(json.dumps(doc))
    *head, last = path.split(".")
    node = doc
    for key in head:
        key = int(key) if isinstance(node, list) else key
        try:
            node = node[key]
        except (KeyError, IndexError, TypeError):
            return doc
    if isinstance(node, dict):
        node[last] = value
    elif isinstance(node, list) and last.isdigit() and int(last) < len(node):
        node[int(last)] = value
    return doc


# what broke the encoder once: objects nested past any writer's recursion, arguments text of 100,000 "[", a
# named tool choice whose function is not an object
deep_objects = st.integers(min_value=900, max_value=1100).map(lambda d: Raw('{"a":' * d + "1" + "}" * d))
api_values = st.one_of(json_values, deep_objects, st.just("[" * 100_000),
                       st.builds(lambda f: {"type": "function", "function": f}, json_values))
routes = st.sampled_from(list(API_BODIES))
mutated_bodies = routes.flatmap(lambda route: st.builds(
    lambda path, value: (route, put(API_BODIES[route], path, value)), st.sampled_from(API_PATHS[route]), api_values))
api_bodies = st.one_of(
    mutated_bodies, mutated_bodies, mutated_bodies,
    routes.flatmap(lambda route: st.builds(lambda extra: (route, {**API_BODIES[route], **extra}), st.dictionaries(
        st.sampled_from([p for p in API_PATHS[route] if "." not in p]), api_values, max_size=3))),
    st.builds(lambda route, value: (route, value), st.sampled_from(list(API_BODIES)), json_values),
    st.builds(lambda route, stream: (route, {**API_BODIES[route], "stream": stream}),
              st.sampled_from(list(API_BODIES)), st.booleans()))


def post_api(port: int, route: str, body) -> tuple[int, str, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    try:
        conn.request("POST", route, body=to_json(body).encode(), headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        return resp.status, resp.getheader("Content-Type", ""), resp.read()
    finally:
        conn.close()


def check_api_answer(route: str, status: int, kind: str, data: bytes) -> None:
    assert status < 500 or status == 503, (route, status, data[:500])
    if kind.startswith("text/event-stream"):
        text = data.decode()
        assert text.rstrip().endswith(("data: [DONE]", '"type":"message_stop"}', '"type":"response.completed"}',
                                       '"type":"response.incomplete"}', '"type":"error"}')) or (
            '"error"' in text), text[-500:]
        assert '"code":"internal"' not in text and '"type":"api_error"' not in text, text[-500:]
        return
    doc = json.loads(data)
    if status >= 400:
        shaped = doc.get("type") == "error" if route.startswith("/v1/messages") else "error" in doc
        assert shaped and "internal" not in json.dumps(doc), (route, doc)


@pytest.fixture(scope="module")
def api_server():
    s = ServerProcess("--chunk", "64", "--context", str(CONTEXT))
    yield s
    assert s.stop() == 0


def test_no_generated_api_body_gets_a_server_error_or_breaks_the_server(api_server):
    server = api_server
    deadline = time.monotonic() + API_BUDGET_S
    ran = []

    @settings(max_examples=MAX_EXAMPLES, deadline=None, derandomize=True, database=None,
              phases=(Phase.explicit, Phase.generate), suppress_health_check=list(HealthCheck))
    @given(api_bodies)
    def example(case):
        if time.monotonic() > deadline:
            return
        route, body = case
        ran.append(route)
        check_api_answer(route, *post_api(server.port, route, body))

    example()
    assert server.proc.poll() is None and server.http("/healthz")[0] == 200
    log = "".join(server.lines)
    assert "Traceback" not in log and "engine fault" not in log, log[-3000:]
    assert len(ran) >= 30, f"only {len(ran)} bodies within {API_BUDGET_S} s"
    print(f"api fuzz: {len(ran)} bodies, {len(set(ran))} routes")
