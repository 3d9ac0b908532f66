"""Cancel by frame and by disconnect, during decode and during a long prefill (800 tokens in chunks of 8,
about a hundred chunks): the engine is free within a chunk or a cycle, and the next request is correct.

"Free within one chunk" is checked without wall-clock thresholds of our own: frames that arrive after the
cancel are counted (at most the one in flight, plus one already on the wire), and after a disconnect the
next request's `queue_ms` (its wait for the engine) is compared with the chunk or token interval the server
itself reported; an uncancelled prefill would make it wait for ~100 chunks."""

import contextlib
import socket

import pytest
from websockets.exceptions import ConnectionClosed

from tests.server_harness import (
    ServerProcess,
    generate,
    open_ws,
    prompt,
    recv,
    reference_ids,
    send,
    token_ids,
    until_end,
)

LONG = 800
NEXT = {  # test -> (prompt, max_tokens) of the request that follows the cancel
    "frame_decode": (prompt(41, 9), 6),
    "frame_prefill": (prompt(42, 9), 6),
    "drop_decode": (prompt(43, 9), 6),
    "drop_prefill": (prompt(44, 9), 6),
}


@pytest.fixture(scope="module")
def server():
    s = ServerProcess("--chunk", "8")
    yield s
    assert s.stop() == 0


@pytest.fixture(scope="module")
def expected():
    keys = list(NEXT)
    return dict(zip(keys, reference_ids([NEXT[k] for k in keys])))


def _cancelled(server) -> float:
    body = server.http("/metrics")[1]
    return sum(float(line.split()[-1]) for line in body.splitlines()
               if line.startswith('decode_requests_total{finish_reason="cancelled"}'))


def _next_request(server, key, expected) -> dict:
    ids, n = NEXT[key]
    with open_ws(server, token=None) as ws:
        assert recv(ws)["state"] == "ready"
        frames = generate(ws, key, ids, n)
    assert frames[-1]["type"] == "done" and frames[-1]["finish_reason"] == "length"
    assert token_ids(frames) == expected[key]
    return frames[-1]


def _until(ws, kind: str, count: int) -> list[dict]:
    frames = []
    while sum(f["type"] == kind for f in frames) < count:
        frames.append(recv(ws))
    return frames


def test_cancel_by_frame_during_decode_stops_within_a_cycle_and_the_next_request_is_correct(server, expected):
    before = _cancelled(server)
    with open_ws(server, token=None) as ws:
        recv(ws)
        send(ws, {"type": "generate", "id": "c", "input_ids": prompt(45, 6), "max_tokens": 400, "ignore_eos": True})
        frames = _until(ws, "delta", 3)
        seen = len(token_ids(frames))
        send(ws, {"type": "cancel", "id": "c"})
        rest = until_end(ws, "c")
        send(ws, {"type": "cancel", "id": "c"})  # late: ignored, not an error
        send(ws, {"type": "ping", "t": 1})
        assert recv(ws)["type"] == "pong"
    done = rest[-1]
    assert done["type"] == "done" and done["finish_reason"] == "cancelled"
    after_cancel = len(token_ids(rest))
    assert after_cancel <= 2, after_cancel
    assert done["usage"]["completion_tokens"] == seen + after_cancel
    assert [f["type"] for f in frames + rest].count("done") == 1
    assert _cancelled(server) == before + 1
    _next_request(server, "frame_decode", expected)


def test_cancel_by_frame_during_a_long_prefill_stops_within_a_chunk_and_the_next_request_is_correct(
        server, expected):
    with open_ws(server, token=None) as ws:
        recv(ws)
        send(ws, {"type": "generate", "id": "p", "input_ids": prompt(46, LONG), "max_tokens": 4})
        frames = _until(ws, "progress", 2)
        send(ws, {"type": "cancel"})  # no id: whatever runs
        rest = until_end(ws, "p")
    done = rest[-1]
    assert done["type"] == "done" and done["finish_reason"] == "cancelled"
    assert done["usage"]["completion_tokens"] == 0 and not token_ids(rest)
    progress_after = [f for f in rest if f["type"] == "progress"]
    assert len(progress_after) <= 2, progress_after
    last = (progress_after or [f for f in frames if f["type"] == "progress"])[-1]
    assert last["processed"] < LONG
    _next_request(server, "frame_prefill", expected)


def _drop(ws) -> None:
    """Vanish without a closing handshake, like a client whose network went away."""
    ws.socket.shutdown(socket.SHUT_RDWR)
    ws.socket.close()


def test_a_dropped_connection_during_a_long_prefill_frees_the_engine_within_a_chunk(server, expected):
    before = _cancelled(server)
    with contextlib.suppress(OSError, ConnectionClosed), open_ws(server, token=None) as ws:
        recv(ws)
        send(ws, {"type": "generate", "id": "d", "input_ids": prompt(47, LONG), "max_tokens": 4})
        frames = _until(ws, "progress", 3)
        ms = [f["ms"] for f in frames if f["type"] == "progress"]
        chunk_ms = max(b - a for a, b in zip(ms, ms[1:]))
        _drop(ws)
    done = _next_request(server, "drop_prefill", expected)
    # the remaining ~95 chunks were skipped: the next request waited for at most the chunk in flight
    assert done["timings"]["queue_ms"] <= 5 * chunk_ms + 100, (done["timings"], chunk_ms)
    assert _cancelled(server) == before + 1


def test_a_closed_connection_during_decode_frees_the_engine_within_a_cycle(server, expected):
    with open_ws(server, token=None) as ws:
        recv(ws)
        send(ws, {"type": "generate", "id": "e", "input_ids": prompt(48, 6), "max_tokens": 400, "ignore_eos": True,
                  "timings": "per_token"})
        frames = _until(ws, "delta", 4)
    t_ms = [t for f in frames if f["type"] == "delta" for t in f["t_ms"]]
    token_interval = max(b - a for a, b in zip(t_ms, t_ms[1:]))
    done = _next_request(server, "drop_decode", expected)
    assert done["timings"]["queue_ms"] <= 5 * token_interval + 100, (done["timings"], token_interval)
