"""Clients that would hold the box or the process: a websocket that pings without reading, sockets that never
send a request or send it a byte at a time, a body that never ends, and more connections than the cap (an
SSE stream nobody reads: tests/test_server_front_door.py, whose scripted engine fills a socket in seconds).
A real `appliance serve` with short deadlines; each test ends with the box free and serving, the log saying
what happened in a line per incident."""

import os
import socket
import time

import pytest

from tests.server_harness import ServerProcess, generate, metric, open_ws, raw_http, recv

DEADLINE = 2.0  # --send-deadline, --header-timeout, --body-timeout
CAP = 12


@pytest.fixture(scope="module")
def server():
    s = ServerProcess("--send-deadline", str(DEADLINE), "--header-timeout", str(DEADLINE), "--body-timeout",
                      str(DEADLINE), "--max-connections", str(CAP), "--chunk", "64")
    yield s
    assert s.stop() == 0


def ws_frame(text: str) -> bytes:
    """One masked text frame (a client's, RFC 6455 5.3)."""
    data, mask = text.encode(), os.urandom(4)
    n = len(data)
    head = bytes([0x81]) + (bytes([0x80 | n]) if n < 126 else bytes([0x80 | 126]) + n.to_bytes(2, "big"))
    return head + mask + bytes(b ^ mask[i % 4] for i, b in enumerate(data))


def stalled_socket(port: int, request: bytes) -> socket.socket:
    """A connection with a tiny receive buffer that sends `request` and then reads nothing."""
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 2048)
    s.connect(("127.0.0.1", port))
    s.sendall(request)
    return s


def dropped(s: socket.socket, within: float, reading: bool = True) -> bool:
    """Whether the server closed or reset `s` within `within` seconds; `reading` False: without taking
    anything it sent (a reset connection has no peer any more), so a stalled client stays stalled."""
    s.settimeout(0.2)
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        if not reading:
            try:
                s.getpeername()
            except OSError:
                return True
            time.sleep(0.2)
            continue
        try:
            if not s.recv(1 << 20):
                return True
        except TimeoutError:
            continue
        except ConnectionError:
            return True
    return False


def box_is_free(server) -> None:
    with open_ws(server, token=None) as ws:
        assert recv(ws)["state"] == "ready"
        assert generate(ws, "after", [5, 6, 7], 3)[-1]["type"] == "done"


def test_a_websocket_that_pings_without_reading_is_dropped_within_the_deadline_and_memory_stays_flat(server):
    before = server.rss_bytes()
    handshake = (b"GET /v1/stream HTTP/1.1\r\nHost: x\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
                 b"Sec-WebSocket-Version: 13\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n"
                 b"Sec-WebSocket-Protocol: decode.v1\r\n\r\n")
    s = stalled_socket(server.port, handshake)
    s.sendall(ws_frame('{"type": "generate", "id": "g", "input_ids": [5, 9, 13], "max_tokens": 3000, '
                       '"ignore_eos": true, "timings": "per_token"}'))
    ping = ws_frame('{"type": "ping", "t": ' + "1" * 300 + "}")
    s.settimeout(0.05)
    sent, t0 = 0, time.monotonic()
    while time.monotonic() - t0 < DEADLINE + 15:  # pings until the server stops reading them or drops us
        try:
            s.sendall(ping)
            sent += len(ping)
        except TimeoutError:
            break
        except ConnectionError:
            break
    assert dropped(s, DEADLINE + 15, reading=False), "the server kept a client that reads nothing"
    took = time.monotonic() - t0
    s.close()
    assert metric(server, 'decode_dropped_connections_total{reason="slow_reader"}') >= 1
    deadline = time.monotonic() + 10
    while metric(server, "decode_running_requests") and time.monotonic() < deadline:
        time.sleep(0.05)
    assert metric(server, "decode_running_requests") == 0  # its request was cancelled
    assert server.rss_bytes() - before < 64 << 20, (before, server.rss_bytes(), sent)
    box_is_free(server)
    assert took < 60 and "stopped reading" in "".join(server.lines)


def test_silent_and_slow_sockets_are_closed_after_the_header_timeout_and_the_cap_refuses_the_rest(server):
    socks = [socket.create_connection(("127.0.0.1", server.port)) for _ in range(CAP + 10)]
    refused = [s for s in socks if dropped(s, 0.3)]  # answered 503 and closed at once
    assert len(refused) >= 10, len(refused)
    slow = socket.create_connection(("127.0.0.1", server.port)) if len(socks) - len(refused) < CAP else None
    for s in socks:
        if s not in refused:
            assert dropped(s, DEADLINE + 5), "a silent socket outlived the header timeout"
            s.close()
    slow = slow or socket.create_connection(("127.0.0.1", server.port))
    t0 = time.monotonic()
    try:
        for byte in b"GET /healthz HTTP/1.1\r\nHost: x\r\n":  # a byte every 0.3 s: never a whole request
            slow.sendall(bytes([byte]))
            time.sleep(0.3)
            if time.monotonic() - t0 > DEADLINE + 3:
                break
    except ConnectionError:
        pass
    assert dropped(slow, DEADLINE + 3) and time.monotonic() - t0 < DEADLINE + 6
    assert raw_http(server.port, b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")[0] == 200
    log = "".join(server.lines)
    assert log.count("refusing connections over --max-connections") == 1, log  # one line per incident
    assert "Traceback" not in log and metric(server, 'decode_dropped_connections_total{reason="over_cap"}') >= 10


def test_a_body_that_never_ends_gets_408_within_the_body_timeout(server):
    s = socket.create_connection(("127.0.0.1", server.port))
    s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              b"Transfer-Encoding: chunked\r\n\r\n5\r\n{\"mes\r\n")
    s.settimeout(DEADLINE + 5)
    t0 = time.monotonic()
    answer = s.recv(4096)
    assert answer.startswith(b"HTTP/1.1 408") and b'"timeout"' in answer, answer
    assert time.monotonic() - t0 < DEADLINE + 3
    s.close()
    assert metric(server, 'decode_dropped_connections_total{reason="slow_body"}') >= 1
    box_is_free(server)
