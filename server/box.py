"""One user per box: who holds it (`Box`), and the request that runs for the holder (`Running`), whose pace
sets a refused client's Retry-After. A holder is a websocket connection (server/session.py, for as long as
it stays) or one HTTP API call (server/http_api.py, for that call); either has `running` and
`tell_position`."""

import asyncio
import threading
import time
from dataclasses import dataclass, field

from appliance.api import Done, Error, Progress, Started, Tokens


class Box:
    """Who holds the box, and (queue mode) who waits for it, first come first served."""

    def __init__(self):
        self.owner = None
        self.waiting: list[tuple[object, asyncio.Future]] = []

    def try_take(self, s) -> bool:
        if self.owner is None and not self.waiting:
            self.owner = s
            return True
        return False

    def wait_for(self, s) -> asyncio.Future:
        fut = asyncio.get_running_loop().create_future()
        self.waiting.append((s, fut))
        s.tell_position(len(self.waiting))
        return fut

    def leave(self, s) -> None:
        if self.owner is s:
            self.owner = None
        self.waiting = [(w, f) for w, f in self.waiting if w is not s]
        while self.owner is None and self.waiting:
            w, fut = self.waiting.pop(0)
            if not fut.done():
                self.owner = w
                fut.set_result(True)
        for i, (w, _) in enumerate(self.waiting):
            w.tell_position(i + 1)

    def retry_after_ms(self) -> int:
        """When a refused client should try again: the owner's remaining tokens at its measured pace (100 ms
        to 60 s), or 1 s when there is no pace to go by."""
        r = self.owner.running if self.owner is not None else None
        if r is not None and r.produced >= 2 and r.first_t is not None and r.last_t is not None:
            per_token = (r.last_t - r.first_t) / (r.produced - 1)
            return int(min(60000, max(100, (r.max_tokens - r.produced) * per_token + 100)))
        return 1000


@dataclass
class Running:
    """The request that runs for a holder, as its events tell it."""

    id: str
    timings: str
    max_tokens: int
    cancel: threading.Event
    submitted: float = field(default_factory=time.monotonic)
    processed: int = 0
    total: int | None = None
    produced: int = 0
    first_t: float | None = None  # t_ms of the first token
    last_t: float | None = None  # t_ms of the latest token
    gaps: list[float] = field(default_factory=list)

    def observe(self, ev, metrics) -> bool:
        """Account for one engine event (positions, token times, the metrics); True for the terminal one."""
        if isinstance(ev, Started):
            self.total, self.processed = ev.prompt_tokens, ev.cached_tokens
        elif isinstance(ev, Progress):
            self.processed, self.total = ev.processed, ev.total
        elif isinstance(ev, Tokens):
            for t in ev.t_ms:
                if self.last_t is not None:
                    self.gaps.append(t - self.last_t)
                if self.first_t is None:
                    self.first_t = t
                self.last_t = t
            self.produced += len(ev.ids)
            metrics.observe_tokens(self.gaps)
            self.gaps.clear()
        elif isinstance(ev, Done | Error):
            metrics.observe_end(ev)
            metrics.running.dec()
            return True
        return False
