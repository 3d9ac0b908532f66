"""SIGTERM on a real server under a fake systemd: it stops accepting, ends the running request (finished
or cancelled after --drain), closes the connection with 1012, sends STOPPING=1 and exits 0. Before that
it told systemd READY=1, STATUS= lines and WATCHDOG=1 pings on the datagram socket the test owns."""

import time

import pytest
from websockets.exceptions import ConnectionClosed, InvalidStatus

from tests.server_harness import Datagrams, ServerProcess, open_ws, prompt, recv, send


@pytest.fixture
def notify_socket():
    d = Datagrams()
    yield d
    d.close()


def test_sigterm_drains_the_running_request_closes_with_1012_and_exits_0(notify_socket):
    server = ServerProcess("--chunk", "8", "--drain", "0.3",
                           env={"NOTIFY_SOCKET": notify_socket.name, "WATCHDOG_USEC": "1500000"})
    try:
        with open_ws(server, token=None) as ws:
            assert recv(ws)["state"] == "ready"
            time.sleep(1.2)  # a few watchdog periods (0.5 s)
            send(ws, {"type": "generate", "id": "last", "input_ids": prompt(51, 6), "max_tokens": 2000,
                      "ignore_eos": True})
            while recv(ws)["type"] != "delta":
                pass
            server.proc.terminate()  # SIGTERM
            frames = []
            with pytest.raises(ConnectionClosed) as closed:
                while True:
                    frames.append(recv(ws, timeout=30))
        code = server.proc.wait(60)
    finally:
        server.kill()
    done = [f for f in frames if f["type"] == "done"]
    assert len(done) == 1 and done[0]["finish_reason"] == "cancelled", frames[-3:]
    assert closed.value.rcvd is not None and closed.value.rcvd.code == 1012
    assert code == 0, "".join(server.lines)
    with pytest.raises((OSError, InvalidStatus)):
        open_ws(server, token=None)
    time.sleep(0.1)
    lines = notify_socket.lines()
    assert any(line.startswith("STATUS=") for line in lines[: lines.index("READY=1")])
    assert lines.count("WATCHDOG=1") >= 2
    assert "STOPPING=1" in lines and lines.index("STOPPING=1") > lines.index("READY=1")


def test_sigterm_with_a_poisoned_connection_keeps_healthz_up_during_the_drain_and_exits_0_in_time():
    """The issue's worst case: a connection sent the values that once killed its writer, then left a request
    running and stopped reading. /healthz stays 200 while the drain runs, new upgrades get 503, and the
    process exits 0 within --drain plus STOP_BOUND_S."""
    from server.app import STOP_BOUND_S

    drain = 2.0
    server = ServerProcess("--chunk", "8", "--drain", str(drain))
    try:
        with open_ws(server, token=None) as ws:
            assert recv(ws)["state"] == "ready"
            ws.send('{"type":"generate","id":"\\ud800","prompt":"a","max_tokens":2}')
            ws.send('{"type": "ping", "t": ' + "1" * 400 + "}")
            assert [recv(ws)["error"]["param"] for _ in range(2)] == ["id", "t"]
            send(ws, {"type": "generate", "id": "long", "input_ids": prompt(52, 6), "max_tokens": 4000,
                      "ignore_eos": True})
            while recv(ws)["type"] != "delta":
                pass  # running; from here on the client reads nothing
            t0 = time.monotonic()
            server.proc.terminate()
            time.sleep(0.3)
            during = [server.http("/healthz")[0], server.http("/readyz")[0]]
            with pytest.raises(InvalidStatus) as refused:
                open_ws(server, token=None)
            code = server.proc.wait(drain + STOP_BOUND_S + 10)
            took = time.monotonic() - t0
    finally:
        server.kill()
    assert during == [200, 503] and refused.value.response.status_code == 503
    assert code == 0 and took < drain + STOP_BOUND_S + 5, (took, "".join(server.lines))
