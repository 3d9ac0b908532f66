"""Every kind of bad input gets its error code (or close code) and the server keeps serving: the same
connection (or a new one, after a close) runs a correct request afterwards."""

import time

import pytest
from websockets.exceptions import ConnectionClosed

from tests.server_harness import (
    ServerProcess,
    generate,
    metric,
    open_ws,
    prompt,
    raw_http,
    recv,
    send,
    token_ids,
    until_end,
)

LIMIT = 256  # --context: small, so over-the-limit prompts are cheap


@pytest.fixture(scope="module")
def server():
    s = ServerProcess("--chunk", "64", "--context", str(LIMIT))
    yield s
    assert s.stop() == 0


BAD = [  # (message, code, param)
    ("{nope", "invalid_request", "message"),
    ("[1, 2]", "invalid_request", "message"),
    ('{"type": "launch"}', "invalid_request", "type"),
    ('{"no_type": 1}', "invalid_request", "type"),
    ('{"type": "generate", "input_ids": [1, 2], "max_tokens": "ten"}', "invalid_request", "max_tokens"),
    ('{"type": "generate", "input_ids": [1, 2], "max_tokens": 2.5}', "invalid_request", "max_tokens"),
    ('{"type": "generate", "input_ids": "1 2 3"}', "invalid_request", "input_ids"),
    ('{"type": "generate", "input_ids": [1, true]}', "invalid_request", "input_ids"),
    ('{"type": "generate", "input_ids": [1, 99999]}', "invalid_request", "input_ids"),
    ('{"type": "generate", "prompt": 5}', "invalid_request", "prompt"),
    ('{"type": "generate"}', "invalid_request", "prompt"),
    ('{"type": "generate", "prompt": "a", "input_ids": [1]}', "invalid_request", "prompt"),
    ('{"type": "generate", "messages": [{"role": "wizard", "content": "x"}]}', "invalid_request",
     "messages[0].role"),
    ('{"type": "generate", "input_ids": [1], "sampling": 5}', "invalid_request", "sampling"),
    ('{"type": "generate", "input_ids": [1], "sampling": {"temp": 1}}', "invalid_request", "sampling.temp"),
    ('{"type": "generate", "input_ids": [1], "ignore_eos": "yes"}', "invalid_request", "ignore_eos"),
    ('{"type": "generate", "input_ids": [1], "stop": "x"}', "invalid_request", "stop"),
    ('{"type": "generate", "input_ids": [1], "timings": "all"}', "invalid_request", "timings"),
    ('{"type": "generate", "input_ids": [1], "max_token": 3}', "invalid_request", "max_token"),
    ('{"type": "generate", "id": 7, "input_ids": [1]}', "invalid_request", "id"),
    ('{"type": "generate", "input_ids": [1], "max_tokens": -1}', "invalid_request", "max_tokens"),
    ('{"type": "generate", "input_ids": [1], "max_tokens": 0}', "invalid_request", "max_tokens"),
    ('{"type": "generate", "input_ids": [1], "max_tokens": 1000000000}', "invalid_request", "max_tokens"),
    ('{"type": "generate", "input_ids": [1], "max_tokens": 100000000000000000000000000000}', "invalid_request",
     "max_tokens"),
    ('{"type": "generate", "input_ids": [1], "sampling": {"temperature": 5}}', "invalid_request",
     "sampling.temperature"),
    ('{"type": "generate", "input_ids": [1], "sampling": {"temperature": -0.5}}', "invalid_request",
     "sampling.temperature"),
    ('{"type": "generate", "input_ids": [1], "sampling": {"top_p": 0}}', "invalid_request", "sampling.top_p"),
    ('{"type": "generate", "input_ids": [1], "sampling": {"top_k": "all"}}', "invalid_request", "sampling.top_k"),
    ('{"type": "cancel", "id": 3}', "invalid_request", "id"),
    ('{"type": "cancel", "id": "never-started"}', "invalid_request", "id"),
    ('{"type": "ping", "t": "now"}', "invalid_request", "t"),
]


def test_each_bad_message_gets_an_error_naming_its_field_and_the_connection_keeps_serving(server):
    with open_ws(server, token=None) as ws:
        assert recv(ws)["state"] == "ready"
        for message, code, param in BAD:
            ws.send(message)
            f = recv(ws)
            assert f["type"] == "error", (message, f)
            assert (f["error"]["code"], f["error"].get("param")) == (code, param), (message, f)
            assert f["retryable"] is False and f["error"]["message"]
        ws.send(b"\x00binary")
        f = recv(ws)
        assert f["type"] == "error" and f["error"]["code"] == "invalid_request"
        frames = generate(ws, "after", prompt(21, 5), 3)
    assert frames[-1]["type"] == "done" and len(token_ids(frames)) == 3


def test_an_out_of_range_message_names_the_limit_and_the_fix(server):
    with open_ws(server, token=None) as ws:
        recv(ws)
        send(ws, {"type": "generate", "input_ids": [1], "max_tokens": 0})
        f = recv(ws)
    assert f["error"]["message"] == f"max_tokens=0: must be an integer in 1..{LIMIT - 1}"


def test_prompts_over_the_context_limit_get_context_length_exceeded(server):
    with open_ws(server, token=None) as ws:
        recv(ws)
        send(ws, {"type": "generate", "id": "long", "input_ids": prompt(22, LIMIT + 10), "max_tokens": 4})
        f = recv(ws)
        assert f["type"] == "error" and f["id"] == "long"
        assert (f["error"]["code"], f["error"]["param"]) == ("context_length_exceeded", "input_ids")
        # fits alone, not with max_tokens: the engine refuses it before any prefill
        send(ws, {"type": "generate", "id": "tight", "input_ids": prompt(23, LIMIT - 10), "max_tokens": 50})
        f = recv(ws)
        assert f["type"] == "error" and f["id"] == "tight", f
        assert (f["error"]["code"], f["error"]["param"]) == ("context_length_exceeded", "max_tokens")
        frames = generate(ws, "ok", prompt(24, 5), 2)
    assert frames[-1]["type"] == "done"


def test_an_oversize_message_closes_with_1009_and_the_server_serves_the_next_connection(server):
    with open_ws(server, token=None) as ws:
        limit = recv(ws)["limits"]["max_message_bytes"]
        ws.send('{"type": "generate", "prompt": "' + "x" * (limit + 10) + '"}')
        with pytest.raises(ConnectionClosed) as e:
            while True:
                recv(ws, timeout=30)
    assert e.value.rcvd is not None and e.value.rcvd.code == 1009
    with open_ws(server, token=None) as ws:
        assert recv(ws)["state"] == "ready"
        frames = generate(ws, "next", prompt(25, 4), 2)
    assert frames[-1]["type"] == "done"


# --- values the encoder could not write back (issue 17: A and B) ------------------------------------------


def test_a_generate_whose_id_is_a_lone_surrogate_is_refused_and_the_connection_serves_on(server):
    with open_ws(server, token=None) as ws:
        recv(ws)
        ws.send('{"type":"generate","id":"\\ud800","prompt":"a","max_tokens":2}')  # the JSON escape, as sent
        f = recv(ws)
        assert f["type"] == "error" and "id" not in f, f
        assert (f["error"]["code"], f["error"]["param"]) == ("invalid_request", "id")
        frames = generate(ws, "after-surrogate", prompt(26, 4), 2)
    assert [f["type"] for f in frames][0] == "started" and frames[-1]["type"] == "done"


def test_a_ping_whose_t_has_400_digits_is_refused_naming_t_and_the_next_ping_gets_its_pong(server):
    with open_ws(server, token=None) as ws:
        seq = recv(ws)["seq"]
        ws.send('{"type": "ping", "t": ' + "9" * 400 + "}")
        f = recv(ws)
        assert (f["type"], f["error"]["code"], f["error"]["param"]) == ("error", "invalid_request", "t")
        send(ws, {"type": "ping", "t": 5})
        pong = recv(ws)
    assert pong["type"] == "pong" and pong["t"] == 5 and seq < f["seq"] < pong["seq"]


def test_a_lone_surrogate_in_the_prompt_or_a_message_is_invalid_request_and_the_cached_prefix_survives(server):
    internal = 'decode_errors_total{code="internal"}'
    invalid = 'decode_errors_total{code="invalid_request"}'
    internal_before, invalid_before = metric(server, internal), metric(server, invalid)
    text = "Zebras and yaks walked over the quiet hills at dawn"
    with open_ws(server, token=None) as ws:
        recv(ws)
        send(ws, {"type": "generate", "id": "first", "prompt": text, "max_tokens": 2})
        assert until_end(ws, "first")[-1]["type"] == "done"
        ws.send('{"type": "generate", "id": "p", "prompt": "' + text + '\\udc00", "max_tokens": 2}')
        ws.send('{"type": "generate", "id": "m", "messages": [{"role": "user", "content": "hi \\ud800"}]}')
        errors = [recv(ws), recv(ws)]
        send(ws, {"type": "generate", "id": "again", "prompt": text + " and dusk", "max_tokens": 2})
        frames = until_end(ws, "again")
    assert [(e["id"], e["error"]["code"], e["error"]["param"]) for e in errors] == [
        ("p", "invalid_request", "prompt"), ("m", "invalid_request", "messages[0].content")]
    started = frames[0]
    assert started["type"] == "started" and started["cached_tokens"] > 0, started  # the state was not reset
    assert metric(server, internal) == internal_before and metric(server, invalid) == invalid_before + 2


def test_the_connections_gauge_returns_to_0_when_every_client_has_left(server):
    with open_ws(server, token=None) as ws:
        recv(ws)
        ws.send('{"type":"generate","id":"\\ud800","prompt":"a","max_tokens":2}')
        recv(ws)
        send(ws, {"type": "generate", "id": "left-running", "input_ids": prompt(27, 4), "max_tokens": 200,
                  "ignore_eos": True})
        assert recv(ws)["type"] == "started"
    deadline = time.monotonic() + 10
    while metric(server, "decode_connections") != 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert metric(server, "decode_connections") == 0 and metric(server, "decode_running_requests") == 0


# --- HTTP methods (issue 17: D) ---------------------------------------------------------------------------


def test_methods_other_than_get_get_405_with_allow_and_head_gets_the_headers_without_a_body(server):
    """The API routes answer OPTIONS (a CORS preflight) and their 405 in the API's error shape."""
    for path, allow in [("/healthz", "GET, HEAD"), ("/readyz", "GET, HEAD"), ("/metrics", "GET, HEAD"),
                        ("/v1/stream", "GET"), ("/v1/models", "GET, HEAD"), ("/v1/chat/completions", "POST"),
                        ("/v1/messages", "POST"), ("/v1/responses", "POST"), ("/v1/models/default_model", "GET, HEAD"),
                        ("/v1/messages/count_tokens", "POST")]:
        api = path.startswith("/v1/") and path != "/v1/stream"
        for method in ("DELETE", "PUT", "OPTIONS", "TRACE", "PATCH", "POST", "GET"):
            if method in allow:
                continue
            status, headers, body = raw_http(server.port, f"{method} {path} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
            if api and method == "OPTIONS":
                assert (status, headers.get("allow")) == (204, allow + ", OPTIONS"), (path, status, body)
                continue
            assert (status, headers.get("allow")) == (405, allow), (method, path, status, body)
            if api:
                assert headers["content-type"] == "application/json" and b"is not allowed on" in body, body
        # a method HTTP does not define: the HTTP parser's 400, naming it, before any route
        status, _, body = raw_http(server.port, f"FROBNICATE {path} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
        assert status == 400 and b"method" in body.lower(), (path, status, body)
    status, headers, body = raw_http(server.port, b"HEAD /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
    assert (status, headers["content-length"], body) == (200, "3", b"")
    status, headers, body = raw_http(server.port, b"HEAD /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
    assert status == 200 and int(headers["content-length"]) > 1000 and body == b""
    assert headers["content-type"].startswith("text/plain; version=")
    assert "Traceback" not in "".join(server.lines)
