"""Cancel by frame and by disconnect, during decode and during a long prefill (800 tokens in chunks of 8,
about a hundred chunks): the engine is free within a chunk or a cycle, and the next request is correct.

"Free within one chunk" is checked without wall-clock thresholds of our own: engine frames queued after
the server read the cancel are counted (a ping sent just before it marks the spot); after a disconnect the
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


def _after_barrier(frames: list[dict]) -> list[dict]:
    """Frames the server queued after it read our ping (sent just before the cancel). The writer sends in
    queue order, so these are exactly the engine events produced after the cancel reached the server,
    however slowly this client read: at most the chunk or cycle in flight, plus one."""
    i = next(i for i, f in enumerate(frames) if f["type"] == "pong" and f["t"] == -1)
    return frames[i + 1:]


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
        send(ws, {"type": "ping", "t": -1})
        send(ws, {"type": "cancel", "id": "c"})
        frames += until_end(ws, "c")
        send(ws, {"type": "cancel", "id": "c"})  # late: ignored, not an error
        send(ws, {"type": "ping", "t": 1})
        assert recv(ws)["type"] == "pong"
    done = frames[-1]
    assert done["type"] == "done" and done["finish_reason"] == "cancelled"
    assert done["usage"]["completion_tokens"] == len(token_ids(frames)) < 400
    assert len(token_ids(_after_barrier(frames))) <= 2, _after_barrier(frames)
    assert [f["type"] for f in frames].count("done") == 1
    assert _cancelled(server) == before + 1
    _next_request(server, "frame_decode", expected)


def test_cancel_by_frame_during_a_long_prefill_stops_within_a_chunk_and_the_next_request_is_correct(
        server, expected):
    with open_ws(server, token=None) as ws:
        recv(ws)
        send(ws, {"type": "generate", "id": "p", "input_ids": prompt(46, LONG), "max_tokens": 4})
        frames = _until(ws, "progress", 2)
        send(ws, {"type": "ping", "t": -1})
        send(ws, {"type": "cancel"})  # no id: whatever runs
        frames += until_end(ws, "p")
    done = frames[-1]
    assert done["type"] == "done" and done["finish_reason"] == "cancelled"
    assert done["usage"]["completion_tokens"] == 0 and not token_ids(frames)
    progress_after = [f for f in _after_barrier(frames) if f["type"] == "progress"]
    assert len(progress_after) <= 2, progress_after
    assert [f for f in frames if f["type"] == "progress"][-1]["processed"] < LONG
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
