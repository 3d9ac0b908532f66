"""The front door as an attacker and as browsers and agent SDKs find it, on an in-process server with a scripted
engine (tests/scripted_engine.py): the browser-origin policy of the API (403, CORS preflight, 415, a repeated
Origin), credentials that are not UTF-8, the chat encoder's refusals of what it cannot render (never an engine
fault), every error in the API's shape (404 and 405 included), the routes agents need (/v1/responses with the
official SDK, models.retrieve, messages.count_tokens), streamed usage as Anthropic streams it (langchain reads
it), SSE keep-alives while a prompt prefills, assistant prefill, and dropped streams that leave the gauges
at 0. Inputs are fresh random words each run."""

import json
import random
import socket
import time

import anthropic
import openai
import orjson
import pytest

from tests.scripted_engine import scripted_engine, words
from tests.server_harness import TOKEN, InProcessServer, raw_http

GOOD = "https://good.example"
CITY = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}


@pytest.fixture(scope="module")
def box():
    engine, session = scripted_engine()
    server = InProcessServer(engine, token=TOKEN, origins=(GOOD,), sse_keepalive_s=0.2)
    yield server, session
    assert server.stop() == 0


@pytest.fixture
def oa(box):
    return openai.OpenAI(base_url=box[0].base + "/v1", api_key=TOKEN, max_retries=0, timeout=30)


@pytest.fixture
def an(box):
    return anthropic.Anthropic(base_url=box[0].base, api_key=TOKEN, max_retries=0, timeout=30)


DEEP = '"DEEP"'  # in a body: stands for a schema nested 1,000 levels (JSON writers stop far short of it)


def post(server, path: str, body, headers: str = "", auth: bool = True):
    """A raw POST (`body` JSON-encoded unless bytes, DEEP replaced); (status, headers, decoded JSON or bytes)."""
    data = body if isinstance(body, bytes) else orjson.dumps(body).replace(
        DEEP.encode(), b'{"type":"object","properties":{"x":' * 500 + b'{"type":"string"}' + b"}}" * 500)
    head = f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Length: {len(data)}\r\n"
    head += f"Authorization: Bearer {TOKEN}\r\n" if auth else ""
    if "content-type" not in headers.lower():
        head += "Content-Type: application/json\r\n"
    status, hdrs, raw = raw_http(server.port, head.encode() + headers.encode("latin-1") + b"\r\n" + data)
    try:
        return status, hdrs, orjson.loads(raw)
    except orjson.JSONDecodeError:
        return status, hdrs, raw


USER = [{"role": "user", "content": "hi"}]
FN = {"type": "function", "function": {"name": "f", "parameters": CITY}}
ENCODER_ATTACKS = [  # (route, body, the field the 400 names) -- the outside attack's repros
    ("/v1/chat/completions", {"messages": USER, "tools": [FN], "tool_choice": {"type": "function", "function": [1]}},
     "tool_choice"),
    ("/v1/chat/completions", {"messages": [*USER, {"role": "assistant", "content": "", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "[" * 100_000}}]}, *USER]},
     "messages[1].tool_calls[0].function.arguments"),
    ("/v1/chat/completions", {"messages": USER, "tools": [{"type": "function", "function": {
        "name": "f", "parameters": DEEP[1:-1]}}]}, "tools[0].function"),
    ("/v1/chat/completions", {"messages": USER, "response_format": {"type": "json_schema", "json_schema": {
        "name": "s", "schema": DEEP[1:-1]}}}, "response_format"),
    ("/v1/messages", {"max_tokens": 5, "messages": USER, "tools": [{"name": "f", "input_schema": DEEP[1:-1]}]},
     "tools[0].function"),
    ("/v1/messages", {"max_tokens": 5, "messages": [*USER, {"role": "assistant", "content": [
        {"type": "tool_use", "id": "t", "name": "f", "input": DEEP[1:-1]}]}, {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "t", "content": "r"}]}]}, "messages[1].content[0].input"),
]


@pytest.mark.parametrize("route,body,field", ENCODER_ATTACKS, ids=[f"{r}:{f}" for r, _, f in ENCODER_ATTACKS])
def test_input_the_encoder_cannot_render_is_a_400_naming_the_field_and_the_cached_prefix_survives(box, oa, route,
                                                                                                     body, field):
    server, session = box
    session.script("a</think>b")
    history = [{"role": "user", "content": words()}]
    first = oa.chat.completions.create(model="m", messages=history, max_tokens=4)
    status, _, answer = post(server, route, body)
    assert status == 400, answer
    message = json.dumps(answer)
    assert field in message and ("nested deeper than 64" in message or "tool_choice" in message), answer
    session.script("c</think>d")
    history += [{"role": "assistant", "content": first.choices[0].message.content}, {"role": "user", "content": "x"}]
    again = oa.chat.completions.create(model="m", messages=history, max_tokens=4)
    assert again.usage.prompt_tokens_details.cached_tokens > 0  # no engine fault reset the state


@pytest.mark.parametrize("credential", [b"Authorization: Bearer \xff\xfe", b"x-api-key: \xff", b"Authorization: \xff"])
def test_a_credential_that_is_not_utf8_is_401_on_every_route(box, credential):
    server, _ = box
    for request in (b"GET /v1/models HTTP/1.1", b"GET /metrics HTTP/1.1", b"POST /v1/chat/completions HTTP/1.1",
                    b"POST /v1/messages HTTP/1.1", b"POST /v1/responses HTTP/1.1",
                    b"GET /v1/stream HTTP/1.1\r\nUpgrade: websocket\r\nConnection: Upgrade\r\nSec-WebSocket-Version: 13"
                    b"\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ=="):
        status, _, body = raw_http(server.port, request + b"\r\nHost: x\r\nContent-Length: 0\r\n" + credential
                                   + b"\r\n\r\n")
        assert status == 401, (request, status, body)
    assert server.app.state == "ready"


def test_a_cross_origin_page_is_refused_and_an_allowed_origin_gets_cors(box):
    server, session = box
    evil = "Origin: https://evil.example\r\n"
    for path in ("/v1/chat/completions", "/v1/messages", "/v1/responses"):
        status, headers, body = post(server, path, b"{}", evil + "Content-Type: text/plain\r\n", auth=False)
        assert status == 403 and "access-control-allow-origin" not in headers, (path, body)
        status, _, body = post(server, path, b"{}", evil + "Content-Type: text/plain\r\n")
        assert status == 403, (path, body)  # a token does not make a page an allowed origin
        status, _, body = post(server, path, b"{}", f"Origin: {GOOD}\r\nContent-Type: text/plain\r\n")
        assert status == 415, (path, body)  # a "simple" cross-origin request cannot skip the preflight
        status, _, body = post(server, path, b"{}", f"Origin: {GOOD}\r\nOrigin: {GOOD}\r\n")
        assert status == 400 and "Origin" in json.dumps(body), (path, body)
    preflight = "OPTIONS /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAccess-Control-Request-Method: POST\r\n"
    status, headers, _ = raw_http(server.port, f"{preflight}Origin: {GOOD}\r\n\r\n".encode())
    assert status == 204 and headers["access-control-allow-origin"] == GOOD
    assert "POST" in headers["access-control-allow-methods"] and "authorization" in headers[
        "access-control-allow-headers"]
    status, headers, _ = raw_http(server.port, f"{preflight}{evil}\r\n".encode())
    assert status == 403 and "access-control-allow-origin" not in headers
    session.script("r</think>ok")
    status, headers, body = post(server, "/v1/chat/completions", {"messages": USER, "max_tokens": 3},
                                 f"Origin: {GOOD}\r\n")
    assert status == 200 and headers["access-control-allow-origin"] == GOOD and headers["vary"] == "Origin", body


def test_every_error_under_v1_is_in_the_apis_shape(box):
    server, _ = box
    auth = f"Authorization: Bearer {TOKEN}\r\n"
    for path, anthropic_shape in (("/v1/nope", False), ("/v1/chat/completions/x", False), ("/v1/messages/x", True)):
        status, headers, body = raw_http(server.port, f"GET {path} HTTP/1.1\r\nHost: x\r\n{auth}\r\n".encode())
        doc = orjson.loads(body)
        assert status == 404 and headers["content-type"] == "application/json", body
        assert (doc["type"] == "error") if anthropic_shape else (doc["error"]["code"] == "not_found"), doc
    status, headers, body = raw_http(server.port, f"PUT /v1/responses HTTP/1.1\r\nHost: x\r\n{auth}\r\n".encode())
    assert status == 405 and headers["allow"] == "POST" and orjson.loads(body)["error"]["code"] == "method_not_allowed"
    status, _, body = post(server, "/v1/chat/completions", b"{", "Content-Type: application/json\r\n")
    assert status == 400 and body["error"]["type"] == "invalid_request_error"


def test_models_retrieve_and_count_tokens_answer_as_the_sdks_expect(box, oa, an):
    server, session = box
    assert oa.models.retrieve("scripted").id == "scripted"
    with pytest.raises(openai.NotFoundError):
        oa.models.retrieve("gpt-nonexistent")
    messages, system = [{"role": "user", "content": words(12)}], words(3)
    counted = an.messages.count_tokens(model="m", messages=messages, system=system).input_tokens
    session.script("a</think>b")
    m = an.messages.create(model="m", max_tokens=5, messages=messages, system=system)
    assert counted == len(session.prompts[-1]) == m.usage.input_tokens + m.usage.cache_read_input_tokens


def test_a_streamed_message_carries_cumulative_usage_and_langchain_reads_the_input_tokens(box, an):
    from langchain_anthropic import ChatAnthropic

    server, session = box
    prompt = words(8)
    session.script(f"{words()}</think>{words(4)}")
    an.messages.create(model="m", max_tokens=50, messages=[{"role": "user", "content": prompt}])
    session.script(f"{words()}</think>{words(4)}")
    with an.messages.stream(model="m", max_tokens=50, messages=[{"role": "user", "content": prompt}]) as s:
        deltas = [ev for ev in s if ev.type == "message_delta"]
    usage = deltas[-1].usage
    assert usage.output_tokens > 0 and usage.cache_read_input_tokens > 0
    assert usage.input_tokens + usage.cache_read_input_tokens == len(session.prompts[-1])
    session.script(f"{words()}</think>{words(4)}")
    llm = ChatAnthropic(model="claude-x", base_url=server.base, api_key=TOKEN, max_tokens=50, max_retries=0)
    total = None
    for chunk in llm.stream(words(5)):
        total = chunk if total is None else total + chunk
    assert total.usage_metadata["input_tokens"] > 0 and total.usage_metadata["output_tokens"] > 0


def test_the_responses_api_streams_and_answers_a_tool_round_trip_and_chains_previous_responses(box, oa):
    server, session = box
    tools = [{"type": "function", "name": "get_weather", "description": "Weather", "parameters": CITY}]
    question, city = words(), words(1)
    session.script(f'{words()}</think>\n\n<｜DSML｜ calls>\n<｜DSML｜ invoke name="get_weather">\n<｜DSML｜ parameter '
                   f'name="city" string="true">{city}</｜DSML｜ parameter>\n</｜DSML｜ invoke>\n</｜DSML｜ calls>')
    events = list(oa.responses.create(model="m", input=question, instructions="Be brief.", tools=tools, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.completed"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    first = events[-1].response
    [call] = [o for o in first.output if o.type == "function_call"]
    assert call.name == "get_weather" and json.loads(call.arguments) == {"city": city}
    answer = words(5)
    session.script(f"{words()}</think>{answer}")
    follow = oa.responses.create(model="m", previous_response_id=first.id, tools=tools,
                                 input=[{"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}])
    assert follow.output_text == answer and follow.status == "completed"
    assert [o.type for o in follow.output] == ["reasoning", "message"]
    assert follow.usage.input_tokens_details.cached_tokens > 0  # the prefix cache restored the first turn
    assert "<tool_result>sunny</tool_result>" in session.prompt_text() and "Be brief" not in session.prompt_text()
    session.script(words(40), eos=False)
    short = oa.responses.create(model="m", input=words(), max_output_tokens=5, reasoning={"effort": "none"})
    assert short.status == "incomplete" and short.incomplete_details.reason == "max_output_tokens"
    with pytest.raises(openai.BadRequestError) as e:
        oa.responses.create(model="m", input="x", previous_response_id="resp_unknown")
    assert e.value.body["param"] == "previous_response_id"


def test_an_sse_stream_gets_keepalives_while_its_prompt_prefills(box):
    server, session = box
    session.chunk_delay_s = 0.1  # 0.2 s between keepalives (the box's --sse-keepalive): one every two chunks
    try:
        for path, mark in (("/v1/chat/completions", b": keep-alive\n\n"),
                           ("/v1/messages", b'event: ping\ndata: {"type": "ping"}\n\n')):
            long = words(120)  # a new prompt: nothing of it is cached
            body = {"messages": [{"role": "user", "content": long}], "stream": True, "max_tokens": 2}
            session.script("a</think>b")
            status, _, raw = post(server, path, body, "Connection: close\r\n")
            assert status == 200 and raw.count(mark) >= 2, raw[:400]
    finally:
        session.chunk_delay_s = 0.0


@pytest.mark.parametrize("api", ["openai", "anthropic"])
def test_an_assistant_prefill_is_continued_on_both_routes(box, oa, an, api):
    server, session = box
    start, rest = words(3), words(4)
    session.script(rest)
    if api == "openai":
        r = oa.chat.completions.create(model="m", max_tokens=200, messages=[
            {"role": "user", "content": words()}, {"role": "assistant", "content": start}])
        text = r.choices[0].message.content
    else:
        m = an.messages.create(model="m", max_tokens=200, messages=[
            {"role": "user", "content": words()}, {"role": "assistant", "content": start}])
        text = m.content[-1].text
    assert session.prompt_text().endswith("</think>" + start) and text == rest


def test_dropped_streams_leave_no_request_running_and_every_request_counted(box, oa):
    server, session = box
    ended = sum(server.metric(f'decode_requests_total{{finish_reason="{r}"}}')
                for r in ("stop", "length", "cancelled", "error"))
    drops = 12
    session.token_delay_s = 0.005
    try:
        for _ in range(drops):
            session.script(words(60))
            stream = oa.chat.completions.create(model="m", messages=[{"role": "user", "content": words()}],
                                                max_tokens=200, stream=True, extra_body={"thinking": False})
            chunks = iter(stream)
            for _ in range(random.randint(1, 4)):
                next(chunks)
            stream.close()
    finally:
        session.token_delay_s = 0.0
    deadline = time.monotonic() + 10
    while server.metric("decode_running_requests") and time.monotonic() < deadline:
        time.sleep(0.02)
    assert server.metric("decode_running_requests") == 0
    assert sum(server.metric(f'decode_requests_total{{finish_reason="{r}"}}')
               for r in ("stop", "length", "cancelled", "error")) == ended + drops


def test_an_sse_stream_nobody_reads_is_dropped_within_the_send_deadline_and_its_request_cancelled():
    """The scripted model writes thousands of tokens a second (a context of a million positions, so the
    request may ask for that many): the unread stream fills both sockets' buffers, a write waits 1.5 s (the
    server's --send-deadline), and the client is dropped; the box serves the next call."""
    engine, session = scripted_engine(capacity=1 << 20)
    server = InProcessServer(engine, token=TOKEN, send_deadline_s=1.5)
    try:
        session.script(words(30000), eos=False)
        body = orjson.dumps({"prompt": words(), "max_tokens": 500_000, "stream": True})
        s = socket.socket()
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 2048)
        s.connect(("127.0.0.1", server.port))
        s.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {TOKEN}\r\nContent-Type: "
                  f"application/json\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body)
        deadline = time.monotonic() + 60
        while not server.metric('decode_requests_total{finish_reason="cancelled"}'):
            assert time.monotonic() < deadline, "the unread stream still holds the box"
            time.sleep(0.05)
        s.close()
        assert server.metric('decode_dropped_connections_total{reason="slow_reader"}') == 1
        assert server.metric("decode_running_requests") == 0 and session.cycles < 150_000
        session.scripts.clear()
        session.script("x</think>free")
        client = openai.OpenAI(base_url=server.base + "/v1", api_key=TOKEN, max_retries=0, timeout=30)
        r = client.chat.completions.create(model="m", messages=[{"role": "user", "content": words()}], max_tokens=9)
        assert r.choices[0].message.content == "free"
    finally:
        assert server.stop() == 0


def test_by_default_parallel_calls_wait_in_line_and_all_are_served(box, oa):
    """An agent's batch (langchain's .batch() sends its calls at once): the second to fourth wait for the box."""
    from concurrent.futures import ThreadPoolExecutor

    server, session = box
    assert server.app.config.on_busy == "queue"
    # the box is shared: a request an earlier test left (its client gone) must end before the scripts are set,
    # or it takes one of them
    deadline = time.monotonic() + 30
    while any(s.running is not None for s in (*server.app.sessions, *server.app.calls)):
        assert time.monotonic() < deadline, "the box never went idle"
        time.sleep(0.05)
    session.scripts.clear()
    answers = [words(3) for _ in range(4)]
    for a in answers:
        session.script(f"x</think>{a}")
    session.token_delay_s = 0.01
    try:
        with ThreadPoolExecutor(4) as pool:
            replies = list(pool.map(lambda q: oa.chat.completions.create(
                model="m", messages=[{"role": "user", "content": q}], max_tokens=200), [words() for _ in range(4)]))
    finally:
        session.token_delay_s = 0.0
    assert sorted(r.choices[0].message.content for r in replies) == sorted(answers)
