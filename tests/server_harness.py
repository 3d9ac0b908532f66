"""A real `appliance serve` in a subprocess on a free loopback port (--port 0), and small websocket clients.

The server runs with OMP_NUM_THREADS=1: on a 2-core machine shared with the test process, two OpenMP
threads per op stall on each other at every barrier (10x slower on the tiny model); one thread is both
faster and deterministic, so its greedy ids match the reference computed the same way."""

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

from websockets.sync.client import connect

ROOT = Path(__file__).resolve().parent.parent
TOKEN = "s3cret-token_for.tests"
SERVER_ENV = {"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


def child_env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("APPLIANCE_", "NOTIFY_SOCKET", "WATCHDOG_"))}
    env.update(SERVER_ENV)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env.update(extra)
    return env


class ServerProcess:
    """`appliance serve --port 0 ARGS`; `.port` once listening; `.wait_ready()`; `.stop()` sends SIGTERM."""

    def __init__(self, *args: str, env: dict | None = None, wait_ready: bool = True):
        self.args = ["--port", "0", *args]
        self.proc = subprocess.Popen([sys.executable, "-m", "appliance", "serve", *self.args], cwd=ROOT,
                                     env=child_env(**(env or {})), stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True)
        self.lines: list[str] = []
        self.port: int | None = None
        self._listening = threading.Event()
        self._ready = threading.Event()
        threading.Thread(target=self._read, daemon=True).start()
        if not self._listening.wait(60):
            self.kill()
            raise RuntimeError("server did not start listening:\n" + "".join(self.lines))
        if wait_ready:
            self.wait_ready()

    def _read(self) -> None:
        for line in self.proc.stderr:
            self.lines.append(line)
            if "listening on ws://" in line:
                self.port = int(line.split("ws://", 1)[1].split("/", 1)[0].rsplit(":", 1)[1])
                self._listening.set()
            if line.startswith("appliance: ready"):
                self._ready.set()
        self._listening.set()

    def wait_ready(self, timeout: float = 120) -> None:
        if not self._ready.wait(timeout):
            raise RuntimeError("server not ready:\n" + "".join(self.lines))

    @property
    def url(self) -> str:
        return f"ws://127.0.0.1:{self.port}/v1/stream"

    def http(self, path: str, headers: dict | None = None) -> tuple[int, str, dict]:
        req = urllib.request.Request(f"http://127.0.0.1:{self.port}{path}", headers=headers or {})
        try:
            with urllib.request.urlopen(req, timeout=10) as r:
                return r.status, r.read().decode(), dict(r.headers)
        except urllib.error.HTTPError as e:
            return e.code, e.read().decode(), dict(e.headers)

    def rss_bytes(self) -> int:
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
        raise RuntimeError("no VmRSS")

    def stop(self, timeout: float = 60) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def raw_http(port: int, request: bytes, timeout: float = 10) -> tuple[int | None, dict, bytes]:
    """Send `request` bytes as they are (repeated headers, any method) and read one answer: its headers, then
    Content-Length bytes of body (none after a 101 or a 204, or for HEAD), or until the server closes: (status or None
    when it closed without an answer, headers with lower-case names, body)."""
    data, head, headers = b"", None, {}
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        s.sendall(request)
        while chunk := s.recv(65536):
            data += chunk
            if head is None and b"\r\n\r\n" in data:
                head, _, data = data.partition(b"\r\n\r\n")
                lines = head.decode("latin-1").split("\r\n")
                headers = dict((k.strip().lower(), v.strip()) for k, v in (line.split(":", 1) for line in lines[1:]))
                if lines[0].startswith(("HTTP/1.1 101 ", "HTTP/1.1 204 ")) or request.startswith(b"HEAD "):
                    break  # no body follows
            if head is not None and "content-length" in headers and len(data) >= int(headers["content-length"]):
                break
    if head is None:
        return None, {}, b""
    return int(head.split(b" ", 2)[1]), headers, data


def metric(server: ServerProcess, name: str, headers: dict | None = None) -> float:
    """The value of one sample of /metrics (`name` with its labels, as exposed), 0 when absent."""
    for line in server.http("/metrics", headers)[1].splitlines():
        if line.startswith(name + " "):
            return float(line.split()[-1])
    return 0.0


def open_ws(server: ServerProcess, token: str | None = TOKEN, **kw):
    headers = {"Authorization": f"Bearer {token}"} if token else None
    return connect(server.url, subprotocols=["decode.v1"], additional_headers=headers, open_timeout=20,
                   compression=None, max_size=None, **kw)


def recv(ws, timeout: float = 60) -> dict:
    return json.loads(ws.recv(timeout=timeout))


def send(ws, frame: dict) -> None:
    ws.send(json.dumps(frame))


def until_end(ws, request_id: str | None = None, timeout: float = 120) -> list[dict]:
    """Frames up to and including the request's done or error."""
    frames = []
    deadline = time.monotonic() + timeout
    while True:
        f = recv(ws, max(0.1, deadline - time.monotonic()))
        frames.append(f)
        if f["type"] in ("done", "error") and (request_id is None or f.get("id") == request_id):
            return frames


def generate(ws, request_id: str, ids: list[int], max_tokens: int, **extra) -> list[dict]:
    send(ws, {"type": "generate", "id": request_id, "input_ids": ids, "max_tokens": max_tokens, "ignore_eos": True,
              "timings": "per_token", **extra})
    return until_end(ws, request_id)


def token_ids(frames: list[dict]) -> list[int]:
    return [i for f in frames if f["type"] == "delta" for i in f["token_ids"]]


def prompt(first: int, n: int, seed: int = 0) -> list[int]:
    """A prompt whose first token `first` no other test uses, so no request reuses another's cached prefix."""
    import random

    rng = random.Random(seed * 1000 + first)
    return [first] + [rng.randrange(8, 500) for _ in range(n - 1)]


def reference_ids(requests: list[tuple[list[int], int]], chunk: int = 8) -> list[list[int]]:
    """Greedy ids of each (prompt, max_tokens) from a fresh decode session, in one subprocess (one model
    load for all), with the server's thread count and chunk."""
    script = (
        "import json, sys\n"
        "from appliance.api import Request, Tokens\n"
        "from appliance.decode.loop import RequestLoop\n"
        "from appliance.decode.session import DecodeSession\n"
        "from appliance.loader import load_model\n"
        "from appliance.options import RunOptions\n"
        f"options = RunOptions(chunk={chunk})\n"
        "lm = load_model(options, notice=None)\n"
        "gen = RequestLoop(DecodeSession(lm, options), lm.tokenizer, lm.model_dir)\n"
        "out = []\n"
        "for ids, n in json.load(sys.stdin):\n"
        "    gen.session.reset()\n"
        "    req = Request(id='ref', input_ids=ids, max_tokens=n, ignore_eos=True)\n"
        "    out.append([i for e in gen.run(req) if isinstance(e, Tokens) for i in e.ids])\n"
        "print(json.dumps(out))\n")
    r = subprocess.run([sys.executable, "-c", script], input=json.dumps(requests), capture_output=True, text=True,
                       env=child_env(), cwd=ROOT, timeout=300)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


class Datagrams:
    """An AF_UNIX datagram socket the test owns, in the abstract namespace, collecting notify messages."""

    def __init__(self):
        self.name = f"@decode-appliance-test-{os.getpid()}-{time.monotonic_ns()}"
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind("\0" + self.name[1:])
        self.sock.settimeout(0.05)
        self.messages: list[tuple[float, str]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self):
        while not self._stop.is_set():
            try:
                self.messages.append((time.monotonic(), self.sock.recv(4096).decode()))
            except TimeoutError:
                continue

    def lines(self) -> list[str]:
        return [line for _, m in self.messages for line in m.split("\n")]

    def close(self):
        self._stop.set()
        self._thread.join()
        self.sock.close()


class InProcessServer:
    """server.app.App on its own event loop in a thread of the test process, serving `engine` (any object with
    the Engine API: a scripted one, or a real Engine), or what `load(status)` returns (the app's load path);
    `say` hears the app's log lines: no process to start, and the test can look at the engine and the app
    directly. `stop()` requests the app's stop (SIGTERM's path) and waits for it."""

    def __init__(self, engine, load=None, say=None, **config):
        import asyncio

        from server.app import App, ServerConfig

        self.app = App(ServerConfig(port=0, nvml=False, **config), load or (lambda status: engine),
                       say=say or (lambda m: None), handle_signals=False)
        self.loop = asyncio.new_event_loop()
        self.code: int | None = None
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()
        deadline = time.monotonic() + 120
        while self.app.state != "ready":
            if time.monotonic() > deadline or not self._thread.is_alive():
                raise RuntimeError(f"in-process server not ready: {self.app.state} ({self.app.status})")
            time.sleep(0.01)
        self.port = self.app.port

    def _serve(self) -> None:
        self.code = self.loop.run_until_complete(self.app.main())

    @property
    def engine(self):
        return self.app.engine

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def url(self) -> str:
        return f"ws://127.0.0.1:{self.port}/v1/stream"

    def metric(self, name: str) -> float:
        """One sample of the app's metrics registry (`name` with its labels, as exposed), 0 when absent."""
        for line in self.app.metrics.exposition().decode().splitlines():
            if line.startswith(name + " "):
                return float(line.split()[-1])
        return 0.0

    def stop(self) -> int | None:
        self.loop.call_soon_threadsafe(self.app.request_stop)
        self._thread.join(60)
        return self.code
