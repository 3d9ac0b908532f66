"""Reports of what clients do to the server (a connection over the cap, a request whose body does not
arrive, a client that stops reading), one log line per incident and not per connection: the first of a
kind is logged at once, later ones are counted and summed up in at most one line every REPORT_S, so a
flood of 20,000 connections writes two lines, not 20,000 tracebacks. Each is counted in
`decode_dropped_connections{reason}` as well."""

import logging
import time

REPORT_S = 60.0
log = logging.getLogger("server.incidents")


class Incidents:
    def __init__(self, metrics, reason: str, what: str):
        """`reason`: the metric's label; `what`: how a log line names the incident."""
        self.counter = metrics.dropped.labels(reason)
        self.what = what
        self.unreported = 0
        self.last: float | None = None

    def __call__(self, detail: str) -> None:
        self.counter.inc()
        self.unreported += 1
        now = time.monotonic()
        if self.last is None or now - self.last >= REPORT_S:
            more = f" (and {self.unreported - 1} more since the last report)" if self.unreported > 1 else ""
            log.warning("%s: %s%s", self.what, detail, more)
            self.last, self.unreported = now, 0
