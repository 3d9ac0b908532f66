"""One user per box: a second connection is refused with busy and close 1013 (or queued with
--on-busy queue), a second generate on the holder's connection gets busy; plus the prefill keepalive and the
idle timeout that frees a box nobody uses."""

import pytest
from websockets.exceptions import ConnectionClosed

from tests.server_harness import ServerProcess, generate, open_ws, prompt, recv, send, token_ids, until_end


@pytest.fixture(scope="module")
def server():
    s = ServerProcess("--chunk", "8", "--on-busy", "reject")
    yield s
    assert s.stop() == 0


@pytest.fixture(scope="module")
def queue_server():
    # One prefill chunk of a few hundred tokens takes about a second: the engine is quiet meanwhile.
    s = ServerProcess("--on-busy", "queue", "--chunk", "4096", "--keepalive", "0.2", "--idle-timeout", "3")
    yield s
    assert s.stop() == 0


def _closed_code(ws) -> int | None:
    with pytest.raises(ConnectionClosed) as e:
        while True:
            recv(ws, timeout=30)
    return e.value.rcvd.code if e.value.rcvd else None


def _metric(server, name) -> float:
    body = server.http("/metrics")[1]
    return sum(float(line.split()[-1]) for line in body.splitlines() if line.startswith(name + " "))


def test_a_second_connection_while_the_first_streams_gets_busy_and_1013_then_succeeds_once_it_is_done(server):
    busy_before = _metric(server, "decode_busy_rejections_total")
    with open_ws(server, token=None) as first:
        assert recv(first)["state"] == "ready"
        send(first, {"type": "generate", "id": "a", "input_ids": prompt(31, 6), "max_tokens": 30,
                     "ignore_eos": True})
        frames = [recv(first)]
        while frames[-1]["type"] != "delta":
            frames.append(recv(first))
        with open_ws(server, token=None) as second:
            hello = recv(second)
            err = recv(second)
            code = _closed_code(second)
        assert hello["type"] == "hello" and hello["state"] == "busy"
        assert err["type"] == "error" and err["error"]["code"] == "busy"
        assert err["retryable"] is True and err["retry_after_ms"] > 0
        assert code == 1013
        frames += until_end(first, "a")
    assert [f["type"] for f in frames].count("done") == 1 and len(token_ids(frames)) == 30
    assert _metric(server, "decode_busy_rejections_total") == busy_before + 1
    with open_ws(server, token=None) as again:
        assert recv(again)["state"] == "ready"
        assert generate(again, "b", prompt(32, 4), 3)[-1]["type"] == "done"


def test_a_second_generate_on_the_same_connection_gets_busy_and_the_first_still_ends_once(server):
    with open_ws(server, token=None) as ws:
        recv(ws)
        send(ws, {"type": "generate", "id": "one", "input_ids": prompt(33, 6), "max_tokens": 20, "ignore_eos": True})
        send(ws, {"type": "generate", "id": "two", "input_ids": prompt(34, 6), "max_tokens": 2})
        frames = until_end(ws, "one")
    errors = [f for f in frames if f["type"] == "error"]
    assert len(errors) == 1 and errors[0]["id"] == "two" and errors[0]["error"]["code"] == "busy"
    ends = [f for f in frames if f["type"] in ("done", "error") and f.get("id") == "one"]
    assert len(ends) == 1 and ends[0]["type"] == "done" and len(token_ids(frames)) == 20


def test_with_on_busy_queue_a_second_connection_waits_in_line_and_gets_the_box_next(queue_server):
    with open_ws(queue_server, token=None) as first:
        assert recv(first)["state"] == "ready"
        with open_ws(queue_server, token=None) as second:
            assert recv(second)["state"] == "busy"
            assert recv(second) == {"type": "queued", "seq": 2, "position": 1}
            # sent while queued: it is read once the box is ours
            send(second, {"type": "generate", "id": "q", "input_ids": prompt(35, 5), "max_tokens": 3,
                          "ignore_eos": True})
            assert generate(first, "f", prompt(36, 5), 3)[-1]["type"] == "done"
            first.close()
            turn = recv(second)
            assert turn["type"] == "queued" and turn["position"] == 0
            frames = until_end(second, "q")
    assert frames[-1]["type"] == "done" and len(token_ids(frames)) == 3


def test_a_long_prefill_chunk_gets_progress_keepalives_from_the_server(queue_server):
    with open_ws(queue_server, token=None) as ws:
        recv(ws)
        frames = generate(ws, "long", prompt(37, 500), 2)
    first_delta = next(i for i, f in enumerate(frames) if f["type"] == "delta")
    keepalives = [f for f in frames[:first_delta] if f["type"] == "progress"]
    assert len(keepalives) >= 2, [f["type"] for f in frames]
    assert all(k["id"] == "long" and k["total"] == 500 and k["ms"] > 0 for k in keepalives)
    assert frames[-1]["type"] == "done"


def test_a_connection_that_holds_the_box_idle_is_closed_with_4408(queue_server):
    with open_ws(queue_server, token=None) as ws:
        recv(ws)
        assert _closed_code(ws) == 4408
