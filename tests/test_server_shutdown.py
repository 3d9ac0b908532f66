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
