"""systemd's notify protocol with the standard library: one datagram to $NOTIFY_SOCKET per message.

What the server says, and when:
- during load: `STATUS=<step>` on every step, and every few seconds `EXTEND_TIMEOUT_USEC=` (plus
  `WATCHDOG=1`) only while the process is visibly working (it read bytes or used CPU since the last
  look), so a slow load that progresses outlives TimeoutStartSec= and a stalled one is killed;
- `READY=1` once `/readyz` turns ready (weights loaded, warm-up generation done);
- `WATCHDOG=1` every WatchdogSec/3 while the engine heartbeat is fresh: a hung device freezes the
  heartbeat, the pings stop, and systemd restarts the service;
- `STOPPING=1` when SIGTERM arrives.
Without $NOTIFY_SOCKET (not under systemd) every call is a no-op.
"""

import os
import socket
import threading
import time


def notify(*lines: str, env=None) -> bool:
    """Send `lines` (KEY=VALUE) as one datagram. False when there is no socket or it cannot be reached."""
    env = os.environ if env is None else env
    path = env.get("NOTIFY_SOCKET", "")
    if not path or not lines:
        return False
    if path[0] == "@":  # abstract namespace: a leading NUL in the address
        addr = "\0" + path[1:]
    elif path[0] == "/":
        addr = path
    else:  # vsock: and other address kinds are for VMs, not this server
        return False
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as s:
            s.connect(addr)
            s.sendall("\n".join(lines).encode())
    except OSError:
        return False
    return True


def watchdog_interval_s(env=None) -> float | None:
    """WatchdogSec= as systemd passes it (WATCHDOG_USEC, for our PID), or None when off."""
    env = os.environ if env is None else env
    usec = env.get("WATCHDOG_USEC")
    pid = env.get("WATCHDOG_PID")
    if not usec:
        return None
    if pid and pid != str(os.getpid()):
        return None
    try:
        value = int(usec)
    except ValueError:
        return None
    return value / 1e6 if value > 0 else None


class Watchdog:
    """Decides each ping from the engine's heartbeat (a monotonic timestamp the engine thread advances
    while it works and while it idles). Pure logic: the caller sends what `tick` returns."""

    def __init__(self, interval_s: float):
        self.interval_s = interval_s
        self.period_s = interval_s / 3  # three chances per interval, so one late wake-up is harmless
        self.stale_after_s = interval_s / 2

    def tick(self, heartbeat: float, now: float | None = None) -> list[str]:
        now = time.monotonic() if now is None else now
        age = now - heartbeat
        if age <= self.stale_after_s:
            return ["WATCHDOG=1"]
        return [f"STATUS=engine stalled: no heartbeat for {age:.0f} s"]


def process_progress() -> int:
    """A number that grows while this process reads files or uses CPU (what loading does)."""
    read = 0
    try:
        with open("/proc/self/io") as f:
            for line in f:
                if line.startswith("rchar:"):
                    read = int(line.split()[1])
    except OSError:
        pass
    t = os.times()
    return read + int((t.user + t.system) * 1e6)


class LoadWatch:
    """While the engine loads: forward each status line as STATUS=, and every `period_s` extend the start
    timeout (and ping the watchdog) only if the process made progress since the last look."""

    def __init__(self, period_s: float = 5.0, send=notify, progress=process_progress, watchdog: bool = False):
        self.period_s = period_s
        self.send = send
        self.progress = progress
        self.watchdog = watchdog
        self.status = "starting"
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="load-watch", daemon=True)

    def start(self) -> "LoadWatch":
        self.send(f"STATUS={self.status}")
        self._thread.start()
        return self

    def update(self, status: str) -> None:
        self.status = status
        self.send(f"STATUS={status}", f"EXTEND_TIMEOUT_USEC={int(3 * self.period_s * 1e6)}")

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def _loop(self) -> None:
        last, since = self.progress(), time.monotonic()
        while not self._stop.wait(self.period_s):
            now = self.progress()
            if now != last:
                last, since = now, time.monotonic()
                extra = ["WATCHDOG=1"] if self.watchdog else []
                self.send(f"STATUS={self.status}", f"EXTEND_TIMEOUT_USEC={int(3 * self.period_s * 1e6)}", *extra)
            else:
                self.send(f"STATUS={self.status} (no progress for {time.monotonic() - since:.0f} s)")
