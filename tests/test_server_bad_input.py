"""Every kind of bad input gets its error code (or close code) and the server keeps serving: the same
connection (or a new one, after a close) runs a correct request afterwards."""

import pytest
from websockets.exceptions import ConnectionClosed

from tests.server_harness import ServerProcess, generate, open_ws, prompt, recv, send, token_ids

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
    ('{"type": "generate", "messages": [{"role": "wizard", "content": "x"}]}', "invalid_request", "messages"),
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
    assert f["error"]["message"] == "max_tokens=0: must be an integer in 1..8192"


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
