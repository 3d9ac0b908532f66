"""The asyncio layer in-process with a fake engine (the Engine API's submit/emit contract, no model): the
loading state, readiness and its notify messages, the watchdog following the engine heartbeat, engine
errors becoming error frames, and the writer merging deltas for a slow reader."""

import asyncio
import threading
import time
import urllib.error
import urllib.request

import orjson
import pytest
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed

from appliance.api import Done, Error, Started, Tokens
from appliance.engine import EngineInfo
from server import app as app_module
from server.app import App, ServerConfig
from server.session import Running, Session
from tests.server_harness import Datagrams


class FakeEngine:
    """Emits Started, one token per `delay_s`, Done (or an Error for prompts starting with 0) from its own
    thread, like the real engine; its heartbeat advances until `stall()`."""

    def __init__(self, delay_s: float = 0.01):
        self.info = EngineInfo("fake", "deepseek_v41", 1024, 512, "none", "cpu")
        self.delay_s = delay_s
        self.heartbeat = time.monotonic()
        self._stalled = threading.Event()
        self._closed = threading.Event()
        threading.Thread(target=self._beat, daemon=True).start()

    def _beat(self):
        while not self._closed.wait(0.02):
            if not self._stalled.is_set():
                self.heartbeat = time.monotonic()

    def stall(self):
        self._stalled.set()

    def stats(self) -> dict:
        return {"prefix_cache_disk_errors": {}}

    def submit(self, request, emit, cancel=None, wait=False):
        cancel = cancel or threading.Event()
        threading.Thread(target=self._run, args=(request, emit, cancel), daemon=True).start()
        return cancel

    def _run(self, req, emit, cancel):
        first = req.input_ids[0] if req.input_ids else None
        if first == 0:
            emit(Error(req.id, "internal", "engine fault: RuntimeError: device lost"))
            return
        emit(Started(req.id, len(req.input_ids or []), 0))
        if first == 9:  # a hung engine: ignores cancel, never ends the request
            self._closed.wait()
            return
        n = 0
        for i in range(req.max_tokens):
            if cancel.is_set():
                break
            time.sleep(self.delay_s)
            text = "\ud800" if first == 7 and i == 1 else "x"  # 7: a token text no encoder can write
            emit(Tokens(req.id, [i + 1], text, i, [float(i)]))
            n += 1
        reason = "cancelled" if cancel.is_set() else "length"
        emit(Done(req.id, reason, {"prompt_tokens": 1, "completion_tokens": n, "cached_tokens": 0},
                  {"queue_ms": 0.0, "ttft_ms": 1.0, "e2e_ms": 2.0}))

    def close(self):
        self._closed.set()


@pytest.fixture
def notify_socket(monkeypatch):
    d = Datagrams()
    monkeypatch.setenv("NOTIFY_SOCKET", d.name)
    monkeypatch.delenv("WATCHDOG_PID", raising=False)
    yield d
    d.close()


def _http(port: int, path: str) -> int:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code


async def _get(port, path) -> int:
    return await asyncio.get_running_loop().run_in_executor(None, _http, port, path)


async def _start(app: App):
    task = asyncio.create_task(app.main())
    while app.port is None:
        await asyncio.sleep(0.01)
    return task


def test_while_loading_readyz_is_503_clients_get_not_ready_and_1013_and_ready_1_follows_readiness(notify_socket):
    release = threading.Event()

    def load(status):
        status("loading weights")
        release.wait(10)
        status("warming up")
        return FakeEngine()

    async def scenario():
        app = App(ServerConfig(port=0, nvml=False), load, say=lambda m: None, handle_signals=False)
        task = await _start(app)
        assert await _get(app.port, "/healthz") == 200
        assert await _get(app.port, "/readyz") == 503
        async with connect(f"ws://127.0.0.1:{app.port}/v1/stream") as ws:
            hello = orjson.loads(await ws.recv())
            err = orjson.loads(await ws.recv())
            with pytest.raises(ConnectionClosed) as closed:
                await ws.recv()
        assert hello["state"] == "loading" and err["error"]["code"] == "not_ready" and err["retryable"]
        assert closed.value.rcvd.code == 1013
        assert "READY=1" not in notify_socket.lines()
        release.set()
        while app.state != "ready":
            await asyncio.sleep(0.01)
        assert await _get(app.port, "/readyz") == 200
        app.request_stop()
        assert await task == 0

    asyncio.run(scenario())
    time.sleep(0.1)
    lines = notify_socket.lines()
    assert "STATUS=loading weights" in lines and "STATUS=warming up" in lines
    assert any(line.startswith("EXTEND_TIMEOUT_USEC=") for line in lines)
    assert lines.index("READY=1") > lines.index("STATUS=warming up")
    assert "STOPPING=1" in lines and lines.index("STOPPING=1") > lines.index("READY=1")


def test_the_watchdog_pings_follow_the_engine_heartbeat_and_stop_when_it_stalls(notify_socket, monkeypatch):
    monkeypatch.setenv("WATCHDOG_USEC", "300000")  # pings every 0.1 s; stale after 0.15 s
    engine = FakeEngine()

    async def scenario():
        app = App(ServerConfig(port=0, nvml=False), lambda status: engine, say=lambda m: None,
                  handle_signals=False)
        task = await _start(app)
        while app.state != "ready":
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.6)
        engine.stall()
        stalled_at = time.monotonic()
        await asyncio.sleep(0.8)
        app.request_stop()
        await task
        return stalled_at

    stalled_at = asyncio.run(scenario())
    pings = [t for t, m in notify_socket.messages if "WATCHDOG=1" in m.split("\n")]
    assert len([t for t in pings if t < stalled_at]) >= 3
    assert not [t for t in pings if t > stalled_at + 0.3], "pings went on after the heartbeat froze"
    assert any("engine stalled" in line for line in notify_socket.lines())


def test_an_engine_error_becomes_one_error_frame_and_the_connection_stays_up():
    async def scenario():
        app = App(ServerConfig(port=0, nvml=False), lambda status: FakeEngine(), say=lambda m: None,
                  handle_signals=False)
        task = await _start(app)
        while app.state != "ready":
            await asyncio.sleep(0.01)
        async with connect(f"ws://127.0.0.1:{app.port}/v1/stream", subprotocols=["decode.v1"]) as ws:
            await ws.recv()
            await ws.send(orjson.dumps({"type": "generate", "id": "x", "input_ids": [0], "max_tokens": 2}).decode())
            err = orjson.loads(await ws.recv())
            await ws.send(orjson.dumps({"type": "generate", "id": "y", "input_ids": [5], "max_tokens": 2}).decode())
            frames = [orjson.loads(await ws.recv()) for _ in range(4)]
        app.request_stop()
        await task
        return err, frames

    err, frames = asyncio.run(scenario())
    assert err["type"] == "error" and err["id"] == "x" and err["error"]["code"] == "internal"
    assert err["error"]["type"] == "server_error" and "device lost" in err["error"]["message"]
    assert [f["type"] for f in frames][0] == "started" and frames[-1]["type"] in ("done", "delta")


class SlowSocket:
    """A websocket (aiohttp's send_str / close) whose first send blocks until released: a client that does
    not read."""

    def __init__(self):
        self.sent: list[dict] = []
        self.release = asyncio.Event()

    async def send_str(self, text):
        self.sent.append(orjson.loads(text))
        if len(self.sent) == 1:
            await self.release.wait()

    async def close(self, *, code, message=b""):
        pass


def test_a_slow_reader_gets_merged_deltas_with_every_token_and_its_exact_time():
    async def scenario():
        app = App(ServerConfig(nvml=False), lambda status: None, say=lambda m: None, handle_signals=False)
        ws = SlowSocket()
        s = Session(app, ws)
        s.running = Running("r", "per_token", 10, threading.Event(), time.monotonic())
        writer = asyncio.create_task(s.write_loop())
        s.emit(Started("r", 3, 0))
        s.emit(Tokens("r", [100], "a", 0, [5.0]))
        await asyncio.sleep(0.05)  # the writer is now stuck sending `started`
        for i in range(1, 10):
            s.emit(Tokens("r", [100 + i], "b", i, [5.0 + 1.5 * i]))
        s.ending = True
        s.emit(Done("r", "length", {"prompt_tokens": 3, "completion_tokens": 10, "cached_tokens": 0}, {}))
        await asyncio.sleep(0.05)
        ws.release.set()
        await asyncio.wait_for(writer, 5)
        return ws.sent

    sent = asyncio.run(scenario())
    assert [f["type"] for f in sent] == ["started", "delta", "delta", "done"]
    merged = sent[2]
    assert merged["index"] == 1 and merged["token_ids"] == [100 + i for i in range(1, 10)]
    assert merged["t_ms"] == [5.0 + 1.5 * i for i in range(1, 10)] and merged["text"] == "b" * 9
    assert [f["seq"] for f in sent] == [1, 2, 3, 4]



async def _ready_app(config: ServerConfig, engine=None):
    app = App(config, lambda status: engine or FakeEngine(), say=lambda m: None, handle_signals=False)
    task = await _start(app)
    while app.state != "ready":
        await asyncio.sleep(0.01)
    return app, task


async def _frames_until(ws, rid: str, kinds=("done", "error")) -> list[dict]:
    frames = []
    while not frames or not (frames[-1]["type"] in kinds and frames[-1].get("id") == rid):
        frames.append(orjson.loads(await asyncio.wait_for(ws.recv(), 10)))
    return frames


def test_a_frame_the_server_cannot_encode_ends_its_request_with_one_internal_error_and_the_connection_serves_on():
    async def scenario():
        app, task = await _ready_app(ServerConfig(port=0, nvml=False))
        async with connect(f"ws://127.0.0.1:{app.port}/v1/stream", subprotocols=["decode.v1"]) as ws:
            await ws.recv()
            await ws.send(orjson.dumps({"type": "generate", "id": "bad", "input_ids": [7], "max_tokens": 50}).decode())
            bad = await _frames_until(ws, "bad")
            await ws.send(orjson.dumps({"type": "generate", "id": "ok", "input_ids": [5], "max_tokens": 3}).decode())
            ok = await _frames_until(ws, "ok")
        while app.sessions:
            await asyncio.sleep(0.01)
        errors = app.metrics.errors.labels("internal")._value.get()
        app.request_stop()
        await task
        return bad, ok, errors, app.metrics.connections._value.get()

    bad, ok, internal_errors, connections = asyncio.run(scenario())
    assert [f["type"] for f in bad][:2] == ["started", "delta"] and bad[-1]["type"] == "error"
    assert bad[-1]["error"]["code"] == "internal" and "could not encode a delta" in bad[-1]["error"]["message"]
    assert [f["type"] for f in ok] == ["started", "delta", "delta", "delta", "done"]  # nothing left of "bad"
    seqs = [f["seq"] for f in bad + ok]
    assert seqs == sorted(set(seqs)) and internal_errors == 1 and connections == 0


def test_sigterm_ends_within_its_bound_when_the_client_stops_reading_and_the_engine_hangs(monkeypatch):
    for name in ("CANCEL_GRACE_S", "CLOSE_GRACE_S", "ABORT_GRACE_S", "ENGINE_CLOSE_S"):
        monkeypatch.setattr(app_module, name, 0.3)
    engine = FakeEngine()
    engine.close = lambda: time.sleep(60)  # an engine whose close hangs too

    async def scenario():
        app, task = await _ready_app(ServerConfig(port=0, nvml=False, drain_s=0.2), engine)
        async with connect(f"ws://127.0.0.1:{app.port}/v1/stream", subprotocols=["decode.v1"]) as ws:
            await ws.recv()
            await ws.send(orjson.dumps({"type": "generate", "id": "h", "input_ids": [9], "max_tokens": 5}).decode())
            assert orjson.loads(await ws.recv())["type"] == "started"
            session = next(iter(app.sessions))
            never = asyncio.Event()

            async def blocked_send(text):  # a client that stopped reading: every send waits forever
                await never.wait()

            session.ws.send_str = blocked_send
            session.send({"type": "pong", "t": 1, "server_t": 0.0})
            await asyncio.sleep(0.05)
            t0 = time.monotonic()
            app.request_stop()
            code = await asyncio.wait_for(task, 10)
            return code, time.monotonic() - t0, app.metrics.connections._value.get(), len(app.sessions)

    code, took, connections, sessions = asyncio.run(scenario())
    assert code == 0 and took < 0.2 + 4 * 0.3 + 0.3 + 1.0, took
    assert connections == 0 and sessions == 0
    engine._closed.set()


def test_metrics_ask_for_the_token_unless_metrics_auth_is_off():
    async def scenario():
        statuses = []
        for metrics_auth in (True, False):
            app, task = await _ready_app(ServerConfig(port=0, nvml=False, token="t0k", metrics_auth=metrics_auth))
            statuses.append((await _get(app.port, "/metrics"), await _get(app.port, "/healthz")))
            app.request_stop()
            await task
        return statuses

    assert asyncio.run(scenario()) == [(401, 200), (200, 200)]
